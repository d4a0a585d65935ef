"""Shared fixtures: tiny random Qwen3 / Llama targets, offline Hub, deterministic torch."""

import pytest
import torch
from helpers import make_target  # noqa: F401  (re-exported until no test imports it from here)


@pytest.fixture(autouse=True)
def _offline_hub(tmp_path_factory, monkeypatch):
    # No network at test time, and nothing written to the user's cache.
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def pytest_configure(config):
    # One thread: tiny models gain nothing from more, and on a shared 2-core machine a second OpenMP thread
    # waiting on a busy core makes every small op ~100x slower.
    torch.set_num_threads(1)


@pytest.fixture
def qwen3_target():
    return make_target("qwen3")


@pytest.fixture
def llama_target():
    return make_target("llama")
