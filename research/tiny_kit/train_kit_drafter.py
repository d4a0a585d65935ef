"""The kit's stronger drafter: 3 DFlash layers reading target layers 1, 3, 5, trained long on cached target features.

    # launch; run again to resume from the latest checkpoint (the data are rescanned: rows the data job wrote
    # since are cached and trained on too)
    nohup nice -n 5 python research/tiny_kit/train_kit_drafter.py train \
        > research/tiny_kit/build/kit_drafter_run.log 2>&1 &
    # seconds per training step with and without the feature cache (same rows, batch and thread)
    python research/tiny_kit/train_kit_drafter.py bench --steps 20
    # tau with TEV at B = 16, T = 0 and 1, on N held-out + N HumanEval prompts
    python research/tiny_kit/train_kit_drafter.py eval research/tiny_kit/build/kit_drafter_run/checkpoint-200

The run's drafter was kept as the study drafter `drafter-dflash-3l` (`paths.STUDY_DRAFTER_DIR`; `--init` and
`eval` take kit or study drafter names as well as folders).

Initialisation: `drafter-dflash-l135` (1 layer) deepened to 3 layers WITHOUT changing its output: its layer 0
is copied into layer 0; layers 1 and 2 start with zero `o_proj` and `down_proj` weights, so they add nothing to
the residual stream (identity blocks) until training moves them. The script checks the output equality on a
real training row before it trains.

Data: every target-written row, `data/*.jsonl` (the kit package's `data/train_generated.jsonl` and this
folder's `data/`) and `build/train_generated_*.jsonl` (files the data job may still be appending to: only
complete lines are read). Their target features (layers 1, 3, 5, float16) live in the feature cache
`build/feature_cache/` (`hf_tev.training.FeatureCache`), computed once; the training steps then run the drafter
only (`ExitTrainer` with a `CachedFeatureDataset`, standard DFlash objective).

Run folder `build/kit_drafter_run/`: `checkpoint-N/` (the drafter in the published layout + optimizer state;
the first after `--first-save-steps`, then every `--save-minutes` of training, the last 2 kept),
`trainlog.jsonl` (every logged step: loss, lr, grad norm, wall time), `launches.jsonl` (one line per launch:
rows, tokens, resumed checkpoint), `speed.json` (from `bench`), `final/` when `--max-steps` is reached.
"""

import argparse
import glob
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import paths
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from hf_tev import DFlashDraftModel, ExitTrainer, ExitTrainingArguments
from hf_tev.packaged import kit_dir
from hf_tev.training import CachedFeatureDataset, FeatureCache

BUILD = paths.BUILD
DEFAULT_DATA = ("data/*.jsonl", "build/train_generated_*.jsonl")  # relative: in research/tiny_kit and in the kit
TARGET_LAYERS = [1, 3, 5]


def roots() -> tuple[Path, Path]:
    """The folders a relative data pattern is looked up in: research/tiny_kit and the kit package."""
    return paths.HERE, kit_dir()


def expand(pattern: str) -> list[str]:
    """The files matching `pattern`: an absolute glob, or a relative one under each of `roots()`."""
    if Path(pattern).is_absolute():
        return glob.glob(pattern)
    return [p for root in roots() for p in glob.glob(str(root / pattern))]


def label(path: str) -> str:
    """`path` relative to the root holding it (`data/train_generated.jsonl`), as the run logs name files."""
    for root in roots():
        if Path(path).resolve().is_relative_to(root.resolve()):
            return str(Path(path).resolve().relative_to(root.resolve()))
    return path


# ----------------------------------------------------------------------------------------------
# Data and initialisation


def load_rows(patterns=DEFAULT_DATA) -> tuple[list[dict], dict[str, int]]:
    """Every complete row of the files matching `patterns` (`expand`; a file being appended to may end mid-line),
    each once: the data job's file in `build/` and its committed copy in `data/` hold the same rows."""
    rows, counts, seen = [], {}, set()
    for path in sorted({p for pattern in patterns for p in expand(pattern)}):
        before = len(rows)
        with open(path) as f:
            for line in f:
                if not line.endswith("\n"):
                    break  # the writer is still at it
                if line.strip() and line not in seen:
                    seen.add(line)
                    rows.append(json.loads(line))
        counts[label(path)] = len(rows) - before
    return rows, counts


