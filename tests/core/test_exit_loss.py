"""ExitTrain loss maths (hf_tev/exit_loss.py) against hand values and straightforward re-computation."""

import math

import pytest
import torch

from hf_tev.exit_loss import (
    ce_decays,
    dflash_loss,
    exittrain_loss,
    expected_block_length,
    node_weights,
    training_flow,
    tree_loss,
)
from hf_tev.tree import DraftTree, build_tree


def make_tree(tokens, parents):
    """A DraftTree from tokens and parent indices (depths and visibility derived here, independently)."""
    n = len(tokens)
    depths, visibility = [0] * n, torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            visibility[i, j] = True
            j = parents[j]
        if i:
            depths[i] = depths[parents[i]] + 1
    return DraftTree(
        tokens=torch.tensor(tokens), depths=torch.tensor(depths), parents=torch.tensor(parents), visibility=visibility
    )


# Hand-made tree over a 4-token vocabulary:
#   root(3) -> a(0) -> c(2)
#                   -> d(3)   (p = 0.01, below alpha = 0.05)
#           -> b(1)
HAND_TREE = make_tree(tokens=[3, 0, 1, 2, 3], parents=[-1, 0, 0, 1, 1])
HAND_PROBS = torch.tensor(
    [
        [0.50, 0.30, 0.10, 0.10],  # root: p(a) = 0.5, p(b) = 0.3, rho = 0.2
        [0.19, 0.20, 0.60, 0.01],  # a: p(c) = 0.6, p(d) = 0.01 -> 0.05 in the product, rho = 1 - 0.61 = 0.39
        [0.25, 0.25, 0.25, 0.25],  # b: leaf, rho = 1
        [0.25, 0.25, 0.25, 0.25],  # c: leaf
        [0.25, 0.25, 0.25, 0.25],  # d: leaf
    ],
    dtype=torch.float64,
)


def test_hand_tree_weights():
    # Worked out by hand from docs/design.md#exittrain with alpha = 0.05.
    P, rho = training_flow(HAND_TREE, HAND_PROBS, alpha=0.05)
    torch.testing.assert_close(P, torch.tensor([1.0, 0.5, 0.3, 0.3, 0.025], dtype=P.dtype))
    torch.testing.assert_close(rho, torch.tensor([0.2, 0.39, 1.0, 1.0, 1.0], dtype=rho.dtype))
    exit_weights = node_weights(HAND_TREE, HAND_PROBS, "exit", alpha=0.05)  # w(v) * depth(v)
    torch.testing.assert_close(exit_weights, torch.tensor([0.0, 0.195, 0.3, 0.6, 0.05], dtype=exit_weights.dtype))
    prefix_weights = node_weights(HAND_TREE, HAND_PROBS, "prefix", alpha=0.05)  # P(v), root excluded
    torch.testing.assert_close(prefix_weights, torch.tensor([0.0, 0.5, 0.3, 0.3, 0.025], dtype=prefix_weights.dtype))
    # 1 + C uses the unfloored flow: 1 + 0.5 + 0.3 + 0.3 + 0.005.
    torch.testing.assert_close(expected_block_length(HAND_TREE, HAND_PROBS), torch.tensor(2.105, dtype=torch.float64))


def test_floor_only_acts_below_alpha_and_rho_is_clipped():
    P_small, _ = training_flow(HAND_TREE, HAND_PROBS, alpha=1e-4)
    assert P_small[4].item() == pytest.approx(0.5 * 0.01)
    # Children covering more than the row (round-off) give rho 0, never negative.
    probs = HAND_PROBS.clone()
    probs[1] = torch.tensor([0.0, 0.0, 0.7, 0.3000001], dtype=torch.float64)
    _, rho = training_flow(HAND_TREE, probs, alpha=1e-4)
    assert rho[1].item() == 0.0


def test_node_weights_reject_unknown_objective():
    with pytest.raises(ValueError, match="tree objectives"):
        node_weights(HAND_TREE, HAND_PROBS, "dflash")


def naive_tree_loss(logits, trees, weights, normalization="nodes"):
    """Materialises log q at every node: the definition, tree by tree."""
    sums = []
    for k, (tree, w) in enumerate(zip(trees, weights, strict=True)):
        log_q = logits[k].log_softmax(-1)  # [D, V]
        node_log_q = torch.stack(
            [
                log_q[d - 1, t] if d > 0 else log_q.new_zeros(())
                for d, t in zip(tree.depths.tolist(), tree.tokens.tolist(), strict=True)
            ]
        )  # [N]
        sums.append(-(w * node_log_q).sum())
    if normalization == "nodes":  # all trees' weighted NLL over the number of drafted nodes (root excluded)
        return torch.stack(sums).sum() / sum(tree.num_nodes - 1 for tree in trees)
    return torch.stack([total / w.sum() for total, w in zip(sums, weights, strict=True)]).mean()


