"""Context drafts (docs/design.md#context-drafts): the n-gram index and the merged drafter + lookup tree, against
brute force."""

import itertools
import math
import random

import pytest
import torch

from hf_tev.lookup import BOTH, DRAFTER, LOOKUP, ContextIndex, LookupStats, build_merged_tree
from hf_tev.tree import build_tree


def test_index_is_incremental_and_finds_the_latest_longest_matches():
    text = [5, 1, 2, 3, 9, 1, 2, 4, 7, 1, 2, 3, 8]
    whole = ContextIndex(max_ngram=3, length=4, branches=3)
    whole.extend(text)
    pieces = ContextIndex(max_ngram=3, length=4, branches=3)
    for start in range(0, len(text), 3):
        pieces.extend(text[start : start + 3])
    assert pieces.ends == whole.ends
    # committed text ends in "... 1 2 3 8"; with root 1 the suffix (8, 1) never occurred, so n = 1 ("1")
    assert whole.continuations(1) == [([2, 3, 8], 1), ([2, 4, 7, 1], 1), ([2, 3, 9, 1], 1)]
    index = ContextIndex(max_ngram=3, length=4, branches=3)
    index.extend(text[:-2])  # "... 7 1 2", root 3: "1 2 3" occurred once (then 9), "2 3" the same, "3" the same
    assert index.continuations(3) == [([9, 1, 2, 4], 3)]
    assert ContextIndex().continuations(4) == []  # nothing committed yet
    with pytest.raises(ValueError):
        ContextIndex(min_ngram=2, max_ngram=1)


def random_logprobs(depths, vocab, seed, sharp=2.0):
    return torch.log_softmax(sharp * torch.randn(depths, vocab, generator=torch.Generator().manual_seed(seed)), -1)


def test_without_continuations_the_merged_tree_is_the_drafters_tree():
    logprobs = random_logprobs(4, 9, 0)
    for budget in (0, 1, 5, 30):
        merged = build_merged_tree(logprobs, budget, 3, [], LookupStats())
        plain = build_tree(logprobs, budget, 3)
        assert torch.equal(merged.tokens, plain.tokens) and torch.equal(merged.parents, plain.parents)
        assert merged.path_logprobs == plain.path_logprobs
        assert set(merged.node_info.sources[1:]) <= {DRAFTER}


def brute_force(logprobs, continuations, stats, budget):
    """Every path's merged score max(drafter, lookup) over all drafter paths and lookup prefixes; the best
    `budget` nodes (parents first on ties) as a set of token paths."""
    depth_count, vocab = logprobs.shape
    scores = {}
    for depth in range(1, depth_count + 1):
        for path in itertools.product(range(vocab), repeat=depth):
            scores[path] = sum(float(logprobs[d, t]) for d, t in enumerate(path))
    lookup = {}
    for continuation, match in continuations:
        score = 0.0
        for depth in range(1, len(continuation) + 1):
            score += math.log(stats.rate(depth, match))
            prefix = tuple(continuation[:depth])
            lookup[prefix] = max(lookup.get(prefix, -math.inf), score)
    merged = {p: max(scores.get(p, -math.inf), lookup.get(p, -math.inf)) for p in set(scores) | set(lookup)}
    order = sorted(merged, key=lambda p: (-merged[p], len(p)))
    return {p: merged[p] for p in order[:budget]}


@pytest.mark.parametrize("seed", range(6))
def test_merged_tree_is_the_best_prefix_closed_set_of_both_sources(seed):
    rng = random.Random(seed)
    logprobs = random_logprobs(3, 4, seed, sharp=rng.uniform(0.5, 3))
    continuations = [([rng.randrange(4) for _ in range(rng.randint(1, 4))], rng.randint(1, 3)) for _ in range(3)]
    stats = LookupStats(prior=rng.uniform(0.2, 0.9))
    for budget in (1, 3, 7, 15, 40):
        tree = build_merged_tree(logprobs, budget, 2, continuations, stats)
        paths = {}
        for node in range(1, tree.num_nodes):
            path = tuple(int(tree.tokens[v]) for v in tree.visibility[node].nonzero().squeeze(1)[1:])
            paths[path] = tree.path_logprobs[node]
        expected = brute_force(logprobs, continuations, stats, budget)
        # the same scores multiset (ties may swap equal-score nodes) and every node at its merged score
        assert sorted(paths.values()) == pytest.approx(sorted(expected.values()), abs=1e-9)
        for path, score in paths.items():
            assert score == pytest.approx(brute_force(logprobs, continuations, stats, 10**6)[path], abs=1e-9)
        lists = tree.lists
        assert all(lists.parents[v] < v for v in range(1, tree.num_nodes))
        for kids in lists.children:  # siblings carry distinct tokens
            assert len({lists.tokens[c] for c in kids}) == len(kids)
        assert tree.path_logprobs == sorted(tree.path_logprobs, reverse=True)


