"""The tiny model kit (the package hf-tev-tiny-kit, tiny_kit/ of the checkout): its files load, and TEV on the
real trained target is exact with real acceptance (tau well above 1) on held-out prompts."""

import json
import os

import pytest
import torch
from safetensors import safe_open

import hf_tev
from hf_tev.packaged import (
    KIT_DRAFTERS,
    KIT_MODELS,
    kit_dir,
    kit_path,
    load_kit_model,
    load_kit_prompts,
    load_kit_tokenizer,
)


@pytest.fixture(scope="module")
def target():
    return load_kit_model("target")


@pytest.fixture(scope="module")
def tokenizer():
    return load_kit_tokenizer()


def test_every_kit_model_loads_from_safetensors_with_a_card():
    for name in KIT_MODELS:
        path = kit_path(name)
        assert (path / "README.md").is_file(), f"{name} has no model card"
        assert not list(path.glob("*.bin")), f"{name} ships a pickle file"
        with safe_open(path / "model.safetensors", "pt") as weights:
            assert len(list(weights.keys())) > 0
    for name in KIT_DRAFTERS:
        drafter = load_kit_model(name)
        assert isinstance(drafter, hf_tev.DFlashDraftModel)
        config = json.loads((kit_path(name) / "config.json").read_text())
        assert config["architectures"] == ["DFlashDraftModel"] and "dflash_config" in config


def test_kit_models_fit_the_target(target):
    for name in KIT_DRAFTERS:
        load_kit_model(name).check_target(target)
    assistant = load_kit_model("assistant-ar")
    assert assistant.config.vocab_size == target.config.vocab_size


def test_prompt_sets():
    for name in ("heldout", "humaneval"):
        prompts = load_kit_prompts(name)
        assert len(prompts) > 100 and all(p == p.rstrip() for p in prompts)
    with pytest.raises(ValueError, match="prompt set"):
        load_kit_prompts("mt-bench")
    with pytest.raises(ValueError, match="kit model"):
        kit_path("drafter-nope")
    with pytest.raises(ValueError, match="kit study's drafters"):  # shipped in the kit before it became a package
        kit_path("drafter-exittrain")


def test_kit_dir_error_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TEV_KIT", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="HF_TEV_KIT"):
        kit_dir()


def test_kit_models_load_from_safetensors_only(monkeypatch, tmp_path):
    # A kit whose target has only pickle weights is refused, not read through torch.load.
    import shutil

    from safetensors.torch import load_file

    shutil.copytree(kit_path("target"), tmp_path / "target", ignore=shutil.ignore_patterns("model.safetensors"))
    torch.save(load_file(kit_path("target") / "model.safetensors"), tmp_path / "target" / "pytorch_model.bin")
    monkeypatch.setenv("HF_TEV_KIT", str(tmp_path))
    with pytest.raises(OSError, match="model.safetensors"):
        load_kit_model("target")


@pytest.mark.parametrize("drafter_name", ["drafter-dflash", "drafter-dflash-l135"])
def test_greedy_tev_on_heldout_prompts_is_exact_with_real_acceptance(target, tokenizer, drafter_name):
    drafter = load_kit_model(drafter_name)
    prompts = load_kit_prompts("heldout", 3) + load_kit_prompts("humaneval", 2)
    accepted = []
    for prompt in prompts:
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
        expected = target.generate(input_ids, do_sample=False, max_new_tokens=40)
        out = target.generate(
            input_ids,
            do_sample=False,
            max_new_tokens=40,
            assistant_model=drafter,
            tev_config=hf_tev.TEVConfig(budget=32),
            return_dict_in_generate=True,
        )
        assert out.sequences.tolist() == expected.tolist()
        accepted += out.tev_stats.accepted_lengths
    tau = sum(accepted) / len(accepted)
    assert tau > 1.5, f"tau {tau:.2f}: the kit's drafter barely gets accepted"


