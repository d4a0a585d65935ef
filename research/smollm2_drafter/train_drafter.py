"""The long training job of SmolLM2-135M-Instruct's strong drafter (`recipe.yaml`): resumable across sessions.

    nice -n 19 python research/smollm2_drafter/train_drafter.py --threads 1 --stop_at 10:10 --commit
    nice -n 19 python research/smollm2_drafter/train_drafter.py --run NAME --recipe OTHER.yaml --shards 46-77 ...

- The first run freezes the finished shards of `data/` into `runs/<run>/shards.json` and joins them into
  `runs/<run>/rows.jsonl`; every later run of the same `--run` trains on the same shards (the data may grow
  meanwhile; a run keeps one fixed set, so its steps and epochs mean the same when it resumes).
- It runs `hf-tev train recipe.yaml` on those rows, with a feature cache in `runs/<run>/features` (the target's
  features of every row, computed once) and its checkpoints in `runs/<run>/out`, resuming from the last one.
- At `--stop_at` (HH:MM) the training process is stopped: at most `save_steps` of work is lost, and the next run
  resumes from the last checkpoint. With `--commit`, the trainer_state.json of each new checkpoint (the loss curve)
  is committed as `runs/<run>/trainer_state.json`, alone.
- When the training ends, the trained drafter and its card are in `runs/<run>/out`; shipping it (one copy, where
  the package reads it) is a separate, reviewed step.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from hf_tev.packaged import packaged_model_path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"


def frozen_shards(run: Path, selection: str | None = None) -> list[str]:
    """The shard files this run trains on: read from `shards.json`, or frozen there on its first start: every
    finished shard, or those numbered FIRST-LAST (`selection`)."""
    record = run / "shards.json"
    if record.exists():
        return json.loads(record.read_text())["shards"]
    shards = sorted(path.name for path in (HERE / "data").glob("shard_*.jsonl"))
    if selection is not None:
        first, last = (int(number) for number in selection.split("-"))
        shards = [name for name in shards if first <= int(name[len("shard_") : -len(".jsonl")]) <= last]
    if not shards:
        raise SystemExit(f"no finished shard in {HERE / 'data'} (selection {selection}): run generate_data.py first")
    run.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"shards": shards}, indent=1) + "\n")
    return shards


def joined_rows(run: Path, shards: list[str]) -> Path:
    """`runs/<run>/rows.jsonl`: the frozen shards' rows, in shard order (rebuilt whenever it is missing)."""
    rows = run / "rows.jsonl"
    if not rows.exists():
        partial = rows.with_name(rows.name + ".partial")
        with partial.open("w") as out:
            for name in shards:
                out.write((HERE / "data" / name).read_text())
        partial.replace(rows)
    return rows


def last_checkpoint(out: Path) -> Path | None:
    """The newest whole checkpoint: `Trainer` writes trainer_state.json last, so one without it was cut off (the
    job stopped while saving) and is passed over."""
    checkpoints = [path for path in out.glob("checkpoint-*") if (path / "trainer_state.json").is_file()]
    return max(checkpoints, key=lambda path: int(path.name.split("-")[1]), default=None)


def record_progress(run: Path, out: Path, commit: bool, recorded: str | None) -> str | None:
    """Copy the newest checkpoint's trainer_state.json to `runs/<run>/` (and commit it) when it is new."""
    checkpoint = last_checkpoint(out)
    if checkpoint is None or checkpoint.name == recorded or not (checkpoint / "trainer_state.json").exists():
        return recorded
    shutil.copyfile(checkpoint / "trainer_state.json", run / "trainer_state.json")
    if commit:
        files = [str(run / "trainer_state.json"), str(run / "shards.json")]
        subprocess.run(["git", "add", *files], cwd=REPO, capture_output=True)
        message = f"research/smollm2_drafter: {run.name} at {checkpoint.name}"
        subprocess.run(["git", "commit", "-q", "-m", message, "--", *files], cwd=REPO, capture_output=True)
    print(f"{datetime.now():%H:%M} {checkpoint.name}", flush=True)
    return checkpoint.name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", default="dflash-l3-b8-v8k", help="the run's folder under runs/")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--stop_at", default=None, help="HH:MM: stop the training process then")
    parser.add_argument("--commit", action="store_true", help="commit each checkpoint's trainer_state.json")
    parser.add_argument("--recipe", default=str(HERE / "recipe.yaml"), help="the hf-tev train recipe of the run")
    parser.add_argument("--shards", default=None, help="FIRST-LAST: the shards a new run freezes (default: all)")
    parser.add_argument(
        "--no_feature_cache",
        action="store_true",
        help="compute the target's features every step (the tree objectives need its K/V; an arm compared with them "
        "reads the same float32 features)",
    )
    args, overrides = parser.parse_known_args()
    run = HERE / "runs" / args.run
    rows = joined_rows(run, frozen_shards(run, args.shards))
    out = run / "out"
    target = packaged_model_path(TARGET)  # the converted folder: hf-tev train reads folders and Hub ids
    command = [sys.executable, "-m", "hf_tev.train", args.recipe, "--target", str(target)]
    command += ["--train_data", str(rows)]
    if not args.no_feature_cache:
        command += ["--feature_cache", str(run / "features")]
    command += ["--output_dir", str(out), "--threads", str(args.threads)]
    if last_checkpoint(out) is not None:
        command += ["--resume_from_checkpoint", str(last_checkpoint(out))]
    command += overrides
    print(" ".join(command), flush=True)
    process = subprocess.Popen(command, cwd=REPO)
    recorded = last_checkpoint(out).name if last_checkpoint(out) else None
    while process.poll() is None:
        time.sleep(30)
        recorded = record_progress(run, out, args.commit, recorded)
        if args.stop_at and datetime.now().strftime("%H:%M") >= args.stop_at:
            print(f"stopping at {args.stop_at}; resume with the same command", flush=True)
            process.terminate()
            process.wait()
    record_progress(run, out, args.commit, recorded)
    sys.exit(process.returncode if process.returncode and process.returncode > 0 else 0)


if __name__ == "__main__":
    main()
