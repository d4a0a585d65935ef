"""Exactness of the verifiers: exhaustive enumeration of every draw, Monte-Carlo, greedy limit.

The exact law of a verifier is obtained by running the real verifier code with its random
helpers (`_sample`, `_sample_host`, `_bernoulli`) replaced by scripted draws and enumerating every sequence of
draw outcomes (depth-first, restarting the verifier for each branch), each weighted by its
probability. The helpers themselves are covered by the seeded Monte-Carlo test, which runs the
verifiers unpatched. The reference is the target's own sampling, computed here by walking the
tree through the parent pointers.
"""

import itertools
import math
from collections import defaultdict

import pytest
import torch

import hf_tev.verify as verify_module
from hf_tev.tree import DraftTree, build_tree
from hf_tev.verify import SAMPLING_VERIFIERS as VERIFIERS
from hf_tev.verify import VERIFIERS as ALL_VERIFIERS
from hf_tev.verify import target_flow, verify_greedy, verify_predraw, verify_residual, verify_tev


def make_tree(parents, tokens) -> DraftTree:
    """A DraftTree from parent pointers, visibility from following the pointers (not the builder)."""
    n = len(parents)
    visibility = torch.zeros(n, n, dtype=torch.bool)
    depths = []
    for node in range(n):
        u, depth = node, 0
        while u >= 0:
            visibility[node, u] = True
            u, depth = parents[u], depth + 1
        depths.append(depth - 1)
    return DraftTree(
        tokens=torch.tensor(tokens), depths=torch.tensor(depths), parents=torch.tensor(parents), visibility=visibility
    )


def children_of(tree):
    kids = defaultdict(list)
    for node, parent in enumerate(tree.parents.tolist()):
        if parent >= 0:
            kids[parent].append(node)
    return kids


def target_law(tree, probs):
    """The target's own law of (exit node, first token outside the tree): P(v) * p_v(y), y not a child token."""
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    p = probs.double().tolist()
    kids = children_of(tree)
    law = {}
    for v in range(tree.num_nodes):
        mass, u = 1.0, v
        while parents[u] >= 0:  # product of p along root..v
            mass *= p[parents[u]][tokens[u]]
            u = parents[u]
        child_tokens = {tokens[c] for c in kids[v]}
        for y in range(probs.shape[1]):
            if y not in child_tokens and mass * p[v][y] > 0:
                law[(v, y)] = mass * p[v][y]
    return law


# --------------------------------------------------------------------------------------------
# Exhaustive enumeration of a verifier's draws


class _NeedBranch(Exception):
    def __init__(self, outcomes):
        self.outcomes = outcomes  # [(outcome, probability)] with probability > 0


class _ScriptedDraws:
    """Replays a fixed list of draw outcomes; asks to branch when the list runs out."""

    def __init__(self, script):
        self.script, self.position, self.probability = script, 0, 1.0

    def _draw(self, outcomes):
        if self.position == len(self.script):
            raise _NeedBranch(outcomes)
        outcome = self.script[self.position]
        self.position += 1
        self.probability *= dict(outcomes)[outcome]
        return outcome

    def sample(self, weights, generator=None, uniform=None):  # stands in for verify._sample
        rows = weights.double().reshape(-1, weights.shape[-1])
        draws = []
        for row in rows:
            total = float(row.sum())
            assert total > 0, "a verifier sampled from all-zero weights"
            draws.append(self._draw([(i, w / total) for i, w in enumerate(row.tolist()) if w > 0]))
        return torch.tensor(draws).reshape(weights.shape[:-1])

    def sample_host(self, weights, uniform):  # stands in for verify._sample_host
        total = sum(weights)
        assert total > 0, "a verifier sampled from all-zero weights"
        return self._draw([(i, w / total) for i, w in enumerate(weights) if w > 0])

    def bernoulli(self, probs, generator=None):  # stands in for verify._bernoulli
        coins = []
        for a in probs.double().reshape(-1).tolist():
            assert 0.0 <= a <= 1.0
            coins.append(self._draw([(o, q) for o, q in ((True, a), (False, 1.0 - a)) if q > 0]))
        return torch.tensor(coins, dtype=torch.bool).reshape(probs.shape)


