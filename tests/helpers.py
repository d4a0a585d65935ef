"""Builders the test modules share: tiny targets and drafters, oracles, statistics, training rows and arguments.

Test modules import from here (never from one another); fixtures that wrap these live in `conftest.py`.
"""

# --- targets, drafters, oracles and statistics (generation and model tests) ---

import torch


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


# --- training rows, arguments and CLI runs (training tests) ---
