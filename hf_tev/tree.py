"""Draft trees: DDTree's best-first builder, the chain special case, tree attention inputs.

A tree holds the root (node 0, the not-yet-verified token of this cycle) and the drafted
nodes in the order the builder added them. Parents always come before their children
(`parents[i] < i`), so index order is also a topological order, and along any root-to-node
path the indices increase with the depth.

Builder (docs/design.md#trees). The score of a token path t_1..t_d is sum_d log q_d(t_d); the tree
is the `budget` highest-scoring paths of length 1..D. Because every log-prob is <= 0 a parent
scores at least as high as its children, so the set is prefix-closed.

Tie rule (total order on paths; the builder returns nodes in exactly this order):
    key(path) = (-score, depth, ranks)
where ranks = (r_1, ..., r_d) and r_d is the token's rank at depth d in a stable sort of
row d-1 of `draft_logprobs` (descending value, ascending token id on equal values), compared
lexicographically. Scores are accumulated root-to-leaf in Python floats (float64) from the
row values, so equal log-probs give exactly equal scores.

The heap visits paths by (depth, rank) moves: a popped path pushes its next sibling (same
parent, rank + 1) and its first child (rank 0 one level deeper). Both moves strictly increase
the key (a sibling has a score <= and a larger rank tuple, a child a score <= and a larger
depth), and every path is reachable from (rank 0 at depth 1) by such moves, so the heap pops
all paths in increasing key order. Only ranks < min(budget, V) can ever be reached within the
budget, hence one top-k per depth suffices.
"""

import array
import dataclasses
import heapq
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import torch


class TreeLists(NamedTuple):
    """The tree's structure as host lists, for the verifiers' per-node bookkeeping (Python on a few
    hundred nodes beats a dozen tiny tensor ops). `tokens[0]` (the root's) may be -1: the builder
    does not copy the root token to the host, and a root is never a child token."""

    parents: list[int]  # parents[0] = -1
    children: list[list[int]]  # children of every node, in index (builder) order
    tokens: list[int]
    internal: list[int]  # nodes with children, ascending (`DraftTree.internal_nodes`)


