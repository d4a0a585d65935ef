"""Static shapes for the tree pass (`cache_implementation="static"`, docs/usage.md#static-shapes): what a GPU user
turns on to capture the tree pass in a compiled graph.

In the default mode every cycle's tree pass has its own shape: the tree's node count, and a mask and cache that
grow by the accepted tokens. A compiled target (`torch.compile`) would then trace a graph per cycle. In the
static mode
 - the target's cache is transformers' `StaticCache`, sized for the call's longest sequence plus one padded tree;
 - every tree is padded to the call's budget (`budget + 1` nodes, `max_budget + 1` with `budget="auto"`), the
   root-only cycles too, so each budget is one shape;
 - the mask is full width, `[1, 1, budget + 1, cache length]`, one buffer updated in place: each cycle makes the
   newly committed columns visible and writes the tree block after them; every column after the block stays
   hidden (the static cache returns its whole buffers, stale entries included);
 - the commit moves the accepted path inside the static buffers and moves their length back
   (`cache.commit_accepted_path`; `StaticLayer.crop` only moves a counter).
A padded node sees the committed tokens and itself, no real node sees it, and its outputs are never read; it is
written into the cache after the tree and cropped with the rest. With a compiled target, a tree pass then compiles
once per budget. One prompt at a time, on targets whose layers all attend to every committed token.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import StaticCache, StaticLayer

from ..tree import DraftTree


def wants_static(generation_config, cache) -> bool:
    """Whether a call asks for static shapes: `cache_implementation="static"`, or a `StaticCache` passed in."""
    return getattr(generation_config, "cache_implementation", None) == "static" or isinstance(cache, StaticCache)


def static_nodes(tev_config) -> int:
    """The node count every tree is padded to: the budget and the root (`max_budget` with `"auto"`)."""
    return (tev_config.max_budget if tev_config.is_auto else tev_config.budget) + 1


def static_cache(model, cache, max_length: int, nodes: int) -> StaticCache:
    """The call's `StaticCache`: `cache` when it is one long enough for `max_length - 1 + nodes` positions (the last
    tree pass writes `nodes` entries after the longest committed sequence), else a new one of that length. A
    cache too short is refused when it holds tokens (a continuation); an empty one (the one generate prepares for
    `cache_implementation="static"`, one tree too short) is replaced."""
    needed = max_length - 1 + nodes
    if isinstance(cache, StaticCache) and cache.get_max_length() >= needed:
        return cache
    if isinstance(cache, StaticCache) and int(cache.get_seq_length()):
        raise ValueError(
            f"The StaticCache passed holds {cache.get_max_length()} positions; this call needs {needed} "
            f"(max_length - 1 = {max_length - 1}, and {nodes} for the last padded tree): pass a longer one, or none."
        )
    return StaticCache(config=model.config, max_cache_len=needed)


def check_static(model, cache, batch: int) -> None:
    """Raise ValueError naming what the static mode does not cover: a batch, or a cache whose layers are not all
    static full-attention layers (sliding-window and linear-attention targets)."""
    if batch > 1:
        raise ValueError(
            "cache_implementation='static': hf_tev's static tree pass decodes one prompt at a time (a batch's "
            "rows keep holes of their own in the cache); decode the prompts one by one, or use the default cache."
        )
    kinds = sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not StaticLayer})
    if kinds:
        raise ValueError(
            f"cache_implementation='static': hf_tev's static tree pass takes full-attention targets only; "
            f"{type(model).__name__}'s static cache has {kinds} layers (sliding-window or recurrent). Use the "
            "default cache for this target."
        )


class StaticTreeInputs:
    """One prompt's tree-pass inputs in static shapes: tokens and position ids `[1, nodes]` and the additive mask
    `[1, 1, nodes, columns]`, buffers written in place every cycle (see the module docstring).

    Args:
        nodes (`int`): the node count every tree is padded to.
        columns (`int`): the static cache's length.
        hidden_columns (`torch.LongTensor`, *optional*): committed columns no node may see (left padding).
        past (`int`): the committed length after the prefill.
    """

    def __init__(self, model, nodes: int, columns: int, device, hidden_columns=None, past: int = 0):
        self.nodes, self.columns, self.hidden_columns = nodes, columns, hidden_columns
        self.min = torch.finfo(model.dtype).min
        self.mask = torch.full((nodes, columns), self.min, dtype=model.dtype, device=device)
        self.tokens = torch.zeros(1, nodes, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, nodes, dtype=torch.long, device=device)
        self.visible = 0  # committed columns made visible so far
        self.past = past  # the committed length, counted on the host (the static cache counts on the device)
        pad = torch.arange(nodes, device=device)
        self.pad_rows = (pad, pad)  # a padded node's own column in the block

    def cache_length(self, cache) -> int:
        """The committed length: counted here from the accepted paths, so that no cycle reads the device's."""
        return self.past

    def __call__(self, trees: list[DraftTree], past: int, first_positions: list[int]):
        """`(tokens [1, nodes], mask [1, 1, nodes, columns], position_ids [1, nodes])` of the one tree, padded."""
        (tree,) = trees
        n = tree.num_nodes
        if n > self.nodes:
            raise ValueError(f"a tree of {n} nodes does not fit the static tree pass of {self.nodes}")
        if past + self.nodes > self.columns:
            raise ValueError(f"the static cache of {self.columns} positions cannot take a tree after {past} tokens")
        if past > self.visible:  # the tokens committed since the last cycle
            self.mask[:, self.visible : past] = 0.0
            if self.hidden_columns is not None:
                self.mask[:, self.hidden_columns] = self.min
            self.visible = past
        block = self.mask.narrow(1, past, self.nodes)
        block.fill_(self.min)
        block[self.pad_rows] = 0.0  # every node sees itself; a padded node nothing else of the tree
        block[:n, :n].masked_fill_(tree.visibility.to(block.device), 0.0)
        self.tokens[0, :n] = tree.tokens
        self.tokens[0, n:] = 0
        torch.add(tree.depths.to(self.positions.device), first_positions[0], out=self.positions[0, :n])
        self.positions[0, n:] = first_positions[0]
        return self.tokens, self.mask[None, None], self.positions

    def commit(self, lengths: list[int]) -> None:
        """The cache kept the accepted path: the committed length grows by it."""
        self.past += lengths[0]

    def select(self, cache, keep: list[int]) -> None:
        """Never needed: the call ends when its one row stops."""

    def compact(self, cache) -> bool:
        return False
