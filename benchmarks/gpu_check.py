"""The prepared GPU check: what only an accelerator shows, in one short run with nothing downloaded.

    bash benchmarks/gpu_check.sh                                             # on the device (docs/bench.md#on-a-gpu)
    python benchmarks/gpu_check.py --device cuda --output gpu_check.json     # the same, without the install step
    python benchmarks/gpu_check.py --device cpu --shape tiny ...             # the whole plan at tiny shapes (tests)

The question it answers: what speedup (SR) does hf_tev reach on a Qwen3-4B-shaped target at the paper's tau?
Sections, in order of priority (a `--time-budget` guard skips the later ones, and the JSON is rewritten after
every section, so a run cut short still leaves what it measured):

1. `tree_pass`: a randomly initialised target of Qwen3-4B's shape (36 layers, hidden 2560, 32 heads / 8 KV heads
   of 128, MLP 9728, vocabulary 151,936) in bf16: the seconds of one tree pass over n tokens after a `--context`-
   token prompt, n = 1, 2, 4, ..., `--max-tokens` and `--budget` + 1 (the pass a tree of the budget makes).
2. `modes.eager`: plain `generate`, hf_tev and transformers' own DFlash chain on that target, with a drafter of the
   published DFlash layout's depth (5 layers, blocks of 16, random weights) made an oracle: it knows the target's
   greedy continuation `--oracle-depth` tokens deep (then it is the random drafter), so every cycle accepts about
   `--oracle-depth` tokens and the cache commit moves real entries. Per method: seconds per step / cycle as the
   difference of two output lengths (no prefill, no warm-up; hf_tev's loop waits for nothing per stage: its stage
   times are CUDA events read after the cycle's one wait); the stage breakdown from `TEVStats` (draft, build, tree
   pass, verify, and the rest of the cycle: the commit of the tokens); hf_tev's own
   time per cycle (cycle - draft - tree pass at the realised size); host waits and kernels per step / cycle from
   the profiler (and, on CUDA, torch's sync debug mode); peak memory; the SR measured at the oracle's tau.
3. `paper_tau`: from the measured curve, the draft time and hf_tev's own time, the SR the paper's tau at B = 64
   (7.80 and 8.85) gives: SR = tau * t_step / (t_draft + t_pass(B + 1) + t_own) (`paper_tau_static`: the same
   in the static mode, after section 5, its padded pass's recorded time as t_pass).
4. `exactness` on the kit (fp32, real weights, on the device): greedy output of every verifier and budget equals
   the target's own greedy `generate`; a greedy batch equals each prompt alone; at T = 1, a seeded law test of
   every verifier (and of a batch) on a tiny-vocabulary target against its exact law, with a power check.
5. `modes.static`: the same as 2 with a static cache (one fresh `StaticCache` per call, of one length for both
   output lengths): transformers compiles plain generate's step on CUDA itself; hf_tev's static tree pass
   (docs/usage.md#static-shapes) runs with the target's forward under `torch.compile(mode="reduce-overhead")` on
   CUDA (`--compile`), with the graphs, recompiles and graph breaks it traced, and its first call's seconds (the
   compile). A method that refuses the mode reports `{"skipped": "<why>"}`.
6. `auto`: what `budget="auto"` chooses under the measured cost curve, on the kit drafter's trees.

Writes one JSON document (`--output`) and prints a summary. Exit status 1 when an exactness check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

SHAPES = {  # name -> Qwen3Config fields (random weights)
    "qwen3-4b": dict(
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,  # enough layers for the published drafter's 5 target layers
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
    ),
}
PUBLISHED_DRAFTER = dict(num_layers=5, block_size=16)  # z-lab's Qwen3 DFlash drafters (e.g. Qwen3-4B-DFlash-b16)
PAPER_TAU_AT_B64 = (7.80, 8.85)  # the paper's tau at B = 64
VERIFIERS = ("tev", "predraw", "residual")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"


def random_target(shape: str, device, dtype):
    """A random Qwen3 of `shape`, its LM head sharpened (as the tests' targets) so that greedy choices are clear
    margins, not near ties that the rounding of a bf16 pass of another shape could flip."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        **SHAPES[shape], max_position_embeddings=8192, tie_word_embeddings=False, attn_implementation="sdpa"
    )
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: no float32 copy of 4B parameters on the way
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = None  # every run makes exactly the tokens asked for
    model.generation_config.pad_token_id = 0
    return model.to(dtype).eval()


# --- 1. the tree-pass cost curve ---


@torch.no_grad()
def tree_pass_curve(target, context: int, sizes: list[int], repeats: int) -> dict:
    """Seconds of a tree pass over n tokens (a chain: the cost does not depend on the shape) after `context`."""
    from transformers import DynamicCache

    from hf_tev.tree import TreeInputs, build_chain

    device = target.device
    prompt = torch.randint(0, target.config.vocab_size, (1, context), device=device)
    cache = DynamicCache(config=target.config)
    target(prompt, cache=cache, logits_to_keep=1)
    inputs = TreeInputs(context + max(sizes), target.dtype, device)
    seconds = []
    for size in sizes:
        chain = build_chain(torch.zeros(size - 1, 1, device=device), size - 1, torch.tensor(1, device=device))
        mask, positions = inputs(chain, context, context)
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            sync(device)
            start = time.perf_counter()
            target(chain.tokens[None], position_ids=positions, attention_mask=mask, cache=cache, logits_to_keep=0)
            sync(device)
            times.append(time.perf_counter() - start)
            cache.crop(context - cache.get_seq_length())
        seconds.append(statistics.median(times[1:]))
    return {"tokens": sizes, "seconds": seconds, "ratio_to_one_token": [s / seconds[0] for s in seconds]}


