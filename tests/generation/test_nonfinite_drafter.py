"""A drafter whose logits are not finite (an fp16 overflow, broken weights): decoding stays exact, the depths it
could not score are not drafted, and the log says so once."""

import pytest
import torch
from helpers import greedy, make_drafter, make_target, transformers_log, with_oracle

from hf_tev import TEVConfig

PROMPTS = torch.tensor([[1, 5, 9, 13, 7, 3], [1, 40, 41, 3, 17, 88]])
SETTINGS = [
    {"budget": 8},
    {"budget": 8, "tree": "chain"},
    {"budget": 8, "lookup": True},
    {"budget": "auto"},
    {"budget": "auto", "tree": "chain"},
    {"budget": "auto", "lookup": True},
]


def broken_drafter(target, how: str):
    """A drafter whose every logit is NaN: an infinite norm weight, or float16 weights that overflow."""
    drafter = make_drafter(target)
    with torch.no_grad():
        if how == "inf_weight":
            drafter.norm.weight[0] = float("inf")
        else:  # normalised states times 60,000 pass float16's largest value, 65,504
            drafter.to(torch.float16)
            drafter.norm.weight.fill_(6e4)
    return drafter


@pytest.mark.parametrize("how", ["inf_weight", "float16_overflow"])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_a_drafter_without_finite_logits_decodes_exactly_and_says_so_once(how, settings):
    target = make_target("qwen3")
    drafter = broken_drafter(target, how)
    for prompts in (PROMPTS[:1], PROMPTS):  # one prompt, a batch
        expected = greedy(target, prompts, max_new_tokens=12)
        with transformers_log() as messages:
            for _ in range(2):
                out = greedy(
                    target, prompts, max_new_tokens=12, assistant_model=drafter, tev_config=TEVConfig(**settings)
                )
                assert out.tolist() == expected.tolist()
        assert len([m for m in messages if "not finite (inf or NaN)" in m]) == 1, messages
    sampled = target.generate(
        PROMPTS, do_sample=True, max_new_tokens=6, assistant_model=drafter, tev_config=TEVConfig(**settings, seed=0)
    )
    assert sampled.shape == (2, PROMPTS.shape[1] + 6)


def overflowing_at_depth(drafter, depth: int):
    """The drafter with an infinite logit at `depth` (1-based) of every block."""
    real = drafter.draft_logits

    def draft_logits(*args, **kwargs):
        logits = real(*args, **kwargs)
        if logits.shape[1] >= depth:
            logits[:, depth - 1, 0] = float("inf")
        return logits

    drafter.draft_logits = draft_logits
    return drafter


@pytest.mark.parametrize("settings", [{"budget": 8, "lookup": False}, {"budget": "auto", "lookup": False}])
def test_the_tree_stops_above_a_depth_the_drafter_could_not_score(settings):
    target = make_target("qwen3")
    prompt = PROMPTS[:1]
    expected = greedy(target, prompt, max_new_tokens=16)
    drafter = overflowing_at_depth(with_oracle(make_drafter(target), expected), depth=3)
    with transformers_log() as messages:
        out = greedy(
            target,
            prompt,
            max_new_tokens=16,
            assistant_model=drafter,
            tev_config=TEVConfig(**settings),
            return_dict_in_generate=True,
        )
    assert out.sequences.tolist() == expected.tolist()
    lengths = out.tev_stats.accepted_lengths
    assert max(lengths) <= 3  # depths 1 and 2 and the bonus: nothing was drafted at depth 3 or below
    if settings["budget"] == 8:
        assert max(lengths) == 3  # the oracle's depths 1 and 2 are still drafted and accepted
    assert any("not finite" in m for m in messages)


def test_finite_depths_sets_exactly_the_rows_without_finite_logits_to_minus_inf():
    from hf_tev.generation.candidates import TreeCandidateGenerator

    target = make_target("qwen3")
    candidates = TreeCandidateGenerator(make_drafter(target), target, TEVConfig(budget=8), 1, torch.device("cpu"))
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    logits[0, 7] = float("inf")  # a row with an inf logit
    logits[1, 3] = float("nan")
    logits[2] = -float("inf")  # no finite logit at all
    logits[3, :40] = -float("inf")  # some tokens banned: a usable row
    logits[4] *= 1e36  # huge but finite
    logprobs = candidates.finite_depths(logits.clone())
    expected = torch.log_softmax(logits, dim=-1)
    unusable = torch.tensor([True, True, True, False, False, False])
    assert torch.equal(logprobs[~unusable], expected[~unusable])
    assert (logprobs[unusable] == -float("inf")).all()
    # the call's flag (read by `warn_nonfinite` at its end) marks exactly those depths
    assert torch.equal(torch.cat(candidates.row_maxima) == -float("inf"), unusable)
