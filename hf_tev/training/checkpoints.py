"""The check of a checkpoint folder before `ExitTrainer` resumes from it (`check_checkpoint`: its files, before any
model work; `check_checkpoint_drafter`: its weights against the drafter being trained), shared by
`ExitTrainer.train` and `hf-tev train --resume_from_checkpoint`.

`Trainer` resumes from what it finds: without `optimizer.pt` / `scheduler.pt` it continues with a fresh optimizer
(Adam moments at zero) and a fresh learning-rate schedule, without `trainer_state.json` from step 0, and it says
nothing. Resuming promises to continue the run that stopped, so an incomplete or damaged checkpoint is refused
before any model work; to start a new run from a checkpoint's weights, load them as the drafter instead.

Seeds of the trainer's random draws (anchors, the Draft-OPD cycles it replays): each draw gets its own CPU
generator seeded by what identifies it (seed, step, draw within the step, process: `seeded_generator`,
`DrawCounter`), so a run resumed from a checkpoint draws exactly what an uninterrupted one would, every process
draws its own, and the global RNG is left alone.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from collections.abc import Hashable
from pathlib import Path

import torch
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

# What to do with a checkpoint that cannot be resumed, `{path}` filled in.
NEW_RUN = (
    "resume from a complete checkpoint, or start a new run from its weights (hf-tev train --drafter {path}, or "
    "DFlashDraftModel.from_pretrained('{path}'))"
)
# What to do with a checkpoint whose weights are missing or damaged (nothing there to start from).
NO_WEIGHTS = "resume from another, complete checkpoint of the run (an earlier checkpoint-N), or start a new run"


def check_checkpoint(path, optimizer: bool = True) -> Path:
    """Raise an error naming the file and the cause unless `path` is a checkpoint `Trainer` resumes completely
    from: a folder with a readable `trainer_state.json` and, with `optimizer` (False under DeepSpeed / FSDP, which
    keep their own layouts), the drafter's weights (`model.safetensors`, whole: not cut off) and the
    `optimizer.pt` and `scheduler.pt` torch files; the random states and Draft-OPD rollouts it holds must be
    readable too. Returns the folder. Whether the weights are those of the drafter being trained is
    `check_checkpoint_drafter`'s question."""
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
        for file in weight_files(folder, NO_WEIGHTS):
            safetensors_shapes(file, NO_WEIGHTS)  # readable and whole
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
    for file in sorted(folder.glob("opd_rollouts_*.json")):  # the run's Draft-OPD rollouts (`RolloutPool`)
        _check_json_file(file, hint)
    return folder


def weight_files(folder: Path, hint: str) -> list[Path]:
    """The drafter's weight files in a checkpoint `ExitTrainer` saved (`model.safetensors`, or the shards its index
    names); ValueError naming what is missing."""
    single, index = folder / SAFE_WEIGHTS_NAME, folder / SAFE_WEIGHTS_INDEX_NAME
    if single.is_file():
        return [single]
    if not index.is_file():
        raise ValueError(f"resume_from_checkpoint: {folder} has no {SAFE_WEIGHTS_NAME} (the drafter's weights); {hint}")
    weight_map = _check_json_file(index, hint)
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} is damaged (no weight_map); {hint}")
    shards = [folder / name for name in sorted(set(map(str, weight_map.values())))]
    missing = [shard.name for shard in shards if not shard.is_file()]
    if missing:
        raise ValueError(
            f"resume_from_checkpoint: {folder} lacks the weight shards {missing} {index.name} names; {hint}"
        )
    return shards