def pass_seconds(curve: dict, tokens: float) -> float:
    """The curve's seconds at `tokens`, linear between the measured sizes (flat past the ends)."""
    points = sorted(zip(curve["tokens"], curve["seconds"], strict=True))
    if tokens <= points[0][0]:
        return points[0][1]
    for (n0, s0), (n1, s1) in zip(points, points[1:], strict=False):
        if tokens <= n1:
            return s0 + (s1 - s0) * (tokens - n0) / (n1 - n0)
    return points[-1][1]


def curve_sizes(max_tokens: int, budget: int) -> list[int]:
    powers = [1 << i for i in range(max_tokens.bit_length()) if (1 << i) <= max_tokens]
    return sorted({*powers, budget + 1})


# --- the oracle drafter and the oracle chain ---


def oracle_drafter(drafter, known: list, depth: int, margin: float = 20.0):
    """Make `drafter` know the target's greedy continuation `known[0]` `[1, L]` (prompt included) `depth`
    tokens deep: at depths 1..depth of a block rooted at position p, token `known[0][p + d]` gets the block
    row's highest logit + `margin`. Every third depth has a decoy: the next token id gets the top logit and the
    known token the second (1 lower), so the accepted path leaves the tree's first nodes there and the cache
    commit moves real entries, as a real drafter's paths do. Deeper rows are the drafter's own. Computed on the
    device (no host read), so the oracle adds no host wait to the cycle it is measured in. `known` is a one-item
    list, so that the continuation can be replaced (`settle_oracle`)."""
    real = drafter.draft_logits

    def draft_logits(target, context, block_ids, position_ids, cache=None, num_depths=None, **kwargs):
        logits = real(target, context, block_ids, position_ids, cache=cache, num_depths=num_depths, **kwargs)
        reference = known[0]
        length = reference.shape[1]
        depths = torch.arange(1, logits.shape[1] + 1, device=logits.device)
        positions = position_ids[:, -block_ids.shape[1]][:, None] + depths  # [B|1, D]
        boosted = (positions < length) & (depths <= depth)
        decoyed = boosted & (depths % 3 == 0)
        tokens = reference[0, positions.clamp(max=length - 1)].expand(logits.shape[0], -1)
        decoys = (tokens + 1) % logits.shape[-1]
        top = logits.amax(-1) + margin
        own = logits.gather(-1, tokens[..., None])[..., 0]
        value = torch.where(boosted, top - decoyed.to(top.dtype), own)
        decoy_value = torch.where(decoyed, top, logits.gather(-1, decoys[..., None])[..., 0])
        logits = logits.scatter(-1, decoys[..., None], decoy_value[..., None])
        return logits.scatter(-1, tokens[..., None], value[..., None])

    drafter.draft_logits = draft_logits
    return drafter


@contextlib.contextmanager
def counted_commits():
    """Counts the cache commits of the calls inside (`{"commits", "moved_commits"}`): a moved commit is one whose
    accepted path is not the tree's first nodes, so entries of the tree window move."""
    from hf_tev.generation import verifier

    counts = {"commits": 0, "moved_commits": 0}
    real = verifier.commit_accepted_path

    def commit(cache, past, path, path_is_prefix, *args, **kwargs):
        counts["commits"] += 1
        counts["moved_commits"] += not path_is_prefix
        return real(cache, past, path, path_is_prefix, *args, **kwargs)

    verifier.commit_accepted_path = commit
    try:
        yield counts
    finally:
        verifier.commit_accepted_path = real


@contextlib.contextmanager
def oracle_chain(known: list, depth: int):
    """transformers' DFlash chain with the same oracle: its first `depth` drafted tokens of each block are the
    target's greedy continuation `known[0]` (the rest are the drafter's), so it accepts what hf_tev's oracle does."""
    from transformers.generation import candidate_generator

    generator = candidate_generator.DFlashTokenCandidateGenerator
    real = generator.get_candidates

    def get_candidates(self, input_ids, *args, **kwargs):
        ids, logits = real(self, input_ids, *args, **kwargs)
        reference, start = known[0], input_ids.shape[1]
        end = min(ids.shape[1], start + depth, reference.shape[1])
        if end > start:
            ids = ids.clone()
            ids[:, start:end] = reference[:, start:end]
        return ids, logits

    generator.get_candidates = get_candidates
    try:
        yield
    finally:
        generator.get_candidates = real


# --- timing, counting, memory ---


def timed(call, device) -> tuple[float, object]:
    sync(device)
    start = time.perf_counter()
    result = call()
    sync(device)
    return time.perf_counter() - start, result


