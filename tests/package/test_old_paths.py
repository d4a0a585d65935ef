"""The drafter's modules before `hf_tev/models/dflash/` (issue 46): the old top-level names still import, warn
with a FutureWarning naming the new path, and give the very objects of the new modules; likewise a renamed function
still answers under its old name, warning with the new one. Nothing in hf_tev, the tests, the benchmarks, the
examples or the Hub recipe uses an old path or name."""

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OLD_PATHS = {
    "hf_tev.configuration_dflash": "hf_tev.models.dflash.configuration_dflash",
    "hf_tev.modeling_dflash": "hf_tev.models.dflash.modeling_dflash",
    "hf_tev.dflash_files": "hf_tev.models.dflash.files",
    "hf_tev.auto_class": "hf_tev.models.dflash.auto",
    "hf_tev.native_drafters": "hf_tev.models.dflash.native",
}
OLD_NAMES = {"hf_tev.packaged.resolve": "hf_tev.packaged.pretrained_source"}  # renamed functions, kept as aliases
CODE_FOLDERS = ("hf_tev", "tests", "benchmarks", "examples", "custom_generate")


@pytest.mark.parametrize("old", OLD_PATHS)
def test_an_old_path_warns_naming_the_new_one_and_gives_the_same_objects(old, monkeypatch):
    new = importlib.import_module(OLD_PATHS[old])
    monkeypatch.delitem(sys.modules, old, raising=False)  # executed anew, so that it warns here
    with pytest.warns(FutureWarning, match=OLD_PATHS[old].replace(".", r"\.")):
        shim = importlib.import_module(old)
    public = [name for name in vars(new) if not name.startswith("_")]
    assert public and all(getattr(shim, name) is getattr(new, name) for name in public)


def test_the_old_files_helper_name_is_the_one_architecture_helper():
    from hf_tev.models.dflash.architecture import architecture_names

    with pytest.warns(FutureWarning):
        shim = importlib.reload(importlib.import_module("hf_tev.dflash_files"))
    assert shim.config_architectures is architecture_names
    assert architecture_names({"architectures": "DFlashDraftModel"}) == ["DFlashDraftModel"]


def test_the_old_name_of_pretrained_source_warns_naming_it_and_gives_its_answer(tmp_path):
    from hf_tev import packaged

    with pytest.warns(FutureWarning, match=r"is now hf_tev\.packaged\.pretrained_source"):
        assert packaged.resolve(str(tmp_path)) == packaged.pretrained_source(str(tmp_path)) == str(tmp_path)


def imported_modules(path: Path) -> set[str]:
    """The dotted modules a file imports (relative imports resolved for files under hf_tev/), `from a import b`
    also as `a.b`."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    package = parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def test_nothing_of_the_project_uses_an_old_path_or_name():
    shims = {ROOT / (old.replace(".", "/") + ".py") for old in OLD_PATHS}
    users = []
    for folder in CODE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path in shims or path == Path(__file__).resolve() or "build" in path.relative_to(ROOT).parts:
                continue
            text = path.read_text(encoding="utf-8")
            named = imported_modules(path) | {old for old in OLD_PATHS if old in text}  # also in code strings
            # an old function name also called as an attribute of its module (`packaged.resolve(...)`)
            named |= {old for old in OLD_NAMES if re.search(re.escape(".".join(old.split(".")[-2:])) + r"\(", text)}
            users += [f"{path.relative_to(ROOT)}: {old}" for old in sorted(named & {*OLD_PATHS, *OLD_NAMES})]
    assert not users, users
