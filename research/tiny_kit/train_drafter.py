"""Train the tiny kit's DFlash drafters: a thin call of `hf-tev train` (`hf_tev.training.cli`) with the kit's recipe.

    # the shared initialisation: a fresh 1-layer drafter, standard DFlash objective
    python research/tiny_kit/train_drafter.py --objective dflash --out research/tiny_kit/build/drafter-dflash \
        --max-steps 1200 --learning-rate 1e-3
    # the paper's Table 2 from that initialisation, equal data, steps and budget
    python research/tiny_kit/train_drafter.py --init drafter-dflash --objective dflash \
        --out research/tiny_kit/build/drafter-finetuned --max-steps 400
    python research/tiny_kit/train_drafter.py --init drafter-dflash --objective prefix \
        --out research/tiny_kit/build/drafter-prefix --max-steps 400
    python research/tiny_kit/train_drafter.py --init drafter-dflash --objective exit \
        --out research/tiny_kit/build/drafter-exittrain --max-steps 400

`--init` takes a kit model name (`drafter-dflash`, `drafter-dflash-l135`: shipped in the package
tiny_kit/hf_tev_tiny_kit/), a study drafter's name (`drafter-finetuned`, `drafter-prefix`, `drafter-exittrain`,
`drafter-dflash-3l`: `paths.STUDY_DRAFTER_DIR`) or a folder. The recorded drafters are the shipped copies and
the study drafters; the commands above write fresh ones under research/tiny_kit/build/ (git-ignored).

The ExitTrain knobs default to `ExitTrainingArguments`' defaults (the authors' released recipe: CE without
position decay for prefix/exit, tree loss over the number of drafted nodes, trees only for anchors with a
full horizon, full target context), except `--anchors`, which stays 8 as in the kit's recorded runs. The
recorded prefix / exit drafters (and `ablation/`) were trained with the defaults before 0.1.0,
`--ce-decay yes --tree-normalization weight_sum --tree-anchors all`; pass those to repeat them.

Data: the kit's `data/train_generated.jsonl` (`paths.data_file`; rows `{"input_ids", "prompt_length"}`:
training-split prompts with continuations sampled from the target itself, `generate_data.py`). The saved folder
holds the drafter in the published DFlash layout, its model card and `trainlog.json` (the logged losses).

The flags below keep their meaning; they become `hf-tev train` flags (`--print-command` shows them), e.g.
`--anchors 8` is `--anchors_per_sequence 8`, `--tree-weight` is ignored (0) for `--objective dflash`, the
schedule is cosine with `min(100, max_steps // 10)` warmup steps, batch 8, no weight decay, logs every 20 steps.
With `--init` and `--target-layers` that widen the drafter, the widened drafter is saved to a temporary folder
and trained from there.
"""

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

import torch

from hf_tev import DFlashDraftModel
from hf_tev.training import cli

# `paths` sits beside this script: on sys.path when the script runs, added here when it is loaded from its file
# (tests/training/test_train_cli.py, opd_comparison.py).
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import paths  # noqa: E402

# What the recorded drafters' cards name as their target: kept as written then (the kit was in examples/tiny_kit).
CARD_TARGET = "tiny-code-target (examples/tiny_kit/target)"