@dataclass(frozen=True)
class DraftTree:
    """A draft tree; node 0 is the root.

    Args:
        tokens (`torch.LongTensor` of shape `[N]`): token of every node.
        depths (`torch.LongTensor` of shape `[N]`): depth of every node, 0 for the root.
        parents (`torch.LongTensor` of shape `[N]`): parent index, -1 for the root; `parents[i] < i`.
            Siblings carry distinct tokens.
        visibility (`torch.BoolTensor` of shape `[N, N]`): `visibility[i, j]` iff node j is an ancestor
            of node i or i itself.
    """

    tokens: torch.LongTensor
    depths: torch.LongTensor
    parents: torch.LongTensor
    visibility: torch.BoolTensor
    # Known at build time; save host syncs when asked for.
    _max_depth: int | None = field(default=None, repr=False, compare=False)
    _internal_nodes: torch.LongTensor | None = field(default=None, repr=False, compare=False)
    _lists: TreeLists | None = field(default=None, repr=False, compare=False)
    _parent_rows: torch.LongTensor | None = field(default=None, repr=False, compare=False)
    _path_logprobs: list | None = field(default=None, repr=False, compare=False)
    _node_info: object | None = field(default=None, repr=False, compare=False)
    _scores_memo: tuple | None = field(default=None, init=False, repr=False, compare=False)  # `memo_for`

    def __post_init__(self):
        # Shapes and dtypes only: checking the values would cost host syncs on accelerators.
        num_nodes = self.tokens.shape[0] if self.tokens.dim() == 1 else -1
        for name in ("tokens", "depths", "parents"):
            value = getattr(self, name)
            if value.dtype != torch.long or value.shape != (num_nodes,) or num_nodes < 1:
                raise ValueError(
                    f"DraftTree.{name} must be a LongTensor of shape [N] (N >= 1, the root first), "
                    f"got {value.dtype} of shape {tuple(value.shape)}"
                )
        if self.visibility.dtype != torch.bool or self.visibility.shape != (num_nodes, num_nodes):
            raise ValueError(
                f"DraftTree.visibility must be a BoolTensor of shape [N, N] = [{num_nodes}, {num_nodes}], "
                f"got {self.visibility.dtype} of shape {tuple(self.visibility.shape)}"
            )

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_depth(self) -> int:
        if self._max_depth is not None:
            return self._max_depth
        return int(self.depths.max())

    @property
    def internal_nodes(self) -> torch.LongTensor:
        """Nodes that have at least one child, ascending: `[I]` (empty for the root alone). Only these
        nodes' target rows enter the target flow (docs/design.md#the-exit-law-and-tev)."""
        if self._internal_nodes is not None:
            return self._internal_nodes
        return torch.unique(self.parents[1:])  # sorted

    @property
    def parent_rows(self) -> torch.LongTensor:
        """For every non-root node, the position of its parent in `internal_nodes`: `[N-1]`."""
        if self._parent_rows is not None:
            return self._parent_rows
        return torch.searchsorted(self.internal_nodes, self.parents[1:])

    @property
    def path_logprobs(self) -> list[float] | None:
        """Host list `[N]`: the drafter's log-probability of every node's whole path root..v (0 for the root),
        non-increasing in index order; set by the tree sources, None for a tree built by hand."""
        return self._path_logprobs

    @property
    def node_info(self):
        """Per-node provenance of a merged drafter + context tree (`hf_tev.lookup.NodeInfo`), else None."""
        return self._node_info

    @property
    def lists(self) -> TreeLists:
        """Host lists of the structure (built trees carry them; otherwise one device-to-host copy, cached)."""
        if self._lists is None:
            parents, tokens = torch.stack([self.parents, self.tokens]).tolist()
            object.__setattr__(self, "_lists", _tree_lists(parents, tokens))  # frozen: cache by hand
        return self._lists

    def memo_for(self, scores: torch.Tensor) -> dict:
        """A dict for values that this tree and `scores` determine, so that they are computed once: a verifier's
        normalised rows and host edge probabilities, read again by the call's statistics (`hf_tev.verify`). It
        lives as long as the tree and starts empty for other scores, or for the same scores changed in place."""
        memo = self._scores_memo
        if memo is None or memo[0]() is not scores or memo[1] != scores._version:
            memo = (weakref.ref(scores), scores._version, {})
            object.__setattr__(self, "_scores_memo", memo)  # frozen: cache by hand
        return memo[2]

    def truncated(self, num_nodes: int) -> "DraftTree":
        """The tree of its first `num_nodes` nodes (root included; all of it when it has no more). Every tree source
        adds a node after its parent, so any first nodes form a tree; a best-first tree's first n + 1 nodes are
        its best tree of n drafted nodes (what the automatic budget cuts to)."""
        if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
            raise ValueError(f"num_nodes must be an int >= 1 (the root), got {num_nodes!r}")
        if num_nodes >= self.num_nodes:
            return self
        lists = self.lists
        parents = lists.parents[:num_nodes]
        kept = _tree_lists(parents, lists.tokens[:num_nodes])
        row_of = {node: row for row, node in enumerate(kept.internal)}
        index = to_device(host_long(kept.internal + [row_of[parent] for parent in parents[1:]]), self.tokens.device)
        depths = [0]  # on the host: the tensor's would cost a device sync
        for parent in parents[1:]:
            depths.append(depths[parent] + 1)
        info = self._node_info
        if info is not None:
            info = dataclasses.replace(
                info, **{f.name: getattr(info, f.name)[:num_nodes] for f in dataclasses.fields(info)}
            )
        return DraftTree(
            tokens=self.tokens[:num_nodes],
            depths=self.depths[:num_nodes],
            parents=self.parents[:num_nodes],
            visibility=self.visibility[:num_nodes, :num_nodes],
            _max_depth=max(depths),
            _internal_nodes=index[: len(kept.internal)],
            _lists=kept,
            _parent_rows=index[len(kept.internal) :],
            _path_logprobs=None if self._path_logprobs is None else self._path_logprobs[:num_nodes],
            _node_info=info,
        )