def marginal(call_at, lengths: tuple[int, int], device, repeats: int) -> dict:
    """Seconds per unit (step or cycle) as the difference of two output lengths: `call_at(n)` decodes n new
    tokens and returns its units; prefill, warm-up and call overhead cancel. The median of `repeats` runs each."""
    runs = {}
    for n in lengths:
        call_at(n)  # warm-up (allocator, kernels, and an automatic budget's probe)
        times, units = [], None
        for _ in range(repeats):
            seconds, units = timed(lambda n=n: call_at(n), device)
            times.append(seconds)
        runs[n] = (statistics.median(times), units)
    (t1, u1), (t2, u2) = runs[lengths[0]], runs[lengths[1]]
    return {
        "seconds_per_unit": (t2 - t1) / max(u2 - u1, 1e-9),
        "units": [u1, u2],
        "seconds": [t1, t2],
        "new_tokens": list(lengths),
        "seconds_per_token": (t2 - t1) / (lengths[1] - lengths[0]),
    }


def profile_counts(call, device) -> dict:
    """Host waits and kernels of one call, from the profiler. On CUDA: runtime synchronisations (stream, device,
    event, blocking memcpy) and device kernels (copies and fills apart), with the sync debug mode's warnings as a
    second count of waits. On the CPU, where nothing is waited for: reads of a tensor's value on the host
    (`aten::_local_scalar_dense`: `.item()`, `int()`, `bool()`) and the leaf aten ops (kernel-like ops)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with profile(activities=activities) as prof:
                units = call()
                sync(device)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    return {"units": units, **count_events(prof.events(), [str(w.message) for w in caught], cuda)}


def count_events(events, warned: list[str], cuda: bool) -> dict:
    """Host waits and kernels among profiler events (`profile_counts`)."""
    from torch.autograd import DeviceType

    if cuda:
        host = [e for e in events if e.device_type == DeviceType.CPU]
        device_events = [e for e in events if e.device_type == DeviceType.CUDA]
        return {
            "host_waits": sum("Synchronize" in e.name or e.name in ("cudaMemcpy", "cuMemcpyDtoH") for e in host),
            "sync_warnings": sum("synchroniz" in message.lower() for message in warned),
            "kernels": sum(not e.name.startswith(("Memcpy", "Memset")) for e in device_events),
            "launches": sum("LaunchKernel" in e.name for e in host),
        }
    aten = [e for e in events if e.name.startswith("aten::")]
    return {
        "host_waits": sum(e.name == "aten::_local_scalar_dense" for e in aten),
        "kernels": sum(not any(c.name.startswith("aten::") for c in e.cpu_children) for e in aten),
    }


def counts_per_unit(call_at, lengths: tuple[int, int], device) -> dict:
    """Profiler counts per unit, as the difference of two output lengths (prefill and warm-up cancel)."""
    first, second = (profile_counts(lambda n=n: call_at(n), device) for n in lengths)
    units = second["units"] - first["units"]
    if units <= 0:
        return {"failed": f"no {lengths[1] - lengths[0]} more tokens took another unit: lengths {list(lengths)}"}
    return {key: (second[key] - first[key]) / units for key in first if key != "units"}


def peak_memory(call, device) -> dict | None:
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    call()
    sync(device)
    peak = torch.cuda.max_memory_allocated(device)
    return {"peak_gib": peak / 2**30, "above_resident_gib": (peak - before) / 2**30}


# --- 2. plain generate, hf_tev and the transformers chain on the oracle ---


def method_calls(target, drafter, prompt, known: dict, args, extra):
    """`call_at(n)` per method: decodes n new tokens greedily and returns its units (steps, cycles, forwards),
    or with `output=True` what generate returned. `known`: each oracle's continuation (`oracle_drafter`);
    `extra()`: each call's further generate arguments (a fresh static cache)."""
    from hf_tev import TEVConfig

    def plain(n):
        target.generate(prompt, do_sample=False, max_new_tokens=n, **extra())
        return n

    def tev(n, output=False):
        out = target.generate(
            prompt, do_sample=False, max_new_tokens=n, assistant_model=drafter, return_dict_in_generate=True,
            tev_config=TEVConfig(budget=args.budget), **extra(),
        )  # fmt: skip
        return out if output else out.tev_stats.num_cycles

    def chain(n, output=False):
        forwards = []
        hook = target.register_forward_hook(lambda *_: forwards.append(1))
        try:
            with oracle_chain(known["transformers_dflash_chain"], args.oracle_depth):
                out = target.generate(
                    prompt, do_sample=False, max_new_tokens=n, assistant_model=drafter, speculation_type="dflash",
                    **extra(),
                )  # fmt: skip
        finally:
            hook.remove()
        return out if output else len(forwards) - 1  # the prefill apart: one target forward per cycle

    return {"plain": plain, "hf_tev": tev, "transformers_dflash_chain": chain}