def widen(drafter, target, target_layers):
    """A drafter reading `target_layers` that computes exactly what `drafter` computes: `fc`'s columns for
    the layers `drafter` already reads are copied, the new layers' columns start at zero (training then
    learns to use them)."""
    old = drafter.config.target_layer_ids
    missing = [i for i in old if i not in target_layers]
    if missing:
        raise ValueError(f"--target-layers {target_layers} must include the --init drafter's layers {old}")
    wide = DFlashDraftModel.from_target(
        target,
        num_layers=drafter.config.num_hidden_layers,
        block_size=drafter.config.block_size,
        mask_token_id=drafter.config.mask_token_id,
        target_layer_ids=target_layers,
    )
    state = drafter.state_dict()
    hidden = drafter.config.hidden_size
    fc = torch.zeros_like(wide.fc.weight)
    for j, layer in enumerate(old):
        k = target_layers.index(layer)
        fc[:, k * hidden : (k + 1) * hidden] = state["fc.weight"][:, j * hidden : (j + 1) * hidden]
    state["fc.weight"] = fc
    wide.load_state_dict(state, strict=True)
    return wide


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--init", default=None, help="drafter to start from: a kit or study drafter name, or a folder (default: new)"
    )
    parser.add_argument("--objective", choices=["dflash", "prefix", "exit"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--data",
        default=str(paths.data_file("train_generated.jsonl")),
        help="JSONL training rows; several files comma-separated are concatenated",
    )
    parser.add_argument("--max-rows", type=int, default=None, help="use the first N rows only")
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--anchors",
        type=int,
        default=8,
        help="anchors per sequence (8: the kit's recorded recipe; ExitTrainingArguments defaults to 32)",
    )
    parser.add_argument("--tree-budget", type=int, default=32)
    parser.add_argument("--tree-weight", type=float, default=0.1)
    parser.add_argument(
        "--ce-decay",
        choices=["auto", "yes", "no"],
        default="auto",
        help="position decay of the CE (auto: only for --objective dflash)",
    )
    parser.add_argument("--gamma", type=float, default=7.0, help="CE decay exp(-(k-1)/gamma) when decayed")
    parser.add_argument("--tree-normalization", choices=["nodes", "weight_sum"], default="nodes")
    parser.add_argument("--tree-anchors", choices=["full_horizon", "all"], default="full_horizon")
    parser.add_argument(
        "--tree-context-window",
        type=int,
        default=None,
        help="tokens before the anchor the target sees when scoring trees (default: all)",
    )
    parser.add_argument("--num-layers", type=int, default=1)
    parser.add_argument(
        "--target-layers",
        default=None,
        help="comma-separated target layers the drafter reads (default: the default rule). With "
        "--init reading a subset of them, the drafter is widened without changing its output",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--print-command", action="store_true", help="print the hf-tev train command and stop")
    return parser.parse_args(argv)


def train_command(args, drafter: str | None) -> list[str]:
    """The `hf-tev train` arguments of the kit's recipe (`drafter`: the folder to start from, or None)."""
    files = args.data.split(",")
    argv = ["--target", str(paths.model_path("target")), "--attn_implementation", "sdpa", "--train_data", *files]
    argv += ["--max_train_rows", str(args.max_rows)] if args.max_rows else []
    if drafter is not None:
        argv += ["--drafter", drafter]
    else:
        argv += ["--num_draft_layers", str(args.num_layers), "--block_size", str(args.block_size)]
        argv += ["--target_layer_ids", *args.target_layers.split(",")] if args.target_layers else []
    argv += [
        "--output_dir", args.out,
        "--objective", args.objective,
        "--tree_budget", str(args.tree_budget),
        "--ce_weight", "1.0",
        "--tree_weight", str(args.tree_weight if args.objective != "dflash" else 0.0),
        "--anchors_per_sequence", str(args.anchors),
        "--gamma", str(args.gamma),
        "--tree_normalization", args.tree_normalization,
        "--tree_anchors", args.tree_anchors,
        "--learning_rate", str(args.learning_rate),
        "--max_steps", str(args.max_steps),
        "--per_device_train_batch_size", str(args.batch_size),
        "--warmup_steps", str(min(100, args.max_steps // 10)),
        "--lr_scheduler_type", "cosine",
        "--weight_decay", "0.0",
        "--logging_steps", "20",
        "--save_strategy", "no",
        "--report_to", "none",
        "--use_cpu",
        "--dataloader_num_workers", "0",
        "--seed", str(args.seed),
        "--disable_tqdm", "true",
        "--threads", str(args.threads),
        "--card_target_name", CARD_TARGET,
        "--dataset_description",
        "Training-split prompts of the tiny kit's Python corpus with continuations written by the target "
        "(`research/tiny_kit/generate_data.py`: sampled at T=1 in `train_generated.jsonl`, greedy in "
        "`train_generated_greedy.jsonl`), from " + ", ".join(f"`{Path(p).name}`" for p in files) + ".",
    ]  # fmt: skip
    if args.ce_decay != "auto":
        argv += ["--ce_decay", "true" if args.ce_decay == "yes" else "false"]
    if args.tree_context_window is not None:
        argv += ["--tree_context_window", str(args.tree_context_window)]
    return argv


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        drafter = str(paths.model_path(args.init)) if args.init else None
        target_layers = [int(i) for i in args.target_layers.split(",")] if args.target_layers else None
        if drafter and target_layers is not None:
            init = DFlashDraftModel.from_pretrained(drafter)
            if target_layers != init.config.target_layer_ids:
                from transformers import AutoModelForCausalLM

                target = AutoModelForCausalLM.from_pretrained(paths.model_path("target"), attn_implementation="sdpa")
                drafter = str(Path(tmp) / f"{Path(drafter).name}-widened")
                widen(init, target, target_layers).save_pretrained(drafter)
        argv = train_command(args, drafter)
        if args.print_command:
            print("hf-tev train " + shlex.join(argv))
            return
        trainer = cli.run(*cli.parse_args(argv))
    (Path(args.out) / "training_args.bin").unlink(missing_ok=True)  # a pickle: the card and trainlog.json say it all
    seconds = next(entry["train_runtime"] for entry in reversed(trainer.state.log_history) if "train_runtime" in entry)
    log = {
        "args": vars(args),
        "seconds": seconds,
        "rows": len(trainer.train_dataset),
        "history": trainer.state.log_history,
        "command": "hf-tev train " + shlex.join(argv),
    }
    (Path(args.out) / "trainlog.json").write_text(json.dumps(log, indent=1))
    print(f"trained {args.max_steps} steps in {seconds:.0f} s -> {args.out}")


if __name__ == "__main__":
    main()
