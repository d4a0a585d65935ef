"""Which request the quick start shows, chosen by measurement: `TEVConfig()` against plain `generate` on
SmolLM2-135M-Instruct with its shipped drafter, over a set of candidate requests written before measuring, side by
side in one process.

    python benchmarks/quickstart_requests.py --threads 1 --repeats 5 --output quickstart_requests.json

Each candidate is a short request of one kind: editing a given piece of text or code, whose answer repeats much of
it (hf_tev's context drafts find those continuations in the prompt; the drafter drafts the rest). Each has a check
of its answer: strings a right answer contains (one of a few alternatives), and strings it must not. Per
candidate, plain `generate` and hf_tev's tree decoding (`TEVConfig()`, greedy, `--max_new_tokens`) run
interleaved `--repeats` times after one warm-up; the figures are the SR of the summed times and of the medians,
the worst and best run's SR, tau, and whether the tokens equal plain `generate`'s (they must) and the answer
passes its check.

The quick start takes the candidate with a right answer whose worst run's SR is highest: a request on which the
speedup is real in every run, not one lucky run. What to expect elsewhere is the spread over every candidate
(printed last).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"
CANDIDATES = [
    {
        "name": "fix-average",
        "request": "Fix the bug in this Python function and show the corrected function:\n\n```python\n"
        "def average(values):\n    total = 0\n    for value in values:\n        total += value\n"
        "    return total / len(value)\n```",
        "right": [["len(values)"]],
        "wrong": ["len(value)\n", "len(value) "],
    },
    {
        "name": "fix-max",
        "request": "Fix the bug in this Python function and show the corrected function:\n\n```python\n"
        "def largest(numbers):\n    best = numbers[0]\n    for number in numbers:\n        if number < best:\n"
        "            best = number\n    return best\n```",
        "right": [["number > best"], ["max(numbers)"]],
        "wrong": [],
    },
    {
        "name": "rename-variable",
        "request": "Rename the variable `x` to `count` in this Python code and show the whole code:\n\n```python\n"
        "x = 0\nfor word in words:\n    if word.startswith('a'):\n        x += 1\nprint(x)\n```",
        "right": [["count += 1", "print(count)"]],
        "wrong": ["x += 1"],
    },
    {
        "name": "add-type-hints",
        "request": "Add type hints to this Python function and show it:\n\n```python\n"
        "def greet(name, times):\n    return ', '.join(['Hello ' + name] * times)\n```",
        "right": [["name: str", "times: int"]],
        "wrong": [],
    },
    {
        "name": "to-comprehension",
        "request": "Rewrite this loop as a list comprehension:\n\n```python\nsquares = []\nfor n in range(10):\n"
        "    squares.append(n * n)\n```",
        "right": [["[n * n for n in range(10)]"], ["[n**2 for n in range(10)]"]],
        "wrong": [],
    },
    {
        "name": "fix-spelling",
        "request": "Correct the spelling mistakes in this sentence and write it out: "
        '"The quick brown fox jumpd over the lazy dog becuase it was realy happy."',
        "right": [["jumped", "because", "really"]],
        "wrong": ["jumpd", "becuase"],
    },
    {
        "name": "uppercase-list",
        "request": "Rewrite this shopping list with every item in capital letters:\n"
        "- apples\n- bread\n- milk\n- cheese\n- tomatoes",
        "right": [["APPLES", "BREAD", "MILK", "CHEESE", "TOMATOES"]],
        "wrong": [],
    },
    {
        "name": "json-from-text",
        "request": "Write this as a JSON object with the keys name, age and city: "
        "Anna is 34 years old and lives in Lisbon.",
        "right": [['"name"', '"Anna"', "34", '"Lisbon"']],
        "wrong": [],
    },
]


def check(answer: str, candidate: dict) -> bool:
    """Right: every string of one of the `right` alternatives is in the answer, and no `wrong` string is."""
    right = any(all(s in answer for s in strings) for strings in candidate["right"])
    return right and not any(s in answer for s in candidate["wrong"])


def timed(function):
    started = time.perf_counter()
    out = function()
    return out, time.perf_counter() - started


def measure(target, drafter, tokenizer, candidate, args) -> dict:
    import hf_tev

    messages = [{"role": "user", "content": candidate["request"]}]
    input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt").input_ids
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False)

    def plain():
        return target.generate(input_ids, **common)

    def tev():
        return target.generate(
            input_ids, assistant_model=drafter, tev_config=hf_tev.TEVConfig(), return_dict_in_generate=True, **common
        )

    plain(), tev()  # warm-up
    plain_s, tev_s, taus = [], [], []
    for _ in range(args.repeats):
        expected, seconds = timed(plain)
        plain_s.append(seconds)
        out, seconds = timed(tev)
        tev_s.append(seconds)
        taus.append(out.tev_stats.tau)
    answer = tokenizer.decode(out.sequences[0, input_ids.shape[1] :], skip_special_tokens=True)
    ratios = [p / t for p, t in zip(plain_s, tev_s, strict=True)]
    return {
        "name": candidate["name"],
        "sr_total": sum(plain_s) / sum(tev_s),
        "sr_median": statistics.median(plain_s) / statistics.median(tev_s),
        "sr_worst": min(ratios),
        "sr_best": max(ratios),
        "tau": statistics.fmean(taus),
        "identical": out.sequences.tolist() == expected.tolist(),
        "right": check(answer, candidate),
        "new_tokens": int(out.sequences.shape[1] - input_ids.shape[1]),
        "plain_s": plain_s,
        "tev_s": tev_s,
        "answer": answer,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_tev
    from hf_tev.packaged import default_drafter, pretrained_source

    source = pretrained_source(TARGET)
    tokenizer = AutoTokenizer.from_pretrained(source)
    target = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, attn_implementation="sdpa").eval()
    drafter = hf_tev.DFlashDraftModel.from_pretrained(default_drafter(TARGET), dtype=torch.float32).eval()
    results = []
    for candidate in CANDIDATES:
        result = measure(target, drafter, tokenizer, candidate, args)
        results.append(result)
        print(
            f"{result['name']:18s} SR {result['sr_total']:.2f} (medians {result['sr_median']:.2f}, runs "
            f"{result['sr_worst']:.2f}-{result['sr_best']:.2f}) tau {result['tau']:.2f} identical "
            f"{result['identical']} right {result['right']}",
            flush=True,
        )
    right = [r for r in results if r["right"] and r["identical"]]
    chosen = max(right, key=lambda r: r["sr_worst"]) if right else None
    totals = sorted(r["sr_total"] for r in results)
    summary = {
        "threads": args.threads,
        "repeats": args.repeats,
        "max_new_tokens": args.max_new_tokens,
        "chosen": chosen and chosen["name"],
        "sr_total_median_over_candidates": statistics.median(totals),
        "sr_total_range": [totals[0], totals[-1]],
        "results": results,
    }
    print(
        f"chosen: {summary['chosen']}; over all {len(results)} candidates, SR (summed times) median "
        f"{summary['sr_total_median_over_candidates']:.2f}, range {totals[0]:.2f}-{totals[-1]:.2f}"
    )
    if args.output:
        Path(args.output).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