def settle_oracle(call_at, known: list, n: int, prompt_length: int, rounds: int = 3) -> dict:
    """Check a method's greedy output against the plain greedy continuation its oracle knows, then let the oracle
    know the method's own output instead until the two agree. In bf16 a pass over many tokens rounds otherwise
    than a one-token step, so where a random target's top two logits nearly tie, the tree's argmax can differ
    from plain generate's (exactness is judged on the kit, in fp32); an oracle left on the plain continuation
    would then be wrong from there on and the cycles would accept about 1 token."""
    first_mismatch, settled, first_call_s = None, False, None
    for round_ in range(rounds):
        started = time.perf_counter()
        out = call_at(n, output=True)
        first_call_s = time.perf_counter() - started if first_call_s is None else first_call_s
        sequence = out if isinstance(out, torch.Tensor) else out.sequences
        differs = (sequence[0] != known[0][0, : sequence.shape[1]]).nonzero()
        if round_ == 0 and differs.numel():
            first_mismatch = int(differs[0]) - prompt_length
        if not differs.numel():
            settled = True
            break
        known[0] = torch.cat([sequence, known[0][:, sequence.shape[1] :]], 1)
    return {"equals_plain_greedy": first_mismatch is None, "first_mismatch": first_mismatch,
            "oracle_rounds": round_, "oracle_settled": settled, "first_call_s": first_call_s}  # fmt: skip


def stage_breakdown(call_tev, n: int, device) -> dict:
    """hf_tev's stage times per cycle from a run's `TEVStats` (on CUDA the device time between events recorded at
    each stage's end, no wait per stage; on the CPU host times): draft, build, tree pass, verify (processors,
    decision, cache commit of the path), and the rest of the cycle (the commit of the tokens: outputs, stops, the
    drafter's context), which the statistics do not keep: the cycle's wall time less the four."""
    with counted_commits() as commits:
        seconds, out = timed(lambda: call_tev(n, output=True), device)
    stats = out.tev_stats
    summary = stats.summary()
    cycle = (seconds - summary["prefill_s"] - summary["probe_s"]) / max(stats.num_cycles, 1)
    stages = {key: summary[f"{key}_s"] for key in ("draft", "build", "forward", "verify")}
    return {
        **{f"{key}_ms": 1e3 * value for key, value in stages.items()},
        "rest_ms": 1e3 * (cycle - sum(stages.values())),
        "cycle_wall_ms": 1e3 * cycle,
        "tau": stats.tau,
        "tree_size": summary["tree_size"],
        "pass_nodes": statistics.fmean(stats.pass_nodes) if stats.pass_nodes else summary["tree_size"] + 1,
        "cycles": stats.num_cycles,
        **commits,
    }


