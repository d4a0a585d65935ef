"""Draft-OPD on the kit: the four training objectives from one initialisation, and ExitTrain on top of Draft-OPD.

    PYTHONPATH=. nice python research/tiny_kit/opd_comparison.py --steps 30 --prompts 8 \
        --out research/tiny_kit/ablation/opd

Arms, each `--steps` optimizer steps from `--init` with the same data, batch, learning rate, schedule and seed
(the kit's Table 2 recipe, `recipes/finetuned.yaml`, through `hf-tev train`):
  standard  objective "dflash" (the standard DFlash objective, "finetuned")
  opd       objective "opd" (Draft-OPD: rollouts by tree decoding refreshed every `--opd-refresh-steps` steps,
            replay at their cycles, plus the standard CE on the same rows)
  prefix    objective "prefix"
  exit      objective "exit" (ExitTrain)
  opd+exit  objective "exit" for `--steps` more steps, starting from the opd arm's drafter
Equal steps and rows per step; each arm's wall time and counted training FLOPs are recorded next to its tau
(the opd arm also spends its rollouts' tree decoding, which the FLOP count leaves out).

Evaluation: TEV tree decoding of the first `--prompts` held-out and HumanEval prompts (`--max-new-tokens` each) at
every budget and temperature, every drafter with the same per-prompt seeds; per prompt the block lengths' sum and
cycles are kept, so every comparison with the standard arm is paired: a percentile bootstrap over prompts
(`--bootstrap` resamples, the same resampled prompts for both drafters) of the ratio of pooled tau.
Writes `<out>/trainlog_<arm>.json`, `<out>/tau.json` (per prompt) and `<out>/summary.md`; `--skip-train` reuses
the drafters already in `--work`.
"""

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import bootstrap

import hf_tev
from hf_tev.packaged import load_kit_model, load_kit_prompts, load_kit_tokenizer
from hf_tev.training import cli

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paths  # noqa: E402
import train_drafter  # noqa: E402  (the kit's recipes and their runner)

ARMS = {  # arm -> (objective, the arm it starts from; None: --init)
    "standard": ("dflash", None),
    "opd": ("opd", None),
    "prefix": ("prefix", None),
    "exit": ("exit", None),
    "opd+exit": ("exit", "opd"),
}


