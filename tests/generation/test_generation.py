"""End-to-end tree decoding inside `generate`: exactness against the target's own decoding."""

import copy
import dataclasses
import math
import re
import warnings

import pytest
import torch
import transformers
from helpers import (
    RecordingStreamer,
    TemperatureLike,
    chi_square_pvalue,
    exact_last_two_law,
    greedy,
    make_drafter,
    make_target,
    transformers_log,
    with_oracle,
)
from transformers import (
    DynamicCache,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation import GenerateDecoderOnlyOutput

import hf_tev
from hf_tev import TEVConfig
from hf_tev.generation.cache import commit_accepted_path
from hf_tev.tree import build_tree, tree_attention_mask, tree_position_ids

PROMPTS = [[1, 5, 9, 13, 7], [1, 40, 41, 3, 3, 17, 88, 20, 6]]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_greedy_equals_target_greedy(arch, attn):
    target = make_target(arch, attn_implementation=attn)
    taus = []
    for prompt_ids in PROMPTS:
        prompt = torch.tensor([prompt_ids])
        for max_new in (5, 29):
            expected = greedy(target, prompt, max_new_tokens=max_new)
            for budget in (1, 8, 64, "auto"):
                for verifier in ("tev", "predraw", "residual"):
                    drafter = with_oracle(make_drafter(target), expected)
                    out = greedy(
                        target,
                        prompt,
                        max_new_tokens=max_new,
                        assistant_model=drafter,
                        tev_config=TEVConfig(budget=budget, verifier=verifier),
                        return_dict_in_generate=True,
                    )
                    assert out.sequences.tolist() == expected.tolist(), (budget, verifier, max_new)
                    taus.append(out.tev_stats.tau)
                    # at T=0 the coverage of a tree is exactly its accepted length
                    assert out.tev_stats.coverages == [float(a) for a in out.tev_stats.accepted_lengths]
    assert max(taus) > 3, "the acceptance path was never exercised"


def test_greedy_with_random_drafter_and_chain():
    target = make_target("qwen3")
    prompt = torch.tensor([PROMPTS[0]])
    expected = greedy(target, prompt, max_new_tokens=20)
    for tree in ("chain", "best_first"):
        for budget in (0, 3, 16):
            out = greedy(
                target,
                prompt,
                max_new_tokens=20,
                assistant_model=make_drafter(target),
                tev_config=TEVConfig(budget=budget, tree=tree),
            )
            assert out.tolist() == expected.tolist()


def test_auto_budget_with_a_useless_drafter_decodes_mostly_plainly():
    target = make_target("qwen3")
    prompt = torch.tensor([PROMPTS[0]])
    expected = greedy(target, prompt, max_new_tokens=40)
    out = greedy(
        target,
        prompt,
        max_new_tokens=40,
        assistant_model=make_drafter(target),
        tev_config=TEVConfig(lookup=False),
        return_dict_in_generate=True,
    )  # the default budget is "auto"; the drafter alone
    stats = out.tev_stats
    assert out.sequences.tolist() == expected.tolist()
    assert len(stats.predicted_lengths) == stats.num_cycles and stats.budget_model["probe_tokens"][0] == 1
    plain = sum(size == 0 for size in stats.tree_sizes)
    assert plain >= stats.num_cycles // 2, stats.tree_sizes  # the drafter is skipped most of the time


def test_auto_budget_continues_its_schedule_in_the_next_call():
    """A call starts with the pauses the last call on the same models left: short calls with a drafter that
    does not pay do not each try it after 1, 2, 4, ... cycles again."""
    from hf_tev.generation import automatic_budget

    target = make_target("qwen3")
    drafter = make_drafter(target)
    calls = []
    real = drafter.draft_logits
    drafter.draft_logits = lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs)
    prompt = torch.tensor([PROMPTS[0]])
    expected = greedy(target, prompt, max_new_tokens=40)
    drafted = []
    for _ in range(2):
        calls.clear()
        out = greedy(target, prompt, max_new_tokens=40, assistant_model=drafter, tev_config=TEVConfig())
        assert out.tolist() == expected.tolist()
        drafted.append(len(calls))
    assert drafted[1] < drafted[0], drafted

    config = copy.deepcopy(target.generation_config)
    kept = automatic_budget(target, drafter, TEVConfig(), config)
    assert automatic_budget(target, drafter, TEVConfig(), config) is kept
    assert automatic_budget(target, drafter, TEVConfig(max_budget=64), config) is not kept
    assert automatic_budget(target, drafter, TEVConfig(lookup=True), config) is not kept
    other = automatic_budget(target, make_drafter(target), TEVConfig(), config)
    assert other is not kept and other.calibration is not kept.calibration and other.cost is kept.cost
    # another target (never one that merely reuses a freed target's address) has its own calibration
    another = automatic_budget(make_target("qwen3"), drafter, TEVConfig(), config)
    assert another.calibration is not kept.calibration and another.cost is not kept.cost


