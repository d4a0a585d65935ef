"""What the tree pass needs from each layer type of the target: its mask, its cache, or a refusal.

Targets with mixed layer types (Gemma 2/3/4: sliding-window layers next to full-attention ones; Qwen3 with
`use_sliding_window`) take one attention mask per layer type, `{"full_attention": m, "sliding_attention": m_sw}`
(transformers 5.24 passes such a mapping through unchanged). The tree pass gives
 - full-attention layers the tree mask: a node sees every committed token and its ancestors (itself included);
 - sliding-window layers the tree mask intersected with the window of the node's own position: a node at depth
   `d` sits at cache index `past + d` of its own path, and sees a committed token or an ancestor only when that
   key's index on the path is less than `sliding_window` behind it, exactly transformers' sliding overlay
   (`kv_idx > q_idx - sliding_window`) for the sequence committed tokens + path.

The cache: every layer keeps a full-length `DynamicLayer`, and the window of sliding layers is enforced by the
mask alone. transformers' own `DynamicSlidingWindowLayer` keeps only the last `sliding_window - 1` positions after
each forward; a tree pass appends all N nodes, so the nodes of a big tree would push committed tokens that the next
tree still needs out of that layer, and the kept path's rows would have to be moved inside a window-sized ring.
With full-length layers the accepted path is committed by the one index_select every layer already gets, and
transformers' own masks (prefill, plain steps) apply the window by position on a full-length layer just as well.
The price is memory: a sliding layer holds the whole context instead of the window (the measurement that chose
this: docs/families.md#sliding-windows).

Layers whose state is a running summary of the sequence (linear attention / recurrent / convolution layers:
Qwen3.5, Qwen3-Next, Mamba hybrids) cannot branch: one pass over a tree would feed the nodes of all branches
through one state in order. They are refused by name, as are layer types the tree mask does not model.
"""

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

TREE_LAYER_TYPES = ("full_attention", "sliding_attention")  # layer types the tree pass masks exactly
RECURRENT_LAYER_TYPES = ("linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba")  # one running state


def layer_types(model) -> list[str]:
    """The target's decoder layer types. Configs that do not list them have one type for every layer: sliding
    attention when they set a `sliding_window` (Mistral, Mixtral), else full attention (Llama)."""
    text_config = model.config.get_text_config()
    types = getattr(text_config, "layer_types", None)
    if types:
        return list(types)
    uniform = "full_attention" if getattr(text_config, "sliding_window", None) is None else "sliding_attention"
    return [uniform] * text_config.num_hidden_layers


def sliding_window(model) -> int | None:
    """The window of the target's sliding-window layers, None when it has none."""
    if "sliding_attention" not in layer_types(model):
        return None
    return model.config.get_text_config().sliding_window


def check_tree_layers(model) -> None:
    """Raise ValueError, naming the layer types and why, for a target whose layers cannot take a tree pass."""
    text_config = model.config.get_text_config()
    name = getattr(text_config, "model_type", type(model).__name__)
    types = layer_types(model)
    recurrent = sorted({t for t in types if t in RECURRENT_LAYER_TYPES})
    if recurrent:
        raise ValueError(
            f"hf_tev's tree decoding cannot decode {name}: its {recurrent} layers (linear attention / recurrent "
            "state, as in Qwen3.5 and Qwen3-Next) keep one running state that every token updates in order, so "
            "the nodes of different tree branches cannot each see only their own ancestors in one target pass, "
            "and a rejected branch cannot be taken back out of the state. Use plain generate for this target."
        )
    other = sorted(set(types) - set(TREE_LAYER_TYPES))
    if other:
        raise ValueError(
            f"hf_tev's tree decoding supports targets whose layers are {list(TREE_LAYER_TYPES)}; {name} has "
            f"{other} layers, whose attention pattern the tree mask does not model."
        )
    if getattr(text_config, "use_bidirectional_attention", None) == "all":
        raise ValueError(f"{name} with use_bidirectional_attention='all' is not a causal language model to decode.")
    window = sliding_window(model)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{name} has sliding_attention layers but sliding_window={window!r} (an int >= 1 is needed)")


def tree_attention_masks(model, depths: torch.Tensor, mask: torch.Tensor | None):
    """The tree pass's mask per layer type: `mask` itself for a target without sliding layers,
    `{"full_attention": mask, "sliding_attention": mask within the window}` for a target that lists its layer
    types, and the windowed mask alone for one whose every layer slides without listing them (Mistral: it takes
    one mask).

    Args:
        depths (`torch.LongTensor` of shape `(N,)`): each tree node's depth (root 0).
        mask (`torch.Tensor` of shape `(1, 1, N, past + N)`, *optional*): the additive float tree mask (0 visible);
            None for a root-only step with nothing hidden, where the target builds its own masks.
    """
    window = sliding_window(model)
    if mask is None or window is None:
        return mask
    past = mask.shape[-1] - depths.shape[0]
    query = past + depths.to(mask.device)  # [N] each node's index on its own path
    keys = torch.cat([torch.arange(past, device=mask.device), query])  # [past + N] committed tokens, then the nodes
    outside = query[:, None] - keys[None, :] >= window  # [N, past + N]
    windowed = mask.masked_fill(outside, torch.finfo(mask.dtype).min)
    if not getattr(model.config.get_text_config(), "layer_types", None):
        return windowed
    return {"full_attention": mask, "sliding_attention": windowed}


def full_length_cache(model, cache: DynamicCache | None = None) -> DynamicCache:
    """The target cache of a tree-decoding call: `cache` (None: a new one) with a full-length `DynamicLayer` for
    every sliding-window layer (holding the same tokens); refuses a sliding layer whose window already dropped
    tokens (a plain `generate` cache of a context longer than the window)."""
    cache = DynamicCache(config=model.config) if cache is None else cache
    layers = []
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, DynamicSlidingWindowLayer):
            held = layer.keys.shape[-2] if layer.is_initialized else 0
            if held < layer.cumulative_length:
                raise ValueError(
                    f"The cache's layer {index} is a sliding-window layer that dropped "
                    f"{layer.cumulative_length - held} of its tokens (it keeps only the last window): hf_tev's tree "
                    "decoding needs every layer at "
                    "full length (the window is applied by the mask). Continue from a cache returned by tree "
                    "decoding, or start without a cache."
                )
            full = DynamicLayer()
            if held:
                full.update(layer.keys, layer.values)
            layer = full
        layers.append(layer)
    cache.layers = layers
    return cache
