"""Builders the test modules share: tiny targets and drafters, oracles, statistics, training rows and arguments,
and bench documents.

Test modules import from here (never from one another); fixtures that wrap these live in `conftest.py`.
"""

# --- targets, drafters, oracles and statistics (generation and model tests) ---

import contextlib
import json

import torch
from safetensors.torch import save_file
from transformers.generation.streamers import BaseStreamer

from hf_tev import DFlashDraftModel


def tiny_text_dims(vocab_size: int = 96, num_layers: int = 4) -> dict:
    """The text dimensions the tiny family, hybrid and Muse Glimmer targets share: hidden 32, heads 4 / KV 2 of 8,
    512 positions, bos 1 / eos 2 / pad 0 (generation reads the special ids)."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def make_target(
    arch: str = "qwen3",
    vocab_size: int = 96,
    hidden_size: int = 64,
    num_layers: int = 4,
    attn_implementation: str = "sdpa",
    seed: int = 0,
    dtype=torch.float32,
):
    """A tiny random causal LM of a real transformers architecture ("qwen3" or "llama")."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        raise ValueError(arch)
    # Random init gives near-uniform logits; sharpen them so greedy paths and acceptance are meaningful.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.set_attn_implementation(attn_implementation)
    return model.to(dtype).eval()


def make_drafter(target, *, block_size: int = 8, seed: int = 1, num_layers: int = 1, target_layer_ids=None):
    """A freshly initialised DFlash drafter sized for `target` (eval mode, as `from_target` returns it), its
    weights drawn after `torch.manual_seed(seed)`. Without `target_layer_ids` the default rule picks them."""
    torch.manual_seed(seed)
    drafter = DFlashDraftModel.from_target(
        target, num_layers=num_layers, block_size=block_size, target_layer_ids=target_layer_ids
    )
    return peaky(drafter)


def peaky(drafter):
    """`drafter` with a unit final norm, as before `from_target` bounded a fresh drafter's logits: a random
    drafter whose logits span sqrt(H) |w_v| proposes varied, confident trees, so deep paths get accepted and
    the law and batch tests have power (tests/real/test_fresh_drafter.py tests the bounded start itself)."""
    with torch.no_grad():
        drafter.norm.weight.fill_(1.0)
    return drafter


def own_sliding_drafter(
    target, layer_types=("sliding_attention", "sliding_attention"), block_size=6, seed=3, sliding_window=4
):
    """hf_tev's own DFlash drafter with sliding-window layers (`layer_types`, window `sliding_window`), reading the
    target's layers 1 and `T - 2`, its weights drawn after `torch.manual_seed(seed)`."""
    torch.manual_seed(seed)
    return peaky(
        DFlashDraftModel.from_target(
            target,
            num_layers=len(layer_types),
            block_size=block_size,
            target_layer_ids=[1, target.config.get_text_config().num_hidden_layers - 2],
            layer_types=list(layer_types),
            sliding_window=sliding_window,
        )
    )


def with_oracle(drafter, reference, boost: float = 40.0):
    """Make a drafter that mostly knows the target's greedy continuation `reference` (so trees get accepted).

    Depth d of a block rooted at position n boosts `reference[n + d]`; every third position gets a small boost
    only, so the right token is often not the drafter's first choice and only a branching tree catches it.
    `boost` is the large boost (the small one is a tenth of it): a real target's draft logits span more.
    """
    real = drafter.draft_logits

    def draft_logits(target, context, block_ids, position_ids, cache=None, num_depths=None):
        logits = real(target, context, block_ids, position_ids, cache=cache, num_depths=num_depths)
        root_position = int(position_ids[0, -block_ids.shape[1]])
        for depth in range(1, logits.shape[1] + 1):
            position = root_position + depth
            if position < reference.shape[1]:
                logits[0, depth - 1, reference[0, position]] += boost if position % 3 else boost / 10
        return logits

    drafter.draft_logits = draft_logits
    return drafter


def greedy(target, prompt, **kwargs):
    """The target's own greedy `generate` (the reference every tree decode must equal)."""
    return target.generate(prompt, do_sample=False, **kwargs)


class RecordingStreamer(BaseStreamer):
    """A streamer that keeps each `put` as its own list of tokens (`chunks`)."""

    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


class Collect(BaseStreamer):
    """A streamer that keeps every token it is given, in one flat list (`tokens`)."""

    def __init__(self):
        self.tokens, self.ended = [], False

    def put(self, value):
        self.tokens += value.reshape(-1).tolist()

    def end(self):
        self.ended = True