def safetensors_shapes(file: Path, hint: str) -> dict[str, list[int]]:
    """Tensor name -> shape of a safetensors file, read from its header; ValueError naming the file when the header
    is unreadable or the file is shorter (cut off) or longer than the header says."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        prefix = f.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        raw = f.read(length) if 0 <= length <= size - 8 else b""
    try:
        header = json.loads(raw.decode("utf-8")) if raw else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict):
        raise ValueError(f"{file} is damaged (no readable safetensors header: was it cut off?); {hint}")
    tensors = {name: entry for name, entry in header.items() if name != "__metadata__" and isinstance(entry, dict)}
    end = 8 + length + max((int(entry.get("data_offsets", [0, 0])[1]) for entry in tensors.values()), default=0)
    if end != size:
        cut = "cut off" if size < end else "longer than its header says"
        raise ValueError(f"{file} is damaged ({size} bytes, its header describes {end}: {cut}); {hint}")
    return {name: list(entry.get("shape", [])) for name, entry in tensors.items()}


def check_checkpoint_drafter(path, drafter) -> None:
    """Raise an error naming the checkpoint and the first differing weight unless its drafter weights have the
    names and shapes of `drafter`'s (the drafter the resumed run trains): a checkpoint of another drafter
    (other layers, width, target layers) would fail inside `Trainer` with a size-mismatch traceback."""
    folder = Path(path)
    saved: dict[str, list[int]] = {}
    for file in weight_files(folder, NO_WEIGHTS):
        saved |= safetensors_shapes(file, NO_WEIGHTS)
    ours = {name: list(value.shape) for name, value in drafter.state_dict().items()}
    differ = [
        f"{name} is {saved[name]} there, {ours[name]} here"
        for name in ours
        if name in saved and saved[name] != ours[name]
    ]
    differ += [f"{name} is missing there" for name in ours if name not in saved]
    differ += [f"{name} is not in this drafter" for name in saved if name not in ours]
    if differ:
        more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
        raise ValueError(
            f"resume_from_checkpoint: {folder} holds another drafter than the one being trained: {differ[0]}{more}; "
            "resume with the drafter options of the run that wrote it, or start a new run from it "
            f"(hf-tev train --drafter {folder})"
        )


SETTINGS_NAME = "exit_train_settings.json"  # in each checkpoint: what the run optimises (`objective_settings`)


def objective_settings(args) -> dict:
    """The settings that say what an ExitTrain run optimises: every field `ExitTrainingArguments` adds to
    `TrainingArguments`, but the ones that only say how it is evaluated (`eval_tau_*`) or stepped. A resumed run
    must keep them (`check_checkpoint_settings`); the optimiser's and schedule's own settings may change."""
    from dataclasses import fields

    from transformers import TrainingArguments

    own = {f.name for f in fields(args)} - {f.name for f in fields(TrainingArguments)}
    kept = sorted(name for name in own if not name.startswith("eval_tau_") and name != "remove_unused_columns")
    return {name: getattr(args, name) for name in kept}


def check_checkpoint_settings(path, args) -> None:
    """Raise an error naming the checkpoint and the settings that differ when the run resuming it optimises
    another objective than the run that wrote it (its `SETTINGS_NAME`; a checkpoint without one is not checked):
    resumed under another objective, the run's steps would mean two trainings under one name."""
    file = Path(path) / SETTINGS_NAME
    if not file.is_file():
        return
    saved = _check_json_file(file, NO_WEIGHTS)
    ours = json.loads(json.dumps(objective_settings(args)))  # as JSON reads it back (tuples as lists)
    differ = [f"{name} {saved[name]!r} there, {ours[name]!r} here" for name in ours
              if name in saved and saved[name] != ours[name]]  # fmt: skip
    if differ:
        raise ValueError(
            f"resume_from_checkpoint: {path} was trained with other settings ({'; '.join(differ)}); resume with the "
            f"settings of the run that wrote it, or start a new run from its weights (hf-tev train --drafter {path})"
        )


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


# ----------------------------------------------------------------------------------------------
# Seeds of the random draws


def seeded_generator(*parts) -> torch.Generator:
    """A CPU generator seeded by a hash of `parts` joined by "/" (e.g. `seed, "train", step, draw, process`)."""
    text = "/".join(str(part) for part in parts)
    return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little"))


class DrawCounter:
    """Numbers the draws made under one key (e.g. an optimizer step): 0, 1, ... while the key stays the same, 0
    again when it changes (gradient accumulation draws several times per step)."""

    def __init__(self):
        self.key, self.draws = None, 0

    def next(self, key: Hashable) -> int:
        self.draws = self.draws + 1 if self.key == key else 0
        self.key = key
        return self.draws
