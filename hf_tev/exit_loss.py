"""ExitTrain loss maths (docs/design.md#exittrain): node weights on an inference-time draft tree and the two losses.

Plain torch, no transformers. Everything here is a small function of tensors so that it can be tested
against a straightforward re-computation; `hf_tev.training.ExitTrainer` only wires it to the models
(drafts the blocks, builds the trees, runs the target) and calls `exittrain_loss`.

Notation (one tree, N nodes, node 0 the root, D draft depths, V the vocabulary):
- `probs[u]` is the frozen target's next-token distribution after the path root..u; the child `c` of
  `u` with token `x_c` has target probability `p(c) = probs[u, x_c]`. Functions that take `probs` also
  take the gathered edge probabilities `[N]` instead (entry `c` = `p(c)`, entry 0 the root's, ignored):
  nothing else of `[N, V]` is used, so the trainer never keeps the distributions of all its trees.
- `P(v)`: product of `max(p, alpha)` along root..v (P(root) = 1); `rho(v) = clip(1 - sum_c p(c), 0, 1)`
  over the children `c` of `v`; exit mass `w(v) = P(v) * rho(v)`.
- Drafter logits `q_d` for depth `d` sit in row `d - 1` of a `[D, V]` block; all nodes of one depth share
  that row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .tree import DraftTree
from .verify import edge_flow

# The objectives ExitTrainer knows: tree weight w(v) * depth(v), tree weight P(v), or the standard
# DFlash cross-entropy alone.
OBJECTIVES = ("exit", "prefix", "dflash")
# How the tree loss is normalised: by the number of drafted tree nodes of all trees (the authors' released
# code, docs/design.md#exittrain), or tree by tree by its own weight sum, then averaged over trees.
TREE_NORMALIZATIONS = ("nodes", "weight_sum")


def _loss_dtype(logits: torch.Tensor) -> torch.dtype:
    # Losses are accumulated in float32 (bf16/fp16 logits are upcast); float64 stays float64 for tests.
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def edge_probs(tree: DraftTree, probs: torch.Tensor) -> torch.Tensor:
    """`[N - 1]` target probabilities `p(c) = probs[parent(c), x_c]` of the drafted nodes, without gradient.

    `probs` is `[N, V]` (distributions at every node) or already the `[N]` edge probabilities (root entry
    ignored).
    """
    probs = probs.detach()
    probs = probs if probs.dtype == torch.float64 else probs.float()
    if probs.dim() == 1:
        return probs[1:]
    return probs[tree.parents[1:], tree.tokens[1:]]


def training_flow(tree: DraftTree, probs: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefix probabilities with floored edges and exit rates, all without gradient.

    Args:
        tree: the draft tree (N nodes).
        probs (`[N, V]` or `[N]`): target next-token distributions at every node, or the edge
            probabilities (see `edge_probs`).
        alpha: floor of an edge probability in the product (keeps deep nodes of a poor tree from
            vanishing to 0 weight).

    Returns:
        `(P, rho)`, both `[N]` float32: `P(root) = 1`, `P(c) = P(u) * max(p_u(x_c), alpha)`, and
        `rho(v) = clip(1 - sum_{c child of v} p_v(x_c), 0, 1)` with the unfloored p.
    """
    child_probs = edge_probs(tree, probs)  # [N - 1] raw p(c)
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
    """`1 + C = sum_v P(v)` (P(root) = 1, unfloored flow, `probs` `[N, V]` or `[N]` as in `edge_probs`): the
    mean tau any optimal exact verifier reaches on this tree when the target samples from `probs`
    (docs/design.md#the-exit-law-and-tev). 0-dim float32 tensor."""
    P, _ = edge_flow(tree, edge_probs(tree, probs))
    return P.sum()


