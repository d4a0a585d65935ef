"""Static shapes for the tree pass (`cache_implementation="static"`): exact decoding, greedy and sampled, with
trees padded to the budget in transformers' StaticCache; a compiled target compiles once per budget and never per
cycle (the compiler's own counters); what the mode does not cover is refused by name."""

import pytest
import torch
from helpers import (
    TemperatureLike,
    chi_square_pvalue,
    exact_last_two_law,
    greedy,
    make_drafter,
    make_target,
    with_oracle,
)
from transformers import LogitsProcessorList, StaticCache

from hf_tev import TEVConfig

PROMPT = torch.tensor([[1, 5, 9, 13, 4]])


@pytest.fixture(scope="module")
def target():
    return make_target()


def static_generate(target, drafter, prompt=PROMPT, **kwargs):
    """`generate` in static shapes: `cache_implementation="static"`, or a StaticCache passed as `cache=`."""
    if "cache" not in kwargs:
        kwargs["cache_implementation"] = "static"
    return target.generate(prompt, assistant_model=drafter, return_dict_in_generate=True, **kwargs)


@pytest.mark.parametrize("budget", [1, 8, "auto"])
def test_greedy_static_decoding_equals_the_targets_and_commits_long_paths(target, budget):
    expected = greedy(target, PROMPT, max_new_tokens=40)
    drafter = with_oracle(make_drafter(target), expected)  # long accepted paths: the commit moves real entries
    config = TEVConfig(budget=budget, max_budget=16, lookup=False)
    out = static_generate(target, drafter, max_new_tokens=40, tev_config=config)
    assert torch.equal(out.sequences, expected)
    assert isinstance(out.cache, StaticCache) and out.tev_stats.tau > (1.5 if budget == 1 else 3.0)
    assert int(out.cache.get_seq_length()) == expected.shape[1] - 1  # every returned token but the last


def test_a_continuation_from_the_returned_static_cache_is_exact():
    target = make_target()  # its own: generate keeps a static cache on the model and reuses it when it fits
    expected = greedy(target, PROMPT, max_new_tokens=30)
    drafter = make_drafter(target)
    first = static_generate(target, drafter, max_new_tokens=10, tev_config=TEVConfig(budget=6))
    # the cache generate returned is too short for 20 more tokens and a padded tree: refused by name
    with pytest.raises(ValueError, match="StaticCache passed holds .* positions; this call needs"):
        static_generate(
            target, drafter, first.sequences, cache=first.cache, max_new_tokens=20, tev_config={"budget": 6}
        )
    cache = StaticCache(config=target.config, max_cache_len=64)
    first = static_generate(target, drafter, cache=cache, max_new_tokens=10, tev_config=TEVConfig(budget=6))
    again = static_generate(
        target, drafter, first.sequences, cache=first.cache, max_new_tokens=20, tev_config={"budget": 6}
    )
    assert torch.equal(again.sequences, expected)


def test_sampled_static_decoding_follows_the_targets_law():
    """The law of the last two of 4 sampled tokens (the first tree after the prefill can emit both) against the
    target's exact law, for every verifier; the pooled counts must reject a wrong law."""
    target = make_target("qwen3", vocab_size=8, hidden_size=32, num_layers=2, seed=4)
    with torch.no_grad():
        target.lm_head.weight.mul_(2.0)  # several tokens matter at each step, and temperature changes the law
    target.generation_config.eos_token_id = None
    prompt = torch.tensor([[1, 5, 3]])
    law = exact_last_two_law(target, prompt, LogitsProcessorList([TemperatureLike(0.9)]))
    drafter = make_drafter(target, block_size=4)
    pooled, accepted = torch.zeros(8, 8), []
    torch.manual_seed(1234)
    for verifier in ("tev", "predraw", "residual"):
        counts = torch.zeros(8, 8)
        for _ in range(150):
            out = static_generate(
                target, drafter, prompt, max_new_tokens=4, tev_config=TEVConfig(budget=6, verifier=verifier),
                do_sample=True, temperature=0.9, top_k=0, top_p=1.0,
            )  # fmt: skip
            counts[out.sequences[0, 5], out.sequences[0, 6]] += 1
            accepted.append(out.tev_stats.accepted_lengths[0])
        assert chi_square_pvalue(counts, law) > 1e-3, verifier
        pooled += counts
    assert sum(a >= 3 for a in accepted) > 30, "depth-2 paths were never accepted: no power"
    assert (
        chi_square_pvalue(pooled, exact_last_two_law(target, prompt, LogitsProcessorList([TemperatureLike(0.6)])))
        < 1e-3
    )


