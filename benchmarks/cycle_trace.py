"""Record every decoding cycle's decisions on a few kit prompts, to prove a refactor changed none of them.

For fixed budgets (the automatic budget follows measured times, so it is left out), both sampling verifiers
and greedy decoding, with and without context drafts, one prompt and a batch, it writes every cycle's tree
(tokens and parents), the accepted path, the block lengths and the output tokens to a JSON file. Two files
from two versions of the code compare with `--compare`:

    python benchmarks/cycle_trace.py --output /tmp/before.json        # on the old code
    python benchmarks/cycle_trace.py --output /tmp/after.json --compare /tmp/before.json

The per-cycle stage times of each run are written beside the decisions (mean milliseconds), for a look at the
cost; they are not compared (this machine is shared and noisy: `hf-tev bench` measures cost side by side).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import hf_tev
from hf_tev import verify
from hf_tev.packaged import load_kit_model, load_kit_prompts, load_kit_tokenizer

BUDGETS = (4, 16, 64)


def runs():
    """(name, TEVConfig fields, temperature, batch): the decisions recorded."""
    for budget in BUDGETS:  # the drafter alone (lookup=False), then with context drafts
        yield f"greedy-b{budget}", {"budget": budget, "lookup": False}, 0.0, False
        for verifier in ("tev", "predraw"):
            fields = {"budget": budget, "verifier": verifier, "seed": 0, "lookup": False}
            yield f"{verifier}-t1-b{budget}", fields, 1.0, False
    yield "greedy-lookup-b16", {"budget": 16, "lookup": True}, 0.0, False
    yield "tev-lookup-t1-b16", {"budget": 16, "lookup": True, "verifier": "tev", "seed": 0}, 1.0, False
    yield "greedy-batch-b16", {"budget": 16, "lookup": False}, 0.0, True
    yield "tev-batch-t1-b16", {"budget": 16, "verifier": "tev", "seed": 0, "lookup": False}, 1.0, True


class TreeRecorder:
    """Wraps every verifier of `hf_tev.verify.VERIFIERS` to record the trees it decides on and its path."""

    def __init__(self):
        self.cycles = []
        self.originals = dict(verify.VERIFIERS)

    def __enter__(self):
        for name, fn in self.originals.items():
            verify.VERIFIERS[name] = self._wrap(fn)
        return self

    def __exit__(self, *exc):
        verify.VERIFIERS.update(self.originals)

    def _wrap(self, fn):
        def recorded(tree, scores, **kwargs):
            path, bonus = fn(tree, scores, **kwargs)
            self.cycles.append(
                {
                    "tokens": tree.tokens.tolist(),
                    "parents": tree.parents.tolist(),
                    "path": path.tolist(),
                    "bonus": int(bonus),
                }
            )
            return path, bonus

        return recorded


def trace(target, drafter, tokenizer, prompts, max_new_tokens):
    result = {}
    for name, fields, temperature, batch in runs():
        groups = [prompts] if batch else [[p] for p in prompts]
        records = []
        for group in groups:
            inputs = tokenizer(group, return_tensors="pt", padding=True, padding_side="left")
            sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature else {}
            with TreeRecorder() as recorder:
                out = target.generate(
                    **inputs,
                    assistant_model=drafter,
                    tev_config=hf_tev.TEVConfig(**fields),
                    max_new_tokens=max_new_tokens,
                    return_dict_in_generate=True,
                    eos_token_id=None,
                    pad_token_id=tokenizer.pad_token_id,
                    **({"do_sample": False} if not temperature else sampling),
                )
            stats = out.tev_stats if isinstance(out.tev_stats, list) else [out.tev_stats]
            records.append(
                {
                    "sequences": out.sequences.tolist(),
                    "accepted_lengths": [s.accepted_lengths for s in stats],
                    "tree_sizes": [s.tree_sizes for s in stats],
                    "trees": recorder.cycles,
                    "ms_per_cycle": {
                        stage: 1e3 * sum(sum(getattr(s, f"{stage}_times")) for s in stats) / max(1, stats[0].num_cycles)
                        for stage in ("draft", "build", "forward", "verify")
                    },
                }
            )
        result[name] = records
        cycles = sum(len(r["accepted_lengths"][0]) for r in records)
        print(f"{name:22s} {cycles:4d} cycles", flush=True)
    return result


def compare(after: dict, before: dict) -> list[str]:
    """The runs whose decisions differ (stage times are not compared)."""
    keys = ("sequences", "accepted_lengths", "tree_sizes", "trees")
    differ = []
    for name in sorted(set(before) | set(after)):
        old, new = before.get(name), after.get(name)
        if old is None or new is None or any(o[k] != n[k] for o, n in zip(old, new, strict=True) for k in keys):
            differ.append(name)
    return differ


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="the JSON file to write")
    parser.add_argument("--compare", help="a JSON file from an earlier run: exit 1 if any decision differs")
    parser.add_argument("--drafter", default="drafter-dflash-l135", help="a kit drafter")
    parser.add_argument("--prompts", type=int, default=3, help="prompts of each kit set (held-out, HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, drafter = load_kit_model("target"), load_kit_model(args.drafter)
    tokenizer = load_kit_tokenizer()
    prompts = load_kit_prompts("heldout", args.prompts) + load_kit_prompts("humaneval", args.prompts)
    with torch.no_grad():
        result = trace(target, drafter, tokenizer, prompts, args.max_new_tokens)
    with open(args.output, "w") as f:
        json.dump(result, f)
    if args.compare:
        with open(args.compare) as f:
            differ = compare(result, json.load(f))
        total = sum(len(t["trees"]) for records in result.values() for t in records)
        print(f"{total} verified cycles compared; runs that differ: {differ or 'none'}")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
