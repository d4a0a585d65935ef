"""Verifier micro-benchmark: the decision of each verifier on the same trees and target distributions.

    python benchmarks/bench_verifier.py                      # CPU, V = 4096 and 32000, B = 32 and 64, D = 15
    python benchmarks/bench_verifier.py --device cuda --runs 200

Trees come from `build_tree` on random drafter log-probs; every node gets a random target
distribution. For each (V, B) all methods run interleaved on the same trees in one process, and
the table gives the median wall time per call (synchronised on accelerators) and predraw / method.

Methods, all taking the processed target distributions `probs` [N, V] unless noted:
- tev, predraw, residual: the three exact verifiers (`hf_tev.verify.VERIFIERS`);
- greedy: the T = 0 rule on logits (no RNG);
- softmax: probs = softmax(logits) over [N, V], the preparation the probs-taking verifiers share.
(Not part of the comparison: the decode loop computes it once for whichever verifier runs.)
"""

import argparse
import statistics
import time

import torch

from hf_tev.tree import build_tree
from hf_tev.verify import verify_greedy, verify_predraw, verify_residual, verify_tev


def make_cases(vocab, budget, depth, num_trees, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for _ in range(num_trees):
        # Drafter marginals with a few plausible tokens per depth, so that the tree branches.
        draft_logprobs = (4 * torch.randn(depth, vocab, generator=gen)).log_softmax(-1).to(device)
        tree = build_tree(draft_logprobs, budget, root_token=0)
        logits = (4 * torch.randn(tree.num_nodes, vocab, generator=gen)).to(device)
        cases.append((tree, logits, torch.softmax(logits, dim=-1)))
    return cases


def methods(generator):
    return {
        "tev": lambda tree, logits, probs: verify_tev(tree, probs, generator),
        "predraw": lambda tree, logits, probs: verify_predraw(tree, probs, generator),
        "residual": lambda tree, logits, probs: verify_residual(tree, probs, generator),
        "greedy": lambda tree, logits, probs: verify_greedy(tree, logits),
        "softmax": lambda tree, logits, probs: torch.softmax(logits, dim=-1),
    }


@torch.inference_mode()
def time_methods(cases, runs, device):
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    generator = torch.Generator(device=device).manual_seed(0)
    fns = methods(generator)
    times = {name: [] for name in fns}
    names = list(fns)
    for name in names:  # warm-up
        for tree, logits, probs in cases:
            fns[name](tree, logits, probs)
    for run in range(runs):
        tree, logits, probs = cases[run % len(cases)]
        order = names[run % len(names):] + names[:run % len(names)]  # rotate: no method always first
        for name in order:
            synchronize()
            start = time.perf_counter()
            fns[name](tree, logits, probs)
            synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: 1e6 * statistics.median(values) for name, values in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocabs", default="4096,32000")
    parser.add_argument("--budgets", default="32,64")
    parser.add_argument("--depth", type=int, default=15)
    parser.add_argument("--trees", type=int, default=20)
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"device {device}, torch {torch.__version__}, CPU threads {torch.get_num_threads()}, "
          f"D = {args.depth}, {args.trees} trees, {args.runs} interleaved runs per method, median us per call\n")
    print("| V | B | N | tev | predraw | residual | greedy | softmax [N,V] | predraw / tev | residual / tev |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for vocab in map(int, args.vocabs.split(",")):
        for budget in map(int, args.budgets.split(",")):
            cases = make_cases(vocab, budget, args.depth, args.trees, device)
            t = time_methods(cases, args.runs, device)
            print(f"| {vocab} | {budget} | {budget + 1} | {t['tev']:.0f} | {t['predraw']:.0f} | {t['residual']:.0f} "
                  f"| {t['greedy']:.0f} | {t['softmax']:.0f} | {t['predraw'] / t['tev']:.1f}x "
                  f"| {t['residual'] / t['tev']:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