def test_eos_inside_accepted_path_stops_there():
    target = make_target("qwen3")
    prompt = torch.tensor([PROMPTS[1]])
    # a repetition penalty keeps the tiny random model out of short loops (and exercises per-node processing)
    reference = greedy(target, prompt, max_new_tokens=30, repetition_penalty=3.0)
    generated = reference[0, prompt.shape[1] :].tolist()
    # a token the target first emits mid-generation, and one it never emits
    eos = next(tok for i, tok in enumerate(generated) if i >= 6 and tok not in generated[:i])
    unused = next(tok for tok in range(3, 96) if tok not in generated)
    eos_ids = [unused, eos]
    expected = greedy(target, prompt, max_new_tokens=30, eos_token_id=eos_ids, repetition_penalty=3.0)
    assert expected.shape[1] < reference.shape[1]
    for verifier in ("tev", "predraw"):
        drafter = with_oracle(make_drafter(target, block_size=16), reference)
        out = greedy(
            target,
            prompt,
            max_new_tokens=30,
            eos_token_id=eos_ids,
            repetition_penalty=3.0,
            assistant_model=drafter,
            tev_config=TEVConfig(budget=16, verifier=verifier),
            return_dict_in_generate=True,
        )
        assert out.sequences.tolist() == expected.tolist()
        assert max(out.tev_stats.accepted_lengths) > 3


def test_processors_per_node_match_plain_generate():
    # repetition penalty and n-gram blocking read each node's own path; scores must match generate's
    target = make_target("llama")
    prompt = torch.tensor([PROMPTS[0]])
    kwargs = dict(
        max_new_tokens=25,
        repetition_penalty=1.5,
        no_repeat_ngram_size=2,
        output_scores=True,
        return_dict_in_generate=True,
    )
    expected = greedy(target, prompt, **kwargs)
    drafter = with_oracle(make_drafter(target), expected.sequences)
    out = greedy(target, prompt, assistant_model=drafter, tev_config=TEVConfig(budget=16), **kwargs)
    assert isinstance(out, GenerateDecoderOnlyOutput)
    assert out.sequences.tolist() == expected.sequences.tolist()
    assert len(out.scores) == len(expected.scores)
    for ours, theirs in zip(out.scores, expected.scores, strict=True):
        finite = torch.isfinite(theirs)
        assert torch.equal(finite, torch.isfinite(ours))
        torch.testing.assert_close(ours[finite], theirs[finite], atol=1e-4, rtol=1e-4)
    assert out.tev_stats.tau > 1


class StopAfterToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_streamer_and_stopping_criteria():
    target = make_target("qwen3")
    prompt = torch.tensor([PROMPTS[1]])
    reference = greedy(target, prompt, max_new_tokens=30)
    stop_token = reference[0, prompt.shape[1] + 9].item()
    criteria = StoppingCriteriaList([StopAfterToken(stop_token)])
    expected = greedy(target, prompt, max_new_tokens=30, stopping_criteria=criteria)
    assert expected.shape[1] < reference.shape[1]
    streamer = RecordingStreamer()
    out = greedy(
        target,
        prompt,
        max_new_tokens=30,
        stopping_criteria=criteria,
        streamer=streamer,
        assistant_model=with_oracle(make_drafter(target), reference),
        tev_config=TEVConfig(budget=8),
    )
    assert out.tolist() == expected.tolist()
    assert streamer.chunks[0] == PROMPTS[1]
    assert sum(streamer.chunks[1:], []) == out[0, prompt.shape[1] :].tolist()
    assert streamer.ended


def test_left_padded_prompt_matches_plain_generate():
    target = make_target("qwen3")
    prompt = torch.tensor([[0, 0, 0] + PROMPTS[0]])
    mask = torch.tensor([[0, 0, 0] + [1] * len(PROMPTS[0])])
    expected = greedy(target, prompt, attention_mask=mask, max_new_tokens=20)
    out = greedy(
        target,
        prompt,
        attention_mask=mask,
        max_new_tokens=20,
        assistant_model=with_oracle(make_drafter(target), torch.cat([expected[:, 3:], expected[:, :3]], 1)),
        tev_config=TEVConfig(budget=8),
    )
    assert out.tolist() == expected.tolist()


