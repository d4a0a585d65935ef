"""Exact tree verifiers: target flow, TEV, predraw-and-follow, sequential residual, greedy.

Every verifier gets the tree and `probs` [N, V]: row u is p_u, the target's processed
next-token distribution after the path root..u. It returns `(path, bonus)`: the accepted
node indices root..v (root first) and one token drawn outside the tree at v. All of them are
exact (the emitted tokens are distributed as the target's own sampling) and optimal (the exit
node follows the exit law E, so E[accepted nodes + 1] = 1 + coverage); SPEC section 5.

Randomness goes through two helpers, `_sample` (categorical) and `_bernoulli`, so that the
tests can replace them by scripted draws and enumerate each verifier's output law exactly.
"""

import torch

from .tree import DraftTree

# --------------------------------------------------------------------------------------------
# Random draws (sync-free on accelerators)


def _sample(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.LongTensor:
    """One categorical draw per row of non-negative (unnormalised) weights, by inverse CDF.

    With x = u * total, u ~ U(0, 1], the draw is the first index whose cumulative weight is >= x:
    index i wins with probability w_i / total, a zero weight never wins (its CDF step is empty,
    and x > 0), and x <= total always finds an index. One cumsum and one binary search per row,
    no host sync. The CDF is float64: a float32 running sum near 1 drops every addend below
    3e-8, i.e. the whole low-probability tail of a large vocabulary. (torch.multinomial and the
    exponential race are exact too, but their per-element random numbers make them several
    times slower on CPU at vocabulary size.)
    """
    # weights: [..., V] -> [...]
    cdf_dtype = torch.float32 if weights.device.type == "mps" else torch.float64  # MPS has no float64
    cdf = weights.cumsum(-1, dtype=cdf_dtype)  # [..., V]
    uniform = torch.rand(cdf.shape[:-1] + (1,), generator=generator, dtype=cdf_dtype, device=cdf.device)
    threshold = (1 - uniform) * cdf[..., -1:]  # [..., 1] in (0, total]
    return torch.searchsorted(cdf, threshold).squeeze(-1)


def _bernoulli(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.BoolTensor:
    """Independent coins, True with the given probabilities."""
    uniform = torch.rand(probs.shape, generator=generator, dtype=probs.dtype, device=probs.device)
    return uniform < probs  # U in [0, 1): P(U < a) = a


# --------------------------------------------------------------------------------------------
# Shared pieces


def _check_rows(tree: DraftTree, rows: torch.Tensor, name: str) -> None:
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(rows).__name__}")
    if not rows.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got dtype {rows.dtype}")
    if rows.dim() != 2 or rows.shape[0] != tree.num_nodes:
        raise ValueError(f"{name} must have shape [N, V] with N = {tree.num_nodes} tree nodes, "
                         f"got {tuple(rows.shape)}")


def _flow_dtype(probs: torch.Tensor) -> torch.dtype:
    return torch.float64 if probs.dtype == torch.float64 else torch.float32


def _edge_probs(tree: DraftTree, probs: torch.Tensor) -> torch.Tensor:
    """p_{parent(c)}(token of c) for every non-root node c: [N-1]."""
    return probs[tree.parents[1:], tree.tokens[1:]]


def _path_to(tree: DraftTree, node: torch.LongTensor) -> torch.LongTensor:
    """Indices root..node in depth order (ancestors have smaller indices): [depth(node) + 1]. Syncs."""
    return tree.visibility[node].nonzero().squeeze(1)


def _residual(tree: DraftTree, row: torch.Tensor, node: torch.LongTensor) -> torch.Tensor:
    """res_node(y) ∝ p_node(y) [y is not a child token of node], unnormalised: [V].

    If the children cover all of p_node's mass the residual is all zero; an exact verifier
    then exits at `node` with probability 0, so this is reached only through round-off in the
    exit masses (~1e-7). Instead of sampling from zeros we fall back to p_node itself.
    """
    # row: [V] p_node
    vocab = row.shape[0]
    # Child tokens of `node`; every other node points at an extra slot V that is cut off again.
    child_tokens = torch.where(tree.parents[1:] == node, tree.tokens[1:], vocab)  # [N-1]
    residual = torch.nn.functional.pad(row, (0, 1)).index_fill_(0, child_tokens, 0)[:vocab]  # [V]
    return torch.where(residual.sum() > 0, residual, row)


def _walk(tree: DraftTree, next_node: torch.LongTensor) -> torch.LongTensor:
    """Follow next_node from the root until a node has none (-1); returns the last node (0-dim).

    Pointer doubling: after j rounds jump[u] is where u is after 2^j steps (stops are fixed
    points), so ceil(log2(max depth + 1)) rounds of one gather (4 for D = 15) reach the end of
    any root path, with no host sync and no per-level Python step.
    """
    # next_node: [N], -1 where the walk stops
    nodes = torch.arange(tree.num_nodes, device=next_node.device)
    jump = torch.where(next_node >= 0, next_node, nodes)  # [N]
    for _ in range(tree.depth_bound.bit_length()):  # 2^rounds > depth bound
        jump = jump[jump]
    return jump[0]


def _child_by_choice(tree: DraftTree, choice: torch.LongTensor) -> torch.LongTensor:
    """For every node u, the child whose token is choice[u], or -1: [N] (siblings have distinct tokens)."""
    children = torch.arange(1, tree.num_nodes, device=choice.device)  # [N-1]
    matches = choice[tree.parents[1:]] == tree.tokens[1:]  # [N-1]
    next_node = torch.full_like(choice, -1)
    return next_node.scatter_reduce(0, tree.parents[1:], torch.where(matches, children, -1), reduce="amax")


# --------------------------------------------------------------------------------------------
# Target flow and the verifiers


def _flow(tree: DraftTree, edge: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, E) from the edge probabilities p_{parent(c)}(tok c) [N-1]; see `target_flow`."""
    # P(u) = product of the edge probabilities on root..u: the ancestor rows of the visibility
    # matrix select them, every level at once. [N, N], tiny next to a vocabulary row.
    # (Column 0, the root, has no edge.)
    flow = torch.where(tree.visibility[:, 1:], edge, 1).prod(-1)  # [N] P
    # E(u) = P(u) - sum_c P(c) = P(u) * (1 - sum_c p_u(tok c)); the second form avoids cancelling
    # separately rounded products and is exactly 0 when the children's tokens cover p_u (exactly
    # summing rows). Round-off can leave tiny negatives: clamp.
    child_mass = torch.zeros_like(flow).index_add_(0, tree.parents[1:], edge)  # [N]
    exit_mass = torch.addcmul(flow, flow, child_mass, value=-1).clamp_min_(0)  # P (1 - child mass)
    return flow, exit_mass


def target_flow(tree: DraftTree, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target flow on the tree.

    Args:
        tree (`DraftTree`): the tree.
        probs (`torch.Tensor` of shape `[N, V]`): p_u for every node.

    Returns:
        `(P, E)`, both `[N]` (float64 for float64 probs, else float32): P(root) = 1,
        P(c) = P(u) p_u(tok c); exit masses E(u) = P(u) - sum_{c child of u} P(c) >= 0, sum E = 1
        (E telescopes to P(root); the clamp only acts when round-off makes child masses exceed 1).
    """
    _check_rows(tree, probs, "probs")
    return _flow(tree, _edge_probs(tree, probs).to(_flow_dtype(probs)))


def verify_tev(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None = None):
    """Tree Exit Verification: draw the exit node v ~ E, accept root..v, bonus ~ res_v.

    Two draws per cycle; the only [V]-sized work is the exit node's residual row.

    Returns:
        `(path, bonus)`: `torch.LongTensor` `[k + 1]` node indices root..v, and a 0-dim token id.
    """
    _, exit_mass = target_flow(tree, probs)
    exit_node = _sample(exit_mass, generator)  # 0-dim
    bonus = _sample(_residual(tree, probs[exit_node], exit_node), generator)
    return _path_to(tree, exit_node), bonus


def verify_predraw(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None = None):
    """DDTree's predraw-and-follow: y_u ~ p_u at every node, follow while y_u is a child token.

    Returns:
        `(path, bonus)` as `verify_tev`; bonus = the first draw that is not a child token.
    """
    _check_rows(tree, probs, "probs")
    draws = _sample(probs, generator)  # [N]
    exit_node = _walk(tree, _child_by_choice(tree, draws))
    return _path_to(tree, exit_node), draws[exit_node]


def verify_residual(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None = None):
    """Sequential residual verification.

    At node u the children are tried in builder order: with r the current normalised residual
    (initially p_u), child token t is accepted with probability r(t); on rejection r(t) is
    zeroed and r renormalised; the walk descends on acceptance, and if every child is
    rejected the bonus is drawn from r. Before child j is tried, r(t_j) = p_u(t_j) / (1 -
    mass of the earlier siblings' tokens), so all coins are flipped up front (one per edge;
    coins off the walk are never looked at, which leaves the law unchanged).

    Returns:
        `(path, bonus)` as `verify_tev`.
    """
    _check_rows(tree, probs, "probs")
    dtype = _flow_dtype(probs)
    edge = _edge_probs(tree, probs).to(dtype)  # [N-1]
    parents = tree.parents[1:]  # [N-1]
    children = torch.arange(1, tree.num_nodes, device=edge.device)  # [N-1]
    earlier_sibling = (parents[:, None] == parents[None, :]) & (children[:, None] > children[None, :])  # [N-1, N-1]
    remaining = 1 - earlier_sibling.to(dtype) @ edge  # [N-1] residual mass when the child is tried
    accept_prob = torch.where(remaining > 0, edge / remaining, 0).clamp_(0, 1)
    accepted = _bernoulli(accept_prob, generator)  # [N-1]
    # The first accepted child of each node in builder order (index order), or none.
    first_accepted = torch.full((tree.num_nodes,), tree.num_nodes, device=edge.device)
    first_accepted.scatter_reduce_(0, parents, torch.where(accepted, children, tree.num_nodes), reduce="amin")
    exit_node = _walk(tree, torch.where(first_accepted < tree.num_nodes, first_accepted, -1))
    # Every child of the exit node was rejected: r is p_v without all child tokens.
    bonus = _sample(_residual(tree, probs[exit_node], exit_node), generator)
    return _path_to(tree, exit_node), bonus


def verify_greedy(tree: DraftTree, logits: torch.Tensor):
    """Temperature 0, the limit of every verifier: follow the argmax (lowest id on ties).

    Args:
        logits (`torch.Tensor` of shape `[N, V]`): target scores per node (any monotone transform of p_u).

    Returns:
        `(path, bonus)`: the deepest node v on the argmax path, and the argmax at v.
    """
    _check_rows(tree, logits, "logits")
    choice = logits.argmax(-1)  # [N]
    exit_node = _walk(tree, _child_by_choice(tree, choice))
    return _path_to(tree, exit_node), choice[exit_node]


VERIFIERS = {"tev": verify_tev, "predraw": verify_predraw, "residual": verify_residual}