def deepen(drafter: DFlashDraftModel, target, num_layers: int) -> DFlashDraftModel:
    """`drafter` with `num_layers` draft layers computing exactly what it computes: its layers are copied, the
    new ones get zero `o_proj` / `down_proj` weights (their attention and MLP outputs are 0: identity blocks)."""
    config = drafter.config
    deep = DFlashDraftModel.from_target(
        target,
        num_layers=num_layers,
        block_size=config.block_size,
        mask_token_id=config.mask_token_id,
        target_layer_ids=config.target_layer_ids,
    )
    state = deep.state_dict()
    state.update(drafter.state_dict())  # fc, hidden_norm, norm and layers 0 .. old - 1
    for i in range(config.num_hidden_layers, num_layers):
        state[f"layers.{i}.self_attn.o_proj.weight"].zero_()
        state[f"layers.{i}.mlp.down_proj.weight"].zero_()
    deep.load_state_dict(state, strict=True)
    return deep


@torch.no_grad()
def check_same_output(old: DFlashDraftModel, new: DFlashDraftModel, target, row: dict) -> float:
    """Draft the blocks of one row at a few anchors with both drafters; raise unless their logits are equal."""
    ids = torch.tensor(row["input_ids"])
    hidden = target(ids[None], output_hidden_states=True).hidden_states
    worst = 0.0
    for a in (len(ids) // 4, len(ids) // 2, len(ids) - 2):
        block = torch.full((1, old.config.block_size), old.config.mask_token_id)
        block[0, 0] = ids[a]
        positions = torch.arange(a + old.config.block_size)[None]
        logits = [d.draft_logits(target, d.context_features(hidden)[:, :a], block, positions) for d in (old, new)]
        worst = max(worst, (logits[0] - logits[1]).abs().max().item())
    if worst > 1e-5:
        raise AssertionError(f"the deepened drafter's logits differ from the initial drafter's by {worst:.3g}")
    return worst


# ----------------------------------------------------------------------------------------------
# Callbacks: timed checkpoints, a JSONL log, step times


class TimedSaves(TrainerCallback):
    """A checkpoint at step `first`, then whenever `minutes` of training passed since the last one."""

    def __init__(self, first: int, minutes: float):
        self.first, self.seconds, self.last = first, minutes * 60, time.time()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.first or time.time() - self.last >= self.seconds:
            control.should_save = True

    def on_save(self, args, state, control, **kwargs):
        self.last = time.time()


class JsonlLog(TrainerCallback):
    def __init__(self, path: Path):
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": state.global_step, "time": round(time.time(), 1), **(logs or {})}) + "\n")


class StepTimes(TrainerCallback):
    def __init__(self):
        self.times, self.start = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.start)


# ----------------------------------------------------------------------------------------------
# Commands


def load_target():
    tokenizer = AutoTokenizer.from_pretrained(paths.model_path("target"))
    target = AutoModelForCausalLM.from_pretrained(paths.model_path("target"), attn_implementation="sdpa").eval()
    return tokenizer, target


def weighted_rows(specs: list[str] | None) -> tuple[list[dict], dict[str, int]]:
    """Rows of `--data` entries `PATTERN[:N]` (globs relative to research/tiny_kit and to the kit package, or
    absolute; N copies of each row, default 1: the way to over-sample a file, e.g. the greedy continuations for
    temperature 0); without `specs`, every data file once."""
    if not specs:
        return load_rows()
    rows, counts = [], {}
    for spec in specs:
        pattern, _, times = spec.partition(":")
        if times and not (times.isdigit() and int(times) > 0):
            raise ValueError(f"--data {spec!r}: N in PATTERN:N must be a positive integer")
        copies = int(times or 1)
        found, found_counts = load_rows((pattern,))
        if not found:
            raise ValueError(f"--data {spec!r} matches no rows")
        rows += found * copies
        counts |= {f"{name} x{copies}": n for name, n in found_counts.items()}
    return rows, counts