def test_tree_pass_logits_equal_path_forwards_and_compaction():
    target = make_target("qwen3")
    prompt = torch.tensor([PROMPTS[1]])
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(prompt, cache=cache)
        past = prompt.shape[1]
        torch.manual_seed(3)
        tree = build_tree(torch.log_softmax(torch.randn(4, 96) * 3, -1), 12, torch.tensor(7))
        out = target(
            tree.tokens[None],
            position_ids=tree_position_ids(tree, past),
            cache=cache,
            attention_mask=tree_attention_mask(tree, past, torch.float32),
        )
        paths = [tree.visibility[i].nonzero()[:, 0] for i in range(tree.num_nodes)]
        for node, path in enumerate(paths):
            plain = target(torch.cat([prompt, tree.tokens[path][None]], 1)).logits[0, -1]
            torch.testing.assert_close(out.logits[0, node], plain, atol=1e-4, rtol=1e-4)
        # keep a path that is not a prefix of the node order, then continue with one token
        node = max(range(tree.num_nodes), key=lambda i: (len(paths[i]), i))
        path = paths[node]
        assert path.tolist() != list(range(len(path)))
        commit_accepted_path(cache, past, path, path_is_prefix=False)
        assert cache.get_seq_length() == past + len(path)
        committed = torch.cat([prompt, tree.tokens[path][None]], 1)
        nxt = torch.tensor([[11]])
        step = target(nxt, cache=cache, position_ids=torch.tensor([[committed.shape[1]]])).logits[0, -1]
        fresh = target(torch.cat([committed, nxt], 1)).logits[0, -1]
        torch.testing.assert_close(step, fresh, atol=1e-4, rtol=1e-4)


def test_committing_the_columns_out_of_place_equals_the_index_select():
    # one row's path with its nodes out of place copied one by one (`moves`) leaves the cache the index_select does
    gen = torch.Generator().manual_seed(0)
    for path in ([0, 1, 4], [0, 2, 5], [0, 3], [0, 1, 2, 3, 9]):
        caches = []
        for with_moves in (False, True):
            cache = DynamicCache()
            cache.update(torch.randn(1, 2, 14, 4, generator=gen.manual_seed(1)), torch.randn(1, 2, 14, 4), 0)
            cache.layers[0].values = cache.layers[0].keys.flip(2).clone()
            moves = [(node, j) for j, node in enumerate(path) if node != j] if with_moves else None
            commit_accepted_path(cache, 4, torch.tensor(path), False, moves)
            caches.append(cache)
        assert caches[0].get_seq_length() == caches[1].get_seq_length() == 4 + len(path)
        assert torch.equal(caches[0].layers[0].keys, caches[1].layers[0].keys)
        assert torch.equal(caches[0].layers[0].values, caches[1].layers[0].values)


def test_crop_to_cuts_as_the_cache_crops():
    from hf_tev.generation.cache import crop_to

    class OwnCrop(DynamicCache):
        crops = []

        def crop(self, max_length):
            self.crops.append(max_length)
            super().crop(max_length)

    for kind in (DynamicCache, OwnCrop):
        cache, expected = kind(), DynamicCache()
        for layer in range(2):
            states = torch.randn(1, 2, 9, 4)
            cache.update(states, states + 1, layer)
            expected.update(states, states + 1, layer)
        crop_to(cache, 6)
        expected.crop(-3)
        for ours, theirs in zip(cache.layers, expected.layers, strict=True):
            assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
        crop_to(cache, 6)  # nothing to cut
        assert cache.get_seq_length() == 6
    assert OwnCrop.crops == [-3]  # a cache class with its own crop is cut by it


# ---------------------------------------------------------------------------------------------------------
# Sampling: the output law must be the target's own sampling law
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("verifier,budget", [("tev", 6), ("predraw", 6), ("tev", "auto")])
@pytest.mark.parametrize("warp", ["plain", "top_k_top_p"])
def test_sampling_law_matches_target(verifier, budget, warp, monkeypatch):
    if budget == "auto":
        # The sizes auto picks depend on measured times; a flat tree-pass cost (an accelerator's view) makes it
        # grow trees whatever this machine's load, so the law is tested on real trees every time. Any sizes
        # would be exact: they are fixed before the target's draws.
        monkeypatch.setattr("hf_tev.generation.loop.probe_tree_costs", lambda *args, **kwargs: ([1, 64], [1e-2, 1e-2]))
        # and a calibration that keeps trusting the drafter (what it learns from 400 calls would shrink the trees)
        monkeypatch.setattr(hf_tev.budget.AcceptanceCalibration, "__call__", lambda self, log_q: 0.5)
    target = make_target("qwen3", vocab_size=8, hidden_size=32, num_layers=2, seed=4)
    with torch.no_grad():
        target.lm_head.weight.mul_(2.0)  # several tokens matter at each step, and temperature changes the law
    target.generation_config.eos_token_id = None  # the law of two free tokens
    prompt = torch.tensor([[1, 5, 3]])
    sampling = dict(do_sample=True, temperature=0.9)
    warpers = [TemperatureLike(0.9)]
    if warp == "top_k_top_p":
        sampling.update(top_k=5, top_p=0.9)
        warpers += [TopKLogitsWarper(5), TopPLogitsWarper(0.9)]
    else:
        sampling.update(top_k=0, top_p=1.0)
    law = exact_last_two_law(target, prompt, LogitsProcessorList(warpers))
    drafter = make_drafter(target, block_size=4)
    counts, accepted = torch.zeros(8, 8), []
    torch.manual_seed(1234)
    for _ in range(400):
        out = target.generate(
            prompt,
            max_new_tokens=4,
            assistant_model=drafter,
            return_dict_in_generate=True,
            tev_config=TEVConfig(budget=budget, verifier=verifier, max_budget=6),
            **sampling,
        )
        counts[out.sequences[0, 5], out.sequences[0, 6]] += 1
        accepted.append(out.tev_stats.accepted_lengths[0])
    assert chi_square_pvalue(counts, law) > 1e-3
    assert sum(a >= 3 for a in accepted) > 20, "the depth-2 paths were never accepted: the test has no power"
    # the test has power: a slightly different law (temperature 1.3, no top-k/top-p) is rejected
    wrong = exact_last_two_law(target, prompt, LogitsProcessorList([TemperatureLike(1.3)]))
    assert chi_square_pvalue(counts, wrong) < 1e-3


