"""Train the tiny kit's DFlash drafters: a thin runner of `hf-tev train` (`hf_tev.training.cli`) over the kit's recipes.

    python research/tiny_kit/train_drafter.py dflash-stage1   # drafter-dflash, stage 1: a fresh drafter, 1,000 steps
    python research/tiny_kit/train_drafter.py dflash          # stage 2: 700 more steps (the shipped drafter-dflash)
    python research/tiny_kit/train_drafter.py finetuned       # the paper's Table 2 from drafter-dflash, 400 steps each:
    python research/tiny_kit/train_drafter.py prefix          #   the standard objective, the prefix-weighted tree
    python research/tiny_kit/train_drafter.py exittrain       #   loss, ExitTrain
    python research/tiny_kit/train_drafter.py dflash-l135     # drafter-exittrain widened to target layers 1, 3, 5
    python research/tiny_kit/train_drafter.py exittrain --init drafter-dflash-l135 --max_steps 300 \
        --warmup_steps 30 --output_dir /tmp/l135-exittrain   # + hf-tev train flags, which override the recipe

Each recorded run is its recipe, `recipes/<stage>.yaml`: every `hf-tev train` setting of the run that made the
drafter of that name (the target, the drafter it starts from, the data, the objective and its knobs, the schedule,
the model card), with the reasons for its values. The recipes' outputs go to research/tiny_kit/build/ (git-ignored);
the recorded drafters are the shipped copies (`drafter-dflash`, `drafter-dflash-l135`: the package
tiny_kit/hf_tev_tiny_kit/) and the study drafters (`paths.STUDY_DRAFTER_DIR`). `drafter-dflash-3l` is not among them:
`train_kit_drafter.py` trains it with `ExitTrainer` directly.

This script runs `hf-tev train RECIPE` in this process from the repository root (the recipes' paths are relative to
it), and adds only what a recipe cannot hold:

- `--init NAME`: the drafter to start from, by name: a kit model (`drafter-dflash`, `drafter-dflash-l135`), a study
  drafter (`drafter-finetuned`, `drafter-prefix`, `drafter-exittrain`, `drafter-dflash-3l`) or a folder; it becomes
  `--drafter FOLDER`;
- `--target-layers L`: the starting drafter (the recipe's or `--init`'s) widened to read the target layers L without
  changing its output (`widen`), saved to a temporary folder and passed as `--drafter`. `hf-tev train` cannot say it
  (`--target_layer_ids` builds a fresh drafter); the stage dflash-l135 takes `1,3,5`, as recorded;
- after training, `trainlog.json` in the output folder (this script's arguments, the command, the seconds, the rows
  and the logged history), and the `training_args.bin` pickle removed (the card and trainlog.json say it all).

RECIPE is a stage name or a recipe file. Any other argument goes to `hf-tev train` after these and overrides the
recipe (`--max_steps 10`, `--output_dir /tmp/x`; a relative path is from the repository root). The recipes' warmup
is `min(100, max_steps // 10)` steps: with another `--max_steps`, give `--warmup_steps` too. The flags of the earlier
version of this script are the recipes' keys now (`--out` is `--output_dir`, `--max-steps` `--max_steps`,
`--anchors` `--anchors_per_sequence`, `--data a,b` `--train_data a b`, `--max-rows` `--max_train_rows`).
`--print-command` prints the command and trains nothing.

The ExitTrain knobs: prefix.yaml and exittrain.yaml repeat the recorded drafters, trained before hf_tev 0.1.0 with
the CE decayed over depth, the tree loss normalised by its weight sum and trees at every anchor (`ce_decay: true`,
`tree_normalization: weight_sum`, `tree_anchors: all`). The authors' released recipe (today's defaults, and the
ablations after 0.1.0) is `--ce_decay false --tree_normalization nodes --tree_anchors full_horizon`.

Data: the kit's `data/train_generated.jsonl` (rows `{"input_ids", "prompt_length"}`: training-split prompts with
continuations sampled from the target itself, `generate_data.py`), and for dflash-l135 also the greedy
`data/train_generated_greedy.jsonl` here. The saved folder holds the drafter in the published DFlash layout, its
model card and `trainlog.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from hf_tev import DFlashDraftModel
from hf_tev.training import cli

# `paths` sits beside this script: on sys.path when the script runs, added here when it is loaded from its file
# (tests/training/test_train_cli.py, opd_comparison.py).
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import paths  # noqa: E402

REPO = paths.HERE.parents[1]  # the recipes' paths are relative to the repository root
RECIPES = paths.HERE / "recipes"
STAGES = ("dflash-stage1", "dflash", "finetuned", "prefix", "exittrain", "dflash-l135")
WIDEN = {"dflash-l135": "1,3,5"}  # the target layers a stage's drafter is widened to before it trains


def widen(drafter, target, target_layers):
    """A drafter reading `target_layers` that computes exactly what `drafter` computes: `fc`'s columns for
    the layers `drafter` already reads are copied, the new layers' columns start at zero (training then
    learns to use them)."""
    old = drafter.config.target_layer_ids
    missing = [i for i in old if i not in target_layers]
    if missing:
        raise ValueError(f"--target-layers {target_layers} must include the starting drafter's layers {old}")
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


def dataset_description(files) -> str:
    """The model card's data sentence of the kit's runs on the rows files `files` (the recipes hold it written out;
    opd_comparison.py writes it for its data)."""
    return (
        "Training-split prompts of the tiny kit's Python corpus with continuations written by the target "
        "(`research/tiny_kit/generate_data.py`: sampled at T=1 in `train_generated.jsonl`, greedy in "
        "`train_generated_greedy.jsonl`), from " + ", ".join(f"`{Path(p).name}`" for p in files) + "."
    )


def recipe_path(recipe: str) -> Path:
    """A stage's recipe, `recipes/<stage>.yaml`, or the recipe file `recipe`."""
    return RECIPES / f"{recipe}.yaml" if recipe in STAGES else Path(recipe).resolve()


