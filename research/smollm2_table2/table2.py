"""The paper's Table 2 on SmolLM2-135M-Instruct: tau of the ExitTrain drafter against the standard one, TEV.

    python research/smollm2_table2/table2.py --prompts 16 --max-new-tokens 64 --threads 2    # after train_drafters.py
    python research/smollm2_table2/table2.py --drafters standard=DIR_A,prefix=DIR_B,exit=DIR_C --output OUT.json

Every drafter after the first is compared with the first.

Prompts: the first `--prompts` of each benchmark set (MT-Bench, HumanEval, GSM8K, MATH-500; test splits, never a
training prompt: hf_tev/bench/prompts/SOURCES.md), chat-templated. Every drafter decodes every prompt at every
budget and temperature with TEV (`TEVConfig(budget=B, lookup=False)`: the drafter's own trees), at T = 1 from the
same per-prompt seed. Per prompt the output tokens and cycles are kept, so the comparison is paired: the ratio of
pooled tau (exit / standard) with a 95% percentile interval over prompts resampled together for both drafters
(`scipy.stats.bootstrap(paired=True)`). Also kept per drafter: the mean coverage `1 + C` of the trees (what an
exact verifier could accept) and the accepted-length histogram, to show why a gain is or is not there.

Writes `--output` (default `runs/table2.json`, per prompt) and prints the table. A run that stops keeps the
prompts already measured; run again, it measures only the missing ones.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from scipy.stats import bootstrap
from study import HERE, SHIPPED, TARGET, pooled_tau
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_tev
from hf_tev.bench.methods import PAPER_PROMPT_SETS, PROMPT_SETS
from hf_tev.packaged import packaged_model_path


def drafter_folder(runs: Path, name: str) -> Path:
    """A `--drafters` entry's folder: `name=FOLDER` names any drafter folder; a bare stage name is that stage's own
    run where this machine trained it, else the drafter shipped from it."""
    if "=" in name:
        return Path(name.split("=", 1)[1])
    run = runs / name
    return run if (run / "model.safetensors").is_file() else SHIPPED[name]


def drafter_name(entry: str) -> str:
    """The name a `--drafters` entry is recorded and reported under: `name` of `name=FOLDER`, else the stage."""
    return entry.split("=", 1)[0]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--drafters",
        default="dflash,exit",
        help="stages (dflash, exit) or NAME=FOLDER entries, the reference first: every other is compared with it",
    )
    parser.add_argument("--runs", default=str(HERE / "runs"))
    parser.add_argument("--budgets", default="64,16", help="measured in this order")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per benchmark set")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--resamples", type=int, default=10_000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=None, help="default: RUNS/table2.json (and its table, table2.md)")
    parser.add_argument("--report", action="store_true", help="print the table of what is measured, measure nothing")
    return parser.parse_args(argv)


def chat_prompts(tokenizer, count: int) -> list[tuple[str, int, torch.Tensor]]:
    prompts = []
    for name in PAPER_PROMPT_SETS:
        for index, text in enumerate(PROMPT_SETS[name].load(count)):
            messages = [{"role": "user", "content": text}]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt").input_ids
            prompts.append((name, index, ids))
    return prompts


def decode(target, drafter, ids, budget: int, temperature: float, seed: int, max_new_tokens: int) -> dict:
    sampling = (
        dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature else {"do_sample": False}
    )
    torch.manual_seed(seed)
    out = target.generate(
        ids, assistant_model=drafter, tev_config=hf_tev.TEVConfig(budget=budget, lookup=False, seed=seed),
        max_new_tokens=max_new_tokens, return_dict_in_generate=True, **sampling,
    )  # fmt: skip
    stats = out.tev_stats
    return {
        "tokens": int(sum(stats.accepted_lengths)),
        "cycles": stats.num_cycles,
        "coverage": float(np.mean(stats.coverages)) if stats.coverages else None,
        "accepted_lengths": list(stats.accepted_lengths),
    }


def ratio_interval(records, base: str, arm: str, resamples: int) -> tuple[float, float, float]:
    """Pooled tau of `arm` / pooled tau of `base`, and its paired 95% percentile interval over prompts."""
    key = lambda r: (r["set"], r["prompt"])  # noqa: E731
    by_arm = {
        name: {key(r): (r["tokens"], r["cycles"]) for r in records if r["drafter"] == name} for name in (base, arm)
    }
    shared = sorted(set(by_arm[base]) & set(by_arm[arm]))
    a = np.array([by_arm[arm][k] for k in shared], dtype=float)
    b = np.array([by_arm[base][k] for k in shared], dtype=float)

    def statistic(tokens_a, cycles_a, tokens_b, cycles_b, axis=-1):
        return (tokens_a.sum(axis) / cycles_a.sum(axis)) / (tokens_b.sum(axis) / cycles_b.sum(axis))

    data = (a[:, 0], a[:, 1], b[:, 0], b[:, 1])
    result = bootstrap(data, statistic, paired=True, n_resamples=resamples, method="percentile", random_state=0)
    return float(statistic(*data)), float(result.confidence_interval.low), float(result.confidence_interval.high)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    output = Path(args.output or Path(args.runs) / "table2.json")
    records = json.loads(output.read_text()) if output.is_file() else []
    entries = args.drafters.split(",")
    names = [drafter_name(entry) for entry in entries]
    if args.report:
        print(report(records, names, args.resamples))
        return
    done = {(r["drafter"], r["budget"], r["temperature"], r["set"], r["prompt"]) for r in records}
    path = packaged_model_path(TARGET)
    target = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    drafters = {
        drafter_name(e): hf_tev.DFlashDraftModel.from_pretrained(drafter_folder(Path(args.runs), e)).eval()
        for e in entries
    }
    budgets = [int(b) for b in args.budgets.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    prompts = chat_prompts(tokenizer, args.prompts)
    # Cell by cell (temperatures outer, budgets in the order given), so a stopped run leaves whole cells behind.
    for temperature in temperatures:
        for budget in budgets:
            for set_name, index, ids in prompts:
                for name in names:  # the same prompt, budget, temperature and seed for every drafter in turn
                    if (name, budget, temperature, set_name, index) in done:
                        continue
                    seed = 1000 * index + PAPER_PROMPT_SETS.index(set_name)
                    row = decode(target, drafters[name], ids, budget, temperature, seed, args.max_new_tokens)
                    records.append({"drafter": name, "budget": budget, "temperature": temperature,
                                    "set": set_name, "prompt": index, **row})  # fmt: skip
                output.write_text(json.dumps(records, indent=1))  # after every prompt: a stopped run keeps its work
    table = report(records, names, args.resamples)
    output.with_suffix(".md").write_text(table)
    print(table)


def report(records, names: list[str], resamples: int) -> str:
    """The measured cells as a markdown table, one row per drafter and cell: pooled tau, its paired ratio to the
    first drafter with a 95% interval, the mean tree coverage 1 + C, the share of cycles accepting the root alone,
    and the per-depth acceptance P(accepted length > d | > d - 1) for d = 1..4 (why a gain is or is not there)."""
    base = names[0]
    lines = [
        f"| B | T | drafter | prompts | tau | / {base} (95% paired bootstrap) | 1 + C | root-only cycles "
        "| acceptance at depth 1 / 2 / 3 / 4 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    cells = sorted({(r["temperature"], r["budget"]) for r in records}, key=lambda c: (c[0], -c[1]))
    for temperature, budget in cells:
        cell = [r for r in records if r["budget"] == budget and r["temperature"] == temperature]
        for name in names:
            rows = [r for r in cell if r["drafter"] == name]
            if not rows or not any(r["drafter"] == base for r in cell):
                continue
            interval = None if name == base else ratio_interval(cell, base, name, resamples)
            ratio = "" if interval is None else "{:.3f} ({:.3f}-{:.3f})".format(*interval)
            coverage = np.mean([r["coverage"] for r in rows if r["coverage"] is not None])
            lengths = np.array([length for r in rows for length in r["accepted_lengths"]])
            lines.append(
                f"| {budget} | {temperature:g} | {name} | {len(rows)} | {pooled_tau(rows):.3f} | {ratio} "
                f"| {coverage:.2f} | {np.mean(lengths == 1):.1%} | {depth_acceptance(lengths)} |"
            )
    return "\n".join(lines) + "\n"


def depth_acceptance(lengths: np.ndarray, depths: int = 4) -> str:
    """P(a cycle accepts more than d drafted tokens | it accepted d - 1), d = 1..depths: an accepted length counts
    the bonus token, so `length > d` means d drafted tokens were accepted."""
    shares = []
    for depth in range(1, depths + 1):
        reached = lengths >= depth
        shares.append(f"{np.mean(lengths[reached] > depth):.0%}" if reached.any() else "-")
    return " / ".join(shares)


if __name__ == "__main__":
    main()