def test_seeded_sampling_is_reproducible():
    target = make_target("qwen3")
    drafter = make_drafter(target)
    prompt = torch.tensor([PROMPTS[0]])
    runs = [
        target.generate(
            prompt, do_sample=True, max_new_tokens=20, assistant_model=drafter, tev_config=TEVConfig(budget=8, seed=7)
        )
        for _ in range(2)
    ]
    assert runs[0].tolist() == runs[1].tolist()
    torch.manual_seed(5)
    a = target.generate(
        prompt, do_sample=True, max_new_tokens=20, assistant_model=drafter, tev_config=TEVConfig(budget=8)
    )
    torch.manual_seed(5)
    b = target.generate(
        prompt, do_sample=True, max_new_tokens=20, assistant_model=drafter, tev_config=TEVConfig(budget=8)
    )
    assert a.tolist() == b.tolist()
    # the ends of the seeds torch takes decode; a negative seed is seed + 2**64, as for torch.Generator
    ends = [
        target.generate(
            prompt, do_sample=True, max_new_tokens=8, assistant_model=drafter, tev_config=TEVConfig(budget=8, seed=s)
        ).tolist()
        for s in (-1, 2**64 - 1, -(2**63))
    ]
    assert ends[0] == ends[1]


# ---------------------------------------------------------------------------------------------------------
# Routing and bad input
# ---------------------------------------------------------------------------------------------------------
def test_disable_and_enable_routing():
    target = make_target("qwen3")
    prompt = torch.tensor([PROMPTS[0]])
    drafter = make_drafter(target)
    try:
        hf_tev.disable()
        assert not hf_tev.is_enabled()
        plain = greedy(target, prompt, max_new_tokens=5)  # untouched path still works
        with pytest.raises(ValueError, match="tev_config"):
            greedy(target, prompt, max_new_tokens=5, assistant_model=drafter, tev_config=TEVConfig())
    finally:
        hf_tev.enable()
    assert (
        greedy(target, prompt, max_new_tokens=5, assistant_model=drafter, tev_config=TEVConfig()).tolist()
        == plain.tolist()
    )


def test_bad_inputs():
    target = make_target("qwen3")
    drafter = make_drafter(target)
    prompt = torch.tensor([PROMPTS[0]])
    with pytest.raises(ValueError, match="budget"):
        TEVConfig(budget=-1)
    with pytest.raises(TypeError, match="budget"):
        TEVConfig(budget=2.5)
    with pytest.raises(ValueError, match="verifier"):
        TEVConfig(verifier="nope")
    # (a batch of prompts decodes: its bad inputs are tested in tests/generation/test_batch.py)
    with pytest.raises(ValueError, match="assistant_model"):
        greedy(target, prompt, max_new_tokens=4, tev_config=TEVConfig(lookup=False))
    with pytest.raises(TypeError, match="TEVConfig"):
        greedy(target, prompt, max_new_tokens=4, assistant_model=drafter, tev_config="tev")
    with pytest.raises(ValueError, match="unknown fields"):
        greedy(target, prompt, max_new_tokens=4, assistant_model=drafter, tev_config={"budgett": 4})
    # a plain dict of TEVConfig fields is a TEVConfig
    as_dict = greedy(target, prompt, max_new_tokens=6, assistant_model=drafter, tev_config={"budget": 4})
    assert as_dict.tolist() == greedy(target, prompt, max_new_tokens=6).tolist()
    # fields changed after construction are checked when the config is used
    changed = TEVConfig()
    changed.tree = "nope"
    with pytest.raises(ValueError, match="tree"):
        greedy(target, prompt, max_new_tokens=4, assistant_model=drafter, tev_config=changed)
    changed = TEVConfig()
    changed.verifier = "greedy"  # greedy is what every verifier becomes at T = 0, not a sampling verifier
    with pytest.raises(ValueError, match="verifier"):
        greedy(target, prompt, max_new_tokens=4, assistant_model=drafter, tev_config=changed)
    with pytest.raises(ValueError, match="block_size"):
        greedy(target, prompt, max_new_tokens=4, assistant_model=drafter, tev_config=TEVConfig(block_size=32))
    other = make_target("qwen3", hidden_size=32)
    with pytest.raises(ValueError):
        greedy(other, prompt, max_new_tokens=4, assistant_model=drafter, tev_config=TEVConfig())
    assistant = make_target("qwen3", num_layers=1)
    with pytest.raises(TypeError, match="DFlash"):
        greedy(target, prompt, max_new_tokens=4, assistant_model=assistant, tev_config=TEVConfig())
    with pytest.raises(ValueError, match="cache"):  # static caches: tests/generation/test_static.py
        greedy(
            target,
            prompt,
            max_new_tokens=4,
            assistant_model=drafter,
            tev_config=TEVConfig(),
            cache_implementation="offloaded",
        )
    target.config._attn_implementation = "flash_attention_2"  # not installed here; the check comes first
    with pytest.raises(ValueError, match="sdpa"):
        greedy(target, prompt, max_new_tokens=4, assistant_model=drafter, tev_config=TEVConfig())


