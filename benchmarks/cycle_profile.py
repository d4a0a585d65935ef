"""What a decoding cycle dispatches, against a plain `generate` step, on the tiny kit: the profiler's count of
kernel-like ops (aten ops that call no other aten op: what becomes a kernel launch on a GPU) and the Python-level
calls (`sys.setprofile`), per cycle and per step; and, in static shapes, how often a compiled target is traced.

    python benchmarks/cycle_profile.py --threads 1 --output cycle_profile.json

- plain: `generate` greedy, `--new_tokens` tokens; per step = totals / new tokens.
- hf_tev: `TEVConfig(budget=--budget, lookup=False)` with the kit's drafter, greedy; per cycle = totals / cycles;
  the default (dynamic) cache and `cache_implementation="static"`.
- static, compiled: the target's `forward` under `torch.compile` with a counting backend (the graphs the compiler
  hands over, each run as traced), over calls that reach at least `--cycles` cycles in all: graphs traced per 100
  cycles after the first call, and dynamo's own recompile counter.
The prefill is included in both totals (one per call); the figures are counts, not times, so the machine's load
does not move them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch


def leaf_ops(profile) -> int:
    """The aten ops of a profile that called no other aten op."""
    events = [event for event in profile.events() if event.name.startswith("aten::")]
    parents = {id(event.cpu_parent) for event in events if event.cpu_parent is not None}
    return sum(1 for event in events if id(event) not in parents)


def python_calls(function) -> tuple[object, int]:
    calls = Counter()

    def count(frame, event, arg):
        if event == "call":
            calls["call"] += 1

    sys.setprofile(count)
    try:
        result = function()
    finally:
        sys.setprofile(None)
    return result, calls["call"]


def measure(function) -> dict:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        function()
    result, calls = python_calls(function)
    return {"result": result, "kernel_like_ops": leaf_ops(profile), "python_calls": calls}


def compiled_graphs(target, drafter, prompt, args) -> dict:
    """Graphs a compiled target traces in static shapes over calls that reach `args.cycles` cycles."""
    from torch._dynamo.utils import counters

    from hf_tev import TEVConfig

    torch._dynamo.reset()
    counters.clear()
    traced = []

    def backend(graph, example_inputs):
        traced.append(graph)
        return graph.forward

    original = target.forward
    target.forward = torch.compile(original, backend=backend, dynamic=False)
    config = TEVConfig(budget=args.budget, lookup=False)
    per_call, cycles = [], 0
    try:
        while cycles < args.cycles:
            before = len(traced)
            out = target.generate(
                prompt, assistant_model=drafter, tev_config=config, cache_implementation="static",
                max_new_tokens=args.new_tokens, do_sample=False, return_dict_in_generate=True,
            )  # fmt: skip
            cycles += out.tev_stats.num_cycles
            per_call.append({"cycles": out.tev_stats.num_cycles, "graphs": len(traced) - before})
    finally:
        target.forward = original
    later = sum(call["graphs"] for call in per_call[1:])
    later_cycles = sum(call["cycles"] for call in per_call[1:])
    return {
        "calls": per_call,
        "graphs_first_call": per_call[0]["graphs"],
        "graphs_per_100_later_cycles": 100 * later / max(later_cycles, 1),
        "dynamo_recompiles": sum(counters["recompiles"].values()),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--cycles", type=int, default=300, help="cycles the compiled static calls reach in all")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from hf_tev import TEVConfig
    from hf_tev.packaged import load_kit_model, load_kit_prompts, load_kit_tokenizer

    target, drafter = load_kit_model("target"), load_kit_model("drafter-dflash-l135")
    prompt = load_kit_tokenizer()(load_kit_prompts("heldout", 1)[0], return_tensors="pt").input_ids
    common = dict(max_new_tokens=args.new_tokens, do_sample=False)

    def plain():
        return target.generate(prompt, **common)

    def tev(**extra):
        config = TEVConfig(budget=args.budget, lookup=False)
        return lambda: target.generate(
            prompt, assistant_model=drafter, tev_config=config, return_dict_in_generate=True, **common, **extra
        )

    report = {"threads": args.threads, "budget": args.budget, "new_tokens": args.new_tokens}
    plain(), tev()()  # warm-up
    counted = measure(plain)
    steps = counted.pop("result").shape[1] - prompt.shape[1]
    report["plain_per_step"] = {key: value / steps for key, value in counted.items()}
    modes = ["dynamic"]
    for name, extra in (("dynamic", {}), ("static", {"cache_implementation": "static"})):
        try:
            counted = measure(tev(**extra))
        except ValueError as error:  # an hf_tev without static shapes (a baseline revision)
            report[f"tev_{name}_per_cycle"] = {"skipped": str(error)}
            continue
        cycles = counted.pop("result").tev_stats.num_cycles
        report[f"tev_{name}_per_cycle"] = {key: value / cycles for key, value in counted.items()}
        report[f"tev_{name}_cycles"] = cycles
        modes = [*dict.fromkeys([*modes, name])]
    if "static" in modes:
        report["static_compiled"] = compiled_graphs(target, drafter, prompt, args)
    plain_step = report["plain_per_step"]
    for name in modes:
        cycle = report[f"tev_{name}_per_cycle"]
        print(
            f"{name}: per cycle {cycle['kernel_like_ops']:.0f} kernel-like ops "
            f"({cycle['kernel_like_ops'] / plain_step['kernel_like_ops']:.2f}x a plain step), "
            f"{cycle['python_calls']:.0f} Python calls ({cycle['python_calls'] / plain_step['python_calls']:.2f}x)"
        )
    compiled = report.get("static_compiled")
    if compiled:
        print(
            f"static, compiled: {compiled['graphs_first_call']} graphs in the first call, "
            f"{compiled['graphs_per_100_later_cycles']:.1f} per 100 later cycles, "
            f"{compiled['dynamo_recompiles']} recompiles"
        )
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