def test_a_compiled_target_compiles_once_per_budget_never_per_cycle():
    """The compiler's own counters: every graph is made in the first call's first cycles (the prefill, the padded
    tree pass); the rest of the call and a second call trace nothing new, nothing is recompiled, and the output
    equals plain `generate` in static shapes on the same compiled model."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    target = make_target()
    expected = greedy(target, PROMPT, max_new_tokens=40)  # eager, before compiling
    traced = []

    def backend(graph, example_inputs):  # counts what the compiler hands over; runs it as traced
        traced.append(graph)
        return graph.forward

    target.forward = torch.compile(target.forward, backend=backend, dynamic=False)
    config = TEVConfig(budget=8, lookup=False)
    drafter = with_oracle(make_drafter(target), expected)
    first = static_generate(target, drafter, max_new_tokens=40, tev_config=config)
    assert torch.equal(first.sequences, expected) and first.tev_stats.num_cycles >= 8
    per_call = len(traced)
    assert 1 <= per_call <= 3  # the prefill and the tree pass (split where the hidden-state capture breaks)
    second = static_generate(target, drafter, max_new_tokens=40, tev_config=config)
    assert torch.equal(second.sequences, expected)
    assert len(traced) == per_call, "a later cycle or call was compiled again"
    assert not counters["recompiles"], dict(counters["recompiles"])
    # a second budget is a second shape: compiled once, in its first call; after that neither budget traces again
    other = TEVConfig(budget=4, lookup=False)
    assert torch.equal(static_generate(target, drafter, max_new_tokens=40, tev_config=other).sequences, expected)
    both = len(traced)
    assert both > per_call
    for tev_config in (other, config, other):
        assert torch.equal(
            static_generate(target, drafter, max_new_tokens=40, tev_config=tev_config).sequences, expected
        )
    assert len(traced) == both, "a budget already compiled was compiled again"
    plain = target.generate(PROMPT, do_sample=False, max_new_tokens=40, cache_implementation="static")
    assert torch.equal(plain, first.sequences)  # plain generate on the same compiled model
    torch._dynamo.reset()


def test_what_the_static_mode_does_not_cover_is_refused_by_name(target):
    drafter = make_drafter(target)
    batch = torch.tensor([[1, 5, 9], [1, 7, 11]])
    with pytest.raises(ValueError, match="static tree pass decodes one prompt at a time"):
        static_generate(target, drafter, batch, max_new_tokens=4, tev_config={"budget": 4})
    from helpers import tiny_text_dims
    from transformers import Qwen3Config, Qwen3ForCausalLM

    sliding = Qwen3ForCausalLM(
        Qwen3Config(**tiny_text_dims(), use_sliding_window=True, sliding_window=4, max_window_layers=0)
    ).eval()
    with pytest.raises(ValueError, match="static tree pass takes full-attention targets only"):
        static_generate(sliding, make_drafter(sliding), max_new_tokens=4, tev_config={"budget": 4})


def test_a_static_commit_is_one_shape_every_cycle(target, monkeypatch):
    """The commit of a path that leaves the tree's first nodes moves the path padded to the pass's width: one
    copy of one shape whatever the accepted length (what a captured graph needs)."""
    from hf_tev.generation import verifier

    real, commits = verifier.commit_accepted_path, []

    def recording(cache, past, path, path_is_prefix, *args, **kwargs):
        commits.append((tuple(path.shape), path_is_prefix, kwargs.get("length")))
        return real(cache, past, path, path_is_prefix, *args, **kwargs)

    monkeypatch.setattr(verifier, "commit_accepted_path", recording)
    expected = greedy(target, PROMPT, max_new_tokens=40)
    drafter = with_oracle(make_drafter(target), expected)  # every third depth: the right token is not the first
    out = static_generate(target, drafter, max_new_tokens=40, tev_config=TEVConfig(budget=8, lookup=False))
    assert torch.equal(out.sequences, expected)
    moved = [(shape, length) for shape, is_prefix, length in commits if not is_prefix]
    assert len(moved) >= 2 and {shape for shape, _ in moved} == {(9,)}  # budget 8 + the root
    assert all(length < 9 for _, length in moved)  # the copy is the pass's width, longer than the path


def test_the_static_tree_pass_inputs_are_one_set_of_buffers_of_one_shape(target):
    """Every tree pass of a static call gets the same token, position and full-width mask buffers (written in place),
    of one shape: the budget's padded nodes by the static cache's length."""
    expected = greedy(target, PROMPT, max_new_tokens=30)
    drafter = with_oracle(make_drafter(target), expected)
    seen = []

    def record(module, args, kwargs):
        if kwargs["input_ids"].shape[1] == 9:  # the tree passes (budget 8 + the root), not the prefill
            mask = kwargs["attention_mask"]
            seen.append((kwargs["input_ids"].data_ptr(), mask.data_ptr(), tuple(mask.shape)))

    hook = target.register_forward_pre_hook(record, with_kwargs=True)
    try:
        out = static_generate(target, drafter, max_new_tokens=30, tev_config=TEVConfig(budget=8, lookup=False))
    finally:
        hook.remove()
    assert torch.equal(out.sequences, expected) and len(seen) == out.tev_stats.num_cycles >= 5
    assert len(set(seen)) == 1 and seen[0][2][-1] == out.cache.get_max_length()
