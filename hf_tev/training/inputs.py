"""What `hf-tev train` reads before any model is loaded: rows and prompts from files (`read_rows`, `read_prompts`)
and the checks of the model folders (`check_model_source`).

The JSON / JSONL readers are small on purpose: `datasets.load_dataset("json", ...)` would copy every file into its
cache and, for a broken or non-UTF-8 line, names neither the file nor the line ("JSON parse error: Invalid value.
in row 1"); these name both, and keep rows exactly as written (no common schema is forced on them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Text columns a prompt is read from when `--prompt_column` is not given, in this order.
PROMPT_COLUMNS = ("prompt", "text", "question", "instruction", "input", "messages", "conversations")
PROMPT_FILES = (".json", ".jsonl", ".txt")
# Pickle weight files of a transformers checkpoint (`pytorch_model.bin`, its shards and their index).
PICKLE_PREFIX = "pytorch_model"


def read_text(path) -> str:
    """A file's text; ValueError naming the file and line when it is not UTF-8."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise ValueError(f"{path} line {line}: not UTF-8 text (byte {error.start}); save it as UTF-8") from None


def read_json_lines(path) -> list[Any]:
    """The JSON value of every non-blank line of a JSONL file; ValueError naming the file and line of one that is
    not JSON."""
    values = []
    for number, line in enumerate(read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            values.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{path} line {number}: not valid JSON ({error.msg} at column {error.colno}); a JSONL file holds one "
                "JSON value per line"
            ) from None
    return values


def read_json_list(path, what: str) -> list[Any]:
    """The list a JSON file holds; ValueError naming the file (and line) when it is not JSON or not a list."""
    try:
        value = json.loads(read_text(path))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} line {error.lineno} column {error.colno}: not valid JSON ({error.msg})") from None
    if not isinstance(value, list):
        raise ValueError(f"{path} must hold a JSON list of {what}, got {type(value).__name__}")
    return value


def read_rows(paths: Sequence[str], limit: int | None = None) -> list[dict[str, Any]]:
    """Rows from JSONL files (one JSON object a line) or JSON files (a list of objects), concatenated.

    Raises ValueError naming the file (and line) of a broken or non-UTF-8 line, of a row that is not a JSON object,
    and of a file without rows; FileNotFoundError for a missing file, IsADirectoryError for a folder.
    """
    rows = []
    for path in paths:
        if Path(path).is_dir():
            raise IsADirectoryError(_folder_of_rows(Path(path)))
        if not Path(path).is_file():
            raise FileNotFoundError(f"rows file {path} does not exist")
        if str(path).endswith(".json"):
            found, where = read_json_list(path, "rows"), "entry"
        else:
            found, where = read_json_lines(path), "line"
        if not found:
            raise ValueError(f"{path} holds no rows (the file is empty)")
        for index, row in enumerate(found):
            if not isinstance(row, dict):
                position = f"{where} {index + 1 if where == 'line' else index}"
                raise ValueError(f"{path} {position}: a row must be a JSON object, got {type(row).__name__}")
        rows += found
    return rows[:limit] if limit is not None else rows


def _folder_of_rows(folder: Path) -> str:
    """The mistake of a folder given where rows files go, with the rows files it holds."""
    held = sorted(p.name for p in folder.iterdir() if p.suffix in (".jsonl", ".json") and p.is_file())
    inside = f" (it holds {', '.join(held[:5])}{', ...' if len(held) > 5 else ''})" if held else ""
    return (
        f"rows file {folder} is a folder, not a file: give rows files, JSONL (one JSON object a line) or .json "
        f"(a list of objects){inside}"
    )


def read_prompts(
    source: str, split: str = "train", config: str | None = None, column: str | None = None, limit: int | None = None
) -> list:
    """Prompts (strings, token-id lists or chat conversations) from a .json / .jsonl / .txt file or a `datasets`
    name or folder (`datasets.load_dataset(source, config, split=split)`)."""
    path = Path(source)
    if path.suffix in PROMPT_FILES and not path.exists():
        raise FileNotFoundError(f"prompts file {source} does not exist")
    if path.is_file() and path.suffix in PROMPT_FILES:
        if path.suffix == ".txt":
            items = [line for line in read_text(path).splitlines() if line.strip()]
        elif path.suffix == ".json":
            items = read_json_list(path, "prompts")
        else:
            items = read_json_lines(path)
    else:
        try:
            import datasets
        except ImportError as error:
            raise ImportError(f"reading prompts from {source!r} needs `pip install datasets`") from error
        items = datasets.load_dataset(source, config, split=split)
    prompts = []
    for index, item in enumerate(items):
        if limit is not None and len(prompts) >= limit:
            break
        prompts.append(_prompt(item, source, index, column))
    if not prompts:
        raise ValueError(f"{source} holds no prompts")
    return prompts


