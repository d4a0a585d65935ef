"""The batch of a training step (its anchors, block labels and masks) and the two forwards every step shares: the
frozen target over the sequences (`target_context`: the drafter's context features, and the K/V cache that trees
and replayed chains are scored against) and the drafter over every block of a batch at once (`draft_blocks`);
`tree_batch_inputs` lays out the ONE target forward that scores every training tree (or replayed chain).

Positions are absolute sequence positions throughout: block `a` holds `x_a` at position `a` and drafts
`x_{a+1} .. x_{a+D}` (D = block_size - 1) at positions `a+1 .. a+D`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..tree import DraftTree


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator):
    """Random block starts: distinct positions `a` whose next token `a + 1` is supervised.

    Args:
        loss_mask (`[B, T]` bool): supervised tokens.
        num_anchors: anchors per sequence (fewer when a sequence has fewer candidates).
        generator: CPU generator (reproducible, resumable anchor draws).

    Returns:
        `(anchors, valid)`, both `[B, min(num_anchors, T)]`, sorted by position; `anchors` is 0 where
        `valid` is False (padding anchors that are masked out of every loss).
    """
    B, T = loss_mask.shape
    candidates = torch.zeros_like(loss_mask)
    candidates[:, :-1] = loss_mask[:, 1:]
    scores = torch.rand(B, T, generator=generator).to(loss_mask.device).masked_fill(~candidates, -1.0)  # [B, T]
    top_scores, anchors = scores.topk(min(num_anchors, T), dim=1)  # [B, A]; a random subset of candidates
    valid = top_scores >= 0
    anchors = anchors.masked_fill(~valid, T)  # invalid ones sort last
    anchors, order = anchors.sort(dim=1)
    valid = valid.gather(1, order)
    return anchors.masked_fill(~valid, 0), valid


def block_labels(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, depth: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels `x_{a+k}`, k = 1..depth, of every block, `[B, A, depth]`, and which of them are supervised."""
    B, T = input_ids.shape
    positions = anchors[..., None] + torch.arange(1, depth + 1, device=anchors.device)  # [B, A, depth]
    inside = positions < T
    flat = positions.clamp(max=T - 1).reshape(B, -1)  # [B, A * depth]
    labels = input_ids.gather(1, flat).view_as(positions)
    supervised = loss_mask.gather(1, flat).view_as(positions) & inside & valid[..., None]
    return labels, supervised


