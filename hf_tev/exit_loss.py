"""ExitTrain loss maths (SPEC section 6): node weights on an inference-time draft tree and the two losses.

Plain torch, no transformers. Everything here is a small function of tensors so that it can be tested
against a straightforward re-computation; `hf_tev.training.ExitTrainer` only wires it to the models.

Notation (one tree, N nodes, node 0 the root, D draft depths, V the vocabulary):
- `probs[u]` is the frozen target's next-token distribution after the path root..u; the child `c` of
  `u` with token `x_c` has target probability `p(c) = probs[u, x_c]`.
- `P(v)`: product of `max(p, alpha)` along root..v (P(root) = 1); `rho(v) = clip(1 - sum_c p(c), 0, 1)`
  over the children `c` of `v`; exit mass `w(v) = P(v) * rho(v)`.
- Drafter logits `q_d` for depth `d` sit in row `d - 1` of a `[D, V]` block; all nodes of one depth share
  that row.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .tree import DraftTree
from .verify import edge_flow

# The objectives ExitTrainer knows: tree weight w(v) * depth(v), tree weight P(v), or the standard
# DFlash cross-entropy alone.
OBJECTIVES = ("exit", "prefix", "dflash")


def _loss_dtype(logits: torch.Tensor) -> torch.dtype:
    # Losses are accumulated in float32 (bf16/fp16 logits are upcast); float64 stays float64 for tests.
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def training_flow(tree: DraftTree, probs: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefix probabilities with floored edges and exit rates, all without gradient.

    Args:
        tree: the draft tree (N nodes).
        probs (`[N, V]`): target next-token distributions at every node.
        alpha: floor of an edge probability in the product (keeps deep nodes of a poor tree from
            vanishing to 0 weight).

    Returns:
        `(P, rho)`, both `[N]` float32: `P(root) = 1`, `P(c) = P(u) * max(p_u(x_c), alpha)`, and
        `rho(v) = clip(1 - sum_{c child of v} p_v(x_c), 0, 1)` with the unfloored p.
    """
    probs = probs.detach()
    probs = probs if probs.dtype == torch.float64 else probs.float()
    child_probs = probs[tree.parents[1:], tree.tokens[1:]]  # [N - 1] raw p(c)
    P, _ = edge_flow(tree, child_probs.clamp_min(alpha))  # the flow of the floored edges
    covered = torch.zeros_like(P).index_add_(0, tree.parents[1:], child_probs)  # [N]
    rho = (1.0 - covered).clamp(0.0, 1.0)
    return P, rho


def node_weights(tree: DraftTree, probs: torch.Tensor, objective: str = "exit", alpha: float = 1e-4) -> torch.Tensor:
    """Stop-gradient tree-loss weight of every node, `[N]` float32 (the root's is 0: it is not drafted).

    `objective="exit"`: `w(v) * depth(v) = P(v) * rho(v) * depth(v)` (ExitTrain);
    `objective="prefix"`: `P(v)` (the prefix-weight ablation).
    """
    if objective not in ("exit", "prefix"):
        raise ValueError(f"node weights exist for the tree objectives 'exit' and 'prefix', not {objective!r}")
    P, rho = training_flow(tree, probs, alpha)
    depths = tree.depths.to(P.dtype)
    if objective == "exit":
        return P * rho * depths  # depth(root) = 0 drops the root
    return P * (depths > 0)


def expected_block_length(tree: DraftTree, probs: torch.Tensor) -> torch.Tensor:
    """`1 + C = sum_v P(v)` (P(root) = 1, unfloored flow): the mean tau any optimal exact verifier reaches
    on this tree (SPEC section 5). 0-dim float32 tensor."""
    P, _ = edge_flow(tree, probs.detach()[tree.parents[1:], tree.tokens[1:]])
    return P.sum()


def tree_loss(logits: torch.Tensor, depths: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted drafter NLL of the tree nodes, mean over trees of `-sum_v weight(v) log q_{depth v}(x_v) / sum_v weight(v)`.

    Computed as `sum_r W_r * logsumexp(logits_r) - sum_v weight(v) * logits[row_v, x_v]` per tree, with
    `W_r` the weight of the depth-`r+1` nodes, so no (nodes x vocab) tensor is built.

    Args:
        logits (`[K, D, V]`): drafter logits of K blocks (row d - 1 = depth d); gradients flow here.
        depths (`[K, N]`): node depths; the root (depth 0) and padding nodes must carry weight 0.
        tokens (`[K, N]`): node tokens.
        weights (`[K, N]`): node weights (no gradient), e.g. from `node_weights`, 0 on padding.

    Returns:
        0-dim tensor: mean over the trees whose weight sum is positive (0 with a graph if none is).
    """
    K, D, V = logits.shape
    dtype = _loss_dtype(logits)
    weights = weights.detach().to(dtype)
    rows = (depths - 1).clamp(min=0)  # [K, N]; the root's row is irrelevant (weight 0)
    row_weights = torch.zeros(K, D, dtype=weights.dtype, device=weights.device).scatter_add_(1, rows, weights)  # [K, D]
    log_normaliser = logits.to(dtype).logsumexp(-1)  # [K, D]
    node_logits = logits.reshape(K, D * V).gather(1, rows * V + tokens).to(dtype)  # [K, N]
    total = weights.sum(-1)  # [K]
    per_tree = ((row_weights * log_normaliser).sum(-1) - (weights * node_logits).sum(-1)) / total.clamp_min(1e-30)
    has_weight = total > 0
    return (per_tree * has_weight).sum() / has_weight.sum().clamp_min(1)


def dflash_loss(logits: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor, gamma: float = 7.0) -> torch.Tensor:
    """The standard DFlash objective: cross-entropy of `q_k` against `x_{a+k}`, weighted `exp(-(k-1)/gamma)`.

    Args:
        logits (`[..., D, V]`): drafter logits, row k - 1 = block position k.
        labels (`[..., D]`): the sequence's tokens `x_{a+k}` (any valid id where masked).
        label_mask (`[..., D]`): which labels are supervised (inside the sequence, not prompt or padding).
        gamma: depth decay; `gamma = inf` weighs all depths equally.

    Returns:
        0-dim tensor, the weighted mean over all supervised positions (0 with a graph if there are none).
    """
    D = logits.shape[-2]
    dtype = _loss_dtype(logits)
    k = torch.arange(D, device=logits.device, dtype=dtype)  # k - 1 for block positions 1..D
    decay = torch.exp(-k / gamma) if math.isfinite(gamma) else torch.ones_like(k)  # [D]
    weights = decay * label_mask.to(dtype)  # [..., D]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(dtype), labels.reshape(-1), reduction="none")
    return (weights.reshape(-1) * nll).sum() / weights.sum().clamp_min(1e-30)
