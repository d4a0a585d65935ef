"""The DFlash drafter's attention masks: the block queries' additive bias over cached, context and block keys, and
its sliding-window form for sliding-window draft layers (as transformers' own DFlash drafter attends)."""

import torch


def attention_bias(attention_mask, block_len: int, kv_len: int, dtype) -> torch.Tensor | None:
    """Additive float mask `[B|1, 1, L, kv]` (or `[B, 1, 1, kv]`) for the block queries, or None."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 2:  # padding mask over cached + new context + block, 1 = visible
        if attention_mask.shape[-1] != kv_len:
            raise ValueError(
                f"2D attention_mask has {attention_mask.shape[-1]} columns, expected cached + context "
                f"+ block = {kv_len}"
            )
        visible = attention_mask[:, None, None, :].bool()
    elif attention_mask.dim() == 4:
        if tuple(attention_mask.shape[-2:]) != (block_len, kv_len):
            raise ValueError(
                f"4D attention_mask has shape {tuple(attention_mask.shape)}, expected "
                f"[B, 1, {block_len}, {kv_len}] (block queries x cached + context + block keys)"
            )
        if attention_mask.dtype != torch.bool:
            return attention_mask.to(dtype)
        visible = attention_mask
    else:
        raise ValueError(f"attention_mask must be 2D or 4D, got shape {tuple(attention_mask.shape)}")
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, torch.finfo(dtype).min)


class SlidingWindowMask:
    """The block's mask in a sliding-window draft layer: `base` with every key more than `window` positions away
    from the query hidden, as transformers' bidirectional sliding overlay (`|q - k| <= window`) does it.

    The keys are those the layer's cache returned: cached rows (transformers' own sliding cache layers return only
    the last ones) followed by the new context and block rows at `position_ids`; cached rows sit at the positions
    just before the first new row's, as they do for one sequence (a batch's cache with holes does not keep them
    so, and is refused for sliding-window drafters).

    Args:
        base (`torch.Tensor`, *optional*): the additive mask of the call `[B|1, 1, L|1, past + c + L]`, or None.
        position_ids (`torch.LongTensor` of shape `[B|1, c + L]`).
    """

    def __init__(self, base, position_ids: torch.Tensor, block_len: int, window: int, dtype: torch.dtype):
        self.base, self.positions, self.block_len, self.window = base, position_ids, block_len, window
        self.dtype = dtype
        self.masks = {}  # by key count

    def for_keys(self, keys: int) -> torch.Tensor:
        """The additive mask `[B|1, 1, L, keys]` for a layer whose attention gets `keys` keys."""
        if keys not in self.masks:
            positions = self.positions
            cached = torch.arange(positions.shape[-1] - keys, 0, device=positions.device)  # -old .. -1
            key_positions = torch.cat([positions[:, :1] + cached, positions], dim=1)  # [B|1, keys]
            query_positions = positions[:, -self.block_len :]  # [B|1, L]
            outside = (query_positions[:, :, None] - key_positions[:, None, :]).abs() > self.window
            base = torch.zeros((), dtype=self.dtype, device=positions.device)
            base = base if self.base is None else self.base[..., -keys:]
            self.masks[keys] = torch.where(outside[:, None], torch.finfo(self.dtype).min, base)
        return self.masks[keys]