@contextlib.contextmanager
def transformers_log():
    """The messages logged by transformers' and hf_tev's loggers inside the block, as transformers' verbosity lets
    them through (hf_tev's logger takes its level from transformers' and prints with its own handler,
    `hf_tev.logs`). `warning_once` forgets what it said before, so each once-per-process warning shows again in
    the block."""
    import logging

    from transformers.utils import logging as transformers_logging

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    libraries = [transformers_logging.get_logger("transformers"), logging.getLogger("hf_tev")]
    transformers_logging.warning_once.cache_clear()
    for library in libraries:
        library.addHandler(handler)
    try:
        yield messages
    finally:
        for library in libraries:
            library.removeHandler(handler)


# Sampling laws: the exact law of a target's own sampling, and a test of observed counts against it


class TemperatureLike:
    """A logits processor that divides the scores by a temperature, as `temperature=` does."""

    def __init__(self, temperature):
        self.temperature = temperature

    def __call__(self, input_ids, scores):
        return scores / self.temperature


def exact_last_two_law(target, prompt, warpers, new_tokens=4):
    """P(generated tokens new_tokens - 1 and new_tokens), all earlier generated tokens summed out, under the
    target's own sampling with `warpers`. With 4 new tokens the first cycle after the prefill drafts a tree of
    depth 2 whose accepted path can emit both tokens, so tree verification itself is on trial."""
    with torch.no_grad():
        vocab = target.get_output_embeddings().weight.shape[0]
        sequences, mass = prompt, torch.ones(1, dtype=torch.float64)  # every prefix and its probability
        for step in range(new_tokens):
            probs = torch.softmax(warpers(sequences, target(sequences).logits[:, -1].float()), -1).double()
            if step < new_tokens - 2:
                mass = (mass[:, None] * probs).reshape(-1)
                sequences = torch.cat(
                    [sequences.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(sequences.shape[0])[:, None]], 1
                )
            elif step == new_tokens - 2:
                joint = mass[:, None] * probs  # [prefixes, V]: P(prefix, token n-1)
                sequences = torch.cat(
                    [sequences.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(sequences.shape[0])[:, None]], 1
                )
            else:
                law = (joint.reshape(-1, 1) * probs).reshape(-1, vocab, vocab).sum(0)  # [V, V]
    return law.float()


def chi_square_pvalue(counts, law, min_expected=5.0):
    """Pearson chi-square p-value, pooling cells with small expectation into one."""
    expected = law.flatten() * counts.sum()
    counts = counts.flatten().double()
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]]).double()
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))


def flattened(drafter, factor: float = 0.1):
    """The drafter with flatter draft marginals: its trees branch over most of a tiny vocabulary, so deep paths get
    accepted under sampling (any tree is exact; this one gives a law test its power)."""
    real = drafter.draft_logits
    drafter.draft_logits = lambda *args, **kwargs: real(*args, **kwargs) * factor
    return drafter


def assert_tree_sampling_law(target, prompt, drafter, verifiers, draws: int = 120):
    """Sample 4 tokens `draws` times per verifier (temperature 0.9, budget 12, seed 1234) and test the law of the
    last two (the first tree after the prefill can emit both) against the target's exact law, per verifier; the
    test must have power: depth-2 paths accepted often, and the pooled counts reject a wrong law (T = 0.6)."""
    from transformers import LogitsProcessorList

    from hf_tev import TEVConfig

    vocab = target.get_output_embeddings().weight.shape[0]
    law = exact_last_two_law(target, prompt, LogitsProcessorList([TemperatureLike(0.9)]))
    start = prompt.shape[1] + 2
    pooled, accepted = torch.zeros(vocab, vocab), []
    torch.manual_seed(1234)
    for verifier in verifiers:
        counts = torch.zeros(vocab, vocab)
        for _ in range(draws):
            out = target.generate(
                prompt, max_new_tokens=4, assistant_model=drafter, return_dict_in_generate=True,
                tev_config=TEVConfig(budget=12, verifier=verifier),  # 4 + 8 of 16 depth-2 paths
                do_sample=True, temperature=0.9, top_k=0, top_p=1.0,
            )  # fmt: skip
            counts[out.sequences[0, start], out.sequences[0, start + 1]] += 1
            accepted.append(out.tev_stats.accepted_lengths[0])
        assert chi_square_pvalue(counts, law) > 1e-3, verifier
        pooled += counts
    assert sum(a >= 3 for a in accepted) > 10 * len(verifiers), "depth-2 paths were never accepted: no power"
    wrong = exact_last_two_law(target, prompt, LogitsProcessorList([TemperatureLike(0.6)]))
    assert chi_square_pvalue(pooled, wrong) < 1e-3


# A published-style DFlash checkpoint (the layout the released drafters were written in), tiny dimensions

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, EPS, THETA = 32, 4, 2, 8, 48, 96, 1e-6, 10000.0