def tree_loss(
    logits: torch.Tensor,
    depths: torch.Tensor,
    tokens: torch.Tensor,
    weights: torch.Tensor,
    normalization: str = "nodes",
) -> torch.Tensor:
    """Weighted drafter NLL of the tree nodes: `sum_trees sum_v weight(v) * -log q_{depth v}(x_v)`, normalised.

    `normalization="nodes"` (docs/design.md#exittrain, the authors' released code): divided by the total number of
    drafted nodes of all K trees (depth > 0: the root and padding are not counted).
    `normalization="weight_sum"`: every tree divided by its own weight sum, then the mean over the trees
    whose weight sum is positive.

    Computed as `sum_r W_r * logsumexp(logits_r) - sum_v weight(v) * logits[row_v, x_v]` per tree, with
    `W_r` the weight of the depth-`r+1` nodes, so no (nodes x vocab) tensor is built.

    Args:
        logits (`[K, D, V]`): drafter logits of K blocks (row d - 1 = depth d); gradients flow here.
        depths (`[K, N]`): node depths; the root and padding nodes have depth 0 and must carry weight 0.
        tokens (`[K, N]`): node tokens.
        weights (`[K, N]`): node weights (no gradient), e.g. from `node_weights`, 0 on padding.
        normalization: `"nodes"` or `"weight_sum"`.

    Returns:
        0-dim tensor (0 with a graph when there is no drafted node / no weight).
    """
    if normalization not in TREE_NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {TREE_NORMALIZATIONS}, got {normalization!r}")
    K, D, V = logits.shape
    dtype = _loss_dtype(logits)
    weights = weights.detach().to(dtype)
    rows = (depths - 1).clamp(min=0)  # [K, N]; the root's row is irrelevant (weight 0)
    row_weights = torch.zeros(K, D, dtype=weights.dtype, device=weights.device).scatter_add_(1, rows, weights)  # [K, D]
    log_normaliser = logits.to(dtype).logsumexp(-1)  # [K, D]
    node_logits = logits.reshape(K, D * V).gather(1, rows * V + tokens).to(dtype)  # [K, N]
    per_tree = (row_weights * log_normaliser).sum(-1) - (weights * node_logits).sum(-1)  # [K] sum_v weight * NLL
    if normalization == "nodes":
        return per_tree.sum() / (depths > 0).sum().clamp_min(1)
    total = weights.sum(-1)  # [K]
    has_weight = total > 0
    return (per_tree / total.clamp_min(1e-30) * has_weight).sum() / has_weight.sum().clamp_min(1)


def dflash_loss(
    logits: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor, gamma: float = 7.0
) -> torch.Tensor:
    """The standard DFlash objective: cross-entropy of `q_k` against `x_{a+k}`, weighted `exp(-(k-1)/gamma)`.

    Args:
        logits (`[..., D, V]`): drafter logits, row k - 1 = block position k.
        labels (`[..., D]`): the sequence's tokens `x_{a+k}` (any valid id where masked).
        label_mask (`[..., D]`): which labels are supervised (inside the sequence, not prompt or padding).
        gamma: depth decay; `gamma = inf` weighs all depths equally.

    Returns:
        0-dim tensor, the weighted mean over all supervised positions (0 with a graph if there are none).
        ExitTrain's cross-entropy is this with `gamma = inf` (no decay, see `exittrain_loss`).
    """
    D = logits.shape[-2]
    dtype = _loss_dtype(logits)
    k = torch.arange(D, device=logits.device, dtype=dtype)  # k - 1 for block positions 1..D
    decay = torch.exp(-k / gamma) if math.isfinite(gamma) else torch.ones_like(k)  # [D]
    weights = decay * label_mask.to(dtype)  # [..., D]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(dtype), labels.reshape(-1), reduction="none")
    return (weights.reshape(-1) * nll).sum() / weights.sum().clamp_min(1e-30)


def ce_decays(objective: str, ce_decay: bool | None) -> bool:
    """Whether the cross-entropy is position-decayed: `ce_decay`, or when None only for objective "dflash"
    (the released ExitTrain code never decays; the standard DFlash recipe does)."""
    return objective == "dflash" if ce_decay is None else bool(ce_decay)


