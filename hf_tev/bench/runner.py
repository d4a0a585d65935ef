"""Running the bench: settings, models, jobs interleaved per prompt, and the records of `bench.json`.

`run_bench(config)` returns the JSON document (schema in `hf_tev/bench/__init__.py`) and writes nothing. Which
method does what comes from `METHODS` (`methods.py`); nothing here tests a method's name.
"""

from __future__ import annotations

import hashlib
import math
import os
import platform
import statistics
import time
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from .._version import __version__
from ..kit import KIT_DRAFTERS, kit_dir, load_kit_model, load_kit_tokenizer
from .methods import METHODS, PROMPT_SETS, REFERENCE_METHOD, REFERENCE_VERIFIER, hub_unreachable_reason
from .replay import same_tree_verifier_stage
from .report import SCHEMA

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------------------
@dataclass
class BenchConfig:
    """What `hf-tev bench` runs. Lists are comma-separated on the command line.

    Args:
        methods (`list[str]`, defaults to every method in `METHODS`): `ar` is always added (SR reference).
        drafters (`list[str]`, defaults to the kit drafters present): kit drafter names, or folders / Hub ids of
            DFlash drafters when `target` is given.
        budgets (`list[int | str]`, defaults to `["auto", 4, 16, 64]`): tree budgets B (drafted nodes, root excluded),
            or `"auto"` (the cost-aware automatic budget, `TEVConfig(budget="auto")`).
        temperatures (`list[float]`, defaults to `[0.0, 1.0]`): 0 is greedy; > 0 samples from the target's
            temperature-scaled distribution (the paper's setting), with top-k / top-p / min-p off unless set below.
        top_k (`int`, *optional*), top_p (`float`, *optional*), min_p (`float`, *optional*): truncation at T > 0,
            passed to `generate` when set; default off (`top_k=0, top_p=1.0, min_p=None`, whatever the model's
            generation config says).
        prompt_sets (`list[str]`, defaults to every set in `PROMPT_SETS`): Hub sets are skipped with a message when
            the Hub is not reachable.
        max_prompts (`int`, defaults to 16): prompts per set (the first ones).
        max_new_tokens (`int`, defaults to 128): tokens per run (exactly, unless `stop_at_eos`).
        repeats (`int`, defaults to 3): timed runs per prompt and method; the median is kept.
        output (`str`, defaults to `"bench_out"`): folder for bench.json, bench.md, bench.png.
        target (`str`, *optional*): model id or folder; default: the tiny kit's target.
        assistant (`str`, *optional*): causal assistant for `assisted`; default: the kit's `assistant-ar` when the
            target is the kit's.
        device (`str`, *optional*): default `cuda` when available, else `cpu`; a CUDA device without CUDA is an
            error. dtype (`str`, defaults to float32).
        threads (`int`, *optional*): `torch.set_num_threads`; default 1 on CPU, untouched elsewhere.
        seed (`int`, defaults to 0): prompt i of every method runs from `torch.manual_seed(seed + i)`.
        prompt_lookup_num_tokens (`int`, defaults to 10), stop_at_eos (`bool`, defaults to False),
        chat_template (`bool`, defaults to True: applied when the tokenizer has one), progress (`bool`).
        batch_sizes (`list[int]`, *optional*): run the batch bench instead (`hf_tev.bench.batch`): the prompts R at
            a time through `generate`, for every R, hf_tev's methods against `ar` (plain batched generate).
    """

    methods: list[str] = field(default_factory=lambda: list(METHODS))
    drafters: list[str] | None = None
    budgets: list[int | str] = field(default_factory=lambda: ["auto", 4, 16, 64])
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
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
    batch_sizes: list[int] | None = None

    def __post_init__(self):
        for name, known in (("methods", METHODS), ("prompt_sets", PROMPT_SETS)):
            unknown = [item for item in getattr(self, name) if item not in known]
            if unknown:
                raise ValueError(f"Unknown {name.replace('_', ' ')[:-1]} {unknown}; known: {sorted(known)}")
            if not getattr(self, name):
                raise ValueError(f"{name} is empty")
        if REFERENCE_METHOD not in self.methods:
            self.methods = [REFERENCE_METHOD, *self.methods]
        need_assistant = [m for m in self.methods if METHODS[m].uses_assistant]
        if self.target is not None and need_assistant and self.assistant is None:
            raise ValueError(
                f"Method {', '.join(map(repr, need_assistant))} needs --assistant (a small causal LM "
                "with the target's tokenizer) when --target is given"
            )
        if self.drafters is None:
            self.drafters = [] if self.target else _present_kit_drafters()
        if self.target is None:
            unknown = [d for d in self.drafters if d not in KIT_DRAFTERS and not Path(d).is_dir()]
            if unknown:
                raise ValueError(
                    f"Unknown drafter {unknown}: the kit has {KIT_DRAFTERS}; a folder of a DFlash drafter "
                    "also works (a Hub id needs --target as well)"
                )
        needs_drafter = [m for m in self.methods if METHODS[m].uses_drafter]
        if needs_drafter and not self.drafters:
            raise ValueError(f"Methods {needs_drafter} need a drafter: pass --drafters")
        if not self.budgets or any(
            b != "auto" and (isinstance(b, bool) or not isinstance(b, int) or b < 0) for b in self.budgets
        ):
            raise ValueError(f'budgets must be non-empty non-negative ints or "auto", got {self.budgets}')
        if not self.temperatures or any(not math.isfinite(t) or t < 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be non-empty finite numbers >= 0, got {self.temperatures}")
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0
        ):
            raise ValueError(f"top_k must be an int >= 0 (0: off), got {self.top_k!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1: off), got {self.top_p!r}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("max_prompts", "max_new_tokens", "repeats", "prompt_lookup_num_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.batch_sizes is not None and (
            not self.batch_sizes
            or any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in self.batch_sizes)
        ):
            raise ValueError(f"batch_sizes must be non-empty ints >= 1, got {self.batch_sizes}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        _check_device(self.device)
        if self.threads is None and self.device == "cpu":
            self.threads = 1
        if self.batch_sizes is not None:
            self.batch_sizes = list(dict.fromkeys(self.batch_sizes))
        for name in ("methods", "drafters", "budgets", "temperatures", "prompt_sets"):  # a repeat adds nothing
            setattr(self, name, list(dict.fromkeys(getattr(self, name))))


def _check_device(name: str) -> None:
    """A clear error now for a device this machine does not have (instead of one deep inside the first run)."""
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ValueError(f"device {name!r} is not a torch device: {error}") from None
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ValueError(f"device {name!r}: CUDA is not available ({why}; torch {torch.__version__}); use --device cpu")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")


def _present_kit_drafters() -> list[str]:
    try:
        root = kit_dir()
    except FileNotFoundError:
        return []
    return [name for name in KIT_DRAFTERS if (root / name / "config.json").is_file()]


def sampling_kwargs(
    temperature: float,
    stop_at_eos: bool,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> dict:
    """What `generate` gets at `temperature`: greedy at 0, else pure temperature sampling (top-k / top-p / min-p
    off whatever the model's defaults, unless given). Without `stop_at_eos`, `eos_token_id=None`: every run
    produces exactly `max_new_tokens`."""
    if temperature == 0:
        kwargs = dict(do_sample=False)
    else:
        kwargs = dict(
            do_sample=True,
            temperature=temperature,
            top_k=0 if top_k is None else top_k,
            top_p=1.0 if top_p is None else top_p,
            min_p=min_p,
        )
    if not stop_at_eos:
        kwargs["eos_token_id"] = None
    return kwargs


def generation_settings(config: BenchConfig, target) -> dict[str, dict]:
    """`f"{T:g}"` -> the keyword arguments `generate` gets at T (the `sampling_kwargs`), with `eos_token_id` as
    the target's generation config gives it when the run stops at EOS."""
    settings = {}
    for temperature in config.temperatures:
        kwargs = sampling_kwargs(temperature, config.stop_at_eos, config.top_k, config.top_p, config.min_p)
        eos = kwargs.get("eos_token_id", target.generation_config.eos_token_id)
        settings[f"{temperature:g}"] = {**kwargs, "eos_token_id": eos}
    return settings


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
            raise ValueError("This method needs --assistant (a small causal LM with the target's tokenizer)")
        return self.assistant


def load_models(config: BenchConfig) -> BenchModels:
    dtype, device = DTYPES[config.dtype], config.device
    needs_assistant = any(METHODS[m].uses_assistant for m in config.methods)
    if config.target is None:
        target, tokenizer = load_kit_model("target", dtype, device), load_kit_tokenizer()
        assistant_name = config.assistant or ("assistant-ar" if needs_assistant else None)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        target = AutoModelForCausalLM.from_pretrained(config.target, dtype=dtype, attn_implementation="sdpa")
        target, tokenizer = target.to(device).eval(), AutoTokenizer.from_pretrained(config.target)
        assistant_name = config.assistant
    drafters = {name: _load_drafter(name, config, dtype, device) for name in config.drafters}
    for drafter in drafters.values():
        drafter.check_target(target)
    assistant = None
    if assistant_name is not None and needs_assistant:
        if config.target is None and assistant_name == "assistant-ar":
            assistant = load_kit_model("assistant-ar", dtype, device)
        else:
            from transformers import AutoModelForCausalLM

            assistant = AutoModelForCausalLM.from_pretrained(assistant_name, dtype=dtype).to(device).eval()
    return BenchModels(target, tokenizer, drafters, assistant, config.prompt_lookup_num_tokens)


def _load_drafter(name, config, dtype, device):
    if config.target is None and name in KIT_DRAFTERS:
        return load_kit_model(name, dtype, device)
    from ..modeling_dflash import DFlashDraftModel

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
                effective = None if budget is None else method.effective_budget(models, drafter, budget)
                plan[(name, drafter, budget)] = Job(name, drafter, effective)
    return plan


def plan_replays(plan: dict[tuple, Job]) -> dict[tuple, tuple[str, ...]]:
    """(drafter, budget) -> the verifiers the same-tree replay times there: the reference verifier, then the
    `replay_verifier` of every planned method at that drafter and budget."""
    replays = {}
    for name, drafter, budget in plan:
        verifier = METHODS[name].replay_verifier
        if verifier is not None and budget != "auto":  # the replay times trees of one fixed size
            replays.setdefault((drafter, budget), [REFERENCE_VERIFIER]).append(verifier)
    return {key: tuple(dict.fromkeys(replays[key])) for key in sorted(replays, key=str)}


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
    out = models.target.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, **sampling, **kwargs
    )
    if sync:
        torch.cuda.synchronize()
    end = time.perf_counter()
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    run = Run(end - start, sequences[:, input_ids.shape[1] :].cpu(), probe.target_forwards)
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
# Aggregation
# --------------------------------------------------------------------------------------------------------
RECORD_FIELDS = (
    "method",
    "drafter",
    "budget",
    "temperature",
    "prompt_set",
    "prompts",
    "max_new_tokens",
    "repeats",
    "new_tokens",
    "target_forwards",
    "cycles",
    "tau",
    "tau_counted",
    "coverage",
    "coverage_z",
    "time_s",
    "ar_time_s",
    "speedup",
    "tokens_per_s",
    "greedy_exact",
    "tokens_sha1",
    "draft_ms",
    "build_ms",
    "forward_ms",
    "verify_ms",
    "cycle_ms",
    "model_ms",
    "overhead_ms",
    "overhead_fraction",
    "setup_ms",
    "prefill_ms",
    "verifier_stage_ms",
    "verifier_stage_ddtree_ms",
    "verifier_stage_reduction",
    "verifier_stage_cycles",
    "tree_size_mean",
    "tree_size_quartiles",
    "plain_cycle_fraction",
    "predicted_tau",
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
    fields_ = dict(
        new_tokens=new_tokens,
        target_forwards=forwards,
        tau_counted=counted,
        tau=counted,
        time_s=time_s,
        ar_time_s=ar_time_s,
        speedup=ar_time_s / time_s,
        tokens_per_s=new_tokens / time_s,
        tokens_sha1=digest.hexdigest(),
    )
    if METHODS[job.method].tev_verifier is None:
        return fields_
    blocks = [length for run in firsts for length in run.stats.accepted_lengths]
    coverages = [c for run in firsts for c in run.stats.coverages]
    timed = [run for runs in runs_per_prompt for run in runs if run.stats.num_cycles]  # every repeat

    def per_cycle_ms(seconds_of):  # median over runs of the run's mean per cycle
        return _median_ms([seconds_of(run) / run.stats.num_cycles for run in timed])

    fields_.update(
        cycles=len(blocks),
        tau=sum(blocks) / max(1, len(blocks)),
        coverage=statistics.fmean(coverages) if coverages else None,
        coverage_z=z_statistic([b - c for b, c in zip(blocks, coverages, strict=True)]),
        draft_ms=per_cycle_ms(lambda run: sum(run.stats.draft_times)),
        build_ms=per_cycle_ms(lambda run: sum(run.stats.build_times)),
        forward_ms=per_cycle_ms(lambda run: sum(run.stats.forward_times)),
        verify_ms=per_cycle_ms(lambda run: sum(run.stats.verify_times)),
        cycle_ms=per_cycle_ms(lambda run: run.loop_s),
        model_ms=per_cycle_ms(lambda run: run.loop_model_s),
        overhead_ms=per_cycle_ms(lambda run: run.loop_s - run.loop_model_s),
        overhead_fraction=statistics.median((run.loop_s - run.loop_model_s) / run.loop_s for run in timed)
        if timed
        else None,
        setup_ms=_median_ms([run.setup_s for run in timed]),
        prefill_ms=_median_ms([run.stats.prefill_time for run in timed]),
        **tree_size_fields(firsts),
    )
    return fields_


def tree_size_fields(runs: list[Run]) -> dict:
    """The chosen tree sizes (drafted nodes per cycle) of the runs: mean, quartiles, the fraction of cycles
    without a tree, and the block length the automatic budget predicted (None for fixed budgets)."""
    sizes = sorted(size for run in runs for size in run.stats.tree_sizes)
    predicted = [p for run in runs for p in run.stats.predicted_lengths]
    if not sizes:
        return {}
    quartiles = [sizes[min(len(sizes) - 1, int(q * len(sizes)))] for q in (0.25, 0.5, 0.75)]
    return dict(
        tree_size_mean=statistics.fmean(sizes),
        tree_size_quartiles=quartiles,
        plain_cycle_fraction=sum(size == 0 for size in sizes) / len(sizes),
        predicted_tau=statistics.fmean(predicted) if predicted else None,
    )


def greedy_mismatch(runs_per_prompt, ar_runs) -> str | None:
    """None when every prompt's tokens equal ar's, else where they first differ."""
    for index, (runs, reference) in enumerate(zip(runs_per_prompt, ar_runs, strict=True)):
        got, want = runs[0].sequence[0], reference[0].sequence[0]
        if not torch.equal(got, want):
            common = min(got.numel(), want.numel())
            differ = (got[:common] != want[:common]).nonzero()
            position = int(differ[0, 0]) if differ.numel() else common
            return f"prompt {index}: first difference at new token {position} (lengths {got.numel()} vs {want.numel()})"
    return None


def make_records(config, plan, runs, stage, temperature, set_name, num_prompts, notes) -> list[dict]:
    """The records of one temperature and prompt set; `stage[(drafter, budget)]` is the replay's verifier -> times."""
    ar_runs = runs[plan[(REFERENCE_METHOD, None, None)]]
    summaries, records = {}, []
    for (method, drafter, budget), job in plan.items():
        if job not in summaries:
            summaries[job] = summarise(job, runs[job], ar_runs)
        record = dict.fromkeys(RECORD_FIELDS)
        record.update(
            method=method,
            drafter=drafter,
            budget=budget,
            temperature=temperature,
            prompt_set=set_name,
            prompts=num_prompts,
            max_new_tokens=config.max_new_tokens,
            repeats=config.repeats,
        )
        record.update(summaries[job])
        if temperature == 0:
            mismatch = greedy_mismatch(runs[job], ar_runs)
            record["greedy_exact"] = mismatch is None
            if mismatch:
                message = (
                    f"GREEDY MISMATCH: {method} (drafter {drafter}, B={budget}) on {set_name} differs from "
                    f"{REFERENCE_METHOD} at T=0: {mismatch}"
                )
                warnings.warn(message, stacklevel=2)
                notes.append(message)
        times, verifier = stage.get((drafter, budget)), METHODS[method].replay_verifier
        if times and verifier is not None:
            reference_ms = _median_ms(times[REFERENCE_VERIFIER])
            record.update(
                verifier_stage_ms=_median_ms(times[verifier]),
                verifier_stage_ddtree_ms=reference_ms,
                verifier_stage_cycles=len(times[REFERENCE_VERIFIER]),
            )
            if verifier != REFERENCE_VERIFIER:
                record["verifier_stage_reduction"] = 1 - record["verifier_stage_ms"] / reference_ms
        records.append(record)
    return records


# --------------------------------------------------------------------------------------------------------
# The bench
# --------------------------------------------------------------------------------------------------------
def machine_info(config: BenchConfig) -> dict:
    import sys

    import transformers

    if config.device.startswith("cuda"):
        device_name = torch.cuda.get_device_name(config.device)
    else:
        cpuinfo = Path("/proc/cpuinfo")
        lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
        names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
        device_name = names[0] if names else platform.processor()
    return dict(
        cpu_count=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        load_average=[os.getloadavg()[0]],
        device=config.device,
        device_name=device_name or platform.machine(),
        dtype=config.dtype,
        torch=torch.__version__,
        transformers=transformers.__version__,
        hf_tev=__version__,
        python=sys.version.split()[0],
        platform=platform.platform(),
        # glibc malloc tuning changes CPU timings of large per-cycle buffers (see the README): record it.
        malloc_env={k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
    )


def check_load(notes: list[str]) -> None:
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores:
        message = (
            f"machine is loaded: 1-min load average {load:.2f} > {cores} cores; timings (SR, stage times) mean little"
        )
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
                message = (
                    f"prompt set {name!r} needs the Hugging Face Hub (datasets), which is not reachable: "
                    f"{reason}; skipped"
                )
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
            prompts = [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
                )
                for text in prompts
            ]
        sets[name] = [tokenizer(text, return_tensors="pt").input_ids.to(device) for text in prompts if text]
    return sets


def run_bench(config: BenchConfig, models: BenchModels | None = None) -> dict:
    """Run the bench and return the JSON document (see `hf_tev.bench`'s docstring); nothing is written."""
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
    replays = plan_replays(plan)
    generation = generation_settings(config, models.target)
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
                sampling = sampling_kwargs(temperature, config.stop_at_eos, config.top_k, config.top_p, config.min_p)
                for set_name, prompts in prompt_sets.items():
                    runs = {job: [[] for _ in prompts] for job in jobs}
                    for index, input_ids in enumerate(prompts):
                        for repeat in range(config.repeats):
                            shift = repeat % len(jobs)  # rotate the order so no method always runs first
                            for job in jobs[shift:] + jobs[:shift]:
                                progress.set_postfix_str(f"T={temperature:g} {set_name} {job.method}", refresh=False)
                                runs[job][index].append(
                                    run_once(
                                        models,
                                        probe,
                                        job,
                                        input_ids,
                                        config.max_new_tokens,
                                        sampling,
                                        config.seed + index,
                                    )
                                )
                                progress.update()
                    stage = {}
                    if temperature > 0:
                        processors = capture_logits_processor(models.target, prompts[0], sampling)
                        for (drafter, budget), verifiers in replays.items():
                            progress.set_postfix_str(f"T={temperature:g} {set_name} verifier stage B={budget}")
                            stage[(drafter, budget)] = same_tree_verifier_stage(
                                models.target,
                                models.drafters[drafter],
                                prompts,
                                budget,
                                processors,
                                config.max_new_tokens,
                                verifiers=verifiers,
                                seed=config.seed,
                            )
                            progress.update(len(prompts))
                    records += make_records(config, plan, runs, stage, temperature, set_name, len(prompts), notes)
    finally:
        progress.close()
        probe.remove()
    check_load(notes)
    machine["load_average"].append(os.getloadavg()[0])
    settings = {f.name: getattr(config, f.name) for f in fields(config)}
    settings["generation"] = generation
    return dict(schema=SCHEMA, settings=settings, machine=machine, warnings=notes, records=records)
