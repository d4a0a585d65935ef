"""ExitTrain loss maths (hf_tev/exit_loss.py) against hand values and straightforward re-computation."""

import math

import pytest
import torch

from hf_tev.exit_loss import dflash_loss, expected_block_length, node_weights, training_flow, tree_loss
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
    return DraftTree(tokens=torch.tensor(tokens), depths=torch.tensor(depths), parents=torch.tensor(parents),
                     visibility=visibility)


# Hand-made tree over a 4-token vocabulary:
#   root(3) -> a(0) -> c(2)
#                   -> d(3)   (p = 0.01, below alpha = 0.05)
#           -> b(1)
HAND_TREE = make_tree(tokens=[3, 0, 1, 2, 3], parents=[-1, 0, 0, 1, 1])
HAND_PROBS = torch.tensor([
    [0.50, 0.30, 0.10, 0.10],  # root: p(a) = 0.5, p(b) = 0.3, rho = 0.2
    [0.19, 0.20, 0.60, 0.01],  # a: p(c) = 0.6, p(d) = 0.01 -> 0.05 in the product, rho = 1 - 0.61 = 0.39
    [0.25, 0.25, 0.25, 0.25],  # b: leaf, rho = 1
    [0.25, 0.25, 0.25, 0.25],  # c: leaf
    [0.25, 0.25, 0.25, 0.25],  # d: leaf
], dtype=torch.float64)


def test_hand_tree_weights():
    # Worked out by hand from SPEC section 6 with alpha = 0.05.
    P, rho = training_flow(HAND_TREE, HAND_PROBS, alpha=0.05)
    torch.testing.assert_close(P, torch.tensor([1.0, 0.5, 0.3, 0.3, 0.025], dtype=P.dtype))
    torch.testing.assert_close(rho, torch.tensor([0.2, 0.39, 1.0, 1.0, 1.0], dtype=rho.dtype))
    exit_weights = node_weights(HAND_TREE, HAND_PROBS, "exit", alpha=0.05)  # w(v) * depth(v)
    torch.testing.assert_close(exit_weights, torch.tensor([0.0, 0.195, 0.3, 0.6, 0.05], dtype=exit_weights.dtype))
    prefix_weights = node_weights(HAND_TREE, HAND_PROBS, "prefix", alpha=0.05)  # P(v), root excluded
    torch.testing.assert_close(prefix_weights, torch.tensor([0.0, 0.5, 0.3, 0.3, 0.025], dtype=prefix_weights.dtype))
    # 1 + C uses the unfloored flow: 1 + 0.5 + 0.3 + 0.3 + 0.005.
    torch.testing.assert_close(expected_block_length(HAND_TREE, HAND_PROBS),
                               torch.tensor(2.105, dtype=torch.float64))


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


def naive_tree_loss(logits, trees, weights):
    """Materialises log q at every node: the definition, tree by tree."""
    per_tree = []
    for k, (tree, w) in enumerate(zip(trees, weights)):
        log_q = logits[k].log_softmax(-1)  # [D, V]
        node_log_q = torch.stack([log_q[d - 1, t] if d > 0 else log_q.new_zeros(())
                                  for d, t in zip(tree.depths.tolist(), tree.tokens.tolist())])  # [N]
        per_tree.append(-(w * node_log_q).sum() / w.sum())
    return torch.stack(per_tree).mean()


def pad(rows, value=0):
    return torch.nn.utils.rnn.pad_sequence(list(rows), batch_first=True, padding_value=value)


def test_tree_loss_equals_naive_loss_and_gradient():
    torch.manual_seed(0)
    K, D, V = 3, 4, 11
    trees = [build_tree(torch.randn(D, V).log_softmax(-1), budget, root_token=k) for k, budget in enumerate([9, 5, 14])]
    weights = [torch.rand(t.num_nodes) * (t.depths > 0) for t in trees]
    logits = torch.randn(K, D, V, dtype=torch.float64, requires_grad=True)
    fast = tree_loss(logits, pad(t.depths for t in trees), pad(t.tokens for t in trees), pad(weights))
    (fast_grad,) = torch.autograd.grad(fast, logits)
    naive = naive_tree_loss(logits, trees, [w.double() for w in weights])
    (naive_grad,) = torch.autograd.grad(naive, logits)
    torch.testing.assert_close(fast.double(), naive, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fast_grad, naive_grad, rtol=1e-6, atol=1e-6)


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


def test_tree_loss_skips_trees_without_weight():
    logits = torch.randn(2, 2, 4, requires_grad=True)
    depths = HAND_TREE.depths[None].repeat(2, 1)
    tokens = HAND_TREE.tokens[None].repeat(2, 1)
    weights = torch.stack([node_weights(HAND_TREE, HAND_PROBS, "prefix"), torch.zeros(5)])
    both = tree_loss(logits, depths, tokens, weights)
    first = tree_loss(logits[:1], depths[:1], tokens[:1], weights[:1])
    torch.testing.assert_close(both, first)
    none = tree_loss(logits, depths, tokens, torch.zeros(2, 5))
    assert none.item() == 0.0 and none.requires_grad


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
