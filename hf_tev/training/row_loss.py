"""The loss of objectives "exit", "prefix" and "dflash" on a batch of training rows (`rows_loss`):

1. context: one no-grad target forward over the sequences (`forwards.target_context`; the K/V cache is kept
   for the trees), or, with objective "dflash", the batch's cached `context_features` (`cached_features`);
2. draft: `anchors_per_sequence` random anchors per sequence, all blocks of a sequence in ONE drafter forward
   (`forwards.draft_blocks`);
3. trees (objectives "exit" and "prefix"): the inference-time tree of every tree anchor, built by the decoder's
   own builder (`hf_tev.tree.build_tree`) from the drafter's log q at `tree_budget`, and ONE target forward
   that scores all trees against the cached context (`score_trees`);
4. loss: `hf_tev.exit_loss.exittrain_loss`, `ce_weight * CE + tree_weight * tree`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..exit_loss import edge_probs, exittrain_loss
from ..tree import build_tree
from .batch import block_labels, sample_anchors, tree_batch_inputs
from .forwards import draft_blocks, target_context
from .metrics import StepSize
from .rows import CONTEXT_FEATURES, INPUT_IDS, LOSS_MASK


@dataclass
class StepLoss:
    """A step's loss, its logged parts (`metrics`: name -> scalar tensor, NaN where a part is absent) and the
    drafter's block logits `[B, A, D, V]` (None when no rows were drafted)."""

    loss: torch.Tensor | float
    metrics: dict[str, torch.Tensor]
    draft_logits: torch.Tensor | None


def rows_loss(
    model, drafter, target, inputs, args, objective: str, ce_weight: float, generator: torch.Generator
) -> tuple[StepLoss, StepSize]:
    """The loss of `objective` ("exit", "prefix" or "dflash") with CE weight `ce_weight` on a collated batch
    (`ExitDataCollator`), the other knobs from `args` (`ExitTrainingArguments`); anchors drawn from `generator`.
    `model` is the trained drafter as the trainer holds it (maybe DDP-wrapped), `drafter` the unwrapped one."""
    if INPUT_IDS not in inputs or LOSS_MASK not in inputs:
        raise ValueError(
            f"ExitTrainer batches need '{INPUT_IDS}' and '{LOSS_MASK}' (ExitDataCollator builds them), "
            f"got {sorted(inputs)}"
        )
    input_ids, loss_mask = inputs[INPUT_IDS], inputs[LOSS_MASK].bool()  # [B, T]
    anchors, valid = sample_anchors(loss_mask, args.anchors_per_sequence, generator)  # [B, A]
    with_trees = objective != "dflash"
    cached = not with_trees and inputs.get(CONTEXT_FEATURES) is not None  # the trees need the target's K/V
    if cached:
        features, cache = cached_features(drafter, inputs), None
    else:
        context = target_context(target, drafter, input_ids, use_cache=with_trees)
        features, cache = drafter.context_features(context.hidden_states), context.cache  # [B, T, k*H]
    draft_logits = draft_blocks(model, drafter, target, input_ids, features, anchors)  # [B, A, D, V]
    B, A, D, V = draft_logits.shape
    labels, supervised = block_labels(input_ids, loss_mask, anchors, valid, D)  # [B, A, D]
    trees, tree_blocks, tree_probs = [], [], []
    if with_trees:
        has_tree = supervised.all(-1) if args.tree_anchors == "full_horizon" else valid  # [B, A]
        trees, tree_blocks, tree_probs = score_trees(
            target, draft_logits, input_ids, anchors, has_tree, cache, args.tree_budget, args.tree_context_window
        )
    parts = exittrain_loss(
        draft_logits.reshape(B * A, D, V),
        labels.reshape(B * A, D),
        supervised.reshape(B * A, D),
        trees,
        tree_blocks,
        tree_probs,
        objective,
        ce_weight=ce_weight,
        tree_weight=args.tree_weight,
        alpha=args.alpha,
        gamma=args.gamma,
        ce_decay=args.ce_decay,
        tree_normalization=args.tree_normalization,
    )
    metrics = {"loss_dflash": parts.ce}
    if with_trees:  # NaN when no tree was built: left out of the averages (every process logs the same names)
        missing = parts.ce.new_tensor(math.nan)
        metrics.update(
            loss_tree=missing if parts.tree is None else parts.tree,
            tree_1_plus_c=missing if parts.tree_block_length is None else parts.tree_block_length,
        )
    nodes = [0] * B  # tree rows per sequence; the tree pass pads them to the most
    for tree, block in zip(trees, tree_blocks, strict=True):
        nodes[block // A] += tree.num_nodes
    size = StepSize(B, input_ids.shape[1], A, D + 1, cached, B * max(nodes))
    return StepLoss(parts.loss, metrics, draft_logits), size


def cached_features(drafter, inputs) -> torch.Tensor:
    """The batch's cached `context_features` `[B, T, k*H]` (a `FeatureCache`), checked against the drafter's
    target layers and hidden size; cast to the drafter's dtype when used."""
    features, input_ids = inputs[CONTEXT_FEATURES], inputs[INPUT_IDS]
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    if features.shape != (*input_ids.shape, width):
        raise ValueError(
            f"batch '{CONTEXT_FEATURES}' has shape {tuple(features.shape)}, expected "
            f"{(*input_ids.shape, width)} (the drafter's target layers x hidden size)"
        )
    return features


def score_trees(target, draft_logits, input_ids, anchors, has_tree, cache, budget: int, context_window: int | None):
    """Build the tree of every anchor with `has_tree` at `budget` and score its nodes with ONE target forward
    against `cache` (seeing the last `context_window` tokens before the anchor; None: all of them).

    Returns `(trees, tree_blocks, edge_probs)`: tree k hangs at block `tree_blocks[k]` (flat index
    `b * A + slot` into `draft_logits` `[B, A, D, V]`) and has the target's edge probabilities
    `p(v) = p_{parent(v)}(x_v)` `[N_k]` (only these are kept, not the `[N, V]` distributions).
    """
    B, T = input_ids.shape
    A = anchors.shape[1]
    # One host sync: the builder works anchor by anchor on the host anyway.
    anchor_list = torch.cat([has_tree.nonzero(), anchors[has_tree][:, None]], dim=1).tolist()  # [(b, slot, a)]
    if not anchor_list:
        return [], [], []
    draft_logprobs = draft_logits.detach().float().log_softmax(-1)  # [B, A, D, V]
    trees = [build_tree(draft_logprobs[b, slot], budget, input_ids[b, a]) for b, slot, a in anchor_list]
    owners = [b for b, _, _ in anchor_list]
    tokens, positions, mask, offsets = tree_batch_inputs(
        trees, owners, [a for _, _, a in anchor_list], B, T, target.dtype, context_window=context_window
    )
    with torch.no_grad():
        node_logits = target(tokens, position_ids=positions, attention_mask=mask, cache=cache).logits
    edges = [
        edge_probs(tree, node_logits[owner, offset : offset + tree.num_nodes].float().softmax(-1))
        for tree, owner, offset in zip(trees, owners, offsets, strict=True)
    ]
    edges = [torch.cat([edge.new_ones(1), edge]) for edge in edges]  # [N]: the root's entry is 1
    return trees, [b * A + slot for b, slot, _ in anchor_list], edges