def test_stats_are_consistent():
    target = make_target("qwen3")
    prompt = torch.tensor([PROMPTS[1]])
    out = target.generate(
        prompt,
        do_sample=True,
        max_new_tokens=30,
        assistant_model=make_drafter(target),
        tev_config=TEVConfig(budget=16),
        return_dict_in_generate=True,
    )
    stats = out.tev_stats
    generated = out.sequences.shape[1] - prompt.shape[1]
    # the first token comes from the prefill; every cycle emits its accepted length (the last may be cut)
    assert 1 + sum(stats.accepted_lengths) >= generated > sum(stats.accepted_lengths[:-1])
    assert all(1 <= c <= 1 + s + 1e-5 for c, s in zip(stats.coverages, stats.tree_sizes, strict=True))
    summary = stats.summary()
    assert summary["cycles"] == stats.num_cycles and math.isfinite(summary["verify_s"])


# ---------------------------------------------------------------------------------------------------------
# The edges of the API: what is returned is never stale, every option works as in plain generate or fails
# clearly (the whole table of generate's options is walked in tests/generation/test_generate_options.py)
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stop_kind", ["eos", "criterion"])
def test_cache_after_a_stop_inside_an_accepted_block_and_continuation(stop_kind):
    target = make_target("qwen3")
    prompt = torch.tensor([PROMPTS[0]])
    reference = greedy(target, prompt, max_new_tokens=40)
    stop_at = prompt.shape[1] + 12  # a token the target first emits there
    token = reference[0, stop_at].item()
    assert token not in reference[0, prompt.shape[1] : stop_at].tolist()
    stop = (
        {"eos_token_id": token}
        if stop_kind == "eos"
        else {"stopping_criteria": StoppingCriteriaList([StopAfterToken(token)])}
    )

    def interrupted():
        out = greedy(
            target,
            prompt,
            max_new_tokens=40,
            assistant_model=with_oracle(make_drafter(target, block_size=16), reference),
            tev_config=TEVConfig(budget=16),
            return_dict_in_generate=True,
            **stop,
        )
        assert out.sequences.tolist() == reference[:, : stop_at + 1].tolist()
        generated = out.sequences.shape[1] - prompt.shape[1]
        assert 1 + sum(out.tev_stats.accepted_lengths) > generated, "the stop was not inside an accepted block"
        return out

    out = interrupted()
    # as plain generate's: every returned token but the last
    assert out.cache.get_seq_length() == out.sequences.shape[1] - 1
    plain = greedy(target, out.sequences, cache=out.cache, max_new_tokens=10)
    assert plain.tolist() == reference[:, : stop_at + 11].tolist()
    out = interrupted()  # continuing from a pre-filled cache also works on the tree route
    tree = greedy(
        target,
        out.sequences,
        cache=out.cache,
        max_new_tokens=10,
        assistant_model=with_oracle(make_drafter(target), reference),
        tev_config=TEVConfig(budget=8),
        return_dict_in_generate=True,
    )
    assert tree.sequences.tolist() == reference[:, : stop_at + 11].tolist()
    assert tree.cache.get_seq_length() == tree.sequences.shape[1] - 1 and max(tree.tev_stats.accepted_lengths) > 2


def test_continue_from_a_plain_cache_and_refuse_a_full_one():
    target = make_target("llama")
    prompt = torch.tensor([PROMPTS[0]])
    reference = greedy(target, prompt, max_new_tokens=24)
    first = greedy(target, prompt, max_new_tokens=6, return_dict_in_generate=True)
    drafter = with_oracle(make_drafter(target), reference)
    out = greedy(
        target, first.sequences, cache=first.cache, max_new_tokens=18, assistant_model=drafter, prefill_chunk_size=1
    )
    assert out.tolist() == reference.tolist()
    full = greedy(target, prompt, max_new_tokens=6, return_dict_in_generate=True).cache
    full.update(full.layers[0].keys[:, :, -1:], full.layers[0].values[:, :, -1:], 0)  # holds every token
    for layer in range(1, len(full.layers)):
        full.update(full.layers[layer].keys[:, :, -1:], full.layers[layer].values[:, :, -1:], layer)
    with pytest.raises(ValueError, match="cache already holds"):
        greedy(target, first.sequences, cache=full, max_new_tokens=4, assistant_model=drafter)