def arm_command(arm: str, args, init: str) -> list[str]:
    """The `hf-tev train` arguments of an arm, run from the repository root: the kit's Table 2 recipe of the standard
    arm (`recipes/finetuned.yaml`: the target, the tree and schedule settings, the card) with this comparison's
    drafter, data, objective, steps, batch, anchors, tree budget, threads and seed, and a log line every step."""
    objective = ARMS[arm][0]
    out = Path(args.work).resolve() / arm.replace("+", "_")
    files = [str(Path(f).resolve()) for f in args.data.split(",")]
    overrides = ["--objective", objective, "--tree_weight", "0.0" if objective == "dflash" else "0.1"]
    overrides += ["--output_dir", str(out), "--train_data", *files]
    overrides += ["--dataset_description", train_drafter.dataset_description(files)]
    overrides += ["--max_steps", str(args.steps), "--warmup_steps", str(min(100, args.steps // 10))]
    overrides += ["--learning_rate", str(args.learning_rate), "--per_device_train_batch_size", str(args.batch_size)]
    overrides += ["--anchors_per_sequence", str(args.anchors), "--tree_budget", str(args.tree_budget)]
    overrides += ["--threads", str(args.threads), "--seed", str(args.seed), "--logging_steps", "1"]
    if objective == "opd":
        overrides += ["--opd_refresh_steps", str(args.opd_refresh_steps)]
        overrides += ["--opd_rollout_temperature", str(args.opd_rollout_temperature)]
        overrides += ["--opd_rollout_max_new_tokens", str(args.opd_rollout_max_new_tokens)]
    return train_drafter.train_command("finetuned", Path(init).resolve(), overrides)


def train_arm(arm: str, args, init: str) -> dict:
    out = Path(args.work).resolve() / arm.replace("+", "_")
    argv = arm_command(arm, args, init)
    start = time.time()
    with train_drafter.in_repo():  # the recipe's paths are relative to the repository root
        trainer = cli.run(*cli.parse_args(argv))
    (out / "training_args.bin").unlink(missing_ok=True)
    log = {
        "arm": arm,
        "init": init,
        "seconds": time.time() - start,
        "total_flos": trainer.state.total_flos,
        "history": trainer.state.log_history,
        "command": "hf-tev train " + shlex.join(argv),
    }
    Path(args.out, f"trainlog_{arm.replace('+', '_')}.json").write_text(json.dumps(log, indent=1))
    print(f"{arm}: {args.steps} steps in {log['seconds']:.0f} s -> {out}", flush=True)
    return log


@torch.no_grad()
def evaluate(drafters: dict, args) -> list[dict]:
    target = load_kit_model("target")
    tokenizer = load_kit_tokenizer()
    prompts = [
        (name, index, tokenizer(prompt, return_tensors="pt").input_ids)
        for name in ("heldout", "humaneval")
        for index, prompt in enumerate(load_kit_prompts(name, args.prompts))
    ]
    records = []
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        sampling = dict(do_sample=True, temperature=temperature, top_k=0) if temperature > 0 else dict(do_sample=False)
        for budget in [int(b) for b in args.budgets.split(",")]:
            for drafter_name, drafter in drafters.items():
                for set_name, index, input_ids in prompts:
                    out = target.generate(
                        input_ids,
                        attention_mask=torch.ones_like(input_ids),
                        assistant_model=drafter,
                        max_new_tokens=args.max_new_tokens,
                        tev_config=hf_tev.TEVConfig(budget=budget, seed=index, lookup=False),  # own trees, same seeds
                        return_dict_in_generate=True,
                        **sampling,
                    )
                    lengths = out.tev_stats.accepted_lengths
                    records.append(
                        dict(
                            drafter=drafter_name,
                            temperature=temperature,
                            budget=budget,
                            prompt_set=set_name,
                            prompt=index,
                            tokens=sum(lengths),
                            cycles=len(lengths),
                        )
                    )
                cell = [r for r in records[-len(prompts) :]]
                tau = sum(r["tokens"] for r in cell) / sum(r["cycles"] for r in cell)
                print(f"T={temperature:g} B={budget:<3} {drafter_name:<10} tau {tau:.3f}", flush=True)
    return records


def paired_bootstrap(records: list[dict], arm: str, base: str, resamples: int, seed: int = 0):
    """Pooled tau of `arm` / pooled tau of `base` over the same prompts, and its 95% percentile interval over
    prompt resamples (`scipy.stats.bootstrap`, paired: the same resampled prompts for both)."""
    key = lambda r: (r["prompt_set"], r["prompt"])  # noqa: E731
    a = {key(r): (r["tokens"], r["cycles"]) for r in records if r["drafter"] == arm}
    b = {key(r): (r["tokens"], r["cycles"]) for r in records if r["drafter"] == base}
    columns = np.array([(*a[k], *b[k]) for k in sorted(a)], dtype=float).T  # tokens, cycles of arm, then base

    def ratio(tokens_a, cycles_a, tokens_b, cycles_b, axis=-1):
        return (tokens_a.sum(axis) / cycles_a.sum(axis)) / (tokens_b.sum(axis) / cycles_b.sum(axis))

    interval = bootstrap(
        tuple(columns), ratio, paired=True, n_resamples=resamples, method="percentile", rng=np.random.default_rng(seed)
    ).confidence_interval
    return float(ratio(*columns)), float(interval.low), float(interval.high)


def summarize(records: list[dict], logs: dict, args) -> str:
    drafters = list(dict.fromkeys(r["drafter"] for r in records))
    cells = sorted({(r["temperature"], r["budget"]) for r in records})
    lines = [
        f"Tree decoding (TEV), {args.prompts} held-out + {args.prompts} HumanEval prompts, {args.max_new_tokens} new "
        f"tokens, same seeds for every drafter. tau (pooled over prompts); in brackets the change against the "
        f"standard arm with its 95% paired-bootstrap interval over prompts ({args.bootstrap} resamples).",
        "",
        "| drafter | " + " | ".join(f"T={t:g}, B={b}" for t, b in cells) + " | train s | train TFLOs |",
        "|---" * (len(cells) + 3) + "|",
    ]
    for name in drafters:
        row = []
        for t, b in cells:
            cell = [r for r in records if r["drafter"] == name and (r["temperature"], r["budget"]) == (t, b)]
            tau = sum(r["tokens"] for r in cell) / sum(r["cycles"] for r in cell)
            text = f"{tau:.3f}"
            if name != "standard" and "standard" in drafters:
                sub = [r for r in records if (r["temperature"], r["budget"]) == (t, b)]
                ratio, low, high = paired_bootstrap(sub, name, "standard", args.bootstrap)
                text += f" [{100 * (ratio - 1):+.1f}%, {100 * (low - 1):+.1f}..{100 * (high - 1):+.1f}]"
            row.append(text)
        log = logs.get(name)
        seconds = f"{log['seconds']:.0f}" if log else "-"
        flos = f"{log['total_flos'] / 1e12:.1f}" if log else "-"
        lines.append(f"| {name} | " + " | ".join(row) + f" | {seconds} | {flos} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--init", default="drafter-dflash-l135", help="kit or study drafter name, or folder")
    parser.add_argument(
        "--data",
        default=f"{paths.data_file('train_generated.jsonl')},{paths.data_file('train_generated_greedy.jsonl')}",
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--anchors", type=int, default=8)
    parser.add_argument("--tree-budget", type=int, default=32)
    parser.add_argument("--opd-refresh-steps", type=int, default=4)
    parser.add_argument("--opd-rollout-temperature", type=float, default=1.0)
    parser.add_argument("--opd-rollout-max-new-tokens", type=int, default=64)
    parser.add_argument("--budgets", default="16,64")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per set (held-out, HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--bootstrap", type=int, default=2000)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", default=str(Path("/tmp") / "hf_tev_opd_comparison"), help="trained drafters")
    parser.add_argument("--out", default=str(paths.HERE / "ablation" / "opd"))
    parser.add_argument("--skip-train", action="store_true", help="reuse the drafters in --work")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    init = str(paths.model_path(args.init))
    arms = args.arms.split(",")
    logs = {}
    for arm in arms:
        start_arm = ARMS[arm][1]
        path = Path(args.work) / arm.replace("+", "_")
        log_path = Path(args.out, f"trainlog_{arm.replace('+', '_')}.json")
        if args.skip_train and (path / "config.json").is_file():
            logs[arm] = json.loads(log_path.read_text()) if log_path.is_file() else None
            continue
        arm_init = init if start_arm is None else str(Path(args.work) / start_arm.replace("+", "_"))
        logs[arm] = train_arm(arm, args, arm_init)
    drafters = {"init": hf_tev.DFlashDraftModel.from_pretrained(init).eval()}
    for arm in arms:
        drafters[arm] = hf_tev.DFlashDraftModel.from_pretrained(Path(args.work) / arm.replace("+", "_")).eval()
    records = evaluate(drafters, args)
    Path(args.out, "tau.json").write_text(json.dumps({"args": vars(args), "records": records}, indent=0))
    text = summarize(records, logs, args)
    Path(args.out, "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
