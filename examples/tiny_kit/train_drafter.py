"""Train the tiny kit's DFlash drafters with hf_tev.ExitTrainer.

    # the shared initialisation: a fresh 1-layer drafter, standard DFlash objective
    python examples/tiny_kit/train_drafter.py --objective dflash --out examples/tiny_kit/drafter-dflash \
        --max-steps 1200 --learning-rate 1e-3
    # the paper's Table 2 from that initialisation, equal data, steps and budget
    python examples/tiny_kit/train_drafter.py --init examples/tiny_kit/drafter-dflash --objective dflash \
        --out examples/tiny_kit/drafter-finetuned --max-steps 400
    python examples/tiny_kit/train_drafter.py --init examples/tiny_kit/drafter-dflash --objective prefix \
        --out examples/tiny_kit/drafter-prefix --max-steps 400
    python examples/tiny_kit/train_drafter.py --init examples/tiny_kit/drafter-dflash --objective exit \
        --out examples/tiny_kit/drafter-exittrain --max-steps 400

The ExitTrain knobs default to `ExitTrainingArguments`' defaults (the authors' released recipe: CE without
position decay for prefix/exit, tree loss over the number of drafted nodes, trees only for anchors with a
full horizon, full target context), except `--anchors`, which stays 8 as in the kit's recorded runs. The
recorded prefix / exit drafters (and `ablation/`) were trained by an earlier hf_tev whose objective was
`--ce-decay yes --tree-normalization weight_sum --tree-anchors all`; pass those to repeat them.

Data: `data/train_generated.jsonl` (rows `{"input_ids", "prompt_length"}`: training-split prompts with
continuations sampled from the target itself, `generate_data.py`). The saved folder holds the drafter in
the published DFlash layout, its model card and `trainlog.json` (the logged losses).
"""

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_tev import DFlashDraftModel, ExitTrainer, ExitTrainingArguments

KIT = Path(__file__).resolve().parent


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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--init", default=None, help="drafter to start from (default: a fresh one)")
    parser.add_argument("--objective", choices=["dflash", "prefix", "exit"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--data",
        default=str(KIT / "data" / "train_generated.jsonl"),
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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(KIT / "target")
    target = AutoModelForCausalLM.from_pretrained(KIT / "target", attn_implementation="sdpa")
    target_layers = [int(i) for i in args.target_layers.split(",")] if args.target_layers else None
    if args.init:
        drafter = DFlashDraftModel.from_pretrained(args.init)
        if target_layers is not None and target_layers != drafter.config.target_layer_ids:
            drafter = widen(drafter, target, target_layers)
    else:
        drafter = DFlashDraftModel.from_target(
            target, num_layers=args.num_layers, block_size=args.block_size, target_layer_ids=target_layers
        )
    rows = [
        json.loads(line)
        for path in args.data.split(",")
        for line in Path(path).read_text().splitlines()
        if line.strip()
    ]
    rows = rows[: args.max_rows] if args.max_rows else rows

    training_args = ExitTrainingArguments(
        output_dir=str(Path(args.out) / "checkpoints"),
        objective=args.objective,
        tree_budget=args.tree_budget,
        ce_weight=1.0,
        tree_weight=args.tree_weight if args.objective != "dflash" else 0.0,
        anchors_per_sequence=args.anchors,
        ce_decay={"auto": None, "yes": True, "no": False}[args.ce_decay],
        gamma=args.gamma,
        tree_normalization=args.tree_normalization,
        tree_anchors=args.tree_anchors,
        tree_context_window=args.tree_context_window,
        learning_rate=args.learning_rate,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        warmup_steps=min(100, args.max_steps // 10),
        lr_scheduler_type="cosine",
        weight_decay=0.0,
        logging_steps=20,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        seed=args.seed,
        disable_tqdm=True,
    )
    trainer = ExitTrainer(
        model=drafter, target_model=target, args=training_args, train_dataset=rows, processing_class=tokenizer
    )
    start = time.time()
    trainer.train()
    seconds = time.time() - start
    trainer.save_model(args.out)
    (Path(args.out) / "training_args.bin").unlink(missing_ok=True)  # a pickle: the card and trainlog.json say it all
    card = trainer.create_model_card(
        repo_id=str(args.out),  # where the drafter is (the trainer's output_dir is its checkpoints folder)
        target_model_id="tiny-code-target (examples/tiny_kit/target)",
        dataset_description=f"{len(rows)} training-split prompts of the tiny kit's Python corpus with continuations "
        "written by the target (`examples/tiny_kit/generate_data.py`: sampled at T=1 in "
        "`train_generated.jsonl`, greedy in `train_generated_greedy.jsonl`), from "
        + ", ".join(f"`{Path(p).name}`" for p in args.data.split(","))
        + ".",
    )
    (Path(args.out) / "README.md").write_text(card)
    log = {"args": vars(args), "seconds": seconds, "rows": len(rows), "history": trainer.state.log_history}
    (Path(args.out) / "trainlog.json").write_text(json.dumps(log, indent=1))
    print(f"trained {args.max_steps} steps in {seconds:.0f} s -> {args.out}")


if __name__ == "__main__":
    main()