def measure_method(name, call_at, args, device, known: dict, prompt_length: int) -> dict:
    lengths = (args.new_tokens // 2, args.new_tokens)
    oracle = settle_oracle(call_at, known[name], args.new_tokens, prompt_length) if name in known else {}
    row = {**marginal(call_at, lengths, device, args.repeats), **oracle}
    halves = (args.new_tokens // 4, args.new_tokens // 2)  # shorter runs: the profiler slows them down
    for key, measure in (
        ("per_unit", lambda: counts_per_unit(call_at, halves, device)),
        ("memory", lambda: peak_memory(lambda: call_at(args.new_tokens), device)),
    ):
        try:  # the times are kept if the profiler or the memory statistics fail on this machine
            row[key] = measure()
        except Exception as error:  # noqa: BLE001
            row[key] = {"failed": first_line(error)}
    return row


@contextlib.contextmanager
def compiled_forward(target, enabled: bool):
    """hf_tev's static mode as docs/usage.md#static-shapes shows it: the target's forward under `torch.compile`
    (CUDA graphs); yields dynamo's counters of what the calls inside traced."""
    if not enabled:
        yield None
        return
    from torch._dynamo.utils import counters

    original = target.forward
    counters.clear()
    target.forward = torch.compile(original, mode="reduce-overhead")
    try:
        yield counters
    finally:
        target.forward = original


def static_cache_factory(target, length: int):
    """A fresh transformers `StaticCache` of `length` positions per call: one length for both output lengths,
    so one shape (a new `max_new_tokens` would otherwise be a new cache length, and a new graph)."""
    from transformers import StaticCache

    return lambda: {"cache": StaticCache(config=target.config, max_cache_len=length)}


@torch.no_grad()
def decode_mode(target, drafter, prompt, reference, curve, args, device, mode: str) -> dict:
    """Plain generate, hf_tev and transformers' chain in one mode: "eager", or "static" (a static cache for all
    three; transformers compiles plain generate's step on CUDA itself, hf_tev's target forward is compiled here
    unless `--compile no`)."""
    static = mode == "static"
    length = prompt.shape[1] + args.new_tokens + args.budget + 16  # the longest call and one padded tree
    extra = static_cache_factory(target, length) if static else dict
    compile_tev = static and (args.compile == "yes" or (args.compile == "auto" and device.type == "cuda"))
    known = {name: [reference.clone()] for name in ("hf_tev", "transformers_dflash_chain")}
    drafter.oracle_known[:] = known["hf_tev"]  # the drafter's oracle reads this mode's continuation
    known["hf_tev"] = drafter.oracle_known
    calls = method_calls(target, drafter, prompt, known, args, extra)
    result = {}
    for name, call_at in calls.items():
        compiling = compiled_forward(target, compile_tev and name == "hf_tev")
        try:
            with compiling as counters:
                result[name] = measure_method(name, call_at, args, device, known, prompt.shape[1])
                if name == "hf_tev":
                    result[name]["stages"] = stage_breakdown(call_at, args.new_tokens, device)
                if counters is not None:
                    result[name]["compiled"] = compile_counts(counters)
        except Exception as error:  # noqa: BLE001 - a mode hf_tev or transformers refuses is reported, not fatal
            result[name] = {"skipped": first_line(error)}
    tev, plain = result["hf_tev"], result["plain"]
    if "skipped" in tev or "skipped" in plain:
        return result
    stages = tev["stages"]
    tev["cycle_ms"] = 1e3 * tev["seconds_per_unit"]
    # the tree pass: the measured curve's at the realised size (eager), or the recorded stage's (static: the
    # padded pass, compiled on CUDA, which the eager curve does not describe)
    forward_ms = stages["forward_ms"] if static else 1e3 * pass_seconds(curve, stages["pass_nodes"])
    tev["own_ms"] = tev["cycle_ms"] - stages["draft_ms"] - forward_ms
    plain["step_ms"] = 1e3 * plain["seconds_per_unit"]
    for name in ("hf_tev", "transformers_dflash_chain"):
        if "skipped" not in result[name]:
            result[name]["sr_per_token"] = plain["seconds_per_token"] / result[name]["seconds_per_token"]
            result[name]["sr_end_to_end"] = plain["seconds"][1] / result[name]["seconds"][1]
    return result


def compile_counts(counters) -> dict:
    """What the compiled calls traced: graphs, dynamo's recompiles and graph breaks (after a first call that
    traces the prefill and the padded tree pass, later calls should trace nothing)."""
    return {
        "unique_graphs": counters["stats"]["unique_graphs"],
        "recompiles": sum(counters["recompiles"].values()),
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def paper_tau(mode: dict, curve: dict | None, budget: int) -> dict:
    """The SR a tau gives under this target's measured costs: tau * t_step / (t_draft + t_pass(B+1) + t_own),
    t_pass(B+1) from the eager curve, or (`curve` None: the static mode, whose every pass is padded to B + 1)
    the mode's recorded tree-pass stage."""
    tev, plain = mode["hf_tev"], mode["plain"]
    step = plain["seconds_per_unit"]
    draft, own = tev["stages"]["draft_ms"] / 1e3, tev["own_ms"] / 1e3
    tree_pass = tev["stages"]["forward_ms"] / 1e3 if curve is None else pass_seconds(curve, budget + 1)
    cycle = draft + tree_pass + own
    taus = {f"{tau:.2f}": tau for tau in PAPER_TAU_AT_B64}
    oracle_tau = tev["stages"]["tau"]
    return {
        "budget": budget,
        "cycle_ms_model": 1e3 * cycle,
        "sr": {key: tau * step / cycle for key, tau in taus.items()},
        "oracle_tau": oracle_tau,
        "sr_model_at_oracle_tau": oracle_tau * step / cycle,
        "sr_measured_at_oracle_tau": tev["sr_per_token"],
    }


# --- 4. exactness on the device ---


def kit_prompt_ids(tokenizer, prompts: int, device) -> list[torch.Tensor]:
    from hf_tev.packaged import load_kit_prompts

    texts = load_kit_prompts("humaneval", prompts)
    return [tokenizer(text, return_tensors="pt").input_ids.to(device) for text in texts]


@torch.no_grad()
def kit_greedy_exact(device, prompts: int, max_new_tokens: int) -> dict:
    """Greedy output of distinct settings, and of a left-padded batch, against the kit target's own greedy
    `generate` of each prompt alone (with the same processors). At T = 0 every verifier is the same argmax walk, so
    the runs differ by what changes the cycle instead: the budget (automatic, 8, 64), context drafts off, and a
    logits processor (a repetition penalty) that the tree's verification must apply per node."""
    from hf_tev import TEVConfig
    from hf_tev.packaged import load_kit_model, load_kit_tokenizer

    target, drafter = load_kit_model("target", device=device), load_kit_model("drafter-dflash-l135", device=device)
    tokenizer = load_kit_tokenizer()
    fixed = dict(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    settings = {
        "auto/tev": ({"budget": "auto"}, {}),
        "8/tev": ({"budget": 8}, {}),
        "64/tev": ({"budget": 64}, {}),
        "64/tev/lookup_off": ({"budget": 64, "lookup": False}, {}),
        "64/tev/repetition_penalty": ({"budget": 64}, {"repetition_penalty": 1.3}),
    }
    results, alone = {}, []
    for ids in kit_prompt_ids(tokenizer, prompts, device):
        expected = {}
        for key, (config, processors) in settings.items():
            if str(processors) not in expected:
                expected[str(processors)] = target.generate(ids, **fixed, **processors)
            out = target.generate(ids, assistant_model=drafter, tev_config=TEVConfig(**config), **fixed, **processors)
            results[key] = results.get(key, True) and torch.equal(out, expected[str(processors)])
        alone.append(expected["{}"][0])
    results["batch"] = kit_batch_exact(target, drafter, [row[: len(row) - max_new_tokens] for row in alone], alone)
    return {"all_equal": all(results.values()), "by_setting": results}


def kit_batch_exact(target, drafter, prompts: list[torch.Tensor], expected: list[torch.Tensor]) -> bool:
    """A left-padded greedy batch through hf_tev equals each prompt's own greedy generate, left padding kept."""
    from hf_tev import TEVConfig

    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=prompts[0].device)
    mask = torch.zeros_like(ids)
    for r, prompt in enumerate(prompts):
        ids[r, width - len(prompt) :], mask[r, width - len(prompt) :] = prompt, 1
    new = len(expected[0]) - len(prompts[0])
    out = target.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=new, eos_token_id=None, pad_token_id=0,
        assistant_model=drafter, tev_config=TEVConfig(budget=16),
    )  # fmt: skip
    return all(torch.equal(out[r, width - len(p) :], e) for r, (p, e) in enumerate(zip(prompts, expected, strict=True)))


def law_target(device):
    """A tiny-vocabulary target (8 tokens) whose exact law of two generated tokens fits in memory, and a random
    drafter with confident, varied trees (unit final norm), so depth-2 paths are often accepted."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hf_tev import DFlashDraftModel

    torch.manual_seed(4)
    config = Qwen3Config(
        vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    target = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(16.0)  # peaked: the law has clear structure, a wrong law is far
    target = target.to(device)
    torch.manual_seed(1)
    drafter = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    with torch.no_grad():
        drafter.norm.weight.fill_(1.0)
    return target, drafter


@torch.no_grad()
def exact_last_two_law(target, prompt, temperature: float, new_tokens: int = 4) -> torch.Tensor:
    """P(generated tokens 3 and 4), the earlier ones summed out, under the target's own sampling at
    `temperature` (`[V, V]`): the first tree after the prefill can emit both."""
    vocab = target.config.vocab_size
    sequences, mass = prompt, torch.ones(1, dtype=torch.float64, device=prompt.device)
    for step in range(new_tokens):
        probs = torch.softmax(target(sequences).logits[:, -1].double() / temperature, -1)
        if step < new_tokens - 1:
            mass = (mass[:, None] * probs).reshape(-1)
            grown = torch.arange(vocab, device=prompt.device).repeat(sequences.shape[0])[:, None]
            sequences = torch.cat([sequences.repeat_interleave(vocab, 0), grown], 1)
    joint = (mass[:, None] * probs).reshape(-1, vocab, vocab, vocab).sum(0)  # [V, V, V]: tokens 2, 3, 4
    return joint.sum(0).cpu()


def chi_square_pvalue(counts: torch.Tensor, law: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value, cells with small expectation pooled into one."""
    expected = law.flatten().double() * counts.sum()
    counts = counts.flatten().double()
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))