class ExitLoss(NamedTuple):
    """The parts of one ExitTrain loss (0-dim tensors)."""

    loss: torch.Tensor  # ce_weight * ce + tree_weight * tree (tree term only for "exit" / "prefix" with trees)
    ce: torch.Tensor  # cross-entropy of the blocks against the sequence
    tree: torch.Tensor | None  # tree loss; None for "dflash" or when no tree was given
    tree_block_length: torch.Tensor | None  # mean over the trees of 1 + C (unfloored flow); None without trees


def exittrain_loss(
    block_logits: torch.Tensor,
    labels: torch.Tensor,
    label_mask: torch.Tensor,
    trees: Sequence[DraftTree] = (),
    tree_blocks: Sequence[int] = (),
    tree_probs: Sequence[torch.Tensor] = (),
    objective: str = "exit",
    *,
    vocab_index: torch.Tensor | None = None,
    ce_weight: float = 1.0,
    tree_weight: float = 0.1,
    alpha: float = 1e-4,
    gamma: float = 7.0,
    ce_decay: bool | None = None,
    tree_normalization: str = "nodes",
) -> ExitLoss:
    """The ExitTrain objective of a batch of drafted blocks and their inference-time trees (docs/design.md#exittrain).

    `loss = ce_weight * CE + tree_weight * tree`, with CE the cross-entropy of every supervised block
    position (plain mean, or decayed `exp(-(k-1)/gamma)` when `ce_decays(objective, ce_decay)`) and, for
    `"exit"` / `"prefix"`, `tree = tree_loss(...)` of the given trees with `node_weights` (floor `alpha`)
    under `tree_normalization`. Objective `"dflash"` ignores the trees.

    Args:
        block_logits (`[M, D, V]`): drafter logits of M blocks; gradients flow here.
        labels (`[M, D]`): the sequence's tokens `x_{a+k}`; label_mask (`[M, D]`): which are supervised.
        trees: K inference-time trees; tree k was built from block `tree_blocks[k]`'s distributions.
        tree_blocks: K block indices into `block_logits`.
        tree_probs: K tensors, `[N_k, V]` target distributions at every node or `[N_k]` edge probabilities.
        vocab_index (`[V_target]`, *optional*): where `block_logits` score a draft vocabulary (`labels` already
            mapped into it), each target id's column, -1 for a token outside it; the trees' target-id nodes are
            mapped through it, and a node outside the vocabulary (probability 0, never trainable) gets no weight.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if not len(trees) == len(tree_blocks) == len(tree_probs):
        raise ValueError(f"{len(trees)} trees, {len(tree_blocks)} tree_blocks and {len(tree_probs)} tree_probs")
    ce = dflash_loss(block_logits, labels, label_mask, gamma if ce_decays(objective, ce_decay) else math.inf)
    if objective == "dflash" or not trees:
        return ExitLoss(ce_weight * ce, ce, None, None)
    weights = [node_weights(tree, probs, objective, alpha) for tree, probs in zip(trees, tree_probs, strict=True)]
    tokens, weights = _pad([t.tokens for t in trees]), _pad(weights)
    if vocab_index is not None:
        tokens = vocab_index[tokens]
        tokens, weights = tokens.clamp_min(0), weights * (tokens >= 0)
    tree = tree_loss(
        block_logits[list(tree_blocks)], _pad([t.depths for t in trees]), tokens, weights, tree_normalization
    )
    lengths = [expected_block_length(tree, probs) for tree, probs in zip(trees, tree_probs, strict=True)]
    block_length = torch.stack(lengths).mean()
    return ExitLoss(ce_weight * ce + tree_weight * tree, ce, tree, block_length)


def _pad(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    # [K, max N], zero padding: depth 0 and weight 0, so padding nodes are neither counted nor weighted.
    return torch.nn.utils.rnn.pad_sequence(list(tensors), batch_first=True, padding_value=0)
