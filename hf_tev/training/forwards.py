"""The two forwards every training step shares: the frozen target over the sequences (the drafter's context
features, and the K/V cache that trees and replayed chains are scored against) and the drafter over every block
of a batch at once.

Positions are absolute sequence positions: block `a` holds `x_a` at position `a` and drafts `x_{a+1} .. x_{a+D}`
(D = block_size - 1) at positions `a+1 .. a+D`.
"""

from __future__ import annotations

import torch

from .batch import block_attention_mask


@torch.no_grad()
def target_context(target, drafter, input_ids: torch.Tensor, use_cache: bool):
    """The target's no-grad forward over `input_ids` `[B, T]` that returns only the drafter's layers as hidden
    states (and the K/V cache when `use_cache`); `drafter.context_features(output.hidden_states)` are its
    features."""
    return target(input_ids, output_hidden_states=drafter.target_hidden_indices, use_cache=use_cache, logits_to_keep=1)


def draft_blocks(model, drafter, target, input_ids, features, anchors) -> torch.Tensor:
    """Drafter logits `[B, A, D, V]` of the blocks `[x_a, MASK, ...]` at every anchor `[B, A]`, from ONE forward:
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
    lm_head = target.get_output_embeddings()
    return lm_head(hidden.to(lm_head.weight.dtype))
