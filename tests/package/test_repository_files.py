"""The repository holds every weight and tokenizer file once (issue "Models get rooms"): no two tracked weight or
tokenizer files have the same content, and no training run's weights or optimizer state are committed."""

import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY_NAMES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model")
HEAVY_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".npy")


def tracked_files() -> list[tuple[str, str]]:
    """(blob id, path) of every tracked file, or a skip outside a git checkout (an installed wheel)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    listing = subprocess.run(["git", "ls-files", "-s"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [(line.split()[1], line.split("\t", 1)[1]) for line in listing.splitlines()]


def is_heavy(path: str) -> bool:
    name = Path(path).name
    return name in HEAVY_NAMES or name.endswith(HEAVY_SUFFIXES)


def test_no_weight_or_tokenizer_file_is_committed_twice():
    paths = defaultdict(list)
    for blob, path in tracked_files():
        if is_heavy(path):
            paths[blob].append(path)
    copies = [sorted(found) for found in paths.values() if len(found) > 1]
    assert not copies, f"the same file is committed more than once: {copies}"


def test_no_optimizer_state_or_checkpoint_is_committed():
    committed = [path for _, path in tracked_files() if "/checkpoint-" in path or Path(path).name == "optimizer.pt"]
    assert not committed, f"training checkpoints are committed: {committed[:5]}"


def test_examples_hold_no_weights_or_tokenizers():
    """examples/ is for what a user copies (issue "Models get rooms"): the shipped models live in their packages and
    a study's models with the study (research/)."""
    heavy = [path for _, path in tracked_files() if path.startswith("examples/") and is_heavy(path)]
    assert not heavy, f"weights or tokenizers in examples/: {heavy[:5]}"