def enumerate_law(verifier, tree, probs, monkeypatch):
    """Exact law of (exit node, bonus) of `verifier` given p_u = probs[u] (as scores log p_u), summed over
    every outcome of every draw."""
    scores = probs.log()
    law = defaultdict(float)
    pending = [[]]
    runs = 0
    while pending:
        script = pending.pop()
        draws = _ScriptedDraws(script)
        monkeypatch.setattr(verify_module, "_sample", draws.sample)
        monkeypatch.setattr(verify_module, "_bernoulli", draws.bernoulli)
        monkeypatch.setattr(verify_module, "_sample_host", draws.sample_host)
        runs += 1
        try:
            path, bonus = verifier(tree, scores, generator=None)
        except _NeedBranch as branch:
            pending.extend(script + [outcome] for outcome, _ in branch.outcomes)
            continue
        assert draws.position == len(script)
        path = path.tolist()
        # The path is root..v through the parent pointers.
        parents = tree.parents.tolist()
        assert path[0] == 0 and all(parents[b] == a for a, b in itertools.pairwise(path))
        law[(path[-1], int(bonus))] += draws.probability
    monkeypatch.undo()
    return dict(law), runs


def assert_laws_equal(law, expected, tol):
    assert abs(sum(law.values()) - 1.0) < tol
    for key in set(law) | set(expected):
        assert abs(law.get(key, 0.0) - expected.get(key, 0.0)) < tol, (key, law.get(key), expected.get(key))


# --------------------------------------------------------------------------------------------
# Fixed cases: small trees with given p_u


def random_probs(num_nodes, vocab, seed, dtype=torch.float64, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(num_nodes, vocab, generator=gen, dtype=torch.float64)).softmax(-1).to(dtype)


def case_branchy():
    # root -> {1: tok 0, 2: tok 2}; 1 -> {3: tok 1, 4: tok 3}; 2 -> {5: tok 0}; 3 -> {6: tok 2}; V = 4
    tree = make_tree([-1, 0, 0, 1, 1, 2, 3], [9, 0, 2, 1, 3, 0, 2])
    return tree, random_probs(7, 4, seed=0)


def case_edge_rows():
    # Special rows: node 1's children (tokens 1, 3) cover all of p_1 (exit rate 0, dyadic so exactly
    # 0); root's second child (token 3) has p = 0; node 2 is one-hot on its child's token; node 4
    # is one-hot outside its children.
    tree = make_tree([-1, 0, 0, 1, 1, 2, 4], [9, 0, 3, 1, 3, 2, 0])
    probs = random_probs(7, 4, seed=1)
    probs[0] = torch.tensor([0.5, 0.25, 0.25, 0.0], dtype=torch.float64)
    probs[1] = torch.tensor([0.0, 0.75, 0.0, 0.25], dtype=torch.float64)
    probs[2] = torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    probs[4] = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    return tree, probs


def case_built():
    # A tree from the real builder (ties included), V = 3.
    logprobs = -0.5 * torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 2.0], [1.0, 0.0, 0.0]])
    tree = build_tree(logprobs, 6, 2)
    return tree, random_probs(tree.num_nodes, 3, seed=2)


def case_chain_float32():
    tree = make_tree([-1, 0, 1, 2], [5, 1, 0, 2])
    return tree, random_probs(4, 4, seed=3, dtype=torch.float32)


def case_branchy_flat():
    tree, _ = case_branchy()
    return tree, random_probs(7, 4, seed=4, scale=0.5)  # many cells with a sizeable mass


CASES = {
    "branchy": case_branchy,
    "branchy_flat": case_branchy_flat,
    "edge_rows": case_edge_rows,
    "built": case_built,
    "chain_f32": case_chain_float32,
}


@pytest.mark.parametrize("case", CASES)
def test_target_flow_matches_direct_recursion(case):
    tree, probs = CASES[case]()
    flow, exit_mass = target_flow(tree, probs.log())
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    p = probs.double().tolist()
    expected_flow = [1.0] * tree.num_nodes
    for c in range(1, tree.num_nodes):  # parents come first
        expected_flow[c] = expected_flow[parents[c]] * p[parents[c]][tokens[c]]
    expected_exit = list(expected_flow)
    for c in range(1, tree.num_nodes):
        expected_exit[parents[c]] -= expected_flow[c]
    tol = 1e-12 if probs.dtype == torch.float64 else 1e-6
    assert flow.tolist() == pytest.approx(expected_flow, abs=tol)
    assert exit_mass.tolist() == pytest.approx([max(e, 0.0) for e in expected_exit], abs=tol)
    assert float(exit_mass.sum()) == pytest.approx(1.0, abs=tol)
    assert (exit_mass >= 0).all()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", VERIFIERS)
