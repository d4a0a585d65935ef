"""Table 2 / Table 5 view of eval_tau.py results: tau (and 1 + C) per drafter, budget and temperature.

    python research/tiny_kit/summarize_tau.py research/tiny_kit/tau_T0.json research/tiny_kit/tau_T1.json

Pools the prompt sets (cycle-weighted) and prints a markdown table, with each drafter's gain over drafter-dflash.
"""

import json
import sys
from collections import defaultdict
from pathlib import Path


def main(paths):
    records = [r for path in paths for r in json.loads(Path(path).read_text())]
    pooled = defaultdict(lambda: [0.0, 0.0, 0])  # (drafter, T, B) -> [sum tau, sum 1+C, cycles]
    for r in records:
        cell = pooled[r["drafter"], r["temperature"], r["budget"]]
        cell[0] += r["tau"] * r["cycles"]
        cell[1] += r["coverage"] * r["cycles"]
        cell[2] += r["cycles"]
    drafters = list(dict.fromkeys(r["drafter"] for r in records))
    budgets = sorted({r["budget"] for r in records})
    for temperature in sorted({r["temperature"] for r in records}):
        print(f"\nT = {temperature:g}: tau (1 + C), held-out + HumanEval prompts pooled")
        print("| drafter | " + " | ".join(f"B={b}" for b in budgets) + " | mean | vs drafter-dflash |")
        print("|---" * (len(budgets) + 3) + "|")
        base = None
        for drafter in drafters:
            cells = [pooled[drafter, temperature, b] for b in budgets]
            taus = [c[0] / c[2] for c in cells]
            mean = sum(taus) / len(taus)
            base = mean if base is None else base
            row = " | ".join(f"{c[0] / c[2]:.3f} ({c[1] / c[2]:.3f})" for c in cells)
            print(f"| {drafter} | {row} | {mean:.3f} | {100 * (mean / base - 1):+.1f}% |")


if __name__ == "__main__":
    main(sys.argv[1:])
