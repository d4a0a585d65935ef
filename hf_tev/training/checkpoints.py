"""The check of a checkpoint folder before `ExitTrainer` resumes from it (`check_checkpoint`), shared by
`ExitTrainer.train` and `hf-tev train --resume_from_checkpoint`.

`Trainer` resumes from what it finds: without `optimizer.pt` / `scheduler.pt` it continues with a fresh optimizer
(Adam moments at zero) and a fresh learning-rate schedule, without `trainer_state.json` from step 0, and it says
nothing. Resuming promises to continue the run that stopped, so an incomplete or damaged checkpoint is refused
before any model work; to start a new run from a checkpoint's weights, load them as the drafter instead.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME

# What to do with a checkpoint that cannot be resumed, `{path}` filled in.
NEW_RUN = (
    "resume from a complete checkpoint, or start a new run from its weights (hf-tev train --drafter {path}, or "
    "DFlashDraftModel.from_pretrained('{path}'))"
)


def check_checkpoint(path, optimizer: bool = True) -> Path:
    """Raise an error naming the file and the cause unless `path` is a checkpoint `Trainer` resumes completely
    from: a folder with a readable `trainer_state.json` and, with `optimizer` (False under DeepSpeed / FSDP, which
    keep their own layouts), the `optimizer.pt` and `scheduler.pt` torch files; the random states and Draft-OPD
    rollouts it holds must be readable too. Returns the folder."""
    folder = Path(path)
    if not folder.is_dir():
        what = "is a file, not a checkpoint folder" if folder.exists() else "does not exist"
        raise FileNotFoundError(f"resume_from_checkpoint: {folder} {what}")
    hint = NEW_RUN.format(path=folder)
    state = folder / TRAINER_STATE_NAME
    if not state.is_file():
        raise ValueError(f"resume_from_checkpoint: {folder} has no {TRAINER_STATE_NAME}: not a Trainer checkpoint")
    loaded = _check_json_file(state, hint)
    if not isinstance(loaded, dict) or not isinstance(loaded.get("global_step"), int):
        raise ValueError(f"{state} is damaged (no 'global_step'); {hint}")
    if optimizer:
        for name in (OPTIMIZER_NAME, SCHEDULER_NAME):
            file = folder / name
            if not file.is_file():
                raise ValueError(
                    f"resume_from_checkpoint: {folder} has no {name}, so the run would go on with a fresh "
                    f"{'optimizer' if name == OPTIMIZER_NAME else 'learning-rate schedule'}; {hint}"
                )
            _check_torch_file(file, hint)
    for file in sorted(folder.glob("rng_state*.pth")):
        _check_torch_file(file, hint)
    for file in sorted(folder.glob("opd_rollouts_*.json")):  # the Draft-OPD rollouts of the run (`opd_rollouts`)
        _check_json_file(file, hint)
    return folder


def _check_torch_file(file: Path, hint: str) -> None:
    if not zipfile.is_zipfile(file):  # torch.save writes a zip archive
        raise ValueError(f"{file} is damaged (not a torch.save file; was it cut off?); {hint}")


def _check_json_file(file: Path, hint: str):
    """The JSON value of a checkpoint file; ValueError naming the file (and line) when it is damaged."""
    try:
        return json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ValueError(f"{file} is damaged (not UTF-8 at byte {error.start}); {hint}") from None
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{file} is damaged (not valid JSON: line {error.lineno} column {error.colno}: {error.msg}; was it cut "
            f"off while being written?); {hint}"
        ) from None
