"""What a tree pass of n tokens costs on SmolLM2-135M-Instruct, in plain steps, and the speedup it leaves room for.

    python benchmarks/tree_pass_cost.py --threads 1 --sizes 1,2,4,8,16,32,64 --output tree_pass_cost.json
    python benchmarks/tree_pass_cost.py --threads 1 --tau research/smollm2_drafter/results/table2.json --drafter l3

After `--context` cached tokens (a `DynamicCache`, cropped back after every pass):
- plain step: the target's forward of one token, as plain `generate` runs it;
- tree pass of n tokens: one forward of n tokens with a 4D mask over the cache and the new tokens (the shape of
  hf_tev's tree pass: a tree's nodes attend to the context and their ancestors; a chain is used, which costs the
  same as any tree of n nodes), the logits of every token kept (the verifier reads every node's).
Variants run interleaved, `--repeats` rounds; each figure is the median and the sum over the rounds, as a multiple
of the plain step's.

A cycle with a tree of B drafted nodes passes B + 1 tokens, so it costs at least cost(B + 1) plain steps plus the
drafter's call, and gives tau(B) tokens: the speedup over plain decoding is at most tau(B) / cost(B + 1). With
`--tau` (Table 2's records) that bound is printed per budget with the drafter's own tau.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"


def timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def pass_of(target, cache, context: int, size: int):
    """One forward of `size` tokens after the cached `context`, cropped back after it."""
    tokens = torch.full((1, size), 100)
    positions = torch.arange(context, context + size)[None]
    causal = torch.ones(size, size, dtype=torch.bool).tril()
    allowed = torch.cat([torch.ones(size, context, dtype=torch.bool), causal], dim=1)
    mask = torch.zeros(1, 1, size, context + size).masked_fill(~allowed, torch.finfo(torch.float32).min)
    mask = None if size == 1 else mask  # a plain step passes no mask

    def run():
        with torch.no_grad():
            target(input_ids=tokens, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True)
        cache.crop(context - cache.get_seq_length())  # transformers 5.24: minus the positions to remove

    return run


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--sizes", default="1,2,4,5,8,16,17,32,33,64,65", help="tokens per pass (1: the plain step)")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--tau", default=None, help="Table 2's records (table2.py --output) for the speedup bound")
    parser.add_argument("--drafter", default=None, help="the drafter's name in --tau (default: every drafter)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    sizes = sorted({1, *(int(s) for s in args.sizes.split(","))})
    records = json.loads(Path(args.tau).read_text()) if args.tau else None  # read before any model work
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, DynamicCache

    from hf_tev.packaged import packaged_model_path

    target = AutoModelForCausalLM.from_pretrained(
        packaged_model_path(TARGET), dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(input_ids=torch.full((1, args.context), 100), cache=cache, use_cache=True)
    passes = {size: pass_of(target, cache, args.context, size) for size in sizes}
    for run in passes.values():  # warm-up
        run()
    times: dict[int, list[float]] = {size: [] for size in sizes}
    for _ in range(args.repeats):
        for size, run in passes.items():
            times[size].append(timed(run))
    plain_median, plain_sum = statistics.median(times[1]), sum(times[1])
    cost = {size: (statistics.median(t) / plain_median, sum(t) / plain_sum) for size, t in times.items()}
    print(f"threads {args.threads}, context {args.context}, {args.repeats} rounds", end="; ")
    print(f"plain step {1e3 * plain_median:.2f} ms")
    print("tokens  ms (median)  plain steps: median (sum)")
    for size, t in times.items():
        print(f"{size:6d}  {1e3 * statistics.median(t):11.2f}  {cost[size][0]:6.3f} ({cost[size][1]:6.3f})")
    report = {
        "threads": args.threads,
        "context": args.context,
        "repeats": args.repeats,
        "seconds": {str(s): {"median": statistics.median(t), "sum": sum(t)} for s, t in times.items()},
    }
    if records is not None:
        report["bound"] = speedup_bound(records, cost, args.drafter)
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1) + "\n")


def speedup_bound(records, cost, drafter=None) -> list[dict]:
    """tau(B) / cost(B + 1) per drafter, budget and temperature of Table 2 where B + 1 was measured: what the
    speedup over plain decoding can be at most with that drafter's own trees (its call not counted)."""
    bound = []
    cells = sorted({(r["drafter"], r["budget"], r["temperature"]) for r in records})
    for name, budget, temperature in cells:
        if (drafter and name != drafter) or budget + 1 not in cost:
            continue
        rows = [r for r in records if (r["drafter"], r["budget"], r["temperature"]) == (name, budget, temperature)]
        tau = sum(r["tokens"] for r in rows) / sum(r["cycles"] for r in rows)
        median, total = cost[budget + 1]
        bound.append({"drafter": name, "budget": budget, "temperature": temperature, "tau": tau, "cost": median})
        print(f"{name} B={budget} T={temperature:g}: tau {tau:.3f} / cost {median:.3f} ({total:.3f}) = "
              f"SR at most {tau / median:.3f} ({tau / total:.3f})")  # fmt: skip
    return bound


if __name__ == "__main__":
    sys.exit(main())