def prepare(args, target):
    """Rows, the updated feature cache and the (deepened, checked) initial drafter."""
    rows, counts = weighted_rows(args.data)
    cache = FeatureCache(args.cache, target, TARGET_LAYERS, dtype=torch.float16)
    started = time.time()
    added = cache.update(rows, batch_size=8, max_batch_tokens=4096)
    print(
        f"{len(rows)} rows from {counts}; {added} rows newly cached in {time.time() - started:.0f} s; the cache "
        f"holds {len(cache)} rows, {cache.num_tokens} tokens",
        flush=True,
    )
    init = DFlashDraftModel.from_pretrained(paths.model_path(args.init)).eval()
    torch.manual_seed(args.seed)  # the new layers' weights (a resumed run loads its checkpoint's instead)
    if init.config.target_layer_ids != TARGET_LAYERS:
        raise ValueError(f"{args.init} reads target layers {init.config.target_layer_ids}, not {TARGET_LAYERS}")
    drafter = deepen(init, target, args.num_layers)
    worst = check_same_output(init, drafter.eval(), target, rows[0])
    print(f"deepened {args.init} to {args.num_layers} layers; logits equal (max difference {worst:.1e})", flush=True)
    return rows, counts, cache, drafter


def training_args(args, output_dir, **overrides):
    settings = dict(
        output_dir=str(output_dir),
        objective="dflash",
        ce_weight=1.0,
        tree_weight=0.0,
        anchors_per_sequence=args.anchors,
        learning_rate=args.learning_rate,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        warmup_steps=args.warmup_steps,
        lr_scheduler_type="cosine",
        weight_decay=0.0,
        logging_steps=10,
        save_strategy="steps",
        save_steps=10**9,
        save_total_limit=2,
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        seed=args.seed,
        disable_tqdm=True,
    )
    return ExitTrainingArguments(**(settings | overrides))


def train(args):
    tokenizer, target = load_target()
    rows, counts, cache, drafter = prepare(args, target)
    run = Path(args.run)
    run.mkdir(parents=True, exist_ok=True)
    last = get_last_checkpoint(str(run)) if any(run.glob("checkpoint-*")) else None
    with open(run / "launches.jsonl", "a") as f:
        f.write(
            json.dumps(
                {
                    "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "resume_from": last,
                    "rows": len(rows),
                    "files": counts,
                    "cached_tokens": cache.num_tokens,
                    "args": vars(args),
                }
            )
            + "\n"
        )
    trainer = ExitTrainer(
        model=drafter.train(),
        target_model=target,
        args=training_args(args, run),
        train_dataset=CachedFeatureDataset(rows, cache),
        processing_class=tokenizer,
        callbacks=[TimedSaves(args.first_save_steps, args.save_minutes), JsonlLog(run / "trainlog.jsonl")],
    )
    print(
        f"{'resuming from ' + last if last else 'starting'}: {args.max_steps} steps, batch {args.batch_size}, "
        f"{args.anchors} anchors per sequence, lr {args.learning_rate}",
        flush=True,
    )
    trainer.train(resume_from_checkpoint=last)
    trainer.save_model(str(run / "final"))
    print(f"done: {run / 'final'}", flush=True)


def bench(args):
    tokenizer, target = load_target()
    rows, _, cache, drafter = prepare(args, target)
    results = {}
    for name, dataset in (("cached_features", CachedFeatureDataset(rows, cache)), ("target_forward", rows)):
        times = StepTimes()
        with tempfile.TemporaryDirectory() as out:
            torch.manual_seed(args.seed)
            model = deepen(DFlashDraftModel.from_pretrained(paths.model_path(args.init)), target, args.num_layers)
            model.train()
            trainer = ExitTrainer(
                model=model,
                target_model=target,
                train_dataset=dataset,
                callbacks=[times],
                args=training_args(
                    args, out, max_steps=args.steps + 1, save_strategy="no", logging_steps=args.steps + 1
                ),
            )
            trainer.train()
        steps = times.times[1:]  # the first step warms up
        results[name] = {
            "seconds_per_step_mean": statistics.mean(steps),
            "seconds_per_step_median": statistics.median(steps),
            "steps": len(steps),
        }
        print(
            f"{name}: {statistics.mean(steps):.2f} s/step (median {statistics.median(steps):.2f}) over "
            f"{len(steps)} steps",
            flush=True,
        )
    record = {
        "batch_size": args.batch_size,
        "anchors": args.anchors,
        "num_layers": args.num_layers,
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,  # Unix only
        "results": results,
    }
    Path(args.run).mkdir(parents=True, exist_ok=True)
    (Path(args.run) / "speed.json").write_text(json.dumps(record, indent=1))