def block_attention_mask(anchors: torch.Tensor, seq_len: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Float additive mask of the drafter's shared forward: `[B, 1, A*L, T + A*L]`.

    Keys are the T context rows followed by the A blocks of L rows. Block `a` sees the context strictly
    before its anchor and all of its own rows (bidirectional), nothing of the other blocks.
    """
    B, A = anchors.shape
    device = anchors.device
    row_anchor = anchors.repeat_interleave(block_size, dim=1)  # [B, A*L]
    sees_context = torch.arange(seq_len, device=device) < row_anchor[..., None]  # [B, A*L, T]
    block_of_row = torch.arange(A * block_size, device=device) // block_size  # [A*L]
    sees_block = (block_of_row[:, None] == block_of_row[None, :]).expand(B, -1, -1)  # [B, A*L, A*L]
    visible = torch.cat([sees_context, sees_block], dim=-1)
    return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(~visible, torch.finfo(dtype).min)[:, None]


def tree_batch_inputs(
    trees: Sequence[DraftTree],
    owners: Sequence[int],
    anchors: Sequence[int],
    batch_size: int,
    seq_len: int,
    dtype: torch.dtype,
    context_window: int | None = None,
):
    """Inputs of ONE target forward that scores every tree against the cached context of its sequence.

    Tree `i` belongs to sequence `owners[i]` and hangs at anchor position `anchors[i]`: its root holds `x_a`
    at position `a`, node `v` sits at `a + depth(v)`, and it sees cache positions `< a` plus its own
    ancestors. Trees of one sequence are concatenated; sequences are right-padded to the longest (padding
    rows see cache position 0 only and are never read).

    `context_window=W` hides cache positions `< a - W` from the tree of anchor `a`: the tree sees the last W
    tokens before its anchor, at their absolute positions. This is a choice, not the authors' exact
    procedure: their released code re-runs the target on the window itself (positions restart at 0, and
    the window tokens' own states are recomputed from the window alone), whereas here the window tokens'
    cached K/V still come from the full-context forward. `None` (default) = the full context.

    Returns:
        `tokens` `[B, M]`, `position_ids` `[B, M]`, `attention_mask` `[B, 1, M, T + M]` (float additive),
        and `offsets` (first row of every tree in its sequence's row block).
    """
    device = trees[0].tokens.device
    per_sequence = [[] for _ in range(batch_size)]
    offsets = []
    for i, owner in enumerate(owners):
        offsets.append(sum(trees[j].num_nodes for j in per_sequence[owner]))
        per_sequence[owner].append(i)
    width = max(sum(trees[j].num_nodes for j in members) for members in per_sequence)
    tokens = torch.zeros(batch_size, width, dtype=torch.long, device=device)
    positions = torch.zeros(batch_size, width, dtype=torch.long, device=device)
    visible = torch.zeros(batch_size, width, seq_len + width, dtype=torch.bool, device=device)
    visible[:, :, 0] = True  # padding rows; real rows overwrite it below
    for b, members in enumerate(per_sequence):
        if not members:
            continue
        n = sum(trees[j].num_nodes for j in members)
        row_anchor = torch.cat([torch.full((trees[j].num_nodes,), anchors[j], device=device) for j in members])  # [n]
        tokens[b, :n] = torch.cat([trees[j].tokens for j in members])
        positions[b, :n] = row_anchor + torch.cat([trees[j].depths for j in members])
        cache_positions = torch.arange(seq_len, device=device)
        visible[b, :n, :seq_len] = cache_positions < row_anchor[:, None]
        if context_window is not None:
            visible[b, :n, :seq_len] &= cache_positions >= row_anchor[:, None] - context_window
        visible[b, :n, seq_len : seq_len + n] = torch.block_diag(*[trees[j].visibility for j in members])
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(~visible, torch.finfo(dtype).min)
    return tokens, positions, mask[:, None], offsets


# ----------------------------------------------------------------------------------------------
# The two forwards


@torch.no_grad()
def target_context(target, drafter, input_ids: torch.Tensor, use_cache: bool):
    """The target's no-grad forward over `input_ids` `[B, T]` that returns only the drafter's layers as hidden
    states (and the K/V cache when `use_cache`); `drafter.context_features(output.hidden_states)` are its
    features."""
    return target(input_ids, output_hidden_states=drafter.target_hidden_indices, use_cache=use_cache, logits_to_keep=1)


def draft_blocks(model, drafter, target, input_ids, features, anchors) -> torch.Tensor:
    """Drafter logits `[B, A, D, V]` of the blocks `[x_a, MASK, ...]` at every anchor `[B, A]`, from ONE forward
    (`V`: the drafter's draft vocabulary where it has one, `DFlashDraftModel.head_logits`):
    every block sees the context features `[B, T, k*H]` strictly before its anchor and its own rows.

    `model` is what the trainer trains (the drafter, or its DDP wrapper: calling it lets gradient synchronisation
    see this forward); `drafter` the unwrapped model, for its config. The block embeddings and the LM head are the
    target's.
    """
    B, T = input_ids.shape
    A = anchors.shape[1]
    L = drafter.config.block_size
    block_ids = torch.full((B, A, L), drafter.config.mask_token_id, dtype=torch.long, device=input_ids.device)
    block_ids[:, :, 0] = input_ids.gather(1, anchors)
    noise_embeds = target.get_input_embeddings()(block_ids.view(B, A * L)).to(drafter.dtype)
    block_positions = (anchors[..., None] + torch.arange(L, device=anchors.device)).view(B, A * L)
    position_ids = torch.cat([torch.arange(T, device=anchors.device).expand(B, T), block_positions], dim=1)
    mask = block_attention_mask(anchors, T, L, drafter.dtype)
    hidden = model(
        noise_embeds=noise_embeds,
        context_hidden_states=features.to(drafter.dtype),
        position_ids=position_ids,
        attention_mask=mask,
    ).last_hidden_state  # [B, A*L, H]
    hidden = hidden.view(B, A, L, -1)[:, :, 1:]  # block positions 1..D
    return drafter.head_logits(target, hidden)
