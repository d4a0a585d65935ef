"""Where the trees' missing mass sits: the exit law of each drafter's own trees, by the exit node's depth.

    python research/smollm2_table2/exit_mass.py --drafters standard=DIR_A,exit=DIR_B --budget 64 --prompts 16 \
        --threads 1 --output OUT.json

Every drafter decodes the held-out prompts of `table2.py` (the same chat-templated prompts, seeds and
`TEVConfig(budget=B, lookup=False)`) at T = 1. In every cycle the target flow of the tree it verified is read
(`hf_tev.verify.target_flow`: P(v), and the exit mass E(v) = P(v) - sum of its children's P, sum E = 1): E(v) is the
probability that the target's own continuation leaves the tree at v (docs/design.md#the-exit-law-and-tev). Summed by
the exit node's depth, and split into nodes with children (the target's next token is none of the drafted ones)
and leaves (the tree stops there), it says where a drafter loses its block length:

- mass at the root is a miss at depth 1: no drafted first token is the target's;
- mass at a leaf of depth d is a path the tree did not continue, for budget or because the drafter's scores fell.

ExitTrain's node weight is w(v) depth(v) = E(v) depth(v) (SPEC section 6): the root's exit mass weighs 0, so the
share of mass at the root is the share of the trees' missing mass the tree term cannot see.

Writes `--output` (per cycle sums, per drafter) and prints the table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from study import TARGET
from table2 import chat_prompts, decode, drafter_name
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_tev
import hf_tev.generation.loop as loop
from hf_tev.bench.methods import PAPER_PROMPT_SETS
from hf_tev.packaged import packaged_model_path
from hf_tev.verify import target_flow

DEPTHS = 5  # exit depths reported one by one; deeper ones are summed into the last column


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafters", required=True, help="NAME=FOLDER entries")
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per benchmark set")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    for entry in args.drafters.split(","):  # before any model loads
        name, _, folder = entry.partition("=")
        if not name or not (Path(folder) / "config.json").is_file():
            parser.error(f"--drafters: {entry!r} is not NAME=FOLDER with a drafter's config.json in FOLDER")
    return args


class ExitMassRecorder:
    """Stands in for `loop.coverage` while a drafter decodes: returns what it returns, and adds each cycle's exit
    masses by depth, split into nodes with children and leaves."""

    def __init__(self, coverage):
        self.coverage = coverage
        self.inner = np.zeros(DEPTHS + 1)
        self.leaf = np.zeros(DEPTHS + 1)
        self.expected = 0.0  # sum over cycles of 1 + C = sum_v E(v) (depth(v) + 1)
        self.cycles = 0

    def __call__(self, tree, scores):
        _, exit_mass = target_flow(tree, scores)
        depth = tree.depths.clamp(max=DEPTHS)
        has_children = torch.zeros(tree.num_nodes, dtype=torch.bool).index_fill_(0, tree.parents[1:], True)
        for split, where in ((self.inner, has_children), (self.leaf, ~has_children)):
            split += (
                torch.zeros(DEPTHS + 1, dtype=torch.float64)
                .index_add_(0, depth[where], exit_mass[where].double())
                .numpy()
            )
        self.expected += float((exit_mass.double() * (tree.depths + 1)).sum())
        self.cycles += 1
        return self.coverage(tree, scores)

    def row(self) -> dict:
        return {
            "cycles": self.cycles,
            "inner": self.inner.tolist(),
            "leaf": self.leaf.tolist(),
            "coverage": self.expected / max(self.cycles, 1),
        }


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    path = packaged_model_path(TARGET)
    target = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = chat_prompts(tokenizer, args.prompts)
    results = {}
    for entry in args.drafters.split(","):
        drafter = hf_tev.DFlashDraftModel.from_pretrained(Path(entry.split("=", 1)[1])).eval()
        recorder, tokens, cycles = ExitMassRecorder(loop.coverage), 0, 0
        loop.coverage = recorder
        try:
            for set_name, index, ids in prompts:
                seed = 1000 * index + PAPER_PROMPT_SETS.index(set_name)
                row = decode(target, drafter, ids, args.budget, 1.0, seed, args.max_new_tokens)
                tokens, cycles = tokens + row["tokens"], cycles + row["cycles"]
        finally:
            loop.coverage = recorder.coverage
        results[drafter_name(entry)] = {**recorder.row(), "tau": tokens / cycles}
    Path(args.output).write_text(json.dumps({"budget": args.budget, "drafters": results}, indent=1))
    print(report(results))


def report(results: dict) -> str:
    """Mean exit mass per cycle by the exit node's depth (inner node + leaf), beside tau and the mean 1 + C."""
    header = " | ".join(f"depth {d}" if d < DEPTHS else f"depth {d}+" for d in range(DEPTHS + 1))
    lines = [
        f"| drafter | cycles | tau | 1 + C | exit mass at {header} (inner + leaf) |",
        "|---|---|---|---|" + "---|" * (DEPTHS + 1),
    ]
    for name, row in results.items():
        inner, leaf = np.array(row["inner"]) / row["cycles"], np.array(row["leaf"]) / row["cycles"]
        cells = " | ".join(f"{i:.3f} + {f:.3f}" for i, f in zip(inner, leaf, strict=True))
        lines.append(f"| {name} | {row['cycles']} | {row['tau']:.3f} | {row['coverage']:.3f} | {cells} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
