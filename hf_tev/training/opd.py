"""Draft-OPD: on-policy distillation of a DFlash drafter (Lei et al., "Draft-OPD: On-Policy Distillation for
Speculative Draft Models", 2026, arXiv 2605.29343), the pieces `ExitTrainer` uses with `objective="opd"`.

1. Rollouts (`collect_rollouts`): hf_tev's own tree decoding, the frozen target verifying the current drafter's
   trees (`rollout.tree_decode`, the decoding of the evaluations' tau too). The sequence follows the target's
   distribution (target-assisted rollout: stable continuations); every cycle's root position (its anchor) and
   accepted length come from `tev_stats`, so the positions where verification rejected a draft are known: cycle
   `c` drafted from anchor `a` and had `n` drafted tokens accepted; depth `n + 1` (position `a + n + 1`, where
   the bonus token went) is the exposed error.
2. Replay (`replay_chains`, `replay_teacher_logits`): the drafter's own block at each cycle's anchor is drafted
   again (with gradient) from the rollout's context, and the teacher of each depth `k` is the target's
   distribution after the replayed chain `x_a, c_1 .. c_{k-1}`: the accepted tokens `c_k = x_{a+k}` up to depth
   `n`, then the drafter's own greedy proposals (draft-induced states). One target forward over the rollout's
   cached context scores all chains (the tree pass of the tree objectives, with chains as trees).
3. Loss (`opd_loss`), the paper's acceptance-aware objective: forward KL `KL(p || q)` at the accepted depths
   (mean), reverse KL `KL(q || p)` at the rejected depths `k > n` with position decay `decay^(k - n - 1)`
   (weighted mean), `(w_acc * L_acc + w_rej * L_rej) / (w_acc + w_rej)` over the streams present.
The teacher is the target's raw distribution (temperature 1), whatever the rollout temperature. `replay_loss` runs
2 and 3 on a micro-batch of rollouts; `opd_rollouts.RolloutPool` keeps the trainer's rollouts between refreshes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from ..tree import DraftTree
from .batch import tree_batch_inputs
from .forwards import draft_blocks, target_context
from .metrics import StepSize
from .rollout import tree_decode


@dataclass
class Rollout:
    """One tree-decoded sequence with its cycles.

    Attributes:
        input_ids: prompt + generated tokens (the whole returned sequence).
        prompt_length: tokens of the prompt.
        anchors: the root position of every cycle (the block it drafted starts there).
        accepted: drafted tokens accepted in every cycle (the cycle's block length minus the bonus token).
        rejected: whether verification exposed a draft error in the cycle: fewer than the drafter's depth
            accepted, the tree not cut short by `max_new_tokens`, and the bonus position inside the sequence
            (the last cycle of a sequence cut at EOS / the token limit exposes none).
    """

    input_ids: list[int]
    prompt_length: int
    anchors: list[int]
    accepted: list[int]
    rejected: list[bool]

    @property
    def block_lengths(self) -> list[int]:
        return [n + 1 for n in self.accepted]

    def to_dict(self) -> dict:
        return dict(
            input_ids=self.input_ids,
            prompt_length=self.prompt_length,
            anchors=self.anchors,
            accepted=self.accepted,
            rejected=self.rejected,
        )


def rollout_from_lengths(
    sequence: Sequence[int], prompt_length: int, block_lengths: Sequence[int], depth: int, max_new_tokens: int
) -> Rollout:
    """The cycles of a tree-decoded sequence from its block lengths (`tev_stats.accepted_lengths`).

    The decoder's first root is the token the prefill drew (position `prompt_length`); a cycle with block length
    `L` commits `L - 1` drafted tokens and a bonus token, so the next root sits `L` positions later. The tree of a
    cycle at anchor `a` was at most `min(depth, prompt_length + max_new_tokens - a - 2)` deep (the decoder's
    token limit); a cycle that accepted that many exposed no error.
    """
    sequence = [int(token) for token in sequence]
    anchors, accepted, rejected = [], [], []
    anchor = prompt_length
    for length in block_lengths:
        n = int(length) - 1
        cap = min(depth, prompt_length + max_new_tokens - anchor - 2)
        anchors.append(anchor)
        accepted.append(n)
        rejected.append(n < cap and anchor + n + 1 <= len(sequence) - 1)
        anchor += int(length)
    return Rollout(sequence, prompt_length, anchors, accepted, rejected)


def collect_rollouts(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    budget: int,
    temperature: float,
    max_new_tokens: int,
    seeds: Sequence[int],
    pad_token_id: int,
) -> list[Rollout]:
    """Tree-decode every prompt with the frozen target verifying `drafter`'s trees at `budget` and return the
    rollouts. Greedy at `temperature` 0, else pure temperature sampling (top-k / top-p off) from a private
    generator seeded `seeds[i]` (reproducible; the global RNG is untouched). The decoding is `rollout.tree_decode`,
    the same as the decoded tau of evaluations."""
    decoded = tree_decode(target, drafter, prompts, budget, temperature, max_new_tokens, seeds, pad_token_id)
    depth = drafter.config.block_size - 1
    return [
        rollout_from_lengths(one.sequence, len(prompt), one.block_lengths, depth, max_new_tokens)
        for one, prompt in zip(decoded, prompts, strict=True)
    ]


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