class CountingProcessor:
    """A stateful user processor (counts its calls): the contract says its output may differ from plain."""

    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        return scores


class PenalizeLastToken(TopKLogitsWarper):
    """A subclass of a row-wise warper that reads input_ids: it must get each node's own sequence."""

    def __init__(self):
        super().__init__(top_k=96)

    def __call__(self, input_ids, scores):
        return scores.scatter(1, input_ids[:, -1:], -100.0)


def test_logits_processor_contract_warns_once_and_pure_ones_match_plain():
    target = make_target("qwen3")
    prompt = torch.tensor([PROMPTS[0]])
    drafter = make_drafter(target)
    counting = CountingProcessor()
    with transformers_log() as messages:
        for _ in range(2):  # once per class
            greedy(
                target,
                prompt,
                max_new_tokens=8,
                logits_processor=LogitsProcessorList([counting]),
                assistant_model=drafter,
            )
    assert len([m for m in messages if "own input_ids" in m and "CountingProcessor" in m]) == 1
    assert counting.calls > 0
    # a pure processor (here a subclass of a row-wise warper that reads input_ids) gives plain generate's output
    processors = LogitsProcessorList([PenalizeLastToken()])
    expected = greedy(target, prompt, max_new_tokens=20, logits_processor=processors)
    with transformers_log() as messages:
        out = greedy(
            target,
            prompt,
            max_new_tokens=20,
            logits_processor=processors,
            assistant_model=with_oracle(make_drafter(target), expected),
            tev_config=TEVConfig(budget=8),
            return_dict_in_generate=True,
        )
    assert any("PenalizeLastToken" in m for m in messages)
    assert out.sequences.tolist() == expected.tolist() and max(out.tev_stats.accepted_lengths) > 2


def test_warnings_obey_transformers_verbosity(monkeypatch):
    from hf_tev import generation

    target = make_target("qwen3")
    monkeypatch.setattr(generation.checks, "TREE_MEMORY_WARNING_BYTES", 1000)
    kwargs = dict(
        max_new_tokens=4,
        logits_processor=LogitsProcessorList([CountingProcessor()]),
        assistant_model=make_drafter(target),
        tev_config=TEVConfig(budget=8),
    )
    verbosity = transformers.logging.get_verbosity()
    try:
        transformers.logging.set_verbosity_error()
        with transformers_log() as messages, warnings.catch_warnings():
            warnings.simplefilter("error")  # and no Python warning either
            greedy(target, torch.tensor([PROMPTS[0]]), **kwargs)
        assert messages == []
    finally:
        transformers.logging.set_verbosity(verbosity)
    with transformers_log() as messages:
        greedy(target, torch.tensor([PROMPTS[0]]), **kwargs)
    assert any("GiB per cycle" in m for m in messages) and any("CountingProcessor" in m for m in messages)


def test_prefix_allowed_tokens_fn_gets_the_batch_row_and_the_nodes_own_sequence():
    target = make_target("qwen3")
    prompt = torch.tensor([PROMPTS[0]])
    seen = []

    def allowed(batch_id, ids):
        seen.append(batch_id)
        return [t for t in range(96) if t % 4 != int(ids[-1]) % 4]

    expected = greedy(target, prompt, max_new_tokens=20, prefix_allowed_tokens_fn=allowed)
    seen.clear()
    out = greedy(
        target,
        prompt,
        max_new_tokens=20,
        prefix_allowed_tokens_fn=allowed,
        assistant_model=with_oracle(make_drafter(target), expected),
        tev_config=TEVConfig(budget=8),
        return_dict_in_generate=True,
    )
    assert out.sequences.tolist() == expected.tolist() and max(out.tev_stats.accepted_lengths) > 2
    assert set(seen) == {0} and len(seen) > out.sequences.shape[1] - prompt.shape[1]  # tree nodes were constrained