@torch.no_grad()
def sampling_law(device, draws: int, batch_rows: int) -> dict:
    """At T = 1, seeded: the law of generated tokens 3 and 4 under every verifier (one prompt, `draws` calls)
    and under a batch (`batch_rows` copies of the prompt per call), against the exact law (p > 1e-3), and the
    power: depth-2 paths accepted, and the pooled counts reject the law at T = 0.6 (p < 1e-3)."""
    from hf_tev import TEVConfig

    target, drafter = law_target(device)
    vocab, prompt = target.config.vocab_size, torch.tensor([[1, 5, 3]], device=device)
    law, wrong = exact_last_two_law(target, prompt, 1.0), exact_last_two_law(target, prompt, 0.6)
    sample = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=4, return_dict_in_generate=True)
    start, pooled, result, deep = prompt.shape[1] + 2, torch.zeros(vocab, vocab), {}, 0
    torch.manual_seed(1234)
    settings = [(verifier, 1, draws) for verifier in VERIFIERS] + [("tev", batch_rows, draws // batch_rows)]
    for verifier, rows, calls in settings:
        counts = torch.zeros(vocab, vocab)
        for _ in range(calls):
            out = target.generate(
                prompt.expand(rows, -1), assistant_model=drafter, **sample,
                tev_config=TEVConfig(budget=6, verifier=verifier),
            )  # fmt: skip
            tokens = out.sequences[:, start : start + 2].cpu()
            counts.index_put_((tokens[:, 0], tokens[:, 1]), torch.ones(rows), accumulate=True)
            stats = out.tev_stats if isinstance(out.tev_stats, list) else [out.tev_stats]
            deep += sum(s.accepted_lengths[0] >= 3 for s in stats)
        result["batch" if rows > 1 else verifier] = chi_square_pvalue(counts, law)
        pooled += counts
    return {
        "pvalues": result,
        "all_pass": all(p > 1e-3 for p in result.values()),
        "depth_2_accepted": deep,
        "draws": int(pooled.sum()),
        "power_wrong_law_pvalue": chi_square_pvalue(pooled, wrong),
        "has_power": bool(chi_square_pvalue(pooled, wrong) < 1e-3 and deep > 0.05 * float(pooled.sum())),
    }


# --- 5. the automatic budget under the measured cost curve ---


@torch.no_grad()
def kit_trees(device, prompts: int, max_new_tokens: int, max_budget: int):
    """The kit drafter's trees (path log-probs, nested: the first n nodes are the best tree of size n) along
    greedy decoding of a few held-out prompts, and the acceptance calibration an "auto" run learns there."""
    from transformers import GenerationConfig

    from hf_tev import TEVConfig
    from hf_tev.generation import TreeCandidateGenerator, automatic_budget
    from hf_tev.packaged import load_kit_model, load_kit_prompts, load_kit_tokenizer

    target, drafter = load_kit_model("target", device=device), load_kit_model("drafter-dflash-l135", device=device)
    tokenizer = load_kit_tokenizer()
    captured = []
    build = TreeCandidateGenerator.build

    def capture(self, draft_logprobs, root, *args, **kwargs):  # every cycle's full tree, for its nested sizes
        if draft_logprobs is not None:
            captured.append(self.builder(draft_logprobs, max_budget, root).path_logprobs)
        return build(self, draft_logprobs, root, *args, **kwargs)

    TreeCandidateGenerator.build = capture
    try:
        for text in load_kit_prompts("heldout", prompts):
            ids = tokenizer(text, return_tensors="pt").input_ids.to(device)
            target.generate(
                ids,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                assistant_model=drafter,
                tev_config=TEVConfig(budget="auto", max_budget=max_budget),
            )
    finally:
        TreeCandidateGenerator.build = build
    config = TEVConfig(budget="auto", max_budget=max_budget)  # the calibration the calls above learnt
    budget = automatic_budget(target, drafter, config, GenerationConfig(do_sample=False))
    return captured, budget.calibration


def auto_choice(trees, calibration, curve: dict, draft_s: float, max_budget: int) -> dict:
    """Under a tree-pass cost curve: the size `auto` picks on every kit tree, and expected tokens per second of
    auto against every fixed budget (the same calibrated acceptance, the same cost model)."""
    from hf_tev.budget import CostAwareBudget, CycleCost

    cost = CycleCost()
    cost.set_probe(curve["tokens"], curve["seconds"])
    cost.observe_draft(draft_s)
    chosen, auto_tokens, auto_time = [], 0.0, 0.0
    fixed = {b: [0.0, 0.0] for b in (1, 4, 16, 64, 256, 1024) if b <= max_budget}
    for log_qs in trees:
        budget = CostAwareBudget(max_budget, calibration, cost)
        rule = budget.size_rule()
        size = next((n - 1 for n in range(1, len(log_qs)) if not rule(n, log_qs[n])), len(log_qs) - 1)
        chosen.append(size)
        accepted = [calibration(q) for q in log_qs[1:]]
        auto_tokens += 1 + sum(accepted[:size])
        auto_time += cost.cycle(size)
        for b in fixed:
            fixed[b][0] += 1 + sum(accepted[:b])
            fixed[b][1] += cost.cycle(min(b, len(log_qs) - 1))
    sizes = sorted(chosen)
    return {
        "chosen_sizes_quartiles": [sizes[int(q * (len(sizes) - 1))] for q in (0.25, 0.5, 0.75)],
        "chosen_size_mean": statistics.fmean(chosen),
        "tokens_per_s_auto": auto_tokens / auto_time,
        "tokens_per_s_fixed": {b: tokens / seconds for b, (tokens, seconds) in fixed.items()},
        "tokens_per_s_plain": 1 / cost.cycle(0, drafted=False),
    }


def auto_section(report: dict, args, device) -> dict:
    curve = report["tree_pass"]
    max_budget = max(curve["tokens"]) - 1
    trees, calibration = kit_trees(device, args.kit_prompts, args.new_tokens, max_budget)
    draft_s = report["modes"]["eager"]["hf_tev"]["stages"]["draft_ms"] / 1e3
    per_token = {"tokens": curve["tokens"], "seconds": [curve["seconds"][0] * k for k in curve["tokens"]]}
    return {
        "under_this_curve": auto_choice(trees, calibration, curve, draft_s, max_budget),
        "under_a_per_token_curve": auto_choice(trees, calibration, per_token, draft_s, max_budget),
    }


# --- the plan ---


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-4b")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens (tree-pass curve and decoding)")
    parser.add_argument("--max-tokens", type=int, default=1024, help="largest tree pass of the curve (tokens)")
    parser.add_argument("--budget", type=int, default=64, help="hf_tev's tree budget B (the paper's tau is at 64)")
    parser.add_argument("--oracle-depth", type=int, default=8, help="tokens the oracle knows per block (tau ~ +1)")
    parser.add_argument("--new-tokens", type=int, default=256, help="the longer of the two output lengths")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per output length (after a warm-up)")
    parser.add_argument("--kit-prompts", type=int, default=3)
    parser.add_argument("--kit-new-tokens", type=int, default=48)
    parser.add_argument("--law-draws", type=int, default=240, help="draws per verifier in the T = 1 law test")
    parser.add_argument("--batch-rows", type=int, default=16, help="rows per call of the batch law test")
    parser.add_argument("--static", choices=["try", "skip"], default="try", help="the static mode's section")
    parser.add_argument(
        "--compile", choices=["auto", "yes", "no"], default="auto", help="compile hf_tev's static target (auto: CUDA)"
    )
    parser.add_argument("--time-budget", type=float, default=330.0, help="seconds after which sections are skipped")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    if not 1 <= args.oracle_depth < PUBLISHED_DRAFTER["block_size"]:
        parser.error(f"--oracle-depth must be in [1, {PUBLISHED_DRAFTER['block_size'] - 1}]")
    if args.new_tokens < 8 or args.budget < 1 or args.repeats < 1 or args.law_draws < args.batch_rows:
        parser.error("--new-tokens must be >= 8, --budget and --repeats >= 1, and --law-draws >= --batch-rows")
    return args


def environment(device) -> dict:
    import transformers

    import hf_tev

    return {
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_tev": getattr(hf_tev, "__version__", None),
        "python": sys.version.split()[0],
    }


def run_sections(report: dict, sections, args, started: float, write) -> None:
    """Each section in turn, skipped once the time budget is spent; a failing section is recorded, not fatal."""
    for name, section in sections:
        if time.perf_counter() - started > args.time_budget:
            report[name] = {"skipped": f"time budget of {args.time_budget:.0f} s spent"}
        else:
            try:
                report[name] = section()
            except Exception as error:  # noqa: BLE001 - the other sections still run in the short window
                report[name] = {"failed": first_line(error)}
        report["seconds"] = time.perf_counter() - started
        write(report)


CHECKOUT_KIT = Path(__file__).resolve().parents[1] / "tiny_kit" / "hf_tev_tiny_kit"


def find_kit() -> None:
    """On a bare device image the tiny kit is not installed, only carried in the checkout: point `HF_TEV_KIT` at
    the checkout's copy unless the kit is installed or the variable is set (the exactness and auto sections load
    it)."""
    from hf_tev.packaged import KIT_PACKAGE, installed_package_dir

    if "HF_TEV_KIT" not in os.environ and installed_package_dir(KIT_PACKAGE) is None:
        os.environ["HF_TEV_KIT"] = str(CHECKOUT_KIT)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import hf_tev  # noqa: F401  (routes generate)

    find_kit()
    from hf_tev import DFlashDraftModel

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    started = time.perf_counter()
    report = {"settings": vars(args), "environment": environment(device), "modes": {}}

    def write(document):
        if args.output:
            with open(args.output, "w") as f:
                f.write(json.dumps(document, indent=1, default=str) + "\n")

    target = random_target(args.shape, device, dtype)
    drafter = DFlashDraftModel.from_target(target, **PUBLISHED_DRAFTER)
    prompt = torch.randint(0, target.config.vocab_size, (1, args.context), device=device)
    reference = target.generate(prompt, do_sample=False, max_new_tokens=args.new_tokens + 16)
    drafter.oracle_known = [reference]
    oracle_drafter(drafter, drafter.oracle_known, args.oracle_depth)

    def mode(name):
        report["modes"][name] = decode_mode(target, drafter, prompt, reference, report["tree_pass"], args, device, name)
        return report["modes"][name]

    sizes = curve_sizes(args.max_tokens, args.budget)
    sections = [
        ("tree_pass", lambda: tree_pass_curve(target, args.context, sizes, args.repeats)),
        ("eager", lambda: bool(mode("eager"))),
        ("paper_tau", lambda: paper_tau(report["modes"]["eager"], report["tree_pass"], args.budget)),
        ("exactness", lambda: exactness(args, device)),
        ("static", lambda: bool(mode("static")) if args.static == "try" else {"skipped": "--static skip"}),
        ("paper_tau_static", lambda: paper_tau(report["modes"]["static"], None, args.budget)),
        ("auto", lambda: auto_section(report, args, device)),
    ]
    run_sections(report, sections, args, started, write)
    if device.type == "cuda":
        report["environment"]["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    for name in ("eager", "static"):  # the modes' results live under "modes"; keep only a failure or a skip
        if report.get(name) is True:
            del report[name]
    write(report)
    print_summary(report)
    return report


def exactness(args, device) -> dict:
    greedy = kit_greedy_exact(device, args.kit_prompts, args.kit_new_tokens)
    law = sampling_law(device, args.law_draws, args.batch_rows)
    return {
        "greedy": greedy,
        "sampling_t1": law,
        "all_exact": greedy["all_equal"] and law["all_pass"] and law["has_power"],
    }


def print_summary(report: dict) -> None:
    curve = report["tree_pass"]
    if "tokens" in curve:
        ratios = zip(curve["tokens"], curve["ratio_to_one_token"], strict=True)
        print("tree pass / one token:", ", ".join(f"{n}: {r:.2f}x" for n, r in ratios))
    for name, mode in report["modes"].items():
        for method, row in mode.items():
            if "skipped" in row:
                print(f"{name} {method}: skipped ({row['skipped']})")
                continue
            text = f"{name} {method}: {1e3 * row['seconds_per_unit']:.2f} ms/unit"
            counts = row["per_unit"]
            if "host_waits" in counts:
                text += f", waits {counts['host_waits']:.1f}, kernels {counts['kernels']:.0f} per unit"
            if "sr_per_token" in row:
                text += f", SR {row['sr_per_token']:.2f}"
            if "own_ms" in row:
                text += f", own {row['own_ms']:.2f} ms/cycle, tau {row['stages']['tau']:.2f}"
                text += f", equals plain greedy: {row['equals_plain_greedy']}"
            print(text)
    for name in ("paper_tau", "paper_tau_static"):
        paper = report.get(name, {})
        if "sr" in paper:
            srs = {tau: round(sr, 2) for tau, sr in paper["sr"].items()}
            print(f"{name}: SR at the paper's tau (B = {paper['budget']}):", srs)
    print("exact:", report.get("exactness", {}).get("all_exact"))
    print(f"done in {report['seconds']:.0f} s")


if __name__ == "__main__":
    sys.exit(0 if main().get("exactness", {}).get("all_exact") else 1)