def pad(rows, value=0):
    return torch.nn.utils.rnn.pad_sequence(list(rows), batch_first=True, padding_value=value)


@pytest.mark.parametrize("normalization", ["nodes", "weight_sum"])
def test_tree_loss_equals_naive_loss_and_gradient(normalization):
    torch.manual_seed(0)
    K, D, V = 3, 4, 11
    trees = [build_tree(torch.randn(D, V).log_softmax(-1), budget, root_token=k) for k, budget in enumerate([9, 5, 14])]
    weights = [torch.rand(t.num_nodes) * (t.depths > 0) for t in trees]
    logits = torch.randn(K, D, V, dtype=torch.float64, requires_grad=True)
    fast = tree_loss(logits, pad(t.depths for t in trees), pad(t.tokens for t in trees), pad(weights), normalization)
    (fast_grad,) = torch.autograd.grad(fast, logits)
    naive = naive_tree_loss(logits, trees, [w.double() for w in weights], normalization)
    (naive_grad,) = torch.autograd.grad(naive, logits)
    torch.testing.assert_close(fast.double(), naive, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fast_grad, naive_grad, rtol=1e-6, atol=1e-6)


def test_tree_loss_rejects_unknown_normalization():
    with pytest.raises(ValueError, match="normalization"):
        tree_loss(torch.zeros(1, 2, 4), HAND_TREE.depths[None], HAND_TREE.tokens[None], torch.zeros(1, 5), "mean")


def test_tree_loss_minimum_is_the_weighted_token_distribution():
    # For each depth d the loss is a cross-entropy against the node weights of that depth, so its
    # gradient vanishes exactly at q_d(t) = (weight of depth-d nodes with token t) / (weight of depth d).
    tree = HAND_TREE
    weights = node_weights(tree, HAND_PROBS, "exit", alpha=0.05).double()
    target = torch.zeros(2, 4, dtype=torch.float64)  # [D, V]
    target.index_put_((tree.depths[1:] - 1, tree.tokens[1:]), weights[1:], accumulate=True)
    target = target / target.sum(-1, keepdim=True)
    logits = target.clamp_min(1e-300).log()[None].requires_grad_(True)
    loss = tree_loss(logits, tree.depths[None], tree.tokens[None], weights[None])
    (grad,) = torch.autograd.grad(loss, logits)
    assert grad.abs().max().item() < 1e-9
    # Any other distribution scores worse.
    other = (logits.detach() + 0.1 * torch.randn_like(logits)).requires_grad_(False)
    assert tree_loss(other, tree.depths[None], tree.tokens[None], weights[None]) > loss


def test_tree_loss_without_weight():
    logits = torch.randn(2, 2, 4, requires_grad=True)
    depths = HAND_TREE.depths[None].repeat(2, 1)
    tokens = HAND_TREE.tokens[None].repeat(2, 1)
    weights = torch.stack([node_weights(HAND_TREE, HAND_PROBS, "prefix"), torch.zeros(5)])
    # weight_sum: a tree without weight is skipped.
    torch.testing.assert_close(
        tree_loss(logits, depths, tokens, weights, "weight_sum"),
        tree_loss(logits[:1], depths[:1], tokens[:1], weights[:1], "weight_sum"),
    )
    # nodes: its 4 drafted nodes still count in the normaliser (4 + 4 instead of 4).
    torch.testing.assert_close(
        tree_loss(logits, depths, tokens, weights, "nodes"),
        tree_loss(logits[:1], depths[:1], tokens[:1], weights[:1], "nodes") / 2,
    )
    for normalization in ("nodes", "weight_sum"):
        none = tree_loss(logits, depths, tokens, torch.zeros(2, 5), normalization)
        assert none.item() == 0.0 and none.requires_grad
    # Padding nodes (depth 0, weight 0) are not counted.
    padded = tree_loss(
        logits[:1],
        torch.cat([depths[:1], torch.zeros(1, 3, dtype=torch.long)], 1),
        torch.cat([tokens[:1], torch.zeros(1, 3, dtype=torch.long)], 1),
        torch.cat([weights[:1], torch.zeros(1, 3)], 1),
        "nodes",
    )
    torch.testing.assert_close(padded, tree_loss(logits[:1], depths[:1], tokens[:1], weights[:1], "nodes"))


