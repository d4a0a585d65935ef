"""The highest tau any drafter can reach with an exact verifier: the target's own best tree of B nodes.

    python research/tiny_kit/coverage_ceiling.py --prompts 24 --budgets 16,32,64 --temperatures 1 \
        --output research/tiny_kit/ablation/coverage_ceiling.json

Why it bounds tau: an exact verifier's output Y_1, Y_2, ... follows the target's law, and it can accept k drafted
tokens only if Y_1..Y_k is a path of the tree. So P(accepted >= k) <= P_target(Y_1..Y_k is in the tree), and

    tau <= 1 + sum over the tree's nodes v of P_target(path root..v)

(the 1 is the bonus token). The tree comes from the drafter, never from the target's draw, so the bound holds for
every drafter and every exact verifier (TEV, token-level, sequence-level). Its maximum over prefix-closed trees
of B nodes is reached by adding nodes best-first by P_target (a node's path probability never exceeds its
parent's), which is what this script does with the target itself as the "drafter": per cycle, the expected
block length of a perfect B-node tree. At T = 0 the bound is 1 + min(B, depth) (the target's argmax chain), so
only T > 0 is interesting: there a block drafter must spread its B nodes over the target's branching.

The contexts are the target's own draws (seeded, the `hf-tev bench` sampling settings: no top-k/top-p, no EOS
stop), every position of each continuation taken as a cycle's root. The expansion of all positions of one
continuation runs in one target pass per step: every position's path reads the continuation's cache up to its
own root through a 4D attention mask, and the cache is cropped back after each pass.
"""

import argparse
import heapq
import json
import math
import statistics

import torch
from transformers import DynamicCache

from hf_tev.packaged import load_kit_model, load_kit_prompts, load_kit_tokenizer


@torch.no_grad()
def best_tree_masses(target, sequence: torch.LongTensor, start: int, budget: int, temperature: float) -> list[list]:
    """For every root position t in [start - 1, len - 2] of `sequence` `[1, L]`: the target probabilities of the
    nodes of its best `budget`-node tree, in best-first order (so the first B of them are the best B-node tree)."""
    length = sequence.shape[1]
    cache = DynamicCache(config=target.config)
    out = target(sequence, cache=cache, use_cache=True)
    roots = list(range(start - 1, length - 1))

    def distributions(logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits.float() / temperature, dim=-1)

    def push_children(heap, probs, mass, path):
        values, ids = probs.topk(budget)
        for p, token in zip((mass * values).tolist(), ids.tolist(), strict=True):
            heapq.heappush(heap, (-p, path + (token,)))

    heaps, masses = [], []
    root_probs = distributions(out.logits[0, roots])
    for row in range(len(roots)):
        heaps.append([])
        masses.append([])
        push_children(heaps[-1], root_probs[row], 1.0, ())
    dtype = out.logits.dtype
    for step in range(budget):
        popped = []
        for row, heap in enumerate(heaps):
            negative, path = heapq.heappop(heap)
            masses[row].append(-negative)
            popped.append((row, -negative, path))
        if step == budget - 1:
            break
        # One pass over every popped path: path tokens of root t see the cache up to t and their own path.
        tokens, positions, blocks = [], [], []
        for row, _, path in popped:
            blocks.append((row, len(tokens), len(path)))
            tokens += path
            positions += [roots[row] + 1 + i for i in range(len(path))]
        n = len(tokens)
        mask = torch.full((1, 1, n, length + n), torch.finfo(dtype).min, dtype=dtype)
        for row, offset, size in blocks:
            mask[0, 0, offset : offset + size, : roots[row] + 1] = 0
            own = torch.ones(size, size, dtype=torch.bool).tril()
            mask[0, 0, offset : offset + size, length + offset : length + offset + size].masked_fill_(own, 0)
        logits = target(
            torch.tensor([tokens]),
            cache=cache,
            attention_mask=mask,
            position_ids=torch.tensor([positions]),
            use_cache=True,
        ).logits[0]
        cache.crop(length - cache.get_seq_length())
        last = distributions(logits[[offset + size - 1 for _, offset, size in blocks]])
        for (row, mass, path), probs in zip(popped, last, strict=True):
            push_children(heaps[row], probs, mass, path)
    return masses


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=24, help="prompts per set (held-out, HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--budgets", default="16,32,64")
    parser.add_argument("--temperatures", default="1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    budgets = sorted(int(b) for b in args.budgets.split(","))
    tokenizer = load_kit_tokenizer()
    target = load_kit_model("target")
    prompts = {
        name: [tokenizer(p, return_tensors="pt").input_ids for p in load_kit_prompts(name, args.prompts)]
        for name in ("heldout", "humaneval")
    }
    results = {"args": vars(args), "ceilings": {}}
    for temperature in (float(t) for t in args.temperatures.split(",")):
        if temperature <= 0:
            raise SystemExit("at T = 0 the ceiling is 1 + min(B, depth): pass temperatures > 0")
        per_prompt = {b: [] for b in budgets}  # mean ceiling over the prompt's roots
        for name, rows in prompts.items():
            for index, input_ids in enumerate(rows):
                torch.manual_seed(args.seed + index)
                sequence = target.generate(
                    input_ids,
                    do_sample=True,
                    temperature=temperature,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=args.max_new_tokens,
                    eos_token_id=None,
                    pad_token_id=0,
                )
                masses = best_tree_masses(target, sequence, input_ids.shape[1], budgets[-1], temperature)
                for b in budgets:
                    per_prompt[b].append(statistics.fmean(1.0 + math.fsum(m[:b]) for m in masses))
                print(name, index, {b: round(per_prompt[b][-1], 3) for b in budgets}, flush=True)
        results["ceilings"][f"{temperature:g}"] = {
            str(b): {"mean": statistics.fmean(v), "min": min(v), "max": max(v), "per_prompt": v}
            for b, v in per_prompt.items()
        }
        for b in budgets:
            v = per_prompt[b]
            print(
                f"T = {temperature:g}, B = {b}: tau ceiling {statistics.fmean(v):.3f} "
                f"(prompts {min(v):.2f}-{max(v):.2f})",
                flush=True,
            )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
