"""Fixtures and pytest hooks only: tiny random Qwen3 / Llama targets (built by `helpers.make_target`), offline Hub,
one torch thread. Builders live in `helpers.py`."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _offline_hub(tmp_path_factory, monkeypatch):
    # No network at test time, and nothing written to the user's cache.
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def pytest_configure(config):
    # One thread: tiny models gain nothing from more, and on a shared 2-core machine a second OpenMP thread
    # waiting on a busy core makes every small op ~100x slower.
    torch.set_num_threads(1)


# `helpers` is imported inside the fixtures, not here: it imports transformers (and so huggingface_hub, which
# reads HF_HOME and HF_HUB_OFFLINE once, at import) and this file is loaded before `_offline_hub` sets them.


@pytest.fixture
def qwen3_target():
    import helpers

    return helpers.make_target("qwen3")


@pytest.fixture
def llama_target():
    import helpers

    return helpers.make_target("llama")
