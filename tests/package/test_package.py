"""The package installs whole: the wheel holds every module and every data file read at run time, and the
model card renders from an installed wheel (not from the checkout). Plus the card's metadata rules."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from hf_tev.training import hub
from hf_tev.training.hub import is_hub_id, render_model_card

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = REPO_ROOT / "hf_tev"
SKIP = ("__pycache__",)


def package_files(suffix_is_py: bool) -> set[str]:
    """Files under hf_tev/ (wheel-style paths), Python sources or everything else."""
    found = set()
    for path in PACKAGE.rglob("*"):
        wanted = path.is_file() and not any(part in SKIP for part in path.parts) and path.suffix != ".pyc"
        if wanted and (path.suffix == ".py") == suffix_is_py:
            found.add(path.relative_to(REPO_ROOT).as_posix())
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a clean copy of the project files (an in-tree build/ could leak stale modules)."""
    source = tmp_path_factory.mktemp("source")
    shutil.copy(REPO_ROOT / "pyproject.toml", source)
    shutil.copy(REPO_ROOT / "README.md", source)
    shutil.copy(REPO_ROOT / "LICENSE", source)
    shutil.copytree(PACKAGE, source / "hf_tev", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (built,) = out.glob("hf_tev-*.whl")
    return built


@pytest.mark.wheel
def test_wheel_holds_every_module_and_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    data = package_files(suffix_is_py=False)
    # The declared run-time data files exist in the source and are among the scanned ones.
    declared = {f"hf_tev/training/{name}" for name in hub.PACKAGE_DATA}
    assert declared <= data, declared - data
    assert not data - names, f"data files missing from the wheel: {sorted(data - names)}"
    modules = package_files(suffix_is_py=True)
    assert "hf_tev/training/__init__.py" in modules and "hf_tev/training/hub.py" in modules
    assert {"hf_tev/models/__init__.py", "hf_tev/models/dflash/__init__.py", "hf_tev/models/dflash/auto.py"} <= modules
    assert not modules - names, f"modules missing from the wheel: {sorted(modules - names)}"
    assert "hf_tev/py.typed" in names  # PEP 561: type checkers read the package's annotations
    (license_file,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert zipfile.ZipFile(wheel).read(license_file) == (REPO_ROOT / "LICENSE").read_bytes()


def test_the_distribution_files_agree_with_pyproject():
    """The license the metadata names is the one shipped, the citation names the paper and the version, and the
    changelog has an entry for this version."""
    import yaml

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "Apache-2.0"}
    license_text = (REPO_ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text  # the whole text, not a stub
    citation = yaml.safe_load((REPO_ROOT / "CITATION.cff").read_text())
    assert citation["cff-version"] == "1.2.0" and citation["license"] == "Apache-2.0"
    assert citation["version"] == project["version"]
    assert citation["preferred-citation"]["title"].startswith("Where Draft Trees Lose Target Mass")
    assert {r["title"].split(":")[0] for r in citation["references"]} >= {"DFlash"}
    changelog = (REPO_ROOT / "CHANGELOG.md").read_text()
    assert f"## {project['version']}" in changelog
    torch_floor = next(d for d in project["dependencies"] if d.startswith("torch"))
    assert torch_floor.startswith("torch>=2.6")  # transformers 5.24 disables its torch support below 2.6


@pytest.mark.wheel
def test_card_renders_and_the_shipped_drafter_loads_from_the_installed_wheel(wheel, tmp_path):
    target = tmp_path / "site"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-compile",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    script = textwrap.dedent("""
        import json, sys
        import hf_tev.training.hub as hub

        card = hub.render_model_card(target_model_id="org/target", objective="exit", block_size=4,
                                     target_layer_ids=[1, 2], repo_id="me/drafter", measured_tau={32: 2.5})
        card.save("README.md")
        from hf_tev import DFlashDraftModel
        from hf_tev.packaged import default_drafter

        drafter = default_drafter("HuggingFaceTB/SmolLM2-135M-Instruct")  # shipped inside the package
        layers = DFlashDraftModel.from_pretrained(drafter).config.num_hidden_layers
        print(json.dumps({"hub": hub.__file__, "template": len(hub.load_template()), "drafter": str(drafter),
                          "layers": layers}))
    """)
    work = tmp_path / "elsewhere"  # not the checkout: nothing can be read from the repository
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert Path(report["hub"]).is_relative_to(target), report  # the installed copy, not the checkout
    assert report["template"] > 0
    assert Path(report["drafter"]).is_relative_to(target) and report["layers"] >= 1  # the wheel's own drafter
    card = ModelCard.load(work / "README.md")
    assert card.data.base_model == "org/target" and card.data.library_name == "hf_tev"
    assert 'DFlashDraftModel.from_pretrained("me/drafter")' in card.text and "| budget 32 |" in card.text


# ---------------------------------------------------------------------------------------------
# Card metadata (no wheel)


def render(tmp_path, target_model_id, **kwargs):
    card = render_model_card(
        target_model_id=target_model_id,
        objective=kwargs.pop("objective", "prefix"),
        block_size=16,
        target_layer_ids=[1, 9, 17],
        **kwargs,
    )
    path = tmp_path / "README.md"
    card.save(path)
    return ModelCard.load(path)  # parsed back from the file


def test_card_metadata_parses_back(tmp_path):
    card = render(
        tmp_path,
        "Qwen/Qwen3-4B",
        license="mit",
        datasets=["org/prompts"],
        repo_id="me/drafter",
        knobs={"tree_budget": 32, "ce_weight": 1.0, "tree_weight": 0.1},
        steps=300,
        measured_tau={(64, 0.0): 6.1, "MT-Bench, budget 32, T=1": 4.2},
    )
    data = card.data
    assert data.base_model == "Qwen/Qwen3-4B" and data.library_name == "hf_tev"
    assert data.pipeline_tag is None and data.license == "mit" and data.datasets == ["org/prompts"]
    assert data.tags == ["speculative-decoding", "dflash", "tev", "exittrain", "prefix"]
    for text in (
        "| block size | 16 (drafts 15 tokens per block) |",
        "[1, 9, 17]",
        "| `tree_budget` | 32 |",
        "| optimizer steps | 300 |",
        "| budget 64 | 0.0 | 6.100 |",
        "| MT-Bench, budget 32, T=1 | not given | 4.200 |",
        "total loss = 1.0 * cross-entropy + 0.1 * tree loss",
        "tev_config=hf_tev.TEVConfig()",
        'from_pretrained("Qwen/Qwen3-4B")',
    ):
        assert text in card.text, text
    # Defaults: apache-2.0, no datasets; the objective is a tag once.
    data = render(tmp_path, "Qwen/Qwen3-4B", objective="dflash").data
    assert data.license == "apache-2.0" and data.datasets is None and data.tags.count("dflash") == 1


def test_base_model_only_for_a_hub_id(tmp_path, monkeypatch):
    local = tmp_path / "models" / "target"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    for name, hub_id in (
        ("Qwen/Qwen3-4B", True),
        ("org/name-that-is-not-here", True),
        (str(local), False),
        ("models/target", False),  # exists relative to the working directory
        ("/nowhere/org/target", False),
        ("./target", False),
        ("~/target", False),
        ("tiny-code-target (examples/tiny_kit/target)", False),
        ("a/b/c", False),
        (None, False),
    ):
        assert is_hub_id(name) is hub_id, name
        card = render(tmp_path, name)
        assert (card.data.base_model == name) if hub_id else card.data.base_model is None, name
        assert card.data.library_name == "hf_tev"
    assert "`target` (a local model folder)" in render(tmp_path, str(local)).text
