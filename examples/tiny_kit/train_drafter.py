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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--init", default=None, help="drafter to start from (default: a fresh one)")
    parser.add_argument("--objective", choices=["dflash", "prefix", "exit"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--data", default=str(KIT / "data" / "train_generated.jsonl"))
    parser.add_argument("--max-rows", type=int, default=None, help="use the first N rows only")
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--anchors", type=int, default=8, help="anchors per sequence")
    parser.add_argument("--tree-budget", type=int, default=32)
    parser.add_argument("--tree-weight", type=float, default=0.1)
    parser.add_argument("--num-layers", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(KIT / "target")
    target = AutoModelForCausalLM.from_pretrained(KIT / "target", attn_implementation="sdpa")
    if args.init:
        drafter = DFlashDraftModel.from_pretrained(args.init)
    else:
        drafter = DFlashDraftModel.from_target(target, num_layers=args.num_layers, block_size=args.block_size)
    rows = [json.loads(line) for line in open(args.data)]
    rows = rows[: args.max_rows] if args.max_rows else rows

    training_args = ExitTrainingArguments(
        output_dir=str(Path(args.out) / "checkpoints"), objective=args.objective, tree_budget=args.tree_budget,
        ce_weight=1.0, tree_weight=args.tree_weight if args.objective != "dflash" else 0.0,
        anchors_per_sequence=args.anchors, learning_rate=args.learning_rate, max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size, warmup_steps=min(100, args.max_steps // 10),
        lr_scheduler_type="cosine", weight_decay=0.0, logging_steps=20, save_strategy="no", report_to=[],
        use_cpu=True, dataloader_num_workers=0, seed=args.seed, disable_tqdm=True,
    )
    trainer = ExitTrainer(model=drafter, target_model=target, args=training_args, train_dataset=rows,
                          processing_class=tokenizer)
    start = time.time()
    trainer.train()
    seconds = time.time() - start
    trainer.save_model(args.out)
    (Path(args.out) / "training_args.bin").unlink(missing_ok=True)  # a pickle: the card and trainlog.json say it all
    card = trainer.create_model_card(
        target_model_id="tiny-code-target (examples/tiny_kit/target)",
        dataset_description=f"{len(rows)} training-split prompts of the tiny kit's Python corpus with "
                            "continuations sampled from the target (T=1), `examples/tiny_kit/generate_data.py`.",
    )
    (Path(args.out) / "README.md").write_text(card)
    log = {"args": vars(args), "seconds": seconds, "rows": len(rows), "history": trainer.state.log_history}
    (Path(args.out) / "trainlog.json").write_text(json.dumps(log, indent=1))
    print(f"trained {args.max_steps} steps in {seconds:.0f} s -> {args.out}")


if __name__ == "__main__":
    main()
