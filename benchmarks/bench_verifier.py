"""Verifier micro-benchmark: the decision of each verifier on the same trees and target distributions.

    python benchmarks/bench_verifier.py                      # CPU, V = 4096 and 32000, B = 32 and 64, D = 15
    python benchmarks/bench_verifier.py --device cuda --runs 200

Trees come from `build_tree` on random drafter log-probs; every node gets a random target
distribution. For each (V, B) all methods run interleaved on the same trees in one process, and
the table gives the median wall time per call (synchronised on accelerators) and predraw / method.

Methods, all taking the processed target logits `scores` [N, V] (each verifier normalises the rows it needs):
- tev, predraw, residual: the three exact verifiers (`hf_tev.verify.VERIFIERS`);
- greedy: the T = 0 rule (no RNG);
- softmax: softmax over all [N, V] rows, for scale (predraw does it inside; TEV and residual normalise only the
  rows of nodes with children and the exit row).
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
        cases.append((tree, logits))
    return cases


def methods(generator):
    return {
        "tev": lambda tree, scores: verify_tev(tree, scores, generator),
        "predraw": lambda tree, scores: verify_predraw(tree, scores, generator),
        "residual": lambda tree, scores: verify_residual(tree, scores, generator),
        "greedy": lambda tree, scores: verify_greedy(tree, scores),
        "softmax": lambda tree, scores: torch.softmax(scores, dim=-1),
    }


@torch.inference_mode()
def time_methods(cases, runs, device):
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    generator = torch.Generator(device=device).manual_seed(0)
    fns = methods(generator)
    times = {name: [] for name in fns}
    names = list(fns)
    for name in names:  # warm-up
        for case in cases:
            fns[name](*case)
    for run in range(runs):
        case = cases[run % len(cases)]
        order = names[run % len(names) :] + names[: run % len(names)]  # rotate: no method always first
        for name in order:
            synchronize()
            start = time.perf_counter()
            fns[name](*case)
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
    print(
        f"device {device}, torch {torch.__version__}, CPU threads {torch.get_num_threads()}, "
        f"D = {args.depth}, {args.trees} trees, {args.runs} interleaved runs per method, median us per call\n"
    )
    print("| V | B | N | tev | predraw | residual | greedy | softmax [N,V] | predraw / tev | residual / tev |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for vocab in map(int, args.vocabs.split(",")):
        for budget in map(int, args.budgets.split(",")):
            cases = make_cases(vocab, budget, args.depth, args.trees, device)
            t = time_methods(cases, args.runs, device)
            print(
                f"| {vocab} | {budget} | {budget + 1} | {t['tev']:.0f} | {t['predraw']:.0f} | {t['residual']:.0f} "
                f"| {t['greedy']:.0f} | {t['softmax']:.0f} | {t['predraw'] / t['tev']:.1f}x "
                f"| {t['residual'] / t['tev']:.1f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
