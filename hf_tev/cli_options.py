"""What the `hf-tev` command lines share (`hf-tev train`, `hf-tev bench`): a recipe file of option values (YAML or
JSON, `--config FILE` or a first argument `FILE.yaml|yml|json`) read with its mistakes named by file, line and
column, and the refusal of one option given under two of its names (`--drafters A --drafter B`,
`--drafter A --model-name-or-path B`), which argparse would settle by keeping the last without a word.

The parsers are argparse parsers (`transformers.HfArgumentParser` included); nothing here imports transformers.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


def canonical(option: str) -> str:
    """An option's name without dashes, `-` read as `_`: both spellings of a name are one name."""
    return option.lstrip("-").replace("-", "_")


def option_names(parser) -> dict[str, str]:
    """Every long option name, with `_` for `-` and without the dashes, -> the argument it sets (aliases too); not
    the `--no_x` flags, which set `x` to False: a recipe file gives `x` its value."""
    return {
        canonical(option): action.dest
        for action in parser._actions
        if not isinstance(action, argparse._StoreFalseAction)
        for option in action.option_strings
        if option.startswith("--")
    }


# ----------------------------------------------------------------------------------------------
# One option under two names


def record_given_names(parser) -> None:
    """Make every option that has several names (`--drafters` / `--drafter`, and a boolean's `--x` / `--no_x`,
    two actions of one argument) record the names it is given under (`action.given_names`, one list per
    argument; abbreviations come resolved by argparse), so that `refuse_names_given_twice` can refuse two of
    them. Call it once the parser has all its options."""
    by_argument: dict[str, list] = {}
    for action in parser._actions:
        if action.option_strings:
            by_argument.setdefault(action.dest, []).append(action)
    for actions in by_argument.values():
        if len({canonical(option) for action in actions for option in action.option_strings}) > 1:
            given_names = []
            for action in actions:
                action.__class__ = _recording(type(action))
                action.given_names = given_names


@functools.cache
def _recording(action_class):
    """`action_class` whose calls record the option name they were given under."""

    def call(self, parser, namespace, values, option_string=None):
        if option_string is not None:
            self.given_names.append(canonical(option_string))
        return action_class.__call__(self, parser, namespace, values, option_string)

    return type(action_class.__name__, (action_class,), {"__call__": call})


def refuse_names_given_twice(parser) -> None:
    """After parsing: a ValueError naming both when one option was given under two of its names. One name given
    twice (in either spelling) stays argparse's last-wins."""
    for action in parser._actions:
        names = list(dict.fromkeys(getattr(action, "given_names", ())))
        if len(names) > 1:  # the actions of one argument share the list: the first of them refuses
            given = " and ".join(f"--{name}" for name in names)
            raise ValueError(f"{given} are two names of one argument ({action.dest}) and were both given; give it once")


# ----------------------------------------------------------------------------------------------
# One run per output folder


@contextmanager
def owned_folder(option: str, folder: Path, lock_name: str, command: str) -> Iterator[None]:
    """Own `folder` (its `lock_name` file, a non-blocking `filelock`) until the block ends, so that two runs of
    `command` never write one folder; a second run is refused at once, by name. A folder this created and left
    empty but for the lock is removed again (a run refused before it starts leaves nothing)."""
    from filelock import FileLock, Timeout

    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(folder / lock_name), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise ValueError(
            f"{option} {folder}: another {command} run holds this folder (its lock {folder / lock_name} is "
            "taken); wait for that run to end, or pick another folder"
        ) from None
    try:
        yield
    finally:
        if created and [path.name for path in folder.iterdir()] == [lock_name]:
            (folder / lock_name).unlink(missing_ok=True)
            folder.rmdir()
        lock.release()


# ----------------------------------------------------------------------------------------------
# Recipe files


def split_config(parser, argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """`(the recipe file or None, the other arguments)`: `--config FILE` (or `--config=FILE`) anywhere, or
    `FILE.yaml|yml|json` first."""
    argv = [part for arg in argv for part in (arg.split("=", 1) if arg.startswith("--config=") else [arg])]
    if "--config" in argv:
        at = argv.index("--config")
        if at + 1 >= len(argv):
            parser.error("--config needs a file")
        return argv[at + 1], argv[:at] + argv[at + 2 :]
    if argv and not argv[0].startswith("-") and argv[0].endswith(CONFIG_SUFFIXES):
        return argv[0], argv[1:]
    return None, argv


def apply_config(parser, path) -> None:
    """The values of the recipe file `path` become the parser's defaults (options given after it override them),
    and an option it sets is no longer required. A file that cannot be read raises (`read_config`); unknown names
    and one option given twice in it are parser errors."""
    values = config_values(parser, path)
    parser.set_defaults(**values)
    for action in parser._actions:
        if action.dest in values:
            action.required = False


def config_values(parser, path) -> dict[str, Any]:
    """The values of a recipe file under their argument names (any name or spelling of an option works)."""
    names = option_names(parser)
    values, unknown = {}, []
    for key, value in read_config(path).items():
        name = names.get(canonical(str(key)))
        if name is None:
            unknown.append(str(key))
        elif name in values:
            parser.error(f"{path}: {name!r} is given twice (as {key!r} and under another name)")
        values[name] = value
    if unknown:
        parser.error(f"{path}: unknown options {unknown} (see --help)")
    return values


def read_config(path) -> dict[str, Any]:
    """A YAML or JSON mapping of option names to values; a file that is not one raises ValueError naming the file
    (and the line and column of a syntax error)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text (byte {error.start})") from None
    if path.suffix == ".json":
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} line {error.lineno} column {error.colno}: not valid JSON ({error.msg})") from None
    else:
        values = _read_yaml(path, text)
    if not isinstance(values, dict):
        raise ValueError(f"{path} must hold a mapping of option names to values, got {type(values).__name__}")
    return values


def _read_yaml(path: Path, text: str) -> Any:
    import yaml

    stream = io.StringIO(text)
    stream.name = str(path)  # PyYAML's marks name the stream: the file, not "<unicode string>"
    try:
        return yaml.safe_load(stream) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        if mark is None:  # a character YAML does not take, or an error without a place
            raise ValueError(f"{path}: not valid YAML ({' '.join(str(error).split())})") from None
        why = "; ".join(part for part in (error.context, error.problem) if part)
        raise ValueError(f"{path} line {mark.line + 1} column {mark.column + 1}: not valid YAML ({why})") from None
