"""The losses of a training step, assembled from its batch (`batch`; the loss maths is `hf_tev.exit_loss`, and
Draft-OPD's `opd_loss` here), and what a step costs (`StepSize`, `FlopCounter`).

Objectives "exit", "prefix" and "dflash" on a batch of training rows (`rows_loss`):

1. context: one no-grad target forward over the sequences (`batch.target_context`; the K/V cache is kept for the
   trees), or, with objective "dflash", the batch's cached `context_features` (`cached_features`);
2. draft: `anchors_per_sequence` random anchors per sequence, all blocks of a sequence in ONE drafter forward
   (`batch.draft_blocks`);
3. trees (objectives "exit" and "prefix"): the inference-time tree of every tree anchor, built by the decoder's
   own builder (`hf_tev.tree.build_tree`) from the drafter's log q at `tree_budget`, and ONE target forward
   that scores all trees against the cached context (`score_trees`);
4. loss: `hf_tev.exit_loss.exittrain_loss`, `ce_weight * CE + tree_weight * tree`.

Draft-OPD (`objective="opd"`; Lei et al., "Draft-OPD: On-Policy Distillation for Speculative Draft Models", 2026,
arXiv 2605.29343) on a micro-batch of rollouts (`replay_loss`; the rollouts are `rollouts.Rollout`: every cycle's
anchor `a` and accepted drafted tokens `n`, depth `n + 1` the exposed error):

1. replay (`replay_chains`, `replay_teacher_logits`): the drafter's own block at each cycle's anchor is drafted
   again (with gradient) from the rollout's context, and the teacher of each depth `k` is the target's
   distribution after the replayed chain `x_a, c_1 .. c_{k-1}`: the accepted tokens `c_k = x_{a+k}` up to depth
   `n`, then the drafter's own greedy proposals (draft-induced states). One target forward over the rollout's
   cached context scores all chains (the tree pass of the tree objectives, with chains as trees);
2. loss (`opd_loss`), the paper's acceptance-aware objective: forward KL `KL(p || q)` at the accepted depths
   (mean), reverse KL `KL(q || p)` at the rejected depths `k > n` with position decay `decay^(k - n - 1)`
   (weighted mean), `(w_acc * L_acc + w_rej * L_rej) / (w_acc + w_rej)` over the streams present.
The teacher is the target's raw distribution (temperature 1), whatever the rollout temperature.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from ..exit_loss import edge_probs, exittrain_loss
from ..models.dflash.vocabulary import to_target_vocab
from ..tree import DraftTree, build_tree
from .batch import block_labels, draft_blocks, sample_anchors, target_context, tree_batch_inputs
from .rollouts import Rollout
from .rows import CONTEXT_FEATURES, INPUT_IDS, LOSS_MASK


@dataclass
class StepSize:
    """The sizes one training step's FLOPs depend on: `batch` sequences of `length` tokens, `anchors` blocks of
    `block` rows per sequence, whether the context features came from a cache (no target forward), and the rows
    of the target's tree (or replayed chain) pass."""

    batch: int
    length: int
    anchors: int
    block: int
    cached: bool
    tree_rows: int