def test_sampled_tev_on_the_kit_tracks_coverage(target, tokenizer):
    # At T=1 the mean accepted length estimates the mean coverage 1 + C of the same trees.
    drafter = load_kit_model("drafter-dflash")
    input_ids = tokenizer(load_kit_prompts("heldout", 1)[0], return_tensors="pt").input_ids
    torch.manual_seed(0)
    out = target.generate(
        input_ids,
        do_sample=True,
        top_k=0,
        max_new_tokens=96,
        assistant_model=drafter,
        tev_config=hf_tev.TEVConfig(budget=32),
        return_dict_in_generate=True,
    )
    stats = out.tev_stats
    differences = torch.tensor(stats.accepted_lengths, dtype=torch.float64) - torch.tensor(stats.coverages)
    standard_error = differences.std() / len(differences) ** 0.5
    assert abs(differences.mean()) < 4 * standard_error + 1e-6
    assert stats.mean_coverage > 1.3


def test_the_kit_is_found_through_its_installed_package(monkeypatch):
    """Without `HF_TEV_KIT`, the kit is the installed `hf_tev_tiny_kit` package's folder; with neither, the error
    says how to install it. hf_tev never looks for it in a source checkout."""
    from hf_tev import packaged

    monkeypatch.delenv("HF_TEV_KIT", raising=False)
    assert kit_dir() == packaged.installed_package_dir("hf_tev_tiny_kit")
    monkeypatch.setattr(packaged, "installed_package_dir", lambda module: None)
    with pytest.raises(FileNotFoundError, match=r"pip install -e \./tiny_kit"):
        kit_dir()


def test_the_library_builds_no_path_into_a_checkout():
    """No module of hf_tev climbs out of its own package folder or names the checkout's example, research or benchmark
    folders: what a wheel user gets must not depend on files beside the package."""
    from pathlib import Path

    package = Path(hf_tev.__file__).resolve().parent
    offenders = []
    for module in package.rglob("*.py"):
        code = "\n".join(line.split("#")[0] for line in module.read_text().splitlines())
        checkout = (".parent.parent", "__file__).parents", "examples/", '"examples"', '"research"', '"benchmarks"')
        if any(pattern in code for pattern in checkout):
            offenders.append(str(module.relative_to(package)))
    assert offenders == []


def test_the_kit_package_ships_every_file_it_holds():
    """A non-editable install of `tiny_kit/` copies only what its package-data globs name: every file of the kit must
    match one (a new nested folder would otherwise be missing from an installed kit)."""
    import fnmatch
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    kit_project = Path(__file__).resolve().parents[2] / "tiny_kit"
    globs = tomllib.loads((kit_project / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]

    def shipped(relative: str) -> bool:  # a setuptools glob: one `*` never crosses a `/`
        parts = relative.split("/")
        return any(
            len(glob.split("/")) == len(parts) and all(map(fnmatch.fnmatch, parts, glob.split("/")))
            for glob in globs["hf_tev_tiny_kit"]
        )

    package = kit_project / "hf_tev_tiny_kit"
    files = [p.relative_to(package).as_posix() for p in package.rglob("*") if p.is_file()]
    files = [f for f in files if "__pycache__" not in f and f != "__init__.py"]
    assert len(files) > 20 and [f for f in files if not shipped(f)] == []


def test_the_test_helpers_import_without_a_kit(tmp_path):
    """Importing tests/helpers.py does no work: without a kit, a test that needs none still runs, and one that asks
    for the kit's files gets the kit's own error with its install hint."""
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    script = (
        "import helpers\n"
        "assert callable(helpers.make_target)\n"
        "try:\n    helpers.KIT_ROWS\nexcept FileNotFoundError as error:\n    print('refused:', error)\n"
    )
    env = {**os.environ, "HF_TEV_KIT": str(tmp_path / "no-kit"), "PYTHONPATH": str(tests)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "refused: No tiny kit at" in done.stdout and "pip install -e ./tiny_kit" in done.stdout