def evaluate(args):
    import hf_tev
    from hf_tev.packaged import load_kit_prompts

    tokenizer, target = load_target()
    prompts = [
        tokenizer(p, return_tensors="pt").input_ids
        for name in ("heldout", "humaneval")
        for p in load_kit_prompts(name, args.prompts)
    ]
    records = {}
    for folder in args.drafters:
        drafter = DFlashDraftModel.from_pretrained(paths.model_path(folder)).eval()
        for temperature in args.temperatures:
            sampling = (
                dict(do_sample=True, temperature=temperature, top_k=0) if temperature > 0 else dict(do_sample=False)
            )
            blocks, coverage = [], []
            for index, input_ids in enumerate(prompts):
                torch.manual_seed(index)  # every drafter sees the same seeds
                out = target.generate(
                    input_ids,
                    assistant_model=drafter,
                    max_new_tokens=args.max_new_tokens,
                    tev_config=hf_tev.TEVConfig(budget=args.budget, lookup=False),  # the drafter's own tau
                    return_dict_in_generate=True,
                    **sampling,
                )
                blocks += out.tev_stats.accepted_lengths
                coverage += out.tev_stats.coverages
            record = {
                "tau": sum(blocks) / len(blocks),
                "coverage": sum(coverage) / len(coverage),
                "cycles": len(blocks),
            }
            records[f"{folder} T={temperature:g}"] = record
            print(
                f"{folder} B={args.budget} T={temperature:g}: tau {record['tau']:.3f} 1+C {record['coverage']:.3f} "
                f"({len(blocks)} cycles, {len(prompts)} prompts)",
                flush=True,
            )
        summary = {
            "budget": args.budget,
            "prompts_per_set": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "records": {k: v for k, v in records.items() if k.startswith(folder + " ")},
        }
        if (paths.model_path(folder) / "trainer_state.json").is_file():  # a checkpoint: keep its tau next to it
            (paths.model_path(folder) / "tau.json").write_text(json.dumps(summary, indent=1))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("train", "bench"):
        sub = commands.add_parser(name)
        sub.add_argument("--init", default="drafter-dflash-l135", help="kit or study drafter name, or folder")
        sub.add_argument("--num-layers", type=int, default=3)
        sub.add_argument(
            "--data",
            nargs="+",
            help="PATTERN[:N] row files (relative: to research/tiny_kit and to the kit package), N copies each "
            "(default: every file once)",
        )
        sub.add_argument("--cache", default=str(BUILD / "feature_cache"))
        sub.add_argument("--run", default=str(BUILD / "kit_drafter_run"))
        sub.add_argument("--max-steps", type=int, default=20_000)
        sub.add_argument("--learning-rate", type=float, default=5e-4)
        sub.add_argument("--warmup-steps", type=int, default=200)
        sub.add_argument("--batch-size", type=int, default=8)
        sub.add_argument("--anchors", type=int, default=32)
        sub.add_argument("--first-save-steps", type=int, default=200)
        sub.add_argument("--save-minutes", type=float, default=15.0)
        sub.add_argument("--seed", type=int, default=0)
        sub.add_argument("--threads", type=int, default=1)
        if name == "bench":
            sub.add_argument("--steps", type=int, default=20)
    sub = commands.add_parser("eval")
    sub.add_argument("drafters", nargs="+", help="kit or study drafter names, drafter or checkpoint folders")
    sub.add_argument("--prompts", type=int, default=8, help="prompts per set (held-out, HumanEval)")
    sub.add_argument("--max-new-tokens", type=int, default=64)
    sub.add_argument("--budget", type=int, default=16)
    sub.add_argument("--temperatures", type=lambda s: [float(t) for t in s.split(",")], default=[0.0, 1.0])
    sub.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    {"train": train, "bench": bench, "eval": evaluate}[args.command](args)


if __name__ == "__main__":
    main()