def test_lookup_only_tree_sources_and_stats():
    stats = LookupStats(prior=0.5)
    continuations = [([4, 5, 6], 2), ([4, 7], 1)]
    tree = build_merged_tree(None, 10, 1, continuations, stats)
    assert tree.tokens.tolist() == [1, 4, 5, 7, 6]  # the shared first token is one node
    assert tree.node_info.sources == [BOTH, LOOKUP, LOOKUP, LOOKUP, LOOKUP]
    assert tree.node_info.matches == [0, 2, 2, 1, 2]
    assert build_merged_tree(None, 10, 1, [], stats).num_nodes == 1  # nothing matches: a plain step
    assert build_merged_tree(None, 2, 1, continuations, stats).num_nodes == 3  # the budget holds
    stats.update(tree, [0, 1, 2])  # accepted 4, 5; rejected 7 (its parent 4 accepted) and 6 (child of 5)
    assert stats.counts == {(1, 2): 1.0, (2, 2): 1.0, (2, 1): 1.0, (3, 2): 1.0}
    assert stats.hits == {(1, 2): 1.0, (2, 2): 1.0, (2, 1): 0.0, (3, 2): 0.0}
    assert stats.rate(1, 2) > 0.5 > stats.rate(2, 1)


def test_a_node_of_both_sources_is_one_node_with_the_larger_score():
    logprobs = torch.full((3, 6), math.log(1e-3))
    logprobs[:, 0] = 0.0  # the drafter is sure of token 0 at every depth
    logprobs = torch.log_softmax(logprobs, -1)
    stats = LookupStats(prior=0.3)
    tree = build_merged_tree(logprobs, 8, 2, [([0, 3], 1)], stats)
    first = tree.lists.children[0]
    assert [tree.lists.tokens[c] for c in first].count(0) == 1
    node = next(c for c in first if tree.lists.tokens[c] == 0)
    assert tree.node_info.sources[node] == BOTH
    assert tree.path_logprobs[node] == pytest.approx(float(logprobs[0, 0]))  # the drafter's, larger than log 0.3


# ---------------------------------------------------------------------------------------------------------
# Inside generate: exactness with context drafts, with and without a drafter
# ---------------------------------------------------------------------------------------------------------
def test_greedy_with_context_drafts_equals_plain_generate_and_sources_add_up():
    from hf_tev import TEVConfig
    from hf_tev.packaged import load_kit_model, load_kit_prompts, load_kit_tokenizer

    tokenizer, target = load_kit_tokenizer(), load_kit_model("target")
    drafter = load_kit_model("drafter-dflash-l135")
    lookup_accepted = 0
    for prompt in load_kit_prompts("heldout", 2):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        expected = target.generate(ids, do_sample=False, max_new_tokens=48)
        settings = [
            (TEVConfig(lookup=True), drafter),
            (TEVConfig(lookup=True, budget=12), drafter),
            (TEVConfig(lookup=True), None),
            (TEVConfig(lookup=True, budget=5, lookup_branches=1), None),
        ]
        settings += [(TEVConfig(lookup=True, budget=8, verifier=v), drafter) for v in ("predraw", "residual")]
        for config, assistant in settings:
            kwargs = {} if assistant is None else dict(assistant_model=assistant)
            out = target.generate(
                ids, do_sample=False, max_new_tokens=48, tev_config=config, return_dict_in_generate=True, **kwargs
            )
            assert out.sequences.tolist() == expected.tolist(), (config, assistant is None)
            stats = out.tev_stats
            # every cycle's block is its accepted nodes by source plus the bonus
            assert sum(stats.accepted_by_source.values()) == sum(stats.accepted_lengths)
            assert stats.accepted_by_source["bonus"] == stats.num_cycles
            if assistant is None:
                assert set(stats.accepted_by_source) <= {"lookup", "bonus"}
            lookup_accepted += stats.accepted_by_source.get("lookup", 0) + stats.accepted_by_source.get("both", 0)
    assert lookup_accepted > 20, "context drafts were never accepted: the test has no power"


