"""The drafter's last layer computes only the block rows `draft_logits` scores: its scores equal the whole block's,
bit for bit, at every number of depths (the block is still drafted whole: every row gives its keys and values)."""

import pytest
import torch
from helpers import make_target, own_sliding_drafter

from hf_tev.models.dflash.modeling_dflash import MATMUL_ROWS, DFlashDraftModel


def whole_block_logits(drafter, target, features, block, positions, mask=None):
    """q_1..q_{L-1} from every block row's output (the drafter's forward without `rows`), no cache."""
    embeds = target.get_input_embeddings()(block)
    rows = drafter(embeds, features, positions, attention_mask=mask).last_hidden_state
    return target.get_output_embeddings()(rows[:, 1:])


def drafter_for(kind, target):
    torch.manual_seed(5)
    if kind == "sliding":  # a sliding-window last layer: its mask rows are cut too
        return own_sliding_drafter(target, ("full_attention", "sliding_attention"), block_size=8)
    return DFlashDraftModel.from_target(target, num_layers=2 if kind == "two layers" else 1, block_size=8)


@pytest.mark.parametrize("kind", ["one layer", "two layers", "sliding"])
def test_scores_equal_the_whole_blocks_at_every_depth(kind):
    target = make_target("qwen3", num_layers=4)
    drafter = drafter_for(kind, target)
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(2, 6, len(drafter.target_hidden_indices) * 64, generator=generator)
    block = torch.full((2, 8), drafter.config.mask_token_id)
    block[:, 0] = torch.tensor([7, 11])
    positions = torch.arange(6 + 8)[None]
    padding = torch.ones(2, 14, dtype=torch.long)
    padding[1, :2] = 0  # the second row's first two context rows are hidden (a 2D mask, broadcast over queries)
    four_d = torch.ones(2, 1, 8, 14, dtype=torch.bool)
    four_d[0, 0, 3:, 1] = False  # a per-query mask: its rows are cut with the queries
    with torch.no_grad():
        for mask in (None, padding, four_d):
            whole = whole_block_logits(drafter, target, features, block, positions, mask)
            for depths in range(8):
                scored = drafter.draft_logits(
                    target, features, block, positions, num_depths=depths, attention_mask=mask
                )
                assert scored.shape == (2, depths, whole.shape[-1])
                assert torch.equal(scored, whole[:, :depths]), (kind, mask is None, depths)


def test_forward_rows_are_the_whole_blocks_rows():
    """`forward(rows=...)` returns those block rows; a cache still gets every row's keys and values."""
    target = make_target("qwen3", num_layers=4)
    drafter = drafter_for("two layers", target)
    features = torch.randn(1, 5, 2 * 64, generator=torch.Generator().manual_seed(1))
    embeds = torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(5 + 8)[None]
    with torch.no_grad():
        whole = drafter(embeds, features, positions).last_hidden_state
        for rows in (slice(1, 1 + MATMUL_ROWS), slice(2, 8), slice(0, 1)):
            cache = drafter.new_cache()
            part = drafter(embeds, features, positions, cache=cache, rows=rows).last_hidden_state
            assert part.shape == whole[:, rows].shape
            torch.testing.assert_close(part, whole[:, rows])  # under MATMUL_ROWS rows the rounding may differ
            assert cache.get_seq_length() == 5 + 8
        for bad in (3, [1, 2], torch.tensor([1, 2])):
            with pytest.raises(TypeError, match=r"rows=\.\.\.\) takes a slice of rows"):
                drafter(embeds, features, positions, rows=bad)


@pytest.mark.parametrize("block_len", [1, 2, 3, 5])
def test_short_blocks(block_len):
    """Blocks shorter than MATMUL_ROWS + 1 rows (and the root alone, which scores nothing) give the whole block's
    scores too."""
    target = make_target("qwen3", num_layers=4)
    drafter = DFlashDraftModel.from_target(target, num_layers=2, block_size=max(block_len, 2))
    features = torch.randn(1, 3, drafter.fc.in_features, generator=torch.Generator().manual_seed(3))
    block = torch.full((1, block_len), drafter.config.mask_token_id)
    block[0, 0] = 5
    positions = torch.arange(3 + block_len)[None]
    with torch.no_grad():
        whole = whole_block_logits(drafter, target, features, block, positions)
        for depths in range(block_len):
            scored = drafter.draft_logits(target, features, block, positions, drafter.new_cache(), num_depths=depths)
            assert torch.equal(scored, whole[:, :depths])
