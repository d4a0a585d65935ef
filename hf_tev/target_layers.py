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

Layers whose state is a running summary of the sequence cannot take a mask: one pass over a tree would feed the
nodes of all branches through one state in order. The gated-DeltaNet linear-attention layers of Qwen3.5,
Qwen3.5-MoE and Qwen3-Next (`LINEAR_ATTENTION_FAMILIES`) get a state per tree node instead
(`hf_tev.generation.hybrid`, docs/design.md#hybrid-targets); their cache layers become `TreeStateLayer`s, which
keep the states of the last tree pass's nodes until the accepted path is chosen. Other recurrent layers (Mamba,
convolution and hybrid layer types, linear attention of other families) are refused by name, as are layer types
the tree mask does not model.
"""

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

TREE_LAYER_TYPES = ("full_attention", "sliding_attention")  # layer types the tree pass masks exactly
RECURRENT_LAYER_TYPES = ("linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba")  # one running state
# text model types whose `linear_attention` layers (gated DeltaNet with its causal conv) get per-node states
LINEAR_ATTENTION_FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")


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
    if recurrent and (recurrent != ["linear_attention"] or name not in LINEAR_ATTENTION_FAMILIES):
        raise ValueError(
            f"hf_tev's tree decoding cannot decode {name}: its {recurrent} layers keep one running state that "
            "every token updates in order, so the nodes of different tree branches cannot each see only their own "
            "ancestors in one target pass. hf_tev gives every tree node its own state only for the gated-DeltaNet "
            f"linear attention of Qwen3.5 and Qwen3-Next ({', '.join(LINEAR_ATTENTION_FAMILIES)}). Use plain "
            "generate for this target."
        )
    other = sorted(set(types) - set(TREE_LAYER_TYPES) - set(recurrent))
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
    every sliding-window layer (holding the same tokens) and a `TreeStateLayer` for every linear-attention layer
    (holding the same states); refuses a sliding layer whose window already dropped tokens (a plain `generate`
    cache of a context longer than the window)."""
    cache = DynamicCache(config=model.config) if cache is None else cache
    layers = []
    for index, layer in enumerate(cache.layers):
        if type(layer) is LinearAttentionLayer:
            layer = TreeStateLayer.of(layer)
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
            full = BufferLayer()
            if held:
                full.update(layer.keys, layer.values)
            layer = full
        elif type(layer) is DynamicLayer:
            layer = BufferLayer.of(layer)
        layers.append(layer)
    cache.layers = layers
    return cache


class BufferLayer(DynamicLayer):
    """A full-length cache layer whose keys and values live in storage that stays put across forwards.

    transformers' `DynamicLayer` concatenates every update onto a new tensor, so each tree pass (and each plain
    step) allocates and copies the whole layer: on a large target at a long context, gigabytes per cycle and two
    caches at the peak. Here the keys and values are views of the first `length` positions of a buffer that
    grows only by doubling; an update writes its rows after them, the commit moves the accepted path inside the
    views (`generation.cache.commit_accepted_path`) and a crop narrows them. What reads `keys` / `values` sees
    exactly the tensors a `DynamicLayer` holds. Anything that replaces them (a batch row selection, a reorder)
    is taken into a new buffer at the next update.
    """

    HEADROOM = 256  # positions a new buffer holds beyond what it must (the next cycles' trees and tokens)

    @classmethod
    def of(cls, layer: DynamicLayer) -> "BufferLayer":
        """`layer`'s tokens in a `BufferLayer` (nothing is copied until its next update)."""
        buffered = cls()
        if layer.is_initialized:
            buffered.lazy_initialization(layer.keys, layer.values)
            buffered.keys, buffered.values = layer.keys, layer.values
        return buffered

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.key_buffer = self.value_buffer = None
        self.views = None  # the `(keys, values)` views of the buffers this layer handed out last

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        end = length + key_states.shape[-2]
        if not self.in_buffer() or end > self.key_buffer.shape[-2]:
            self._rebuffer(key_states, value_states, length, end)
        self.key_buffer[..., length:end, :].copy_(key_states)
        self.value_buffer[..., length:end, :].copy_(value_states)
        self.narrow_to(end)
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' crop (5.24: a negative count of positions to remove; 0 removes nothing; a positive one is
        refused), as a narrower view of the buffers."""
        if tokens_to_remove < 0 and self.is_initialized and self.in_buffer():
            self.narrow_to(max(self.get_seq_length() - abs(tokens_to_remove), 0))
            return
        super().crop(tokens_to_remove)

    def narrow_to(self, length: int) -> None:
        """`keys` / `values` become the buffers' first `length` positions (a crop, or the end of an update)."""
        self.keys, self.values = self.key_buffer.narrow(-2, 0, length), self.value_buffer.narrow(-2, 0, length)
        self.views = (self.keys, self.values)

    def in_buffer(self) -> bool:
        """Whether `keys` / `values` are still the views this layer handed out (anything that replaced them, a row
        selection, a reorder, transformers' own crop, gave new tensors): one identity check per update, which
        runs for every layer of every forward."""
        return self.views is not None and self.keys is self.views[0] and self.values is self.views[1]

    def _rebuffer(self, key_states, value_states, length: int, end: int) -> None:
        """New storage for `end` positions and as many again as it had (at least HEADROOM), holding the tokens: the
        capacity about doubles, so a call reallocates a logarithmic number of times, not once per cycle."""
        old = 0 if self.key_buffer is None else self.key_buffer.shape[-2]
        capacity = end + max(old, self.HEADROOM)
        buffers = []
        for held, new in ((self.keys, key_states), (self.values, value_states)):
            buffer = new.new_empty((*new.shape[:-2], capacity, new.shape[-1]))
            if length:
                buffer[..., :length, :].copy_(held)
            buffers.append(buffer)
        self.key_buffer, self.value_buffer = buffers


