"""The GPU window's carry (docs/bench.md#on-a-gpu): the requirements it installs are hf_tev's own without torch, the
device scripts parse, and, where `bash benchmarks/gpu_carry.sh` has filled gpu_wheels/, a dry run installs them
with no index into a fresh environment that has only torch and numpy (what the device's image brings) and imports
transformers 5.24 and hf_tev from it."""

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / "gpu_wheels"
REQUIREMENTS = ROOT / "benchmarks" / "gpu_requirements.txt"


def carried_requirements() -> list[Requirement]:
    lines = [line.split("#")[0].strip() for line in REQUIREMENTS.read_text().splitlines()]
    return [Requirement(line) for line in lines if line]


def test_the_carried_requirements_are_hf_tevs_dependencies_without_torch():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = {Requirement(text).name: Requirement(text) for text in declared}
    carried = {requirement.name: requirement for requirement in carried_requirements()}
    assert set(carried) == set(declared) - {"torch"}
    for name, requirement in carried.items():  # every carried spec lies inside hf_tev's own
        pinned = [spec.version for spec in requirement.specifier if spec.operator == "=="]
        if pinned:
            assert declared[name].specifier.contains(pinned[0]), name


@pytest.mark.parametrize("script", ["gpu_carry.sh", "gpu_check.sh"])
def test_the_device_scripts_parse(script):
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / script)], check=True)


def distribution_closure(names: list[str]) -> set[str]:
    """Installed distributions `names` need, theirs included (markers and extras ignored: a superset)."""
    seen, todo = set(), list(names)
    while todo:
        name = Requirement(todo.pop()).name.lower()
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if name not in seen:
            seen.add(name)
            todo.extend(r for r in distribution.requires or [] if "extra ==" not in r)
    return seen


def link_image(names: list[str], image: Path) -> None:
    """`image`: symlinks to this machine's installed `names` (and what they need), a stand-in for the device
    image's site-packages."""
    image.mkdir()
    for name in distribution_closure(names):
        distribution = importlib.metadata.distribution(name)
        for top in {file.parts[0] for file in distribution.files or [] if file.parts[0] != ".."}:
            source = Path(distribution.locate_file(top))
            if source.exists() and not (image / top).exists():
                (image / top).symlink_to(source)


@pytest.mark.wheel
@pytest.mark.skipif(not WHEELS.is_dir(), reason="no gpu_wheels/: `bash benchmarks/gpu_carry.sh` downloads it")
@pytest.mark.skipif(sys.version_info < (3, 11), reason="transformers 5.24 needs Python >= 3.11")
def test_the_carry_installs_with_no_index_over_an_image_with_only_torch(tmp_path):
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True)
    python = tmp_path / "venv" / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    # the venv's bundled setuptools (older than torch asks for) would shadow the image's
    subprocess.run([python, "-m", "pip", "uninstall", "--quiet", "--yes", "setuptools"], check=True)
    link_image(["torch", "numpy"], tmp_path / "image")
    (Path(site) / "image.pth").write_text(str(tmp_path / "image") + "\n")
    # no pip configuration and no PIP_* variable: the carried folder is the only source, as on the device
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    env |= {"PIP_CONFIG_FILE": os.devnull, "PYTHONPATH": str(ROOT)}
    install = subprocess.run(
        [python, "-m", "pip", "install", "--no-index", "--find-links", str(WHEELS), "-r", str(REQUIREMENTS)],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr
    check = "import transformers, hf_tev, torch; print(transformers.__version__, transformers.__file__)"
    imported = subprocess.run([python, "-c", check], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert imported.returncode == 0, imported.stderr
    version, location = imported.stdout.split()
    assert version == "5.24.0" and location.startswith(site), imported.stdout