def test_exact_law_equals_target(name, case, monkeypatch):
    tree, probs = CASES[case]()
    law, _ = enumerate_law(VERIFIERS[name], tree, probs, monkeypatch)
    expected = target_law(tree, probs)
    tol = 1e-9 if probs.dtype == torch.float64 else 1e-6
    assert_laws_equal(law, expected, tol)
    # The bonus is never a child token of the exit node. (Exception, at round-off probability: when
    # the children cover p_v but the computed exit mass of v is ~1e-16 instead of 0, the residual
    # is all zero and the verifier falls back to p_v rather than sample from zeros.)
    kids, tokens = children_of(tree), tree.tokens.tolist()
    assert sum(mass for (v, bonus), mass in law.items() if bonus in {tokens[c] for c in kids[v]}) < 1e-12
    # Optimal: expected block length (accepted nodes + bonus) = 1 + coverage.
    depths = tree.depths.tolist()
    mean_tau = sum(mass * (depths[v] + 1) for (v, _), mass in law.items())
    coverage = float(target_flow(tree, probs.log())[0][1:].sum())
    assert mean_tau == pytest.approx(1 + coverage, abs=tol)


def test_enumeration_explores_every_draw(monkeypatch):
    # Guard against a harness that silently explores nothing: predraw draws one token per node,
    # so its enumeration must run through the product of all row supports.
    tree, probs = case_chain_float32()
    _, runs = enumerate_law(verify_predraw, tree, probs, monkeypatch)
    assert runs > 4**tree.num_nodes
    _, runs = enumerate_law(verify_tev, tree, probs, monkeypatch)
    assert runs < 4 * tree.num_nodes + 8  # two draws only


def test_enumeration_detects_a_wrong_verifier(monkeypatch):
    # A deliberately wrong rule (bonus from p_v including child tokens) must be rejected.
    def wrong_tev(tree, scores, generator=None):
        _, exit_mass = target_flow(tree, scores)
        node = int(verify_module._sample(exit_mass, generator))
        return verify_module._path(tree.lists, node), verify_module._sample(scores[node].softmax(-1), generator)

    tree, probs = case_branchy()
    law, _ = enumerate_law(wrong_tev, tree, probs, monkeypatch)
    with pytest.raises(AssertionError):
        assert_laws_equal(law, target_law(tree, probs), 1e-9)


# --------------------------------------------------------------------------------------------
# Seeded Monte-Carlo with the real random helpers


def chi_square_critical(dof, z=3.719):
    """Wilson-Hilferty upper quantile of chi2(dof); z = 3.719 is the 1e-4 normal quantile."""
    h = 2.0 / (9.0 * dof)
    return dof * (1.0 - h + z * math.sqrt(h)) ** 3


@pytest.mark.parametrize("case", ["branchy_flat", "edge_rows"])
@pytest.mark.parametrize("name", VERIFIERS)
def test_monte_carlo_frequencies_match_exact_law(name, case):
    tree, probs = CASES[case]()
    probs = probs.float()
    expected = target_law(tree, probs)
    gen = torch.Generator().manual_seed(1234)
    num_samples = 4000
    counts = defaultdict(int)
    kids, tokens = children_of(tree), tree.tokens.tolist()
    for _ in range(num_samples):
        path, bonus = VERIFIERS[name](tree, probs.log(), generator=gen)
        v, y = int(path[-1]), int(bonus)
        assert y not in {tokens[c] for c in kids[v]}
        counts[(v, y)] += 1
    assert set(counts) <= set(expected)
    # Pool cells with expected count < 5 into one.
    statistic, cells, pooled_observed, pooled_expected = 0.0, 0, 0, 0.0
    for key, mass in expected.items():
        e = mass * num_samples
        if e < 5:
            pooled_observed += counts.get(key, 0)
            pooled_expected += e
        else:
            statistic += (counts.get(key, 0) - e) ** 2 / e
            cells += 1
    if pooled_expected > 0:
        statistic += (pooled_observed - pooled_expected) ** 2 / pooled_expected
        cells += 1
    assert cells >= 6
    assert statistic < chi_square_critical(cells - 1), (statistic, cells)