class RecordScores(StoppingCriteria):
    def __init__(self):
        self.seen = []

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append(None if scores is None else len(scores))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("output_scores", [False, True])
def test_stopping_criteria_get_the_scores_plain_generate_passes(output_scores):
    target = make_target("qwen3")
    prompt = torch.tensor([PROMPTS[0]])
    kwargs = dict(max_new_tokens=12, return_dict_in_generate=True, output_scores=output_scores)
    plain, ours = RecordScores(), RecordScores()
    expected = greedy(target, prompt, stopping_criteria=StoppingCriteriaList([plain]), **kwargs)
    greedy(
        target,
        prompt,
        stopping_criteria=StoppingCriteriaList([ours]),
        assistant_model=with_oracle(make_drafter(target), expected.sequences),
        **kwargs,
    )
    assert ours.seen == plain.seen  # per token: None, or the tuple of every score so far


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("budget", -1, ValueError),
        ("budget", 4097, ValueError),
        ("budget", 2.5, TypeError),
        ("budget", "big", ValueError),
        ("max_budget", 0, ValueError),
        ("max_budget", 10_000, ValueError),
        ("verifier", "greedy", ValueError),
        ("tree", "nope", ValueError),
        ("block_size", 1, ValueError),
        ("seed", "7", TypeError),
        ("seed", 2**64, ValueError),  # torch.Generator.manual_seed takes -2**63 <= seed < 2**64
        ("seed", -(2**63) - 1, ValueError),
        ("lookup", "yes", TypeError),
        ("lookup_min_ngram", 0, ValueError),
        ("lookup_max_ngram", 65, ValueError),
        ("lookup_length", 0, ValueError),
        ("lookup_branches", 1.5, ValueError),
        ("budgett", 4, ValueError),  # not a field: a typo would otherwise be ignored
    ],
)
def test_tev_config_fields_are_checked_when_used(field, value, error):
    target = make_target("qwen3")
    changed = TEVConfig()
    setattr(changed, field, value)
    with pytest.raises(error, match=field):
        greedy(
            target,
            torch.tensor([PROMPTS[0]]),
            max_new_tokens=4,
            assistant_model=make_drafter(target),
            tev_config=changed,
        )
    with pytest.raises(error, match=field):
        TEVConfig(**{field: value}) if field != "budgett" else TEVConfig.coerce({field: value})


def test_every_tev_config_field_has_a_bad_value_case():
    cases = {args[0] for args in test_tev_config_fields_are_checked_when_used.pytestmark[0].args[1]}
    assert {f.name for f in dataclasses.fields(TEVConfig)} <= cases


def test_budget_bound_and_memory_warning(monkeypatch):
    from hf_tev import config, generation

    assert TEVConfig(budget=config.MAX_TREE_NODES, max_budget=config.MAX_TREE_NODES).largest_tree == 4096
    # the report's case: budget 10,000 on the kit (vocabulary 4096, fp32) would take about 1 GB per cycle
    assert config.tree_memory_bytes(10_001, 4096, 10_064, 4) > 2**30 - 2**28
    target = make_target("qwen3")
    monkeypatch.setattr(generation.checks, "TREE_MEMORY_WARNING_BYTES", 1000)
    with transformers_log() as messages:
        greedy(
            target,
            torch.tensor([PROMPTS[0]]),
            max_new_tokens=4,
            assistant_model=make_drafter(target),
            tev_config=TEVConfig(budget=8),
        )
    assert any(re.search(r"a tree of 9 nodes takes about .* GiB per cycle", m) for m in messages)
    # a batch holds a tree per row: the estimate counts the rows
    one_tree = config.tree_memory_bytes(9, 96, 5 + 4, 4)
    monkeypatch.setattr(generation.checks, "TREE_MEMORY_WARNING_BYTES", 3 * one_tree)
    for rows, warned in ((3, False), (4, True)):
        with transformers_log() as messages:
            greedy(
                target,
                torch.tensor([PROMPTS[0]] * rows),
                max_new_tokens=4,
                assistant_model=make_drafter(target),
                tev_config=TEVConfig(budget=8),
            )
        found = [m for m in messages if "GiB per cycle" in m]
        assert bool(found) == warned, (rows, found)
    assert "a batch of 4 trees of 9 nodes" in found[0]


@pytest.mark.parametrize(
    "target_dtype, drafter_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]
)
def test_drafter_and_target_of_different_dtypes(target_dtype, drafter_dtype):
    target = make_target("qwen3", dtype=target_dtype)
    drafter = make_drafter(make_target("qwen3")).to(drafter_dtype)
    prompt = torch.tensor([PROMPTS[0]])
    expected = greedy(target, prompt, max_new_tokens=16)
    out = greedy(
        target,
        prompt,
        max_new_tokens=16,
        assistant_model=with_oracle(drafter, expected),
        tev_config=TEVConfig(budget=8),
        return_dict_in_generate=True,
    )
    assert out.sequences.tolist() == expected.tolist() and max(out.tev_stats.accepted_lengths) > 2
    assert next(drafter.parameters()).dtype == drafter_dtype  # the drafter ran in its own dtype