def published_weights(num_layers: int, num_features: int, dtype=torch.float32, seed: int = 0) -> dict:
    """Random weights under the published names (norm weights away from 1 so that they matter)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.2):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    def norm(n):
        return (1.0 + torch.randn(n, generator=g) * 0.2).to(dtype)

    w = {
        "fc.weight": rand(HIDDEN, num_features * HIDDEN),
        "hidden_norm.weight": norm(HIDDEN),
        "norm.weight": norm(HIDDEN),
    }
    for n in range(num_layers):
        p = f"layers.{n}."
        w.update(
            {
                p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
                p + "self_attn.q_norm.weight": norm(HEAD_DIM),
                p + "self_attn.k_norm.weight": norm(HEAD_DIM),
                p + "mlp.gate_proj.weight": rand(INTER, HIDDEN),
                p + "mlp.up_proj.weight": rand(INTER, HIDDEN),
                p + "mlp.down_proj.weight": rand(HIDDEN, INTER),
                p + "input_layernorm.weight": norm(HIDDEN),
                p + "post_attention_layernorm.weight": norm(HIDDEN),
            }
        )
    return w


def published_config(
    num_layers: int = 2,
    num_target_layers: int = 6,
    target_layer_ids=(1, 3),
    mask_token_id=95,
    block_size=4,
    block_size_in_dflash_config=False,
    dtype="float32",
) -> dict:
    """config.json as transformers 4.x wrote it for the published drafters (tiny dimensions)."""
    dflash = {"mask_token_id": mask_token_id}
    if target_layer_ids is not None:
        dflash["target_layer_ids"] = list(target_layer_ids)
    config = {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dflash_config": dflash,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INTER,
        "layer_types": ["full_attention"] * num_layers,
        "max_position_embeddings": 512,
        "max_window_layers": num_layers,
        "model_type": "qwen3",
        "num_attention_heads": HEADS,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": KV_HEADS,
        "num_target_layers": num_target_layers,
        "rms_norm_eps": EPS,
        "rope_scaling": None,
        "rope_theta": THETA,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "transformers_version": "4.57.1",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    }
    if block_size_in_dflash_config:
        dflash["block_size"] = block_size
    else:
        config["block_size"] = block_size
    return config


def write_checkpoint(folder, config: dict, weights: dict):
    """A checkpoint folder: `config.json` and `model.safetensors`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


# --- training rows, arguments and CLI runs (training tests) ---

import os  # noqa: E402  (each section keeps its imports with it)
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from hf_tev.packaged import kit_dir  # noqa: E402

TRAINING_BLOCK_SIZE = 4  # the training tests' drafters draft depths 1..3
REPO_ROOT = Path(__file__).resolve().parent.parent
# The kit study's own drafters (Table 2 arms and the 3-layer run; research/tiny_kit/README.md), not shipped in the kit
KIT_STUDY_DRAFTERS = REPO_ROOT / "research" / "tiny_kit" / "drafters"
# The installed tiny kit (tiny_kit/ of this checkout) and two of its files, found when a test first asks for them:
# importing helpers does no work, so a test that needs no kit runs without one.
KIT_FILES = {"KIT": ".", "KIT_PROMPTS": "prompts/train.json", "KIT_ROWS": "data/train_generated.jsonl"}


def __getattr__(name: str):
    if name in KIT_FILES:
        return kit_dir() / KIT_FILES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# `hf-tev train` flags of a few steps of a tiny drafter: small blocks, trees and decodes.
SMALL_RUN = dict(
    block_size=4,
    tree_budget=4,
    anchors_per_sequence=4,
    per_device_train_batch_size=2,
    max_steps=2,
    eval_tau_prompts=2,
    eval_tau_max_new_tokens=8,
    report_to="none",
    save_strategy="no",
    disable_tqdm="true",
    threads=1,
    seed=0,
)


def training_rows(n=8, length=16, prompt_length=3, seed=1) -> list[dict]:
    """`n` rows of `length` random token ids (3..95), the first `prompt_length` of them prompt."""
    generator = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(3, 96, (length,), generator=generator).tolist(), "prompt_length": prompt_length}
        for _ in range(n)
    ]


def training_args(tmp_path, **overrides):
    """`ExitTrainingArguments` of a short CPU run into `tmp_path / "out"` (2 steps of 2 rows, small trees, a log
    every step, no checkpoints), with `overrides`."""
    from hf_tev.training import ExitTrainingArguments

    settings = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
        per_device_train_batch_size=2,
        tree_budget=6,
        anchors_per_sequence=3,
        max_steps=2,
        seed=0,
    )
    settings.update(overrides)
    return ExitTrainingArguments(**settings)


def training_drafter(target, seed: int = 0):
    """The training tests' drafter for `target`: one layer, blocks of `TRAINING_BLOCK_SIZE`."""
    return make_drafter(target, block_size=TRAINING_BLOCK_SIZE, seed=seed)