OPD_DRAFT_VOCAB = (
    "objective 'opd' does not train a drafter with a draft vocabulary (its KL terms need the drafter's law over the "
    "target's whole vocabulary): train it with 'dflash', 'exit' or 'prefix', or remove the vocabulary "
    "(drafter.set_draft_vocab(None))"
)


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
            target,
            drafter,
            draft_logits,
            input_ids,
            anchors,
            has_tree,
            cache,
            args.tree_budget,
            args.tree_context_window,
        )
    vocab_index = drafter.draft_index  # [V_target] -> column of draft_logits, -1 where not scored; None: all
    if vocab_index is not None:  # a label the drafter cannot score is not supervised (EAGLE-3's loss mask)
        labels = vocab_index[labels]
        supervised, labels = supervised & (labels >= 0), labels.clamp_min(0)
    parts = exittrain_loss(
        draft_logits.reshape(B * A, D, V),
        labels.reshape(B * A, D),
        supervised.reshape(B * A, D),
        trees,
        tree_blocks,
        tree_probs,
        objective,
        vocab_index=vocab_index,
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


def score_trees(
    target, drafter, draft_logits, input_ids, anchors, has_tree, cache, budget: int, context_window: int | None
):
    """Build the tree of every anchor with `has_tree` at `budget` and score its nodes with ONE target forward
    against `cache` (seeing the last `context_window` tokens before the anchor; None: all of them). The trees hold
    target ids, as at inference: a drafter's draft-vocabulary logits are spread over the target's vocabulary
    first (probability 0 outside it).

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
    if drafter.draft_vocab is not None:
        draft_logprobs = to_target_vocab(draft_logprobs, drafter.draft_vocab, drafter.config.vocab_size)
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


# ----------------------------------------------------------------------------------------------
# Draft-OPD


def rollout_batch(rollouts: Sequence[Rollout], max_cycles: int, generator: torch.Generator, pad_token_id: int):
    """Pad rollouts into one batch and pick up to `max_cycles` of each one's cycles (at random, seeded).

    Only cycles that train something are candidates: an accepted depth inside the sequence, or an exposed error.

    Returns:
        `input_ids` `[B, T]` (right-padded), `lengths` `[B]`, `anchors` `[B, A]` (sorted, 0 where not `valid`),
        `valid` `[B, A]`, `accepted` `[B, A]` (accepted drafted tokens `n`), `rejected` `[B, A]` (bool).
    """
    B = len(rollouts)
    input_ids = pad_sequence(
        [torch.tensor(r.input_ids, dtype=torch.long) for r in rollouts], batch_first=True, padding_value=pad_token_id
    )
    chosen = []
    for r in rollouts:
        candidates = [
            c
            for c in range(len(r.anchors))
            if r.rejected[c] or (r.accepted[c] > 0 and r.anchors[c] + 1 <= len(r.input_ids) - 1)
        ]
        order = torch.randperm(len(candidates), generator=generator)[:max_cycles].tolist()
        chosen.append(sorted(candidates[i] for i in order))
    A = max(1, max(len(c) for c in chosen))
    anchors = torch.zeros(B, A, dtype=torch.long)
    accepted = torch.zeros(B, A, dtype=torch.long)
    valid = torch.zeros(B, A, dtype=torch.bool)
    rejected = torch.zeros(B, A, dtype=torch.bool)
    for b, (r, cycles) in enumerate(zip(rollouts, chosen, strict=True)):
        for slot, c in enumerate(cycles):
            anchors[b, slot], accepted[b, slot] = r.anchors[c], r.accepted[c]
            valid[b, slot], rejected[b, slot] = True, r.rejected[c]
    lengths = torch.tensor([len(r.input_ids) for r in rollouts])
    return input_ids, lengths, anchors, valid, accepted, rejected


def accepted_depths(anchors: torch.Tensor, accepted: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """`m = min(n, last position - a)`: the accepted depths whose tokens are inside the sequence `[B, A]`."""
    return torch.minimum(accepted, lengths[:, None] - 1 - anchors).clamp_min(0)


def replay_chains(
    input_ids: torch.Tensor, anchors: torch.Tensor, accepted: torch.Tensor, lengths: torch.Tensor, draft_logits
) -> torch.Tensor:
    """The replayed chain of every cycle `[B, A, D]`: node 0 the root `x_a`, node `k` (depth k) the committed token
    `x_{a+k}` for `k <= m` (`accepted_depths`), else the drafter's own greedy proposal at depth `k`.
    `draft_logits` `[B, A, D, V]` are the drafter's block logits at the anchors (depths 1..D)."""
    B, A, D, _ = draft_logits.shape
    depths = torch.arange(D, device=anchors.device)  # node k = depth k, k = 0..D-1
    proposals = draft_logits.detach().argmax(-1)  # [B, A, D]: depth k+1 at index k
    chain = torch.cat([input_ids.gather(1, anchors)[..., None], proposals[..., : D - 1]], dim=-1)  # [B, A, D]
    positions = (anchors[..., None] + depths).clamp_max(input_ids.shape[1] - 1)  # [B, A, D]
    committed = input_ids.gather(1, positions.view(B, -1)).view(B, A, D)
    use_committed = depths <= accepted_depths(anchors, accepted, lengths)[..., None]  # the root is depth 0
    return torch.where(use_committed, committed, chain)


def chain_tree(tokens: torch.Tensor) -> DraftTree:
    """A chain as a `DraftTree` (node k's parent is node k - 1)."""
    n = tokens.shape[0]
    index = torch.arange(n, device=tokens.device)
    return DraftTree(tokens, index, index - 1, torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril())


@torch.no_grad()
def replay_teacher_logits(target, chains: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, cache, seq_len):
    """The target's logits after every replayed chain prefix `[B, A, D, V]` (zeros where not `valid`): entry
    `[b, s, k-1]` is the target's next-token logits given `x_{<a}` (from `cache`, the rollout batch's K/V) and
    the chain's nodes `0..k-1`, i.e. the teacher of depth `k`. ONE target forward scores every chain."""
    B, A, D = chains.shape
    cells = valid.nonzero().tolist()  # [(b, slot)]
    if not cells:
        return None
    trees = [chain_tree(chains[b, s]) for b, s in cells]
    tokens, positions, mask, offsets = tree_batch_inputs(
        trees, [b for b, _ in cells], [int(anchors[b, s]) for b, s in cells], B, seq_len, target.dtype
    )
    logits = target(tokens, position_ids=positions, attention_mask=mask, cache=cache).logits  # [B, M, V]
    teacher = logits.new_zeros(B, A, D, logits.shape[-1])
    for (b, s), offset in zip(cells, offsets, strict=True):
        teacher[b, s] = logits[b, offset : offset + D]
    return teacher


@dataclass
class OPDLoss:
    """`loss` and its streams (NaN when a stream has no position in the batch)."""

    loss: torch.Tensor
    accept: torch.Tensor
    reject: torch.Tensor


def opd_loss(
    draft_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    accepted: torch.Tensor,
    rejected: torch.Tensor,
    valid: torch.Tensor,
    accept_weight: float = 1.0,
    reject_weight: float = 1.0,
    decay: float = 0.8,
) -> OPDLoss:
    """Draft-OPD's acceptance-aware loss over cycles `[..., D, V]` (depth k at index k - 1).

    Args:
        draft_logits, teacher_logits: the drafter's block logits and the target's (teacher) logits per depth.
        accepted (`[...]` long): accepted depths `m` whose teacher is the target on the committed sequence.
        rejected (`[...]` bool): whether the cycle exposed an error: depths `> m` form the rejected stream.
        valid (`[...]` bool): the cycles that count.
    Forward KL `KL(p || q)` at depths `1..m` (mean over them), reverse KL `KL(q || p)` at depths `m+1..D` of
    rejected cycles with weight `decay^(k - m - 1)` (weighted mean), combined as
    `(accept_weight * L_acc + reject_weight * L_rej) / (sum of the weights of the streams present)`.
    """
    D = draft_logits.shape[-2]
    log_q = draft_logits.float().log_softmax(-1)
    log_p = teacher_logits.float().log_softmax(-1)
    depth = torch.arange(1, D + 1, device=draft_logits.device)
    accept_mask = valid[..., None] & (depth <= accepted[..., None])  # [..., D]
    reject_mask = (valid & rejected)[..., None] & (depth > accepted[..., None])
    exponent = (depth - accepted[..., None] - 1).clamp_min(0).float()
    reject_w = torch.pow(torch.tensor(float(decay), device=draft_logits.device), exponent) * reject_mask
    forward_kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [..., D]
    reverse_kl = (log_q.exp() * (log_q - log_p)).sum(-1)
    nan = log_q.new_tensor(float("nan"))
    parts, weights = [], []
    accept = reject = nan
    if accept_mask.any():
        accept = forward_kl[accept_mask].mean()
        parts.append(accept_weight * accept)
        weights.append(accept_weight)
    if reject_mask.any():
        reject = (reverse_kl * reject_w).sum() / reject_w.sum()
        parts.append(reject_weight * reject)
        weights.append(reject_weight)
    if not parts or sum(weights) == 0:
        loss = (log_q.sum() * 0.0) if not parts else sum(parts) * 0.0
    else:
        loss = sum(parts) / sum(weights)
    return OPDLoss(loss, accept, reject)


def replay_loss(model, drafter, target, rollouts, args, generator, pad_token_id: int) -> tuple[OPDLoss, StepSize]:
    """Draft-OPD on a micro-batch of rollouts: the drafter's blocks at up to `anchors_per_sequence` of each
    rollout's cycles (picked by `generator`), the chains replayed through the target (one forward over the
    rollouts, one over the chains) and the acceptance-aware loss with the `opd_*` weights of `args`
    (`ExitTrainingArguments`). `model` is the trained drafter as the trainer holds it, `drafter` unwrapped."""
    if drafter.draft_vocab is not None:
        raise ValueError(OPD_DRAFT_VOCAB)
    input_ids, lengths, anchors, valid, accepted, rejected = (
        t.to(args.device) for t in rollout_batch(rollouts, args.anchors_per_sequence, generator, pad_token_id)
    )
    context = target_context(target, drafter, input_ids, use_cache=True)
    features = drafter.context_features(context.hidden_states)
    draft_logits = draft_blocks(model, drafter, target, input_ids, features, anchors)  # [B, A, D, V]
    B, A, D, _ = draft_logits.shape
    chains = replay_chains(input_ids, anchors, accepted, lengths, draft_logits)
    teacher = replay_teacher_logits(target, chains, anchors, valid, context.cache, input_ids.shape[1])
    if teacher is None:  # no cycle to train (e.g. every rollout stopped at once)
        nan = draft_logits.new_tensor(math.nan)
        parts = OPDLoss(draft_logits.sum() * 0.0, nan, nan)
    else:
        parts = opd_loss(
            draft_logits,
            teacher,
            accepted_depths(anchors, accepted, lengths),
            rejected,
            valid,
            accept_weight=args.opd_accept_weight,
            reject_weight=args.opd_reject_weight,
            decay=args.opd_reject_decay,
        )
    chain_rows = int(valid.sum(1).max()) * D
    return parts, StepSize(B, input_ids.shape[1], A, D + 1, False, B * chain_rows)


# ----------------------------------------------------------------------------------------------
# What a step costs


class FlopCounter:
    """FLOPs of the training steps, counted like `Trainer` counts them: 6 per parameter and trained token, 2 per
    parameter and no-grad token."""

    def __init__(self, drafter, target):
        # The parameters that touch each token.
        lm_head = target.get_output_embeddings().weight.numel()
        self.params = {
            "drafter": drafter.num_parameters(),
            "fc": drafter.fc.weight.numel(),
            "lm_head": lm_head,
            "target_body": target.num_parameters(exclude_embeddings=True) - lm_head,
        }
        self.pending = 0  # FLOPs of the steps not yet handed to Trainer

    def flos(self, size: StepSize) -> int:
        """FLOPs of one step (forward + backward): the drafter over its `batch * anchors * block` block rows, its
        `fc` over the `batch * length` context rows, the target's LM head over the drafted rows (4: forward and the
        gradient of its input), the target's context forward (unless the features are cached) and its tree pass
        over `tree_rows` rows."""
        n = self.params
        drafted = size.batch * size.anchors * size.block
        flos = (
            6 * n["drafter"] * drafted
            + 6 * n["fc"] * size.batch * size.length
            + 4 * n["lm_head"] * size.batch * size.anchors * (size.block - 1)
        )
        if not size.cached:
            flos += 2 * n["target_body"] * size.batch * size.length
        flos += 2 * (n["target_body"] + n["lm_head"]) * size.tree_rows
        return flos

    def add(self, size: StepSize) -> None:
        self.pending += self.flos(size)

    def pop(self) -> int:
        """The FLOPs added since the last call."""
        flos, self.pending = self.pending, 0
        return flos
