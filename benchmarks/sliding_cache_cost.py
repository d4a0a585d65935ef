"""The cost of hf_tev's cache choice for sliding-window targets (docs/families.md#sliding-windows): KV bytes and
tree-pass time with full-length layers windowed by the mask, against the sliding layers' own cache, on a tiny
random Gemma 3.

    python benchmarks/sliding_cache_cost.py
"""

import time

import torch
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig

from hf_tev.target_layers import full_length_cache, tree_attention_masks
from hf_tev.tree import build_tree, tree_attention_mask, tree_position_ids

WINDOW, VOCAB, REPEATS = 128, 512, 7


def kv_bytes(cache) -> int:
    return sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in cache.layers if layer.keys is not None)


def tree_pass_seconds(model, tree, prompt, full_length: bool) -> tuple[float, int]:
    """Best of REPEATS tree passes after `prompt`, and the cache's KV bytes after the prompt.

    `full_length`: hf_tev's cache (every layer full length, the window applied by the mask); otherwise the sliding
    layers' own cache (window - 1 rows kept) with transformers' causal masks: what attending over fewer keys would
    save (not exact for a tree; timed only for its cost)."""
    past = prompt.shape[1]
    mask, positions = tree_attention_mask(tree, past, torch.float32), tree_position_ids(tree, past)
    best, size = float("inf"), 0
    for _ in range(REPEATS):
        cache = full_length_cache(model) if full_length else DynamicCache(config=model.config)
        model(prompt, cache=cache)
        size = kv_bytes(cache)
        masks = tree_attention_masks(model, tree.depths, mask) if full_length else None
        start = time.perf_counter()
        model(tree.tokens[None], position_ids=positions, cache=cache, attention_mask=masks, logits_to_keep=0)
        best = min(best, time.perf_counter() - start)
    return best, size


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = Gemma3TextConfig(  # default layer types: 5 sliding : 1 full
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=WINDOW,
        max_position_embeddings=8192,
    )
    model = Gemma3ForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    torch.manual_seed(1)
    tree = build_tree(torch.log_softmax(torch.randn(8, VOCAB) * 3, -1), 32, torch.tensor(7))
    with torch.no_grad():
        for context in (512, 2048):
            prompt = torch.randint(3, VOCAB, (1, context))
            full_s, full_bytes = tree_pass_seconds(model, tree, prompt, full_length=True)
            sliding_s, sliding_bytes = tree_pass_seconds(model, tree, prompt, full_length=False)
            print(
                f"context {context}: KV cache full-length {full_bytes / 2**20:.2f} MiB vs sliding "
                f"{sliding_bytes / 2**20:.2f} MiB; tree pass ({tree.num_nodes} nodes) full-length + window mask "
                f"{full_s * 1e3:.1f} ms vs sliding cache {sliding_s * 1e3:.1f} ms"
            )


if __name__ == "__main__":
    main()
