"""Exact tree verifiers: target flow, TEV, predraw-and-follow, sequential residual, greedy.

Every verifier gets the tree and `scores` [N, V]: row u holds the target's processed
next-token logits after the path root..u (what generate's logits processors return), so
p_u = softmax(scores[u]); -inf entries (top-k, top-p, ...) have probability 0. It returns
`(path, bonus)`: the accepted node indices root..v (root first) and one token drawn
outside the tree at v. All of them are exact (the emitted tokens are distributed as the
target's own sampling) and optimal (the exit node follows the exit law E, so
E[accepted nodes + 1] = 1 + coverage); docs/design.md#the-exit-law-and-tev.

Where the work goes. The [V]-wide work stays on the device: each verifier normalises only
the rows it reads (TEV and the residual verifier: the rows of nodes with children plus the
exit row; predraw: every row, it draws at every node). The per-node bookkeeping (flow,
exit masses, the walk) then runs on the host, after ONE device-to-host copy of N numbers:
on trees of tens to hundreds of nodes Python floats cost less than the dozen tiny tensor
ops (each a dispatch on CPU, a launch on GPU) that the same arithmetic needs on the device,
and the decode loop has to bring the accepted path to the host anyway. `path` is returned
on the host; `bonus` (0-dim) stays on the device.

Randomness goes through three helpers, `_sample` (categorical on the device),
`_sample_host` (categorical from host weights and a given uniform) and `_bernoulli`, so
that the tests can replace them by scripted draws and enumerate each verifier's output law
exactly.
"""

import itertools
from bisect import bisect_left

import torch

from .tree import DraftTree, TreeLists, host_long, to_device

# --------------------------------------------------------------------------------------------
# Random draws (sync-free on accelerators)


def _sample(
    weights: torch.Tensor, generator: torch.Generator | None = None, uniform: float | None = None
) -> torch.LongTensor:
    """One categorical draw per row of non-negative (unnormalised) weights, by inverse CDF.

    With x = u * total, u ~ U(0, 1], the draw is the first index whose cumulative weight is >= x:
    index i wins with probability w_i / total, a zero weight never wins (its CDF step is empty,
    and x > 0), and x <= total always finds an index. One cumsum and one binary search per row,
    no host sync. The CDF is float64: a float32 running sum near 1 drops every addend below
    3e-8, i.e. the whole low-probability tail of a large vocabulary. (torch.multinomial and the
    exponential race are exact too, but their per-element random numbers make them several
    times slower on CPU at vocabulary size.) A host `uniform` (one row) saves the device draw.
    """
    # weights: [..., V] -> [...]
    cdf_dtype = torch.float32 if weights.device.type == "mps" else torch.float64  # MPS has no float64
    cdf = weights.cumsum(-1, dtype=cdf_dtype)  # [..., V]
    if uniform is None:
        uniform = torch.rand(cdf.shape[:-1] + (1,), generator=generator, dtype=cdf_dtype, device=cdf.device)
    threshold = (1 - uniform) * cdf[..., -1:]  # [..., 1] in (0, total]
    return torch.searchsorted(cdf, threshold).squeeze(-1)


def sample_scores(scores: torch.Tensor, generator: torch.Generator | None = None) -> torch.LongTensor:
    """One token per row from softmax(scores) `[..., V]` -> `[...]`, by `_sample`'s inverse CDF: a plain step's
    draw (the prefill's root, a root-only cycle's bonus), with the verifiers' one uniform per draw."""
    return _sample(torch.softmax(scores, dim=-1), generator)


def _bernoulli(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.BoolTensor:
    """Independent coins, True with the given probabilities."""
    uniform = torch.rand(probs.shape, generator=generator, dtype=probs.dtype, device=probs.device)
    return uniform < probs  # U in [0, 1): P(U < a) = a


def _sample_host(weights: list[float], uniform: float) -> int:
    """One categorical draw from non-negative host weights, by inverse CDF with the given u ~ U[0, 1).

    The same rule as `_sample`: the first index whose running sum is >= (1 - u) * total, so index i
    wins with probability w_i / total and a zero weight never wins.
    """
    cdf = list(itertools.accumulate(weights))
    return min(bisect_left(cdf, (1.0 - uniform) * cdf[-1]), len(cdf) - 1)


# --------------------------------------------------------------------------------------------
# Shared pieces


def _check_rows(tree: DraftTree, rows: torch.Tensor, name: str) -> None:
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(rows).__name__}")
    if not rows.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got dtype {rows.dtype}")
    if rows.dim() != 2 or rows.shape[0] != tree.num_nodes:
        raise ValueError(f"{name} must have shape [N, V] with N = {tree.num_nodes} tree nodes, got {tuple(rows.shape)}")


