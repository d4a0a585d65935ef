"""Train SmolLM2-135M-Instruct's DFlash drafters: the paper's Table 2 on a real target, resumable across sessions.

    python research/smollm2_table2/train_drafters.py init     # the shared initialisation (standard objective)
    python research/smollm2_table2/train_drafters.py dflash   # + 100 standard-objective steps from it
    python research/smollm2_table2/train_drafters.py exit     # + 100 ExitTrain steps (equal data, steps, seed)
    python research/smollm2_table2/train_drafters.py init --runs /tmp/short --max_steps 10   # + hf-tev train flags

Each stage is its recipe, `recipes/<stage>.yaml`: every `hf-tev train` setting of the stage, with the reasons for
its values (the drafter, the data, the objective, the schedule, the checkpoints). This script is a thin runner: it
runs `python -m hf_tev.train recipes/<stage>.yaml` from the repository root (the recipes' paths are relative to it)
and adds only what a recipe cannot hold:

- `--target`: the packaged target's folder (`hf_tev.packaged.packaged_model_path`, the Q4_1 weights dequantized,
  the weights the data came from), which depends on the machine;
- `--output_dir RUNS/<stage>` and `--threads`; with `--runs` other than `runs/`, also `--drafter RUNS/init` for
  dflash and exit, so they start from that folder's initialisation;
- `--resume_from_checkpoint last` when `RUNS/<stage>` holds a checkpoint: a stage that stops (a checkpoint every
  25 steps) resumes from its newest one, so a session loses at most 25 steps;
- `--max_train_rows N` with `--max-rows N`.

Any other argument goes to `hf-tev train` after these and overrides the recipe (`--max_steps 10`; a relative path
is from the repository root; pick the output folder with `--runs`, which the checks below and the resumption read).
The options the recipes now hold (`--data`, `--init-steps`, `--steps`, `--save-steps`) are gone from this script,
so each setting has one place; their `hf-tev train` flags (`--train_data`, `--max_steps`, `--save_steps`) override
it for one run (warmup stays the recipe's `warmup_steps`). `--print-command` prints the command and runs nothing.
A finished stage (its `model.safetensors` written) is not run again; dflash and exit need the finished init.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

from study import HERE, REPO, STAGES, TARGET, recipe

from hf_tev.packaged import packaged_model_path

RUNS = HERE / "runs"


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    """`(this script's arguments, the rest: hf-tev train flags that override the recipe)`."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("stage", choices=STAGES)
    parser.add_argument("--runs", default=str(RUNS), help="the stages' folders, RUNS/<stage> (default: runs/)")
    parser.add_argument("--max-rows", type=int, default=None, help="use the first N rows only")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--print-command", action="store_true", help="print the hf-tev train command and stop")
    return parser.parse_known_args(argv)


def from_repo(path: Path) -> str:
    """`path` as the command names it: relative to the repository root (where it runs) when inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def train_command(args: argparse.Namespace, target, overrides: list[str] = ()) -> list[str]:
    """The arguments of `hf-tev train` for the stage, run from the repository root: its recipe, then the runner's
    additions, then `overrides`."""
    runs = Path(args.runs).resolve()
    out = runs / args.stage
    argv = [from_repo(recipe(args.stage)), "--target", str(target), "--output_dir", from_repo(out)]
    if args.stage != "init" and runs != RUNS:
        argv += ["--drafter", from_repo(runs / "init")]
    if any(out.glob("checkpoint-*")):
        argv += ["--resume_from_checkpoint", "last"]
    argv += ["--threads", str(args.threads)]
    argv += ["--max_train_rows", str(args.max_rows)] if args.max_rows else []
    return argv + list(overrides)


def main(argv=None):
    args, overrides = parse_args(argv)
    runs = Path(args.runs)
    if (runs / args.stage / "model.safetensors").is_file():
        print(f"{args.stage}: finished ({runs / args.stage})")
        return
    if args.stage != "init" and not (runs / "init" / "model.safetensors").is_file():
        raise SystemExit(f"{args.stage} starts from the shared initialisation: run the init stage first")
    command = train_command(args, packaged_model_path(TARGET), overrides)
    if args.print_command:
        print(f"cd {shlex.quote(str(REPO))} && hf-tev train {shlex.join(command)}")
        return
    sys.exit(subprocess.run([sys.executable, "-m", "hf_tev.train", *command], cwd=REPO).returncode)


if __name__ == "__main__":
    main()
