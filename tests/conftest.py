"""Shared fixtures: tiny random Qwen3 / Llama targets, offline Hub, deterministic torch."""

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


def make_target(
    arch: str = "qwen3",
    vocab_size: int = 96,
    hidden_size: int = 64,
    num_layers: int = 4,
    attn_implementation: str = "sdpa",
    seed: int = 0,
    dtype=torch.float32,
):
    """A tiny random causal LM of a real transformers architecture ("qwen3" or "llama")."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        raise ValueError(arch)
    # Random init gives near-uniform logits; sharpen them so greedy paths and acceptance are meaningful.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.set_attn_implementation(attn_implementation)
    return model.to(dtype).eval()


@pytest.fixture
def qwen3_target():
    return make_target("qwen3")


@pytest.fixture
def llama_target():
    return make_target("llama")
