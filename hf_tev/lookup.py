"""Context drafts: continuations found in the committed text, merged into the draft tree.

Design: docs/design.md#context-drafts.

Plain Python and torch, no transformers.

- `ContextIndex` keeps, for every n-gram (n in [min_ngram, max_ngram]) of the committed tokens, where it ended,
  updated with each cycle's newly committed tokens (no rescan). `continuations(root)` takes the last n tokens of
  the committed text followed by the root, for n from max_ngram down to min_ngram, finds their earlier
  occurrences (latest first) and returns up to `branches` distinct continuations of up to `length` tokens.
- `LookupStats` learns how often a lookup node at depth d from a match of length n is accepted once its parent
  is (counts over the call, smoothed by a prior), so a lookup path gets a probability on the drafter's scale:
  the product of those rates along it.
- `build_merged_tree` merges the drafter's best-first candidates and the lookup trie into ONE best-first
  order by path score (a node proposed by both keeps the larger score). Both scores fall along every path, so
  the first n nodes of that order are prefix-closed and are the best tree of size n: the budget, fixed or
  automatic (`size_rule`, `hf_tev.budget`), applies to both sources alike. Without drafter output the tree is
  the lookup trie alone (the root alone when nothing matches: a plain decoding step).

The tree depends only on the committed tokens, the drafter's output and counts from earlier cycles, never on
this cycle's target draws: every verifier stays exact.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass

import torch

from .tree import DraftTree, check_draft_logprobs, host_topk, root_tensor, tree_from_lists

DRAFTER, LOOKUP, BOTH = "drafter", "lookup", "both"


class ContextIndex:
    """Where every n-gram of the committed tokens ended, for n in [min_ngram, max_ngram].

    Args:
        min_ngram (`int`), max_ngram (`int`): match lengths tried, longest first (the root counts in a match).
        length (`int`): tokens per continuation.
        branches (`int`): distinct continuations per cycle.
    """

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3, length: int = 10, branches: int = 3):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        if length < 1 or branches < 1:
            raise ValueError(f"length and branches must be >= 1, got {length} and {branches}")
        self.min_ngram, self.max_ngram, self.length, self.branches = min_ngram, max_ngram, length, branches
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions just after each occurrence

    def extend(self, tokens: list[int]) -> None:
        """Append newly committed tokens and index the n-grams that end in them."""
        start = len(self.tokens)
        self.tokens.extend(tokens)
        for end in range(start + 1, len(self.tokens) + 1):
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self.ends.setdefault(tuple(self.tokens[end - n : end]), []).append(end)

    def continuations(self, root: int) -> list[tuple[list[int], int]]:
        """Up to `branches` distinct `(continuation, match length)` for the text `committed + [root]`: the tokens
        that followed earlier occurrences of its last n tokens, longest matches first, latest occurrences first."""
        found, seen = [], set()
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if n - 1 > len(self.tokens):
                continue
            key = (*self.tokens[len(self.tokens) - (n - 1) :], root) if n > 1 else (root,)
            for end in reversed(self.ends.get(key, ())):
                continuation = self.tokens[end : end + self.length]
                if continuation and tuple(continuation) not in seen:
                    seen.add(tuple(continuation))
                    found.append((continuation, n))
                    if len(found) == self.branches:
                        return found
        return found


class LookupStats:
    """The acceptance rate of a lookup node given its parent was accepted, per (depth, match length), learnt
    from the verifier's outcomes and smoothed towards `prior` (with `prior_weight` pseudo-counts)."""

    def __init__(self, prior: float = 0.4, prior_weight: float = 2.0):
        self.prior, self.prior_weight = prior, prior_weight
        self.hits: dict[tuple[int, int], float] = {}
        self.counts: dict[tuple[int, int], float] = {}

    def rate(self, depth: int, match: int) -> float:
        key = (depth, match)
        return (self.hits.get(key, 0.0) + self.prior_weight * self.prior) / (
            self.counts.get(key, 0.0) + self.prior_weight
        )

    def update(self, tree: DraftTree, path: list[int]) -> None:
        """Count every lookup node whose parent lies on the accepted path: accepted or not."""
        info = tree.node_info
        if not info or not any(match for match in info.matches):
            return
        on_path = set(path)
        parents, depths = tree.lists.parents, info.depths
        for node in range(1, len(parents)):
            match = info.matches[node]
            if match and parents[node] in on_path:
                key = (depths[node], match)
                self.counts[key] = self.counts.get(key, 0.0) + 1.0
                self.hits[key] = self.hits.get(key, 0.0) + float(node in on_path)


@dataclass(frozen=True)
class NodeInfo:
    """Per node (root first, host lists): who proposed it, its depth, and for lookup nodes the match length of
    the continuation that proposed it (0 otherwise)."""

    sources: list[str]
    depths: list[int]
    matches: list[int]


def _lookup_trie(continuations: list[tuple[list[int], int]], stats: LookupStats):
    """The continuations as a trie: `(nodes, order)`, nodes `(score, depth, parent, token, match)` (node 0 the
    root) and the non-root nodes in non-increasing score, parents before children on ties."""
    trie: dict[tuple[int, int], int] = {}  # (parent trie id, token) -> trie id; the root is trie id 0
    trie_nodes = [(0.0, 0, -1, -1, 0)]  # (score, depth, parent trie id, token, match)
    for continuation, match in continuations:
        parent, score = 0, 0.0
        for depth, token in enumerate(continuation, start=1):
            node = trie.get((parent, token))
            step = math.log(stats.rate(depth, match))
            if node is None:
                node = trie[(parent, token)] = len(trie_nodes)
                trie_nodes.append((score + step, depth, parent, token, match))
            elif score + step > trie_nodes[node][0]:  # the longer match or the earlier branch estimates higher
                trie_nodes[node] = (score + step, depth, parent, token, match)
            parent, score = node, trie_nodes[node][0]
    return trie_nodes, sorted(range(1, len(trie_nodes)), key=lambda t: (-trie_nodes[t][0], trie_nodes[t][1], t))