def host_long(values: list[int]) -> torch.LongTensor:
    """A host LongTensor `[n]` of Python ints. `torch.tensor(list)` inspects every element; a tensor over an
    `array("q")` buffer (which it keeps alive) is several times cheaper, and the decoding cycle makes a few."""
    if not values:
        return torch.empty(0, dtype=torch.long)  # frombuffer refuses an empty buffer
    return torch.frombuffer(array.array("q", values), dtype=torch.long)


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A host tensor copied to `device` without a host wait: on CUDA from pinned memory and asynchronously (the
    caching host allocator keeps the pinned block until the copy is done, so the host may drop `host`); a
    blocking copy would wait for all the work queued before it (docs/design.md#host-waits). On the CPU: itself."""
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def check_draft_logprobs(draft_logprobs, token_ids=None) -> None:
    if not isinstance(draft_logprobs, torch.Tensor):
        raise TypeError(f"draft_logprobs must be a torch.Tensor, got {type(draft_logprobs).__name__}")
    if not draft_logprobs.is_floating_point():
        raise TypeError(f"draft_logprobs must be a floating tensor, got dtype {draft_logprobs.dtype}")
    if draft_logprobs.dim() != 2 or draft_logprobs.shape[1] == 0:
        raise ValueError(f"draft_logprobs must have shape [D, V] with V >= 1, got {tuple(draft_logprobs.shape)}")
    if token_ids is not None and tuple(token_ids.shape) != draft_logprobs.shape[1:]:
        raise ValueError(
            f"token_ids must hold one target id per column of draft_logprobs ({draft_logprobs.shape[1]}), got shape "
            f"{tuple(token_ids.shape)}"
        )


def root_tensor(root_token, device) -> torch.LongTensor:
    """root_token (int or one-element integer tensor) -> LongTensor [1] on `device`, without a host sync."""
    if isinstance(root_token, torch.Tensor):
        if root_token.numel() != 1 or root_token.is_floating_point() or root_token.dtype == torch.bool:
            raise ValueError(
                f"root_token must be one integer token id, got a {root_token.dtype} tensor "
                f"of shape {tuple(root_token.shape)}"
            )
        return root_token.reshape(1).to(device=device, dtype=torch.long)
    if isinstance(root_token, bool) or not isinstance(root_token, int):
        raise TypeError(f"root_token must be an int or a one-element integer tensor, got {type(root_token).__name__}")
    return torch.tensor([root_token], dtype=torch.long, device=device)


def ranked_topk(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.LongTensor, torch.Tensor]:
    """The first k entries of each row in the order (descending value, ascending index).

    torch.topk does not specify which of several equal values it returns (and log-probs of bf16
    drafter logits tie a lot), while a full stable sort of [D, V] is ~50x slower than topk on
    CPU. So topk runs on an integer key that is unique per entry: for values <= 0 (all valid
    input) the float order is the reverse of the order of |x|'s IEEE bits, and +0.0 / -0.0 share
    the bits 0, hence the k smallest of (bits(|x|), index) in lexicographic order are the wanted
    entries, in order. The key packs that pair into one int64, bits(|x|) << s | index with
    2**s > V (a shift and an or: cheaper than bits * V + index, the same order). Float64 has no
    room for the index in 64 bits and takes the stable sort.

    Also returns each row's maximum (NaN if the row has a NaN), for input validation.
    """
    # logprobs: [D, V]
    vocab = logprobs.shape[1]
    row_max = logprobs.amax(-1)  # [D]; propagates NaN
    if logprobs.dtype == torch.float64:
        values, ids = logprobs.sort(dim=-1, descending=True, stable=True)
        return values[:, :k], ids[:, :k], row_max
    magnitude_bits = logprobs.float().abs().view(torch.int32).long()  # [D, V], exact for 16-bit floats
    key = magnitude_bits.bitwise_left_shift_(vocab.bit_length()).bitwise_or_(
        torch.arange(vocab, device=logprobs.device)
    )  # [D, V], unique
    ids = key.topk(k, dim=-1, largest=False).indices  # [D, k]
    return logprobs.gather(1, ids), ids, row_max


def host_topk(draft_logprobs: torch.Tensor, k: int, token_ids=None) -> tuple[list[list[float]], list[list[int]]]:
    """`ranked_topk`'s values and token ids as host lists `[D][k]`, checked to be log-probabilities (every row's
    maximum <= 0, so no NaN): one device-to-host transfer of all three. `token_ids` `[V]` (ascending, e.g. a
    drafter's draft vocabulary) maps the chosen columns to their token ids before the transfer (ascending, so
    that ties still go to the lower token id); None: column v is token v. On CPU, where nothing is transferred,
    list conversions replace the packing into one float64 tensor (the same numbers: float32 and bfloat16 values
    are exact in Python floats, token ids in float64), and a top-k of the values replaces the key where it finds
    the same entries (`_cpu_host_topk`; torch's CPU top-k selects more slowly once k exceeds V / 64, where the
    one more entry it needs costs more than the key saves)."""
    on_cpu = draft_logprobs.device.type == "cpu"
    prefetched = getattr(draft_logprobs, "_hf_tev_topk", None)  # `prefetch_host_topk`
    if prefetched is not None and prefetched[:2] == (k, draft_logprobs._version):
        maxima, values, ids = prefetched[2:]
    elif on_cpu and draft_logprobs.dtype != torch.float64 and 64 * (k + 1) <= draft_logprobs.shape[1]:
        maxima, values, ids = _cpu_host_topk(draft_logprobs, k, token_ids)
    elif on_cpu:
        values, ids, row_max = ranked_topk(draft_logprobs, k)
        maxima, values, ids = row_max.tolist(), values.tolist(), _token_ids(ids, token_ids).tolist()
    else:
        values, ids, row_max = ranked_topk(draft_logprobs, k)
        ids = _token_ids(ids, token_ids)
        host = torch.cat([values.double(), ids.double(), row_max.double()[:, None]], dim=1).cpu()  # [D, 2k + 1]
        maxima, values, ids = host[:, -1].tolist(), host[:, :k].tolist(), host[:, k : 2 * k].long().tolist()
    if not all(maximum <= 0 for maximum in maxima):  # a positive maximum or a NaN
        raise ValueError(
            "draft_logprobs must be log-probabilities (<= 0, no NaN; -inf allowed): "
            "pass log_softmax of the drafter logits"
        )
    return values, ids


def _token_ids(columns: torch.LongTensor, token_ids: torch.LongTensor | None) -> torch.LongTensor:
    """The token ids of top-k columns (`host_topk`'s `token_ids`)."""
    return columns if token_ids is None else token_ids[columns]


def prefetch_host_topk(drafts: list, budget: int, token_ids=None) -> None:
    """The `host_topk` of several drafts `[d_i, V]` (None: no draft) of one vocabulary, brought to the host in ONE
    device-to-host copy for the builds that follow (a batch's rows on an accelerator: one wait, not one per row).
    Each draft keeps its lists until it is changed; on the CPU, where reading costs no wait, nothing is done."""
    drafts = [q for q in drafts if q is not None and q.shape[0] and q.device.type != "cpu"]
    k = min(budget, drafts[0].shape[1]) if drafts else 0
    if len(drafts) < 2 or k == 0:
        return
    packed = []  # as `host_topk` packs one draft: [d_i, 2k + 1] float64 values, ids and the row maximum
    for draft in drafts:
        values, ids, row_max = ranked_topk(draft, k)
        ids = _token_ids(ids, token_ids)
        packed.append(torch.cat([values.double(), ids.double(), row_max.double()[:, None]], dim=1))
    host, start = torch.cat(packed).tolist(), 0  # the one copy
    for draft in drafts:
        rows, start = host[start : start + draft.shape[0]], start + draft.shape[0]
        ids = [[int(token) for token in row[k : 2 * k]] for row in rows]
        draft._hf_tev_topk = (k, draft._version, [row[-1] for row in rows], [row[:k] for row in rows], ids)


def _cpu_host_topk(
    logprobs: torch.Tensor, k: int, token_ids=None
) -> tuple[list[float], list[list[float]], list[list[int]]]:
    """`host_topk` on CPU: `(row maxima, values, ids)`, the same lists as `ranked_topk` gives.

    There `ranked_topk`'s integer key (four passes over `[D, V]` and an int64 copy of it) costs more than the
    top-k itself. A top-k of the values, one entry longer, finds the same entries whenever no value ties across
    rank k (entry k - 1 larger than entry k: every entry at least that large is in it); then only equal values
    inside it need their order, lower token id first, which the host puts right. A row with a tie across rank k
    (rare for float32 log-probabilities; -inf tails) takes the key.
    """
    top_values, top_ids = logprobs.topk(k + 1, dim=-1)  # [D, k + 1], by value; ties in any order
    values, ids = top_values.tolist(), _token_ids(top_ids, token_ids).tolist()
    maxima = [row[0] for row in values]  # each row's maximum: torch's CPU top-k ranks NaN above every number
    for depth, (row_values, row_ids) in enumerate(zip(values, ids, strict=True)):
        if row_values[k - 1] == row_values[k]:  # which of the tied entries come first: the key says
            exact_values, exact_ids, _ = ranked_topk(logprobs[depth : depth + 1], k)
            values[depth], ids[depth] = exact_values[0].tolist(), _token_ids(exact_ids[0], token_ids).tolist()
            continue
        del row_values[k:], row_ids[k:]
        if len(set(row_values)) < k:  # equal values (adjacent, as sorted): lower token id first
            order = sorted(range(k), key=lambda j, v=row_values, i=row_ids: (-v[j], i[j]))
            values[depth], ids[depth] = [row_values[j] for j in order], [row_ids[j] for j in order]
    return maxima, values, ids


def build_tree(draft_logprobs: torch.Tensor, budget: int, root_token, size_rule=None, token_ids=None) -> DraftTree:
    """Best-first DDTree draft tree (docs/design.md#trees, tie rule in the module docstring).

    Args:
        draft_logprobs (`torch.Tensor` of shape `[D, V]`): log q_d; row d-1 is depth d. Must be <= 0
            (log-probabilities, e.g. `log_softmax` of the drafter logits).
        budget (`int`): number of drafted nodes, root excluded; 0 gives the root alone. A budget
            above the number of token paths gives all paths.
        root_token (`int` or one-element integer `torch.Tensor`): token of the root.
        size_rule (*optional*): `size_rule(n, path_logprob) -> bool`, asked before node n (1, 2, ...) is
            added with its path log-probability; False stops the tree there. Nodes come in non-increasing
            path log-probability, so the first n nodes are the best tree of size n: a rule can stop where no
            larger tree pays and the caller keep the best first nodes (`hf_tev.budget.SizeRule`,
            `DraftTree.truncated`).
        token_ids (`torch.LongTensor` of shape `[V]`, *optional*): the token id of each column, ascending (a
            drafter's draft vocabulary, `DFlashDraftModel.draft_vocab`: its log-probs as scored, not spread over
            the target's vocabulary); None: column v is token v.

    Returns:
        `DraftTree` on the device of `draft_logprobs`, nodes in pop order (non-increasing score).
    """
    check_draft_logprobs(draft_logprobs, token_ids)
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise TypeError(f"budget must be an int, got {type(budget).__name__}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    device = draft_logprobs.device
    root = root_tensor(root_token, device)
    num_depths, vocab = draft_logprobs.shape
    k = min(budget, vocab)
    if k == 0 or num_depths == 0:
        return build_chain(draft_logprobs, 0, root)

    # 1. Ranked top-k per depth, the only host transfer: values and token ids, [D][k] floats / ints.
    values, ids = host_topk(draft_logprobs, k, token_ids)

    # 2. Best-first search over (depth, rank) moves. Heap entry: (-score, depth, ranks, parent node,
    # parent score); (depth, ranks) is unique per path, so the entries after it are never compared.
    # Scores are always accumulated root-to-leaf as parent score + value, the same float operations
    # for every way of reaching a path, so equal sums stay exactly equal.
    tokens, depths, parents, scores = [], [], [], [0.0]
    frontier = [(-values[0][0], 1, (0,), 0, 0.0)]
    while frontier and len(tokens) < budget:
        if size_rule is not None and not size_rule(len(tokens) + 1, -frontier[0][0]):
            break
        negative_score, depth, ranks, parent, parent_score = heapq.heappop(frontier)
        node, rank, row = len(tokens) + 1, ranks[-1], values[depth - 1]
        scores.append(-negative_score)
        tokens.append(ids[depth - 1][rank])
        depths.append(depth)
        parents.append(parent)
        if rank + 1 < k:  # next sibling: same parent, next rank
            sibling_score = parent_score + row[rank + 1]
            heapq.heappush(frontier, (-sibling_score, depth, ranks[:-1] + (rank + 1,), parent, parent_score))
        if depth < num_depths:  # first child: rank 0 one level deeper
            score = parent_score + row[rank]
            heapq.heappush(frontier, (-(score + values[depth][0]), depth + 1, ranks + (0,), node, score))

    return tree_from_lists(root, tokens, depths, parents, scores)


def _tree_lists(parents: list[int], tokens: list[int]) -> TreeLists:
    children = [[] for _ in parents]
    for node in range(1, len(parents)):
        children[parents[node]].append(node)
    return TreeLists(parents, children, tokens, [node for node, kids in enumerate(children) if kids])


def tree_from_lists(root: torch.LongTensor, tokens: list, depths: list, parents: list, scores: list) -> DraftTree:
    """Assemble a DraftTree from the builder's host lists (drafted nodes only; root prepended)."""
    device = root.device
    n = len(tokens) + 1
    lists = _tree_lists([-1] + parents, [-1] + tokens)
    row_of = {node: row for row, node in enumerate(lists.internal)}
    internal = len(lists.internal)
    # Everything in ONE host buffer, so one tensor and one copy to the device (each tensor made from a list costs
    # more than the list): the int64 depths, parents, tokens, parent rows and internal nodes, then the visibility
    # as n * n bytes, each node's row its parent's row (a byte copy: parents come first) plus itself.
    ints = array.array("q", [0, *depths, -1, *parents, -1, *tokens, *(row_of[p] for p in parents), *lists.internal])
    width = ints.itemsize * len(ints)
    buffer = bytearray(width + n * n)
    buffer[:width] = ints.tobytes()
    buffer[width] = 1  # the root sees itself
    for node, parent in enumerate(parents, start=1):
        row, parent_row = width + node * n, width + parent * n
        buffer[row : row + node] = buffer[parent_row : parent_row + node]  # the parent's row holds 1s up to itself
        buffer[row + node] = 1
    data = to_device(torch.frombuffer(buffer, dtype=torch.uint8), device)
    longs = data[:width].view(torch.long)
    return DraftTree(
        tokens=torch.cat([root, longs[2 * n + 1 : 3 * n]]),
        depths=longs[:n],
        parents=longs[n : 2 * n],
        visibility=data[width:].view(torch.bool).view(n, n),
        _max_depth=max(depths, default=0),
        _internal_nodes=longs[4 * n - 1 : 4 * n - 1 + internal],
        _lists=lists,
        _parent_rows=longs[3 * n : 4 * n - 1],
        _path_logprobs=scores,
    )


def build_chain(draft_logprobs: torch.Tensor, budget: int, root_token, size_rule=None, token_ids=None) -> DraftTree:
    """The chain special case (plain DFlash): one rank-0 (argmax, lowest id on ties) child per depth.

    Same signature as `build_tree`: at most `budget` nodes, and never deeper than the drafted depths.

    Args:
        draft_logprobs (`torch.Tensor` of shape `[D, V]`): drafter scores per depth (log-probs or logits).
        budget (`int`): drafted nodes, root excluded; the chain has `min(budget, D)` of them.
        root_token (`int` or one-element integer `torch.Tensor`): token of the root.
        size_rule (*optional*): as for `build_tree` (costs one host copy of the chain's log-probs).
        token_ids (*optional*): as for `build_tree`.
    """
    check_draft_logprobs(draft_logprobs, token_ids)
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise TypeError(f"budget must be an int, got {type(budget).__name__}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    length = min(budget, draft_logprobs.shape[0])
    scores = [0.0] if length == 0 else None  # the root alone; a chain's scores cost a host copy: only with a rule
    if size_rule is not None and length:
        scores = [0.0] + draft_logprobs[:length].amax(-1).double().cumsum(0).tolist()
        length = next((n - 1 for n in range(1, length + 1) if not size_rule(n, scores[n])), length)
        scores = scores[: length + 1]
    device = draft_logprobs.device
    root = root_tensor(root_token, device)
    depths = torch.arange(length + 1, device=device)  # [N]
    return DraftTree(
        tokens=torch.cat([root, _token_ids(draft_logprobs[:length].argmax(-1), token_ids)]),
        depths=depths,
        parents=depths - 1,
        visibility=torch.ones(length + 1, length + 1, dtype=torch.bool, device=device).tril(),
        _max_depth=length,
        _internal_nodes=depths[:-1],
        _parent_rows=depths[:-1],  # node i's parent i - 1 is internal node number i - 1
        _path_logprobs=scores,
    )


class RootTrees:
    """Trees of the root alone (a plain decoding step), the same as `build_chain(..., 0, root)` gives. Their
    structure tensors are the same for every root, so they are made once per device and shared (trees are never
    written to): a cycle that drafts nothing pays one view of its root instead of a dozen small tensor ops."""

    def __init__(self, device):
        depths = torch.zeros(1, dtype=torch.long, device=device)
        self.structure = {
            "depths": depths,
            "parents": depths - 1,
            "visibility": torch.ones(1, 1, dtype=torch.bool, device=device),
            "_internal_nodes": depths[:0],
            "_parent_rows": depths[:0],
        }

    def __call__(self, root: torch.LongTensor) -> DraftTree:
        """The tree of `root` (a one-element LongTensor on this device) alone."""
        return DraftTree(tokens=root.reshape(1), _max_depth=0, _path_logprobs=[0.0], **self.structure)


# Tree sources, one signature: (draft_logprobs [D, V], budget, root_token, size_rule=None) -> DraftTree.
# `TEVConfig.tree` names one.
TREE_BUILDERS = {"best_first": build_tree, "chain": build_chain}


def tree_attention_mask(tree: DraftTree, past_length: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Additive attention mask for the verify forward pass.

    Returns:
        `torch.Tensor` of shape `[1, 1, N, past_length + N]`: 0 where visible (every cached position,
        and the tree columns of the row's ancestors and itself), `finfo(dtype).min` elsewhere.
    """
    if past_length < 0:
        raise ValueError(f"past_length must be >= 0, got {past_length}")
    if not dtype.is_floating_point:
        raise TypeError(f"the attention mask dtype must be floating, got {dtype}")
    device = tree.visibility.device if device is None else device
    num_nodes = tree.num_nodes
    mask = torch.zeros(num_nodes, past_length + num_nodes, dtype=dtype, device=device)  # [N, past + N]
    hidden = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=device)
    mask[:, past_length:] = torch.where(tree.visibility.to(device), 0.0, hidden)
    return mask[None, None]


def tree_position_ids(tree: DraftTree, past_length: int) -> torch.LongTensor:
    """Position ids `[1, N]` = past_length + depth: a node sits where it would in its own path."""
    if past_length < 0:
        raise ValueError(f"past_length must be >= 0, got {past_length}")
    return (past_length + tree.depths)[None]


class TreeInputs:
    """The tree pass's attention mask and position ids, in buffers reused across the cycles of one call.

    A fresh `[N, past + N]` mask per cycle costs an allocation and a fill that grow with the context; here
    (as in the DDTree reference) one `[rows, max_past + rows]` buffer is allocated at the first tree and
    sliced. Columns of committed tokens hold 0 (visible) except `hidden_columns` (left padding), which stay
    hidden for good; each call writes the tree block at columns `past .. past + N` after clearing the
    previous call's block (those columns now hold committed tokens, or are overwritten). The buffers are
    re-allocated only when a tree has more nodes than any before it.

    Args:
        max_past (`int`): the longest cache the call can reach before a tree pass (e.g. `max_length - 1`).
        dtype (`torch.dtype`): floating dtype of the additive mask (the target's).
        device: where the buffers live.
        hidden_columns (`torch.LongTensor`, *optional*): committed columns no tree node may see.
    """

    def __init__(self, max_past: int, dtype: torch.dtype, device, hidden_columns=None):
        if not dtype.is_floating_point:
            raise TypeError(f"the attention mask dtype must be floating, got {dtype}")
        self.max_past, self.dtype, self.device, self.hidden_columns = max_past, dtype, device, hidden_columns
        self.hidden = torch.finfo(dtype).min
        self.mask = torch.zeros(0, 0, dtype=dtype, device=device)  # [rows, max_past + rows]
        self.positions = torch.zeros(1, 0, dtype=torch.long, device=device)  # [1, rows]
        self._block = None  # (past, N) of the block written last

    def _allocate(self, rows: int, columns: int) -> None:
        self.mask = torch.zeros(rows, columns, dtype=self.dtype, device=self.device)
        if self.hidden_columns is not None:
            self.mask[:, self.hidden_columns] = self.hidden
        self.positions = torch.zeros(1, rows, dtype=torch.long, device=self.device)
        self._block = None

    def __call__(self, tree: DraftTree, past_length: int, first_position: int) -> tuple[torch.Tensor, torch.LongTensor]:
        """`(mask [1, 1, N, past_length + N], position_ids [1, N])` for `tree` after `past_length` cached
        tokens, the root at position `first_position` (= past_length unless padding shifts positions).
        Views of the buffers: valid until the next call. The root alone with nothing hidden needs no mask (it
        sees every cached token): the mask is then None, and the target takes its plain decoding path."""
        if past_length < 0:
            raise ValueError(f"past_length must be >= 0, got {past_length}")
        num_nodes = tree.num_nodes
        if num_nodes == 1 and self.hidden_columns is None:
            positions = self.positions[:, :1] if self.positions.shape[1] else self.positions.new_empty(1, 1)
            positions.fill_(first_position)
            return None, positions
        rows, columns = self.mask.shape
        if num_nodes > rows or past_length + num_nodes > columns:
            rows = max(num_nodes, rows)
            self._allocate(rows, max(self.max_past, past_length) + rows)
        # (views by `narrow`, cheaper than slicing by index, as this runs every cycle)
        if self._block is not None:
            start, size = self._block
            self.mask.narrow(0, 0, size).narrow(1, start, size).zero_()
        block = self.mask.narrow(0, 0, num_nodes).narrow(1, past_length, num_nodes)  # [N, N]
        block.fill_(self.hidden).masked_fill_(tree.visibility.to(self.device), 0.0)
        self._block = (past_length, num_nodes)
        positions = self.positions.narrow(1, 0, num_nodes)
        torch.add(tree.depths.to(self.device), first_position, out=positions[0])
        return self.mask.narrow(0, 0, num_nodes).narrow(1, 0, past_length + num_nodes)[None, None], positions
