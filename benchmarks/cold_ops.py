"""What a small torch call costs right after a model forward, against the same call in a warm loop.

    python benchmarks/cold_ops.py --threads 1

A decoding cycle runs hf_tev's own work (a few dozen small torch calls and some Python) between two model
forwards. A forward streams the model's weights through the CPU caches (the kit target: 12M parameters, 48 MB in
float32), so the code and data of the calls that follow are cold. This measures, per call, the median time of
each of a few small calls (torch, numpy, plain Python) made in sequence right after a forward of the kit target,
and the same sequence in a warm loop (no forward between sequences), with `time.perf_counter` (no profiler).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy
import torch

from hf_tev.packaged import load_kit_model

SMALL = torch.arange(20)
ROOT = torch.tensor([3])
LOGITS = torch.randn(17, 4096)
SMALL_NUMPY, ROOT_NUMPY = SMALL.numpy(), ROOT.numpy()

CALLS = {
    "slice (a view)": lambda: SMALL[2:5],
    "cat of two small tensors": lambda: torch.cat([ROOT, SMALL[2:5]]),
    "argmax of one row": lambda: LOGITS[0].argmax(),
    "empty(3)": lambda: torch.empty(3),
    "cat again": lambda: torch.cat([ROOT, SMALL[2:5]]),
    # not torch's dispatcher alone: numpy and plain Python pay it too
    "numpy concatenate": lambda: numpy.concatenate([ROOT_NUMPY, SMALL_NUMPY[2:5]]),
    "numpy empty(3)": lambda: numpy.empty(3),
    "Python: sort a small list": lambda: sorted([3, 1, 2] + [5]),
}


def timed_sequence() -> list[float]:
    times = []
    for call in CALLS.values():
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--context", type=int, default=150, help="tokens of the forward's input")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_kit_model("target")
    tokens = torch.randint(0, target.config.vocab_size, (1, args.context))
    cold, warm = [], []
    with torch.no_grad():
        for _ in range(args.repeats):
            target(tokens)
            cold.append(timed_sequence())
        for _ in range(args.repeats):
            warm.append(timed_sequence())
    print(f"kit target forward over {args.context} tokens, torch threads {args.threads}, medians of {args.repeats}")
    print(f"{'call (in this order)':28s} {'after a forward':>16s} {'warm':>8s}")
    for i, name in enumerate(CALLS):
        after, before = (1e6 * statistics.median(run[i] for run in runs) for runs in (cold, warm))
        print(f"{name:28s} {after:13.1f} us {before:5.1f} us")


if __name__ == "__main__":
    main()