WINDOW_SLOT_DIMS = (1, 2, 2, 2, 1)  # the node dimension of each piece of a `TreeStateLayer` window


class TreeStateLayer(LinearAttentionLayer):
    """A linear-attention layer's cache (a conv window and a recurrent state per row) that also keeps what the
    last tree pass computed per node, so that the pass is committed like the attention layers' keys.

    The states themselves are not kept per node: `open_window` stores, per node, its conv input and the pieces of
    the gated delta rule it added (`hf_tev.generation.hybrid.tree_gated_delta_rule`): its normalised key `[H, Dk]`,
    its corrected value `[H, Dv]` and the decay summed along its path `[H]`, beside the committed states before the
    pass. The recurrent state after a path is the committed state decayed along the path plus the path's decayed
    key-value products, and its conv window the path's last inputs (after the committed ones). The commit does to
    the window what it does to the attention layers' tree columns: each row's accepted path moves to the front
    (`select_window`) and the rest is cropped (`crop`); a later crop goes back along the kept path (a stop inside
    an accepted block). After each of these the layer's own states (`conv_states[0]`, `recurrent_states[0]`, what
    the model's layers read) are those after the window's slots taken as a path: after the commit, the accepted
    path's last node's. `settle` drops the window (any other update of the states does too).
    """

    def __init__(self, number_of_states: int = 1, **kwargs):
        super().__init__(number_of_states, **kwargs)
        self.window = None  # (inputs, keys, values, decays, weights): see `open_window`
        self.committed = None  # (conv, recurrent) before the window

    @classmethod
    def of(cls, layer: LinearAttentionLayer) -> "TreeStateLayer":
        """`layer`'s states (the same tensors) in a `TreeStateLayer`; a conv state recorded past the kernel size
        (transformers' chain rollback) is cut back to it."""
        if layer.number_of_states != 1:
            raise ValueError(f"a linear-attention cache layer with {layer.number_of_states} states is not supported")
        tree_layer = cls.__new__(cls)
        tree_layer.__dict__.update({k: dict(v) if isinstance(v, dict) else v for k, v in layer.__dict__.items()})
        tree_layer.window = tree_layer.committed = None
        if tree_layer.record_past:
            if tree_layer.is_conv_states_initialized[0]:
                tree_layer.conv_states[0] = tree_layer.conv_states[0][..., -tree_layer.conv_kernel_size[0] :]
            tree_layer.record_past = False
        return tree_layer

    def open_window(self, inputs, keys, values, decays) -> None:
        """Keep a tree pass's per-node pieces (node i in slot i) after the current states: `inputs` `[R, N, C]`
        (conv inputs), `keys` `[R, H, N, Dk]`, `values` `[R, H, N, Dv]` (corrected values) and `decays` `[R, H, N]`
        (summed along each node's path). Weights `[R, N]` mark repeated path slots (0) once a path is selected."""
        self.settle()
        weights = torch.ones(inputs.shape[:2], dtype=decays.dtype, device=decays.device)
        self.committed = (self.conv_states[0], self.recurrent_states[0])
        self.window = (inputs, keys, values, decays, weights)
        self.take_window()

    def select_window(self, path: torch.Tensor) -> None:
        """Move each row's accepted path to the front of the window: `path` `[R, K]` holds node indices, padded by
        repeating a row's last node (a repeat counts once)."""
        kept = path.shape[1]
        pieces = []
        for piece, dim in zip(self.window, WINDOW_SLOT_DIMS, strict=True):
            shape = [path.shape[0]] + [1] * (piece.dim() - 1)
            shape[dim] = kept
            index = path.view(shape).expand(*piece.shape[:dim], kept, *piece.shape[dim + 1 :])
            rest = piece.narrow(dim, kept, piece.shape[dim] - kept)  # cropped next, as the attention layers' rest
            pieces.append(torch.cat([piece.gather(dim, index), rest], dim))
        pieces[-1][:, 1:kept] *= (path[:, 1:] != path[:, :-1]).to(pieces[-1].dtype)  # the weights: repeats count 0
        self.window = tuple(pieces)
        self.take_window()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the window's last `-tokens_to_remove` slots, as an attention layer drops its last tokens."""
        remove = -tokens_to_remove
        if remove < 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if remove == 0:
            return
        kept = 0 if self.window is None else self.window[0].shape[1]
        if remove > kept:
            raise RuntimeError(
                f"A linear-attention layer cannot remove {remove} tokens: it keeps the per-token states of the "
                f"last {kept} tokens only (the last tree pass's window)."
            )
        self.window = tuple(
            piece.narrow(dim, 0, kept - remove) for piece, dim in zip(self.window, WINDOW_SLOT_DIMS, strict=True)
        )
        self.take_window()

    def take_window(self) -> None:
        """The layer's states after the committed ones and the window's slots, taken as one path."""
        (conv, recurrent), (inputs, keys, values, decays, weights) = self.committed, self.window
        if inputs.shape[1] == 0:
            self.conv_states[0], self.recurrent_states[0] = conv, recurrent
            return
        # the conv window: the last `kernel` inputs of the committed ones and the path (repeats excluded)
        kernel = conv.shape[-1]
        lengths = weights.sum(dim=1).long()  # [R]
        sequence = torch.cat([conv.transpose(1, 2), inputs.to(conv.dtype)], dim=1)  # [R, kernel + W, C]
        index = (lengths[:, None] + torch.arange(kernel, device=lengths.device))[..., None]
        self.conv_states[0] = sequence.gather(1, index.expand(-1, -1, sequence.shape[-1])).transpose(1, 2).contiguous()
        # the recurrent state: the committed one decayed along the path, plus the path's decayed key-value products
        last = decays[:, :, -1:]  # [R, H, 1]: repeats share the last node's; before a path is chosen, any slots
        scale = (last - decays).clamp(max=0.0).exp() * weights[:, None, :]  # [R, H, W]
        state = recurrent.to(keys.dtype) * last.exp()[..., None] + (keys * scale[..., None]).transpose(-1, -2) @ values
        self.recurrent_states[0] = state.to(recurrent.dtype)

    def settle(self) -> None:
        """Keep the states alone, dropping the window (a returned cache; before another update of the states)."""
        self.window = self.committed = None

    def update_conv_state(self, *args, **kwargs) -> torch.Tensor:
        self.settle()
        return super().update_conv_state(*args, **kwargs)

    def update_recurrent_state(self, *args, **kwargs) -> torch.Tensor:
        self.settle()
        return super().update_recurrent_state(*args, **kwargs)

    def reset(self) -> None:
        self.settle()
        super().reset()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only rows `indices` (a batch's rows that decode on)."""
        self.settle()
        for states in (self.conv_states, self.recurrent_states):
            if states[0] is not None:
                states[0] = states[0][indices]


def tree_state_bytes(model) -> int:
    """Bytes a tree node keeps in the linear-attention layers' windows until the commit, over all layers
    (`TreeStateLayer.open_window`): its conv input (`conv_dim` in the model's dtype), its key and corrected value
    (`linear_num_value_heads x (linear_key_head_dim + linear_value_head_dim)`, float32), its path decay and weight;
    0 for a target without linear-attention layers."""
    config = model.config.get_text_config()
    layers = layer_types(model).count("linear_attention")
    if not layers:
        return 0
    heads, key_dim, value_dim = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    conv_dim = 2 * config.linear_num_key_heads * key_dim + heads * value_dim
    return layers * (conv_dim * model.dtype.itemsize + 4 * (heads * (key_dim + value_dim + 1) + 1))


def settle_tree_states(cache: DynamicCache) -> None:
    """Every `TreeStateLayer` of `cache` keeps its state alone (the cache a call returns: no tree-pass window)."""
    for layer in cache.layers:
        if isinstance(layer, TreeStateLayer):
            layer.settle()