def test_dflash_loss_matches_definition():
    torch.manual_seed(1)
    B, A, D, V, gamma = 2, 3, 5, 7, 2.5
    logits = torch.randn(B, A, D, V, dtype=torch.float64)
    labels = torch.randint(0, V, (B, A, D))
    mask = torch.rand(B, A, D) > 0.3
    total, weight_sum = 0.0, 0.0
    for b in range(B):
        for a in range(A):
            for k in range(1, D + 1):
                if mask[b, a, k - 1]:
                    w = math.exp(-(k - 1) / gamma)
                    total += -w * logits[b, a, k - 1].log_softmax(-1)[labels[b, a, k - 1]].item()
                    weight_sum += w
    assert dflash_loss(logits, labels, mask, gamma).item() == pytest.approx(total / weight_sum, rel=1e-6)
    # Perfect predictions give (almost) 0.
    sharp = torch.full((1, D, V), -50.0).scatter(-1, labels[0, :1, :, None], 50.0)
    assert dflash_loss(sharp, labels[0, :1], torch.ones(1, D, dtype=torch.bool), gamma).item() < 1e-20
    # gamma = inf weighs every depth equally: the plain masked mean.
    plain = torch.nn.functional.cross_entropy(logits[mask], labels[mask])
    torch.testing.assert_close(dflash_loss(logits, labels, mask, float("inf")), plain)


def test_edge_probabilities_stand_in_for_the_distributions():
    edges = torch.tensor([1.0, 0.5, 0.3, 0.6, 0.01], dtype=torch.float64)  # p(v) = probs[parent(v), x_v]
    for got, expected in (
        (training_flow(HAND_TREE, edges, 0.05), training_flow(HAND_TREE, HAND_PROBS, 0.05)),
        (node_weights(HAND_TREE, edges, "exit", 0.05), node_weights(HAND_TREE, HAND_PROBS, "exit", 0.05)),
        (expected_block_length(HAND_TREE, edges), expected_block_length(HAND_TREE, HAND_PROBS)),
    ):
        torch.testing.assert_close(got, expected)


# ---------------------------------------------------------------------------------------------
# The whole objective on a case worked out by hand from docs/design.md#exittrain (no hf_tev function computes
# an expected number here).


def log_q(row, token):
    """log softmax(row)[token] by hand."""
    return row[token] - math.log(sum(math.exp(x) for x in row))


# Three drafted blocks (block size 3: depths 1 and 2), vocabulary of 3.
HAND_LOGITS = [
    [[2.0, 1.0, 0.0], [0.0, 1.0, 0.5]],  # block 0: q_1, q_2
    [[0.5, 0.0, 1.0], [1.0, 1.0, 0.0]],  # block 1
    [[0.0, 0.0, 0.0], [3.0, 0.0, 0.0]],  # block 2
]
HAND_LABELS = [[0, 1], [2, 1], [1, 0]]  # x_{a+1}, x_{a+2}
HAND_MASK = [[True, True], [True, True], [True, False]]  # block 2's second token is not supervised: no tree there
# Tree A (block 0): root -> a(token 0) -> c(token 1); root -> b(token 2).
TREE_A = make_tree(tokens=[0, 0, 2, 1], parents=[-1, 0, 0, 1])
PROBS_A = torch.tensor(
    [
        [0.6, 0.1, 0.3],  # root: p(a) = 0.6, p(b) = 0.3
        [0.2, 0.00005, 0.79995],  # a: p(c) = 0.00005 < alpha = 1e-4 (floored in P), rho(a) = 1 - 0.00005
        [1 / 3, 1 / 3, 1 / 3],  # b: leaf, rho = 1
        [1 / 3, 1 / 3, 1 / 3],  # c: leaf, rho = 1
    ],
    dtype=torch.float64,
)
# Tree B (block 1): root -> d(token 1) -> e(token 1).
TREE_B = make_tree(tokens=[2, 1, 1], parents=[-1, 0, 1])
PROBS_B = torch.tensor(
    [
        [0.5, 0.4, 0.1],  # root: p(d) = 0.4
        [0.3, 0.5, 0.2],  # d: p(e) = 0.5, rho(d) = 0.5
        [1 / 3, 1 / 3, 1 / 3],  # e: leaf, rho = 1
    ],
    dtype=torch.float64,
)


def hand_objective(**kwargs):
    return exittrain_loss(
        torch.tensor(HAND_LOGITS, dtype=torch.float64),
        torch.tensor(HAND_LABELS),
        torch.tensor(HAND_MASK),
        [TREE_A, TREE_B],
        [0, 1],
        [PROBS_A, PROBS_B],
        alpha=1e-4,
        **kwargs,
    )