def test_tree_lookup_without_a_drafter_needs_lookup():
    from helpers import make_target

    from hf_tev import TEVConfig

    target = make_target("qwen3")
    prompt = torch.tensor([[1, 5, 9, 13, 7, 1, 5, 9]])
    with pytest.raises(ValueError, match="lookup=True"):
        target.generate(prompt, do_sample=False, max_new_tokens=4, tev_config=TEVConfig(lookup=False))
    expected = target.generate(prompt, do_sample=False, max_new_tokens=12).tolist()
    for lookup in (True, "auto"):  # "auto" without a drafter is tree lookup decoding, sampled or not
        out = target.generate(prompt, do_sample=False, max_new_tokens=12, tev_config=TEVConfig(lookup=lookup))
        assert out.tolist() == expected
    with pytest.raises(ValueError, match="best_first"):
        TEVConfig(lookup=True, tree="chain")


@pytest.mark.parametrize("assistant,budget", [("drafter", 6), ("drafter", "auto"), ("none", "auto")])
def test_sampling_law_with_context_drafts(assistant, budget, monkeypatch):
    """The last two of four sampled tokens against the target's own law, with trees where context drafts and
    drafter candidates overlap and branch (a prompt that repeats itself, vocabulary 8)."""
    from helpers import TemperatureLike, chi_square_pvalue, exact_last_two_law, make_drafter, make_target
    from transformers import LogitsProcessorList

    import hf_tev
    from hf_tev import TEVConfig

    # a flat tree cost that stays flat (measured times are not learnt): the automatic budget takes trees whatever
    # this machine's load
    monkeypatch.setattr("hf_tev.generation.loop.probe_tree_costs", lambda *args, **kwargs: ([1, 64], [1e-2, 1e-2]))
    monkeypatch.setattr(hf_tev.budget.CycleCost, "observe", lambda self, nodes, tree_s, rest_s: None)
    monkeypatch.setattr(hf_tev.budget.CycleCost, "observe_draft", lambda self, draft_s: None)
    monkeypatch.setattr(hf_tev.budget.AcceptanceCalibration, "__call__", lambda self, log_q: 0.5)
    target = make_target("qwen3", vocab_size=8, hidden_size=32, num_layers=2, seed=4)
    with torch.no_grad():
        target.lm_head.weight.mul_(2.0)
    target.generation_config.eos_token_id = None
    prompt = torch.tensor([[1, 5, 3, 6, 1, 5, 3, 2, 1, 5, 3, 6, 1, 5]])
    law = exact_last_two_law(target, prompt, LogitsProcessorList([TemperatureLike(0.9)]))
    drafter = make_drafter(target, block_size=4) if assistant == "drafter" else None
    kwargs = {} if drafter is None else dict(assistant_model=drafter)
    counts, sources = torch.zeros(8, 8), {}
    torch.manual_seed(1234)
    for _ in range(400):
        out = target.generate(
            prompt,
            max_new_tokens=4,
            do_sample=True,
            temperature=0.9,
            top_k=0,
            top_p=1.0,
            tev_config=TEVConfig(budget=budget, lookup=True, lookup_branches=3, max_budget=8),
            return_dict_in_generate=True,
            **kwargs,
        )
        counts[out.sequences[0, -2], out.sequences[0, -1]] += 1
        for source, count in out.tev_stats.accepted_by_source.items():
            sources[source] = sources.get(source, 0) + count
    assert chi_square_pvalue(counts, law) > 1e-3
    wrong = exact_last_two_law(target, prompt, LogitsProcessorList([TemperatureLike(1.3)]))
    assert chi_square_pvalue(counts, wrong) < 1e-3
    assert sources.get("lookup", 0) + sources.get("both", 0) > 30, sources  # context drafts were on trial
    if drafter is not None and budget != "auto":  # (auto may leave a useless drafter out for lookup alone)
        assert sources.get("drafter", 0) > 10 and sources.get("both", 0) > 0, sources  # overlap and branches
