"""The paper's Table 2 on SmolLM2-135M-Instruct: tau of the ExitTrain drafter against the standard one, TEV.

    python research/smollm2_table2/table2.py --prompts 16 --max-new-tokens 64 --threads 2    # after train_drafters.py
    python research/smollm2_table2/table2.py --drafters standard=DIR_A,prefix=DIR_B,exit=DIR_C --output OUT.json

    python research/smollm2_table2/table2.py --drafters standard=DIR_A,exit=DIR_C --budgets 64 --temperatures 1 \
        --verifiers predraw,tev --timed --output TABLE4.json      # the paper's Table 4: drafter x verifier

Every drafter after the first is compared with the first (with the same verifier); `--pairs exit/prefix,...` adds
more comparisons. `--timed` also times every call and, per prompt, the target's own `generate` beside it, in the same
process and order, so each cell gets SR (plain seconds per token over the method's, summed over prompts).

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
import time
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
    parser.add_argument("--verifiers", default="tev", help="TEVConfig verifiers, each a separate arm")
    parser.add_argument("--pairs", default="", help="more comparisons, ARM/BASE entries (e.g. exit/prefix)")
    parser.add_argument("--timed", action="store_true", help="time each call beside plain generate (SR)")
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


def sampling_of(temperature: float) -> dict:
    return dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature else {"do_sample": False}


def decode(target, drafter, ids, budget, temperature, seed, max_new_tokens, verifier: str = "tev") -> dict:
    torch.manual_seed(seed)
    started = time.perf_counter()
    out = target.generate(
        ids, assistant_model=drafter, max_new_tokens=max_new_tokens, return_dict_in_generate=True,
        tev_config=hf_tev.TEVConfig(budget=budget, lookup=False, seed=seed, verifier=verifier),
        **sampling_of(temperature),
    )  # fmt: skip
    seconds = time.perf_counter() - started
    stats = out.tev_stats
    return {
        "tokens": int(sum(stats.accepted_lengths)),
        "cycles": stats.num_cycles,
        "coverage": float(np.mean(stats.coverages)) if stats.coverages else None,
        "accepted_lengths": list(stats.accepted_lengths),
        "seconds": seconds,
        "new_tokens": out.sequences.shape[1] - ids.shape[1],
    }


def plain(target, ids, temperature, seed, max_new_tokens) -> dict:
    """The target's own `generate` of the same prompt: the time every method's is compared with."""
    torch.manual_seed(seed)
    started = time.perf_counter()
    out = target.generate(ids, max_new_tokens=max_new_tokens, **sampling_of(temperature))
    return {"seconds": time.perf_counter() - started, "new_tokens": out.shape[1] - ids.shape[1]}


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
    pairs = [tuple(pair.split("/")) for pair in args.pairs.split(",") if pair]
    if args.report:
        print(report(records, names, args.resamples, pairs))
        return
    verifiers = args.verifiers.split(",")
    done = {(r["drafter"], r.get("verifier", "tev"), r["budget"], r["temperature"], r["set"], r["prompt"])
            for r in records}  # fmt: skip
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
                seed = 1000 * index + PAPER_PROMPT_SETS.index(set_name)
                where = {"budget": budget, "temperature": temperature, "set": set_name, "prompt": index}
                arms = [(name, verifier) for verifier in verifiers for name in names]
                todo = [arm for arm in arms if (*arm, budget, temperature, set_name, index) not in done]
                if todo and args.timed:  # plain generate first, then every arm, in one process
                    records.append(
                        {"drafter": PLAIN, **where, **plain(target, ids, temperature, seed, args.max_new_tokens)}
                    )
                for name, verifier in todo:  # the same prompt, budget, temperature and seed for every arm in turn
                    row = decode(target, drafters[name], ids, budget, temperature, seed, args.max_new_tokens, verifier)
                    records.append({"drafter": name, "verifier": verifier, **where, **row})
                output.write_text(json.dumps(records, indent=1))  # after every prompt: a stopped run keeps its work
    table = report(records, names, args.resamples, pairs)
    output.with_suffix(".md").write_text(table)
    print(table)


PLAIN = "plain generate"  # the records of the target's own generate (`--timed`)


def report(records, names: list[str], resamples: int, pairs=()) -> str:
    """The measured cells as a markdown table, one row per drafter (and verifier) and cell: pooled tau, its paired
    ratio to the first drafter (same verifier) with a 95% interval, the mean tree coverage 1 + C, the share of
    cycles accepting the root alone, the per-depth acceptance P(accepted length > d | > d - 1) for d = 1..4 (why a
    gain is or is not there) and, where timed, SR against plain generate (summed seconds per token). Then each of
    `pairs` (arm, base) per cell and verifier."""
    base = names[0]
    lines = [
        f"| B | T | verifier | drafter | prompts | tau | / {base} (95% paired bootstrap) | 1 + C | root-only cycles "
        "| acceptance at depth 1 / 2 / 3 / 4 | SR |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    extra = [
        "",
        "| B | T | verifier | arm / base | prompts | ratio of tau (95% paired bootstrap) |",
        "|---|---|---|---|---|---|",
    ]
    arms = [r for r in records if r["drafter"] != PLAIN]
    cells = sorted({(r["temperature"], r["budget"], r.get("verifier", "tev")) for r in arms},
                   key=lambda c: (c[0], -c[1], c[2]))  # fmt: skip
    for temperature, budget, verifier in cells:
        cell = [r for r in arms if r["budget"] == budget and r["temperature"] == temperature
                and r.get("verifier", "tev") == verifier]  # fmt: skip
        plain_rows = [r for r in records if r["drafter"] == PLAIN and r["budget"] == budget
                      and r["temperature"] == temperature]  # fmt: skip
        for name in names:
            rows = [r for r in cell if r["drafter"] == name]
            if not rows or not any(r["drafter"] == base for r in cell):
                continue
            interval = None if name == base else ratio_interval(cell, base, name, resamples)
            ratio = "" if interval is None else "{:.3f} ({:.3f}-{:.3f})".format(*interval)
            coverage = np.mean([r["coverage"] for r in rows if r["coverage"] is not None])
            lengths = np.array([length for r in rows for length in r["accepted_lengths"]])
            lines.append(
                f"| {budget} | {temperature:g} | {verifier} | {name} | {len(rows)} | {pooled_tau(rows):.3f} | {ratio} "
                f"| {coverage:.2f} | {np.mean(lengths == 1):.1%} | {depth_acceptance(lengths)} "
                f"| {speed_ratio(plain_rows, rows)} |"
            )
        for arm, pair_base in pairs:
            if {arm, pair_base} <= {r["drafter"] for r in cell}:
                shared = len({(r["set"], r["prompt"]) for r in cell if r["drafter"] == arm})
                extra.append(
                    f"| {budget} | {temperature:g} | {verifier} | {arm} / {pair_base} | {shared} | "
                    + "{:.3f} ({:.3f}-{:.3f}) |".format(*ratio_interval(cell, pair_base, arm, resamples))
                )
    return "\n".join(lines + (extra if len(extra) > 3 else [])) + "\n"


def speed_ratio(plain_rows: list[dict], rows: list[dict]) -> str:
    """Plain generate's seconds per token over the method's, each summed over the prompts both measured ("" when
    untimed): the speedup, read beside tau."""
    plain_by = {(r["set"], r["prompt"]): r for r in plain_rows}
    timed = [r for r in rows if "seconds" in r and (r["set"], r["prompt"]) in plain_by]
    if not timed:
        return ""
    base = [plain_by[(r["set"], r["prompt"])] for r in timed]
    plain_rate = sum(r["seconds"] for r in base) / sum(r["new_tokens"] for r in base)
    return f"{plain_rate / (sum(r['seconds'] for r in timed) / sum(r['new_tokens'] for r in timed)):.3f}"


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