def test_exittrain_objective_by_hand():
    L = HAND_LOGITS
    # Node NLLs -log q_{depth(v)}(x_v) from the drafting block of each tree.
    nll_a, nll_b, nll_c = -log_q(L[0][0], 0), -log_q(L[0][0], 2), -log_q(L[0][1], 1)
    nll_d, nll_e = -log_q(L[1][0], 1), -log_q(L[1][1], 1)
    # Exit weights w(v) * depth(v) = P(v) * rho(v) * depth(v):
    w_a = 0.6 * (1 - 0.00005) * 1  # P = 0.6, rho = 1 - p(c)
    w_b = 0.3 * 1 * 1  # P = 0.3, leaf
    w_c = (0.6 * 1e-4) * 1 * 2  # P = 0.6 * max(0.00005, alpha), leaf, depth 2
    w_d = 0.4 * 0.5 * 1  # P = 0.4, rho = 1 - p(e)
    w_e = (0.4 * 0.5) * 1 * 2  # P = 0.4 * 0.5, leaf, depth 2
    weighted = w_a * nll_a + w_b * nll_b + w_c * nll_c + w_d * nll_d + w_e * nll_e
    tree = weighted / 5  # 5 drafted nodes (a, b, c, d, e), roots excluded
    # Cross-entropy: plain mean over the 5 supervised positions, no decay.
    ce = -(log_q(L[0][0], 0) + log_q(L[0][1], 1) + log_q(L[1][0], 2) + log_q(L[1][1], 1) + log_q(L[2][0], 1)) / 5
    # 1 + C per tree with the unfloored flow, then the mean over the two trees.
    block_length = ((1 + 0.6 + 0.3 + 0.6 * 0.00005) + (1 + 0.4 + 0.4 * 0.5)) / 2

    parts = hand_objective(objective="exit", ce_weight=1.0, tree_weight=0.1)
    assert parts.ce.item() == pytest.approx(ce, rel=1e-12)
    assert parts.tree.item() == pytest.approx(tree, rel=1e-12)
    assert parts.loss.item() == pytest.approx(1.0 * ce + 0.1 * tree, rel=1e-12)
    assert parts.tree_block_length.item() == pytest.approx(block_length, rel=1e-6)

    # Prefix weight P(v), same normalisation, other weights of the total.
    prefix = (0.6 * nll_a + 0.3 * nll_b + 0.6 * 1e-4 * nll_c + 0.4 * nll_d + 0.4 * 0.5 * nll_e) / 5
    parts = hand_objective(objective="prefix", ce_weight=0.5, tree_weight=2.0)
    assert parts.loss.item() == pytest.approx(0.5 * ce + 2.0 * prefix, rel=1e-12)

    # Knobs: the old normalisation (each tree by its weight sum, then the mean over trees) and the decayed CE.
    per_tree = (
        (w_a * nll_a + w_b * nll_b + w_c * nll_c) / (w_a + w_b + w_c) + (w_d * nll_d + w_e * nll_e) / (w_d + w_e)
    ) / 2
    decay = math.exp(-1 / 7)  # position 2 of every block
    decayed = -(
        log_q(L[0][0], 0)
        + decay * log_q(L[0][1], 1)
        + log_q(L[1][0], 2)
        + decay * log_q(L[1][1], 1)
        + log_q(L[2][0], 1)
    ) / (3 + 2 * decay)
    parts = hand_objective(objective="exit", tree_normalization="weight_sum", ce_decay=True, gamma=7.0)
    assert parts.tree.item() == pytest.approx(per_tree, rel=1e-12)
    assert parts.ce.item() == pytest.approx(decayed, rel=1e-12)
    assert parts.loss.item() == pytest.approx(decayed + 0.1 * per_tree, rel=1e-12)

    # "dflash": decayed CE alone by default, the trees are ignored.
    parts = hand_objective(objective="dflash", gamma=7.0)
    assert parts.tree is None and parts.loss.item() == pytest.approx(decayed, rel=1e-12)


def test_ce_decay_default_depends_on_the_objective():
    assert ce_decays("dflash", None) and not ce_decays("exit", None) and not ce_decays("prefix", None)
    assert ce_decays("exit", True) and not ce_decays("dflash", False)


def test_exittrain_loss_without_trees_and_bad_input():
    parts = exittrain_loss(
        torch.tensor(HAND_LOGITS, dtype=torch.float64, requires_grad=True),
        torch.tensor(HAND_LABELS),
        torch.tensor(HAND_MASK),
        objective="exit",
    )
    assert parts.tree is None and parts.tree_block_length is None and parts.loss.requires_grad
    with pytest.raises(ValueError, match="tree_blocks"):
        exittrain_loss(
            torch.tensor(HAND_LOGITS), torch.tensor(HAND_LABELS), torch.tensor(HAND_MASK), [TREE_A], [], [PROBS_A]
        )
    with pytest.raises(ValueError, match="objective"):
        exittrain_loss(torch.tensor(HAND_LOGITS), torch.tensor(HAND_LABELS), torch.tensor(HAND_MASK), objective="kl")
