"""Cache surgery and the tree pass's inputs: keeping the accepted path, the masks of one prompt and of a batch.

One prompt's cache holds its committed tokens in order; a batch's rows share one cache layout whose columns a
row may not see (its left padding, and holes where it accepted a shorter path than the cycle's longest), hidden
by its mask (docs/design.md#batches). Both kinds of input have the same interface, so the decoding cycle is one
for every batch size: `__call__` (tokens, mask, position ids of the rows' trees), `commit` (the accepted
lengths), `select` (rows that stay) and `compact` (drop columns no row needs).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, StaticCache

from ..target_layers import BufferLayer, TreeStateLayer, sliding_window, tree_attention_masks
from ..tree import DraftTree, TreeInputs, host_long, to_device
from .hybrid import tree_pass_masks


class PromptTreeInputs:
    """One prompt's tree-pass inputs: the mask in buffers reused across cycles (`hf_tev.tree.TreeInputs`), per
    layer type for a target with sliding-window layers (`hf_tev.target_layers`). The root alone with nothing
    hidden takes the target's plain decoding path (no mask).

    Args:
        max_past (`int`): the longest cache the call reaches before a tree pass.
        hidden_columns (`torch.LongTensor`, *optional*): committed columns no node may see (left padding).
    """

    def __init__(self, model, max_past: int, device, hidden_columns=None):
        self.model = model
        self.buffers = TreeInputs(max_past, model.dtype, device, hidden_columns)
        self.windowed = sliding_window(model) is not None  # read once: only then are masks per layer type made

    def __call__(self, trees: list[DraftTree], past: int, first_positions: list[int]):
        """`(tokens [1, N], mask, position_ids [1, N])` of the one tree."""
        (tree,) = trees
        mask, positions = self.buffers(tree, past, first_positions[0])
        masks = tree_attention_masks(self.model, tree.depths, mask) if self.windowed else mask
        return tree.tokens[None], tree_pass_masks(self.model, trees, masks, tree.num_nodes), positions

    def cache_length(self, cache: DynamicCache) -> int:
        """The committed length (the cache's own count)."""
        return cache.get_seq_length()

    def commit(self, lengths: list[int]) -> None:
        """Nothing to track: the cache keeps exactly the accepted path."""

    def select(self, cache: DynamicCache, keep: list[int]) -> None:
        """Never needed: the call ends when its one row stops."""

    def compact(self, cache: DynamicCache) -> bool:
        return False


class BatchTreeInputs:
    """The batch's tree-pass inputs, and which committed cache columns each row must not see.

    All rows share one cache layout `[R, heads, C, head_dim]`. A row does not see its left padding, nor the
    holes it keeps when it accepts a shorter path than the longest of the cycle (`commit_accepted_path` crops
    the window to the longest path); `hidden` `[R, C]` marks those columns. A row sees its own committed tokens
    at their own position ids, so its attention is the one it would have alone (the hidden columns add exact
    zeros). `compact` removes holes once they are a large share of the cache; `select` drops finished rows.

    The mask and `hidden` live in buffers that stay put across cycles (allocated again only when a tree or the
    cache outgrows them, or rows leave): each cycle writes the columns committed since the last one and its own
    tree block, and hands out a view, instead of a new `[R, 1, N, past + N]` mask that grows with the context.

    Args:
        hidden (`torch.BoolTensor` of shape `(R, C)`): committed columns each row must not see.
        dtype (`torch.dtype`): the target's floating dtype (the additive mask's).
        model (*optional*): the target, whose linear-attention layers read the trees' structure
            (`hybrid.tree_pass_masks`).
        max_length (`int`, *optional*): the call's longest sequence, which sizes the buffers once.
    """

    def __init__(self, hidden: torch.Tensor, dtype: torch.dtype, model=None, max_length: int = 0):
        self.dtype, self.min, self.model, self.max_length = dtype, torch.finfo(dtype).min, model, max_length
        self.visible = (~hidden).sum(dim=1).tolist()  # each row's visible columns, kept on the host (one read)
        self._set_hidden(hidden)

    def _set_hidden(self, hidden: torch.Tensor) -> None:
        """`hidden` into a new buffer with room for the call's columns; the mask is rebuilt from it."""
        capacity = max(hidden.shape[1], self.max_length) + 64
        self.hidden_buffer = hidden.new_zeros(hidden.shape[0], capacity)
        self.hidden_buffer[:, : hidden.shape[1]] = hidden
        self.hidden = self.hidden_buffer.narrow(1, 0, hidden.shape[1])
        self.mask_buffer, self.synced = None, 0  # `synced`: leading columns written from `hidden`

    def _mask(self, past: int, nodes: int) -> torch.Tensor:
        """The mask buffer `[R, 1, rows, columns]` with columns `0 .. past` written from `hidden` for every
        query row (only those committed since the last cycle are written now)."""
        buffer = self.mask_buffer
        if buffer is None or nodes > buffer.shape[2] or past + nodes > buffer.shape[3]:
            rows = nodes if buffer is None else max(nodes, buffer.shape[2])
            columns = max(past, self.max_length, self.hidden_buffer.shape[1]) + rows
            buffer = torch.zeros(self.hidden.shape[0], 1, rows, columns, dtype=self.dtype, device=self.hidden.device)
            self.mask_buffer, self.synced = buffer, 0
        if past > self.synced:
            new = self.hidden[:, None, None, self.synced : past]
            buffer[..., self.synced : past] = torch.where(new, self.min, 0.0).to(self.dtype)
            self.synced = past
        return buffer

    def __call__(self, trees: list[DraftTree], past: int, first_positions: list[int]):
        """`(tokens [R, N], mask [R, 1, N, past + N], position_ids [R, N])` for the rows' trees padded to the
        largest node count N (the mask a view of the buffer, valid until the next call). A padding node sees
        only itself and no node sees it; its outputs are ignored."""
        rows, nodes, device = len(trees), max(tree.num_nodes for tree in trees), self.hidden.device
        tokens = torch.zeros(rows, nodes, dtype=torch.long, device=device)
        depths = torch.zeros(rows, nodes, dtype=torch.long, device=device)
        visible = torch.eye(nodes, dtype=torch.bool, device=device).repeat(rows, 1, 1)  # [R, N, N]
        for i, tree in enumerate(trees):
            n = tree.num_nodes
            tokens[i, :n], depths[i, :n] = tree.tokens, tree.depths
            visible[i, :n, :n] = tree.visibility
        buffer = self._mask(past, nodes)
        block = buffer[:, 0, :nodes, past : past + nodes]  # [R, N, N]
        block.fill_(self.min).masked_fill_(visible, 0.0)
        mask = buffer[:, :, :nodes, : past + nodes]
        positions = depths + to_device(host_long(first_positions), device)[:, None]
        if self.model is not None:
            mask = tree_pass_masks(self.model, trees, mask, nodes)
        return tokens, mask, positions

    def cache_length(self, cache: DynamicCache) -> int:
        """The committed length (the cache's own count)."""
        return cache.get_seq_length()

    def commit(self, lengths: list[int]) -> None:
        """The cache grew by the longest accepted path; row i keeps `lengths[i]` of those columns."""
        start, kept = self.hidden.shape[1], max(lengths)
        if start + kept > self.hidden_buffer.shape[1]:
            self._set_hidden(self.hidden)
        window = torch.arange(kept, device=self.hidden.device)
        holes = window[None] >= to_device(host_long(lengths), self.hidden.device)[:, None]  # [R, K]
        self.hidden_buffer[:, start : start + kept] = holes
        self.hidden = self.hidden_buffer.narrow(1, 0, start + kept)
        self.visible = [count + length for count, length in zip(self.visible, lengths, strict=True)]

    def select(self, cache: DynamicCache, keep: list[int]) -> None:
        """Keep only rows `keep` (in that order) of the cache and the mask state."""
        self._set_hidden(select_rows(cache, self.hidden, keep))
        self.visible = [self.visible[i] for i in keep]

    def compact(self, cache: DynamicCache, min_share: float = 0.25) -> bool:
        """`compact_columns` of the cache and the mask state; whether it compacted."""
        hidden = compact_columns(cache, self.hidden, min_share, max(self.visible, default=0))
        if hidden is None:
            return False
        self._set_hidden(hidden)
        return True


def select_rows(cache: DynamicCache, hidden: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """Keep only rows `keep` (in that order) of a batch cache; returns their `hidden` `[len(keep), C]`."""
    index = to_device(host_long(keep), hidden.device)
    cache.batch_select_indices(index)
    return hidden[index]


def compact_columns(
    cache: DynamicCache, hidden: torch.Tensor, min_share: float = 0.25, kept: int | None = None
) -> torch.Tensor | None:
    """When at least `min_share` of a batch cache's columns can go (no row needs them), move every row's
    visible columns to the right end (in order; a row with fewer keeps hidden columns on the left, like left
    padding) and drop the rest: one gather per layer, so a full copy only every so often. Returns the new
    `hidden` `[R, C']`, or None when nothing was done. `kept`: the most visible columns of a row, when the caller
    counts them on the host (else one read of `hidden`)."""
    columns = hidden.shape[1]
    if kept is None:
        kept = int((~hidden).sum(dim=1).max()) if hidden.shape[0] else 0
    if columns - kept < max(1.0, min_share * columns):
        return None
    # a stable sort puts each row's hidden columns first and its visible ones after, each in order
    index = torch.argsort((~hidden).to(torch.int8), dim=1, stable=True)[:, columns - kept :]  # [R, kept]
    for layer in cache.layers:
        if isinstance(layer, TreeStateLayer):  # a state per row, no columns
            continue
        for name in ("keys", "values"):
            states = getattr(layer, name)
            rows = index[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[3])
            setattr(layer, name, states.gather(2, rows))
    return hidden.gather(1, index)


def commit_accepted_path(
    cache: DynamicCache,
    past: int,
    path: torch.Tensor,
    path_is_prefix: bool,
    moves: list | None = None,
    length: int | None = None,
) -> None:
    """Keep only the accepted path's rows of the tree window appended after `past` cached positions.

    `path` is `[R, K]` (or `[K]` for one row): each row's accepted nodes, padded to the longest path K by
    repeating its last node. Rows `past + path` move to `past .. past + K - 1` on every layer, then the window is
    cropped to `past + K`. A row whose path is shorter than K keeps holes in its last columns, which its mask
    hides (`BatchTreeInputs`). When every path is the first nodes of its tree (often: node order is best-first),
    nothing moves. `moves` (one row, optional): the `(node, j)` of its path's nodes out of place (`path[j] = node
    != j`), known on the host; when given, only those columns are copied, one copy each (usually one node: the
    path leaves the first nodes at its last step), instead of an index_select of the whole path per tensor.
    `length` (optional): the accepted length K when `path` is padded further, to the tree pass's width (a
    `StaticCache`: the copy then has one shape every cycle, which a captured graph needs); the columns after K
    are moved too, and cropped.
    """
    width = path.shape[-1]
    kept = width if length is None else length
    if not path_is_prefix:
        index = past + (path if path.dim() == 2 else path[None])  # [R, K]
        for layer in cache.layers:
            if isinstance(layer, TreeStateLayer):  # linear attention: the path's node states (generation/hybrid.py)
                layer.select_window(index - past)
                continue
            if layer.keys is None:  # a KV-sharing layer (Gemma 4) that stores nothing of its own
                continue
            for states in (layer.keys, layer.values):  # [R, heads, past + N, head_dim]
                if moves is not None:  # in path order: a node's column is never an earlier node's place (node > j)
                    for node, j in moves:
                        states.select(2, past + j).copy_(states.select(2, past + node))
                    continue
                if index.shape[0] == 1:  # one row: a plain index_select
                    states[:, :, past : past + width] = states.index_select(2, index[0])
                    continue
                rows = index[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[3])
                states[:, :, past : past + width] = states.gather(2, rows)
    crop_to(cache, past + kept)


def crop_to(cache: DynamicCache, length: int) -> None:
    """`cache` cut to its first `length` positions, as `cache.crop` cuts it; a plain `DynamicLayer` by two narrow
    views (the same views as its `crop`, which slices by index for several times the cost, every cycle); a
    `StaticCache` by setting its layers' length counters, which live on the device (its `crop` reads them: a host
    wait per layer)."""
    if isinstance(cache, StaticCache):
        for layer in cache.layers:
            layer.cumulative_length.fill_(length)
        return
    excess = cache.get_seq_length() - length
    if excess and type(cache).crop is not DynamicCache.crop:  # a cache class with its own crop
        cache.crop(-excess)
    elif excess:
        for layer in cache.layers:
            if type(layer) is BufferLayer and layer.in_buffer():
                layer.narrow_to(length)
            elif type(layer) in (DynamicLayer, BufferLayer) and layer.keys is not None:
                layer.keys, layer.values = layer.keys.narrow(-2, 0, length), layer.values.narrow(-2, 0, length)
            else:
                layer.crop(-excess)