def from_repo(path) -> str:
    """`path` as the command names it: relative to the repository root (where it runs) when inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


@contextmanager
def in_repo():
    """Run the body from the repository root, where the recipes' relative paths point."""
    before = os.getcwd()
    os.chdir(REPO)
    try:
        yield
    finally:
        os.chdir(before)


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    """`(this script's arguments, the rest: hf-tev train flags that override the recipe)`."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("recipe", help=f"a stage ({', '.join(STAGES)}: recipes/<stage>.yaml) or a recipe file")
    parser.add_argument("--init", default=None, help="drafter to start from: a kit or study drafter name, or a folder")
    parser.add_argument(
        "--target-layers",
        default=None,
        help="comma-separated target layers: the starting drafter is widened to read them without changing its "
        "output (default: the stage's, 1,3,5 for dflash-l135; else none)",
    )
    parser.add_argument("--print-command", action="store_true", help="print the hf-tev train command and stop")
    args, overrides = parser.parse_known_args(argv)
    if args.recipe not in STAGES:
        if not Path(args.recipe).is_file():
            parser.error(f"{args.recipe!r} is neither a stage ({', '.join(STAGES)}) nor a recipe file")
        path = Path(args.recipe).resolve()  # named from here; the command runs from the repository root
        args.recipe = path.stem if path == recipe_path(path.stem) else str(path)  # a stage's recipe: the stage
    if args.target_layers is None:
        args.target_layers = WIDEN.get(args.recipe)
    if args.target_layers and any(arg.split("=")[0] == "--drafter" for arg in overrides):
        parser.error("--target-layers widens the drafter to start from: name it with --init, not --drafter")
    return args, overrides


def train_command(recipe: str, drafter=None, overrides=()) -> list[str]:
    """The arguments of `hf-tev train`, run from the repository root: the recipe, the drafter to start from (None:
    the recipe's), then `overrides`."""
    argv = [from_repo(recipe_path(recipe))]
    if drafter is not None:
        argv += ["--drafter", from_repo(drafter)]
    return argv + list(overrides)


def widened_drafter(args, overrides, folder) -> str:
    """The starting drafter (`--init`'s, else the recipe's) widened to `--target-layers`, saved under `folder`; the
    drafter itself when it reads those layers already. Run from the repository root."""
    from transformers import AutoModelForCausalLM

    layers = [int(i) for i in args.target_layers.split(",")]
    script, _ = cli.parse_args(train_command(args.recipe, args.init, overrides))
    if script.drafter is None:
        raise SystemExit("--target-layers widens a drafter; for a fresh one give --target_layer_ids")
    init = DFlashDraftModel.from_pretrained(script.drafter)
    if layers == init.config.target_layer_ids:
        return script.drafter
    target = AutoModelForCausalLM.from_pretrained(script.target, attn_implementation=script.attn_implementation)
    wide = str(Path(folder) / f"{Path(script.drafter).name}-widened")
    widen(init, target, layers).save_pretrained(wide)
    return wide


def main(argv=None):
    args, overrides = parse_args(argv)
    if args.init is not None:
        args.init = str(paths.model_path(args.init).resolve())  # a folder given from here, before moving to the root
    with tempfile.TemporaryDirectory() as tmp, in_repo():
        drafter = widened_drafter(args, overrides, tmp) if args.target_layers else args.init
        command = train_command(args.recipe, drafter, overrides)
        if args.print_command:
            print(f"cd {shlex.quote(str(REPO))} && hf-tev train {shlex.join(command)}")
            return
        trainer = cli.run(*cli.parse_args(command))
        out = REPO / trainer.args.output_dir
    (out / "training_args.bin").unlink(missing_ok=True)  # a pickle: the card and trainlog.json say it all
    seconds = next(entry["train_runtime"] for entry in reversed(trainer.state.log_history) if "train_runtime" in entry)
    log = {
        "args": {**vars(args), "overrides": overrides},
        "seconds": seconds,
        "rows": len(trainer.train_dataset),
        "history": trainer.state.log_history,
        "command": "hf-tev train " + shlex.join(command),
    }
    (out / "trainlog.json").write_text(json.dumps(log, indent=1))
    print(f"trained {trainer.state.global_step} steps in {seconds:.0f} s -> {out}")


if __name__ == "__main__":
    main()