@pytest.mark.parametrize(
    "case, named",
    [
        ("guidance_scale", "guidance_scale"),
        ("inputs_embeds", "inputs_embeds"),
        ("num_beams", "num_beams"),
        ("masked_prompt", "attention_mask"),
        ("meta_drafter", "meta device"),
        # generate drops an all-ones mask before the decoder: the route checks the caller's
        ("longer_mask_of_ones", r"`attention_mask` of shape \(1, 9\) does not match `input_ids` of shape \(1, 5\)"),
        ("shorter_mask", r"`attention_mask` of shape \(1, 3\)"),
        ("mask_of_another_batch", r"`attention_mask` of shape \(2, 5\)"),
        ("longer_position_ids", r"`position_ids` of shape \(1, 9\)"),
        ("one_dimensional_input_ids", r"`input_ids`\) must be a 2D tensor .* got \(5,\)"),
        ("one_dimensional_input_ids_keyword", r"`input_ids`\) must be a 2D tensor"),
        ("float_input_ids", r"`input_ids`\) must be a 2D tensor of token ids"),
    ],
)
def test_refusals_name_the_option_before_any_model_call(case, named):
    target = make_target("qwen3")
    drafter = make_drafter(target)
    prompt = torch.tensor([PROMPTS[0]])
    ones = torch.ones(1, 9, dtype=torch.long)
    kwargs = {
        "guidance_scale": {"guidance_scale": 1.5},
        "inputs_embeds": {"inputs_embeds": target.get_input_embeddings()(prompt)},
        "num_beams": {"num_beams": 3},
        "masked_prompt": {"attention_mask": torch.zeros_like(prompt)},
        "meta_drafter": {},
        "longer_mask_of_ones": {"attention_mask": ones},
        "shorter_mask": {"attention_mask": ones[:, :3]},
        "mask_of_another_batch": {"attention_mask": torch.ones(2, 5, dtype=torch.long)},
        "longer_position_ids": {"position_ids": torch.arange(9)[None]},
        "one_dimensional_input_ids": {"inputs": prompt[0]},
        "one_dimensional_input_ids_keyword": {"input_ids": prompt[0], "inputs": None},
        "float_input_ids": {"inputs": prompt.float()},
    }[case]
    if case == "meta_drafter":
        drafter = drafter.to("meta")

    def called(module, args):
        raise AssertionError("a model was called before the refusal")

    target.register_forward_pre_hook(called)
    drafter.register_forward_pre_hook(called)
    inputs = kwargs.pop("inputs", prompt)
    with pytest.raises(ValueError, match=named):
        greedy(target, inputs, max_new_tokens=4, assistant_model=drafter, **kwargs)


def test_the_full_block_is_drafted_near_max_length():
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=8)
    rows, depths = [], []
    forward, draft_logits = drafter.forward, drafter.draft_logits

    def recording_forward(noise_embeds, *args, **kwargs):
        rows.append(noise_embeds.shape[1])
        return forward(noise_embeds, *args, **kwargs)

    def recording_draft_logits(*args, **kwargs):
        logits = draft_logits(*args, **kwargs)
        depths.append(logits.shape[1])
        return logits

    drafter.forward, drafter.draft_logits = recording_forward, recording_draft_logits
    greedy(
        target, torch.tensor([PROMPTS[0]]), max_new_tokens=4, assistant_model=drafter, tev_config=TEVConfig(budget=16)
    )
    assert rows and set(rows) == {8}  # the drafter always sees its whole block
    assert max(depths) <= 2  # only the depths that can still be emitted are scored


def test_lookup_auto_is_decided_per_call():
    """`TEVConfig()`'s context drafts: on for greedy decoding of the best-first tree, off when sampling or where
    `no_repeat_ngram_size` bans the repeats they propose; always on without a drafter (tree lookup decoding)."""
    from transformers import GenerationConfig

    config = TEVConfig()
    assert config.lookup == "auto"
    greedy_config, sampled = GenerationConfig(do_sample=False), GenerationConfig(do_sample=True)
    assert config.for_call(greedy_config, has_drafter=True).lookup is True
    assert config.for_call(sampled, has_drafter=True).lookup is False
    assert config.for_call(GenerationConfig(no_repeat_ngram_size=3), has_drafter=True).lookup is False
    assert TEVConfig(tree="chain").for_call(greedy_config, has_drafter=True).lookup is False
    assert config.for_call(sampled, has_drafter=False).lookup is True
    for fixed in (True, False):
        assert TEVConfig(lookup=fixed).for_call(sampled, has_drafter=True).lookup is fixed
    with pytest.raises(TypeError, match="lookup"):
        TEVConfig(lookup="yes")
    # end to end: the default config decodes greedy with context drafts, exactly
    target = make_target("qwen3")
    prompt = torch.tensor([[1, 5, 9, 13, 7, 1, 5, 9, 13, 7, 1, 5]])
    out = greedy(
        target, prompt, max_new_tokens=16, assistant_model=make_drafter(target), tev_config=config,
        return_dict_in_generate=True,
    )  # fmt: skip
    assert out.sequences.tolist() == greedy(target, prompt, max_new_tokens=16).tolist()
    assert out.tev_stats.accepted_by_source.get("lookup", 0) + out.tev_stats.accepted_by_source.get("both", 0) > 0