def lookup_path_logprobs(continuations: list[tuple[list[int], int]], stats: LookupStats) -> list[float]:
    """The path scores a tree of the continuations alone would have, root first, in the builder's order: what
    the automatic budget weighs a cycle without the drafter by."""
    trie_nodes, order = _lookup_trie(continuations, stats)
    return [0.0] + [trie_nodes[t][0] for t in order]


def build_merged_tree(
    draft_logprobs: torch.Tensor | None,
    budget: int,
    root_token,
    continuations: list[tuple[list[int], int]],
    stats: LookupStats,
    size_rule=None,
    device=None,
    token_ids=None,
) -> DraftTree:
    """The draft tree of the drafter's best-first candidates and the lookup continuations, in one best-first
    order by path log-probability (module docstring). `draft_logprobs` `[D, V]` may be None (lookup only);
    `token_ids` `[V]`: its columns' token ids, as for `hf_tev.tree.build_tree`.

    Returns a `DraftTree` with `path_logprobs` (the merged scores) and `node_info` (`NodeInfo`).
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"budget must be an int >= 0, got {budget!r}")
    if draft_logprobs is not None:
        check_draft_logprobs(draft_logprobs, token_ids)
        device = draft_logprobs.device
    root = root_tensor(root_token, device if device is not None else "cpu")
    # 1. The lookup trie, its nodes in non-increasing lookup score (parents before children on ties).
    trie_nodes, lookup_order = _lookup_trie(continuations, stats)
    # 2. The drafter's ranked top-k per depth (as in `build_tree`), on the host.
    values, ids, k = _host_topk(draft_logprobs, budget, token_ids)
    # 3. Merge the two streams by score.
    merged = _MergedNodes(budget, size_rule)
    merged_of_trie = {0: 0}
    frontier = [(-values[0][0], 1, (0,), 0, 0.0)] if values else []
    position = 0  # next entry of lookup_order
    while True:
        drafter_score = -frontier[0][0] if frontier else -math.inf
        lookup_score = trie_nodes[lookup_order[position]][0] if position < len(lookup_order) else -math.inf
        if drafter_score == -math.inf and lookup_score == -math.inf:
            break
        if drafter_score >= lookup_score:
            negative, depth, ranks, parent, parent_score = heapq.heappop(frontier)
            rank, row = ranks[-1], values[depth - 1]
            node = merged.add(parent, ids[depth - 1][rank], depth, -negative, DRAFTER, 0)
            if node is None:
                break
            if rank + 1 < k:
                heapq.heappush(
                    frontier, (-(parent_score + row[rank + 1]), depth, ranks[:-1] + (rank + 1,), parent, parent_score)
                )
            if depth < len(values):
                score = parent_score + row[rank]
                heapq.heappush(frontier, (-(score + values[depth][0]), depth + 1, ranks + (0,), node, score))
        else:
            trie_id = lookup_order[position]
            position += 1
            score, depth, trie_parent, token, match = trie_nodes[trie_id]
            node = merged.add(merged_of_trie[trie_parent], token, depth, score, LOOKUP, match)
            if node is None:
                break
            merged_of_trie[trie_id] = node
    return merged.tree(root)


def _host_topk(draft_logprobs: torch.Tensor | None, budget: int, token_ids=None) -> tuple[list, list, int]:
    """The drafter's ranked top-k log-probs and ids per depth as host lists `[D][k]`, k = min(budget, V) (empty
    when there is nothing to draft), in one host transfer."""
    if draft_logprobs is None or budget == 0 or draft_logprobs.shape[0] == 0:
        return [], [], 0
    k = min(budget, draft_logprobs.shape[1])
    return *host_topk(draft_logprobs, k, token_ids), k


class _MergedNodes:
    """The merged tree as it grows: one node per (parent, token), with its path score, who proposed it and the
    match length of a lookup node. A node both sources propose is kept once (source `BOTH`)."""

    def __init__(self, budget: int, size_rule):
        self.budget, self.size_rule = budget, size_rule
        self.tokens, self.depths, self.parents = [], [], []
        self.scores, self.sources, self.matches = [0.0], [BOTH], [0]
        self.node_of: dict[tuple[int, int], int] = {}

    def add(self, parent: int, token: int, depth: int, score: float, source: str, match: int) -> int | None:
        """The node of `token` under `parent` (added, or found), None when the budget or the size rule stops
        the tree."""
        existing = self.node_of.get((parent, token))
        if existing is not None:
            if self.sources[existing] != source:
                self.sources[existing] = BOTH
                self.matches[existing] = max(self.matches[existing], match)
            return existing
        size = len(self.tokens)
        if size >= self.budget or (self.size_rule is not None and not self.size_rule(size + 1, score)):
            return None
        node = size + 1
        self.node_of[(parent, token)] = node
        self.tokens.append(token)
        self.depths.append(depth)
        self.parents.append(parent)
        self.scores.append(score)
        self.sources.append(source)
        self.matches.append(match)
        return node

    def tree(self, root: torch.LongTensor) -> DraftTree:
        tree = tree_from_lists(root, self.tokens, self.depths, self.parents, self.scores)
        return dataclasses.replace(tree, _node_info=NodeInfo(self.sources, [0] + self.depths, self.matches))