def _flow_dtype(scores: torch.Tensor) -> torch.dtype:
    return torch.float64 if scores.dtype == torch.float64 else torch.float32


def _internal_probs(tree: DraftTree, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """p_u for the nodes with children, and the edge probabilities read from them; computed once per tree and
    scores (`DraftTree.memo_for`: the decode loop's coverage after a verifier reads the same rows).

    Returns:
        `(probs, edge)`: `[I, V]` softmax of the rows of `tree.internal_nodes` (in the flow dtype), and
        `[N-1]` p_{parent(c)}(token of c) for every non-root node c.
    """
    memo = tree.memo_for(scores)
    if "internal" not in memo:
        internal = tree.internal_nodes  # [I], ascending
        probs = torch.softmax(scores.index_select(0, internal).to(_flow_dtype(scores)), dim=-1)  # [I, V]
        memo["internal"] = probs, probs[tree.parent_rows, tree.tokens[1:]]
    return memo["internal"]


def _exit_row(tree: DraftTree, scores: torch.Tensor, probs: torch.Tensor, node: int) -> torch.Tensor:
    """p_node [V]: from the rows already normalised when `node` has children, else its own softmax."""
    lists = tree.lists
    if lists.children[node]:
        return probs[bisect_left(lists.internal, node)]
    return torch.softmax(scores[node].to(_flow_dtype(scores)), dim=-1)


def _residual(tree: DraftTree, row: torch.Tensor, node: int, residual_mass: float = 0.0) -> torch.Tensor:
    """res_node(y) ∝ p_node(y) [y is not a child token of node], unnormalised: [V].

    If the children cover all of p_node's mass the residual is all zero; an exact verifier
    then exits at `node` with probability 0, so this is reached only through round-off in the
    exit masses (~1e-7). Instead of sampling from zeros we fall back to p_node itself. The
    check costs device ops, so it is skipped when the caller knows (from the edge probabilities,
    `residual_mass` = 1 - their sum) that the residual is far from empty.
    """
    children = tree.lists.children[node]
    if not children:
        return row
    child_tokens = to_device(host_long([tree.lists.tokens[c] for c in children]), row.device)
    residual = row.index_fill(0, child_tokens, 0)
    if residual_mass > 1e-3:  # float32 edge sums are off by ~1e-6 at most: the residual holds mass
        return residual
    return torch.where(residual.sum() > 0, residual, row)


def _to_host(values: torch.Tensor, generator: torch.Generator | None, draws: int = 1):
    """values [n] and `draws` fresh uniforms, in one device-to-host copy (a step: `yield from` it)."""
    uniform = torch.rand(draws, generator=generator, dtype=torch.float64, device=values.device)
    if values.device.type == "cpu":  # nothing to batch: two list conversions are cheaper than a cat
        return values.tolist(), uniform.tolist()
    host = yield torch.cat([values.to(torch.float64), uniform])
    return host[:-draws], host[-draws:]


# --------------------------------------------------------------------------------------------
# Steps: a verifier as a generator that yields the one tensor it reads and gets it back as a host list, so that
# a batch's rows read their decisions together (`run_together`: one wait for the device instead of one per row).


def run_steps(steps):
    """Drive one verifier's steps: each tensor it yields is read to the host (`tolist`); returns its result."""
    try:
        request = next(steps)
        while True:
            request = steps.send(request.tolist())
    except StopIteration as done:
        return done.value


def read_all(tensors: list[torch.Tensor]) -> list[list]:
    """1-D tensors as host lists, in ONE device-to-host copy (a mix of dtypes goes as float64, which holds token
    ids, node indices and coins exactly)."""
    same = len({tensor.dtype for tensor in tensors}) == 1
    host = torch.cat(tensors if same else [tensor.to(torch.float64) for tensor in tensors]).tolist()
    values, start = [], 0
    for tensor in tensors:
        part = host[start : start + tensor.numel()]
        if not same and not tensor.is_floating_point():
            part = [(bool if tensor.dtype == torch.bool else int)(value) for value in part]
        values.append(part)
        start += tensor.numel()
    return values


def run_together(runs: list) -> list:
    """Drive several verifiers' steps with one read per round: each runs to its read, then every request is read
    at once and each goes on. Returns their results in order. Draws before a read keep their order (row by row),
    so a verifier that draws only before its read (TEV, predraw) draws what it would alone."""
    results, waiting = [None] * len(runs), []
    for i, run in enumerate(runs):
        try:
            waiting.append((i, run, next(run)))
        except StopIteration as done:
            results[i] = done.value
    while waiting:
        answers, still = read_all([request.reshape(-1) for _, _, request in waiting]), []
        for (i, run, _), answer in zip(waiting, answers, strict=True):
            try:
                still.append((i, run, run.send(answer)))
            except StopIteration as done:
                results[i] = done.value
        waiting = still
    return results


def _path(lists: TreeLists, node: int) -> torch.LongTensor:
    """Node indices root..node (ancestors have smaller indices), on the host: [depth(node) + 1]."""
    path = [node]
    while lists.parents[path[-1]] >= 0:
        path.append(lists.parents[path[-1]])
    return host_long(path[::-1])


def _follow(lists: TreeLists, choice: list[int]) -> int:
    """From the root, move to the child whose token is choice[u] while there is one; the last node."""
    node = 0
    while True:
        step = next((c for c in lists.children[node] if lists.tokens[c] == choice[node]), None)
        if step is None:
            return node
        node = step


# --------------------------------------------------------------------------------------------
# Target flow and the verifiers


def edge_flow(tree: DraftTree, edge: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, E) on the device from the edge probabilities p_{parent(c)}(tok c) `[N-1]` (any dtype, differentiable);
    see `target_flow`. ExitTrain's loss weights use it with floored edges."""
    if not isinstance(edge, torch.Tensor) or edge.shape != (tree.num_nodes - 1,):
        raise ValueError(
            f"edge must be a tensor of shape [N - 1] = [{tree.num_nodes - 1}] (one per non-root node), "
            f"got {getattr(edge, 'shape', type(edge).__name__)}"
        )
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


def _exit_masses_host(lists: TreeLists, edge: list[float]) -> tuple[list[float], list[float]]:
    """E on the host, the same recursion as `edge_flow`: P(c) = P(u) p_u(tok c), E = P (1 - child mass).
    Also returns 1 - child mass per node (the residual mass)."""
    flow, residual_mass = [1.0] * len(lists.parents), [1.0] * len(lists.parents)
    for node in range(1, len(lists.parents)):
        parent = lists.parents[node]
        flow[node] = flow[parent] * edge[node - 1]
        residual_mass[parent] -= edge[node - 1]
    return [max(p * r, 0.0) for p, r in zip(flow, residual_mass, strict=True)], residual_mass


def target_flow(tree: DraftTree, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target flow on the tree, on the device (no host sync).

    Args:
        tree (`DraftTree`): the tree.
        scores (`torch.Tensor` of shape `[N, V]`): processed target logits, p_u = softmax(scores[u]).

    Returns:
        `(P, E)`, both `[N]` (float64 for float64 scores, else float32): P(root) = 1,
        P(c) = P(u) p_u(tok c); exit masses E(u) = P(u) - sum_{c child of u} P(c) >= 0, sum E = 1
        (E telescopes to P(root); the clamp only acts when round-off makes child masses exceed 1).
    """
    _check_rows(tree, scores, "scores")
    return edge_flow(tree, _internal_probs(tree, scores)[1])


def coverage(tree: DraftTree, scores: torch.Tensor) -> float | torch.Tensor:
    """1 + C, the tree's expected block length under the processed target scores: `target_flow`'s P summed over
    every node. On the host (a Python float, from float64 products) when a verifier already brought this tree's
    edge probabilities there (TEV); otherwise a 0-dim tensor on the scores' device, read by the caller when it
    needs the number (no host sync per cycle)."""
    edge = tree.memo_for(scores).get("host_edge")
    if edge is None:
        return target_flow(tree, scores)[0].sum()
    flow, parents = [1.0] * tree.num_nodes, tree.lists.parents
    for node in range(1, tree.num_nodes):
        flow[node] = flow[parents[node]] * edge[node - 1]
    return sum(flow)


def verify_tev(tree: DraftTree, scores: torch.Tensor, generator: torch.Generator | None = None):
    """Tree Exit Verification: draw the exit node v ~ E, accept root..v, bonus ~ res_v.

    Two draws per cycle, no walk: the exit masses come from the edge probabilities alone, and
    the only [V]-wide work besides normalising the rows of nodes with children is the exit
    node's residual row.

    Returns:
        `(path, bonus)`: `torch.LongTensor` `[k + 1]` node indices root..v (host), and a 0-dim token id.
    """
    return run_steps(tev_steps(tree, scores, generator))


def tev_steps(tree: DraftTree, scores: torch.Tensor, generator: torch.Generator | None = None):
    """`verify_tev` as steps (`run_steps`)."""
    _check_rows(tree, scores, "scores")
    lists = tree.lists
    probs, edge = _internal_probs(tree, scores)
    edge, (exit_uniform, bonus_uniform) = yield from _to_host(edge, generator, draws=2)  # the one host copy
    tree.memo_for(scores)["host_edge"] = edge  # for `coverage`
    exit_mass, residual_mass = _exit_masses_host(lists, edge)
    exit_node = _sample_host(exit_mass, exit_uniform)
    residual = _residual(tree, _exit_row(tree, scores, probs, exit_node), exit_node, residual_mass[exit_node])
    return _path(lists, exit_node), _sample(residual, generator, uniform=bonus_uniform)


def verify_predraw(tree: DraftTree, scores: torch.Tensor, generator: torch.Generator | None = None):
    """DDTree's predraw-and-follow: y_u ~ p_u at every node, follow while y_u is a child token.

    Returns:
        `(path, bonus)` as `verify_tev`; bonus = the first draw that is not a child token.
    """
    return run_steps(predraw_steps(tree, scores, generator))


def predraw_steps(tree: DraftTree, scores: torch.Tensor, generator: torch.Generator | None = None):
    """`verify_predraw` as steps (`run_steps`)."""
    _check_rows(tree, scores, "scores")
    draws = _sample(torch.softmax(scores.to(_flow_dtype(scores)), dim=-1), generator)  # [N]
    exit_node = _follow(tree.lists, (yield draws))  # the one host copy
    return _path(tree.lists, exit_node), draws[exit_node]


def verify_residual(tree: DraftTree, scores: torch.Tensor, generator: torch.Generator | None = None):
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
    return run_steps(residual_steps(tree, scores, generator))


def residual_steps(tree: DraftTree, scores: torch.Tensor, generator: torch.Generator | None = None):
    """`verify_residual` as steps (`run_steps`). Its bonus is drawn after the read: in `run_together` after
    every row's coins (the same law, other draws than row by row)."""
    _check_rows(tree, scores, "scores")
    lists = tree.lists
    probs, edge = _internal_probs(tree, scores)  # [N-1]
    parents = tree.parents[1:]  # [N-1]
    children = torch.arange(1, tree.num_nodes, device=edge.device)  # [N-1]
    earlier_sibling = (parents[:, None] == parents[None, :]) & (children[:, None] > children[None, :])  # [N-1, N-1]
    remaining = 1 - earlier_sibling.to(edge.dtype) @ edge  # [N-1] residual mass when the child is tried
    accept_prob = torch.where(remaining > 0, edge / remaining, 0).clamp_(0, 1)
    accepted = [False] + (yield _bernoulli(accept_prob, generator))  # per node; the one host copy
    node = 0
    while True:  # descend into the first accepted child in builder order
        step = next((c for c in lists.children[node] if accepted[c]), None)
        if step is None:
            break
        node = step
    # Every child of the exit node was rejected: r is p_v without all child tokens.
    bonus = _sample(_residual(tree, _exit_row(tree, scores, probs, node), node), generator)
    return _path(lists, node), bonus


def verify_greedy(tree: DraftTree, logits: torch.Tensor, generator: torch.Generator | None = None):
    """Temperature 0, the limit of every verifier: follow the argmax (lowest id on ties). Draws nothing
    (`generator` is accepted for the common signature and unused).

    Args:
        logits (`torch.Tensor` of shape `[N, V]`): target scores per node (any monotone transform of p_u).

    Returns:
        `(path, bonus)`: the deepest node v on the argmax path (host), and the argmax at v.
    """
    return run_steps(greedy_steps(tree, logits))


def greedy_steps(tree: DraftTree, logits: torch.Tensor, generator: torch.Generator | None = None):
    """`verify_greedy` as steps (`run_steps`)."""
    _check_rows(tree, logits, "logits")
    lists = tree.lists
    if logits.device.type == "cpu":  # a host read costs no device sync: take the argmax of the visited rows only
        node = 0
        while True:
            choice = logits[node].argmax()
            token = int(choice)
            step = next((c for c in lists.children[node] if lists.tokens[c] == token), None)
            if step is None:
                return _path(lists, node), choice
            node = step
    choice = logits.argmax(-1)  # [N]
    exit_node = _follow(lists, (yield choice))  # the one host copy
    return _path(lists, exit_node), choice[exit_node]


# Every verifier: (tree, scores [N, V], generator=None) -> (path on the host, bonus). The sampling ones are exact
# at any temperature and selectable in `TEVConfig.verifier`; "greedy" is what all of them become at temperature 0
# and is what the decoder uses for greedy decoding.
SAMPLING_VERIFIERS = {"tev": verify_tev, "predraw": verify_predraw, "residual": verify_residual}
VERIFIERS = {**SAMPLING_VERIFIERS, "greedy": verify_greedy}
# Each verifier's steps (`run_together` reads a batch's decisions at once); a verifier not here is called as it is.
VERIFIER_STEPS = {
    verify_tev: tev_steps,
    verify_predraw: predraw_steps,
    verify_residual: residual_steps,
    verify_greedy: greedy_steps,
}