def test_verifiers_are_reproducible_with_a_generator():
    tree, probs = case_branchy()
    for verifier in VERIFIERS.values():
        first = [verifier(tree, probs.log(), torch.Generator().manual_seed(s)) for s in range(5)]
        again = [verifier(tree, probs.log(), torch.Generator().manual_seed(s)) for s in range(5)]
        for (p1, b1), (p2, b2) in zip(first, again, strict=True):
            assert torch.equal(p1, p2) and torch.equal(b1, b2)


# --------------------------------------------------------------------------------------------
# Greedy: the T -> 0 limit


def greedy_by_walking(tree, logits):
    kids, tokens = children_of(tree), tree.tokens.tolist()
    node = 0
    while True:
        best = int(logits[node].argmax())
        nxt = [c for c in kids[node] if tokens[c] == best]
        if not nxt:
            return node, best
        node = nxt[0]


@pytest.mark.parametrize("seed", range(6))
def test_greedy_is_the_zero_temperature_limit(seed):
    gen = torch.Generator().manual_seed(seed)
    logprobs = (3 * torch.randn(4, 5, generator=gen)).log_softmax(-1)
    tree = build_tree(logprobs, 14, 0)
    # Quantised logits so that ties occur (argmax takes the lowest id); correlate them with the
    # tree so that the argmax path goes deep.
    logits = torch.randint(0, 3, (tree.num_nodes, 5), generator=gen).float()
    next_tokens = torch.full((tree.num_nodes,), -1)
    next_tokens[tree.parents[1:]] = tree.tokens[1:]
    has_child = next_tokens >= 0
    logits[has_child, next_tokens[has_child]] += 2 * (torch.rand(int(has_child.sum()), generator=gen) < 0.7)
    path, bonus = verify_greedy(tree, logits)  # on CPU it reads the argmax of the rows it walks through
    node, best = greedy_by_walking(tree, logits)
    assert int(path[-1]) == node and int(bonus) == best and bonus.dim() == 0 and bonus.dtype == torch.long
    assert path.tolist() == tree.visibility[node].nonzero().squeeze(1).tolist()
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), 5).float()
    for verifier in VERIFIERS.values():
        for s in range(3):
            sampled_path, sampled_bonus = verifier(tree, one_hot.log(), torch.Generator().manual_seed(s))
            assert torch.equal(sampled_path, path) and int(sampled_bonus) == best


def test_greedy_is_a_registered_verifier_with_the_common_signature():
    tree, probs = case_branchy()
    assert ALL_VERIFIERS["greedy"] is verify_greedy and set(VERIFIERS) <= set(ALL_VERIFIERS)
    path, bonus = ALL_VERIFIERS["greedy"](tree, probs.log(), generator=torch.Generator().manual_seed(0))
    assert torch.equal(path, verify_greedy(tree, probs)[0]) and int(bonus) == int(verify_greedy(tree, probs)[1])


def test_single_node_tree():
    tree = make_tree([-1], [3])
    probs = torch.tensor([[0.0, 0.0, 1.0]])
    for verifier in VERIFIERS.values():
        path, bonus = verifier(tree, probs.log(), torch.Generator().manual_seed(0))
        assert path.tolist() == [0] and int(bonus) == 2
    path, bonus = verify_greedy(tree, probs)
    assert path.tolist() == [0] and int(bonus) == 2 and bonus.dim() == 0


def test_bad_inputs_raise_clear_errors():
    tree, probs = case_branchy()
    for fn in (target_flow, verify_tev, verify_predraw, verify_residual, verify_greedy):
        with pytest.raises(ValueError, match="tree nodes"):
            fn(tree, probs[:-1])
        with pytest.raises(ValueError, match=r"shape \[N, V\]"):
            fn(tree, probs[0])
        with pytest.raises(TypeError, match="floating"):
            fn(tree, probs.long())
        with pytest.raises(TypeError, match="torch.Tensor"):
            fn(tree, probs.tolist())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_distributions(dtype):
    # The decode loop may hand over half-precision rows: flows are computed in float32, draws in float64.
    tree, probs = case_edge_rows()
    probs = probs.to(dtype)
    flow, exit_mass = target_flow(tree, probs.log())
    assert flow.dtype == torch.float32 and float(exit_mass.sum()) == pytest.approx(1.0, abs=1e-2)
    kids, tokens = children_of(tree), tree.tokens.tolist()
    for verifier in VERIFIERS.values():
        for s in range(20):
            path, bonus = verifier(tree, probs.log(), torch.Generator().manual_seed(s))
            v = int(path[-1])
            assert int(bonus) not in {tokens[c] for c in kids[v]} and probs[v, int(bonus)] > 0