def _prompt(item, source: str, index: int, column: str | None):
    """The prompt of one entry: the entry itself, or its `column` (default: the first of `PROMPT_COLUMNS`)."""
    if isinstance(item, dict):
        name = column or next((c for c in PROMPT_COLUMNS if c in item), None)
        if name is None or name not in item:
            wanted = repr(column) if column else "among " + ", ".join(PROMPT_COLUMNS)
            raise ValueError(
                f"{source} entry {index} has no prompt column {wanted}; it has {sorted(item)} (pass --prompt_column)"
            )
        item = item[name]
    if isinstance(item, str) and not item.strip():
        raise ValueError(f"{source} entry {index} is an empty prompt")
    return item


def is_local_path(name: str) -> bool:
    """True when `name` can only be a local path, never a Hub model id (`owner/name` or `name`)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1 or "\\" in name:
        return True
    try:
        validate_repo_id(name)
    except HFValidationError:
        return True
    return False


def check_model_source(option: str, name: str, allow_pickle: bool, pickle_hint: str) -> None:
    """Check a model argument (`--target`, `--drafter`) before loading: a folder must exist with a `config.json`
    and safetensors weights (pickle-only weights refused unless `allow_pickle`; `pickle_hint` says what to do);
    a name that can only be a path must exist. A Hub id is left to the loader."""
    path = Path(name).expanduser()
    if not path.exists():
        if is_local_path(name):
            raise FileNotFoundError(f"{option} {name}: the folder does not exist (and it is not a Hub model id)")
        return
    if not path.is_dir():
        raise ValueError(f"{option} {name} is a file; give the model's folder (with config.json) or a Hub id")
    files = os.listdir(path)
    if "config.json" not in files:
        raise ValueError(f"{option} {name} has no config.json: not a saved model folder")
    safetensors = [f for f in files if f.endswith(".safetensors") or f.endswith(".safetensors.index.json")]
    pickles = sorted(f for f in files if f.startswith(PICKLE_PREFIX) and (f.endswith(".bin") or f.endswith(".json")))
    if pickles and not safetensors and not allow_pickle:
        raise ValueError(f"{option} {name} holds only pickle weights ({', '.join(pickles)}); {pickle_hint}")


DRAFTER_OPTION = "--drafter (trl's --model_name_or_path)"


def check_model_roles(target: str, drafter: str | None, hub: bool = False) -> None:
    """Refuse a model passed in the other's place, before any model is loaded: a causal LM as the drafter (trl's
    habit: `--model_name_or_path` names the model trained, here the drafter) or a DFlash drafter as the target.
    Local folders are read; with `hub`, a Hub id's `config.json` is fetched too (one that cannot be fetched is left
    to the loader, which says why)."""
    from ..models.dflash.files import is_drafter_config_dict, model_not_drafter

    if drafter is not None:
        config = _model_config(drafter, hub)
        what = None if config is None else model_not_drafter(config)
        if what is not None:
            raise ValueError(
                f"{DRAFTER_OPTION} {drafter} is {what}, not a DFlash drafter; pass it as --target (the model the "
                "drafter is trained for), and --drafter a DFlash drafter checkpoint or nothing (a fresh drafter)"
            )
    config = _model_config(target, hub)
    if config is not None and is_drafter_config_dict(config):
        raise ValueError(
            f"--target {target} is a DFlash drafter, not a causal LM; pass it as {DRAFTER_OPTION}, and as --target "
            "the model it drafts for"
        )


def _model_config(name: str, hub: bool) -> dict | None:
    """The `config.json` of a local model folder (or, with `hub`, of a Hub id) as a dict; None when there is none
    to read."""
    file = Path(name).expanduser() / "config.json"
    if not file.is_file() and hub and not is_local_path(name):
        from transformers.utils import cached_file

        try:
            found = cached_file(name, "config.json", _raise_exceptions_for_missing_entries=False)
        except OSError:  # offline, gated, missing: the loader reports it
            found = None
        file = Path(found) if found else file
    if not file.is_file():
        return None
    try:
        config = json.loads(file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{file} is not valid JSON ({error}): not a saved model's config") from None
    return config if isinstance(config, dict) else None