def logged(trainer, key: str = "loss", after_step: int = 0) -> list:
    """The values of `key` in the trainer's log history, from the steps after `after_step`."""
    return [entry[key] for entry in trainer.state.log_history if key in entry and entry["step"] > after_step]


def small_run_flags(**changes) -> list[str]:
    """The `SMALL_RUN` flags with `changes` (None drops a flag), and --use_cpu."""
    settings = {**SMALL_RUN, **changes}
    return ["--use_cpu"] + [text for k, v in settings.items() if v is not None for text in (f"--{k}", str(v))]


def run_command(command, tmp_path, timeout=300, check=True):
    """Run `command` from the repository root, offline, with its own HF_HOME; it must succeed (unless not `check`)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0 or not check, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def train_summary(result) -> dict:
    """The summary `hf-tev train` prints after saving (steps, rows, eval tau, FLOPs)."""
    line = next(line for line in result.stdout.splitlines() if line.startswith("hf-tev train: saved"))
    return json.loads(line.split(": ", 2)[-1])


def run_two_processes(script: str, tmp_path) -> tuple[list[dict], Path]:
    """Run the Python `script` in 2 CPU processes (`torch.distributed.run`; tests/ importable). It gets an output
    folder as its argument and writes `rank{r}.json` into it; returns both ranks' JSON and the folder."""
    path, out = tmp_path / "two_processes.py", tmp_path / "out"
    # both processes leave the process group together: a process that exits with it alive can abort in gloo's
    # teardown ("terminate called without an active exception") after its work is done
    ending = "\nimport torch.distributed\nif torch.distributed.is_initialized():\n"
    ending += "    torch.distributed.barrier()\n    torch.distributed.destroy_process_group()\n"
    path.write_text(script + ending)
    out.mkdir()
    tests = REPO_ROOT / "tests"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(tests), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(path)]
    result = subprocess.run([*command, str(out)], env=env, capture_output=True, text=True, timeout=240)
    # a failing rank's own traceback comes first in stderr, torch.distributed.run's summary of it last
    first_traceback = result.stderr[result.stderr.find("Traceback") :][:3000] if "Traceback" in result.stderr else ""
    assert result.returncode == 0, result.stdout[-3000:] + first_traceback + result.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)], out


# --- bench documents (bench report tests) ---
# `hf_tev.bench` is imported inside these builders: importing it takes seconds, which the many test modules that
# import helpers for other builders would pay for nothing.


def bench_record(method, drafter, budget, temperature, prompt_set, speedups, taus, per_prompt=True, **extra):
    """A record of `hf_tev.bench/1` with the given per-prompt SR and tau (and the same values pooled)."""
    from hf_tev import bench

    record = dict.fromkeys(bench.RECORD_FIELDS)
    record.update(
        method=method,
        drafter=drafter,
        budget=budget,
        temperature=temperature,
        prompt_set=prompt_set,
        prompts=len(speedups),
        speedup=sum(speedups) / len(speedups),
        tau=sum(taus) / len(taus),
        tokens_per_s=100 * sum(speedups) / len(speedups),
        greedy_exact=True if temperature == 0 else None,
        **extra,
    )
    if per_prompt:
        record["per_prompt"] = dict(speedup=speedups, tau=taus, tokens_per_s=[100 * s for s in speedups])
    return record


def fake_document(budgets=(4, 64, "auto"), per_prompt=True) -> dict:
    """Two prompt sets, T = 0, `ar`, `prompt_lookup` and `tev` with one drafter at `budgets`."""
    from hf_tev import bench

    records = []
    for prompt_set in ("humaneval", "heldout"):
        records.append(bench_record("ar", None, None, 0.0, prompt_set, [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], per_prompt))
        records.append(
            bench_record("prompt_lookup", None, None, 0.0, prompt_set, [1.2, 1.4, 1.6], [1.5, 2, 2.5], per_prompt)
        )
        for budget in budgets:
            size = 8 if budget == "auto" else budget
            speedups = [0.8 + size / 100, 0.9 + size / 100, 1.0 + size / 100]
            taus = [1.5 + size / 50, 1.7 + size / 50, 1.9 + size / 50]
            records.append(
                bench_record("tev", "drafter-x", budget, 0.0, prompt_set, speedups, taus, per_prompt, cycle_ms=2.0)
            )
    settings = dict(
        target="org/target-model",
        temperatures=[0.0],
        budgets=list(budgets),
        max_prompts=3,
        max_new_tokens=16,
        repeats=1,
    )
    machine = dict(
        device="cpu",
        device_name="Some CPU 9000",
        dtype="float32",
        cpu_count=8,
        torch_threads=4,
        load_average=[0.5, 0.6],
        torch="2",
        transformers="5",
    )
    return dict(schema=bench.SCHEMA, settings=settings, machine=machine, warnings=[], records=records)