@pytest.mark.parametrize("case", CASES)
def test_flow_reads_only_rows_of_nodes_with_children(case):
    # TEV and the residual verifier normalise only these rows (the saving over a softmax of every row):
    # leaf rows must not matter to the flow.
    tree, probs = CASES[case]()
    scores = probs.log()
    leaves = torch.ones(tree.num_nodes, dtype=torch.bool)
    leaves[tree.internal_nodes] = False
    assert leaves.any()
    poisoned = scores.clone()
    poisoned[leaves] = float("nan")
    for got, want in zip(target_flow(tree, poisoned), target_flow(tree, scores), strict=True):
        assert torch.equal(got, want)


def test_edge_flow_checks_its_input():
    tree, probs = case_branchy()
    edge = probs[tree.parents[1:], tree.tokens[1:]]
    torch.testing.assert_close(verify_module.edge_flow(tree, edge), target_flow(tree, probs.log()), atol=1e-12, rtol=0)
    for bad in (edge[:-1], edge[None], edge.tolist()):
        with pytest.raises(ValueError, match="edge must be"):
            verify_module.edge_flow(tree, bad)


def test_scores_are_logits_up_to_a_row_constant():
    # The verifiers take processed logits: shifting a row by a constant leaves p_u, hence every draw, unchanged.
    tree, probs = case_branchy()
    scores = probs.log()
    shifted = scores + torch.arange(tree.num_nodes, dtype=scores.dtype)[:, None] * 3.5
    for verifier in VERIFIERS.values():
        for s in range(5):
            a = verifier(tree, scores, torch.Generator().manual_seed(s))
            b = verifier(tree, shifted, torch.Generator().manual_seed(s))
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.allclose(target_flow(tree, shifted)[1], target_flow(tree, scores)[1], atol=1e-12)


def test_host_sampler_follows_the_inverse_cdf():
    sample = verify_module._sample_host
    weights = [0.0, 0.25, 0.0, 0.5, 0.25, 0.0]
    # x = (1 - u) * total: the first index whose running sum reaches x; zero weights never win.
    assert sample(weights, 0.0) == 4 and sample(weights, 0.2) == 4 and sample(weights, 0.26) == 3
    assert sample(weights, 0.74) == 3 and sample(weights, 0.76) == 1 and sample(weights, 1 - 1e-12) == 1
    gen = torch.Generator().manual_seed(0)
    counts = [0] * len(weights)
    for u in torch.rand(20000, generator=gen, dtype=torch.float64).tolist():
        counts[sample(weights, u)] += 1
    assert counts[0] == counts[2] == counts[5] == 0
    assert abs(counts[3] / 20000 - 0.5) < 0.015 and abs(counts[1] / 20000 - 0.25) < 0.015


def test_coverage_after_a_verifier_equals_the_target_flow():
    from hf_tev.verify import coverage

    gen = torch.Generator().manual_seed(0)
    tree = build_tree((2 * torch.randn(4, 30, generator=gen)).log_softmax(-1), 12, 3)
    scores = 2 * torch.randn(tree.num_nodes, 30, generator=gen)
    expected = float(target_flow(tree, scores)[0].sum())
    assert float(coverage(tree, scores)) == expected  # no verifier ran: the device computation itself
    for name, verifier in VERIFIERS.items():
        fresh = build_tree((2 * torch.randn(4, 30, generator=gen)).log_softmax(-1), 12, 3)
        fresh_scores = 2 * torch.randn(fresh.num_nodes, 30, generator=gen)
        verifier(fresh, fresh_scores, generator=gen)
        value = coverage(fresh, fresh_scores)  # TEV's host edges, else its normalised rows or a fresh flow
        assert float(value) == pytest.approx(float(target_flow(fresh, fresh_scores)[0].sum()), rel=1e-6), name
    # what a verifier remembers belongs to its scores: other scores, or the same changed in place, start afresh
    verify_tev(tree, scores, generator=gen)
    other = scores.clone()
    other[0] += 5.0
    assert float(coverage(tree, other)) == float(target_flow(tree, other.clone())[0].sum())
    scores[0] += 5.0
    assert float(coverage(tree, scores)) == float(target_flow(tree, scores.clone())[0].sum())
