"""Tree decoding of a batch of prompts (docs/design.md#batches): each row's output is that prompt's own output alone."""

import json

import pytest
import torch
from helpers import (
    RecordingStreamer,
    TemperatureLike,
    chi_square_pvalue,
    exact_last_two_law,
    greedy,
    make_drafter,
    make_target,
)
from transformers import DynamicCache, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

import hf_tev
from hf_tev import TEVConfig
from hf_tev.generation.cache import BatchTreeInputs, commit_accepted_path
from hf_tev.tree import build_tree

PROMPTS = [[1, 5, 9, 13, 7], [1, 40, 41, 3, 3, 17, 88, 20, 6, 31, 60, 12], [1, 7], [1, 22, 23, 24, 25, 26, 70]]


def left_padded(prompts, pad=0):
    """`(input_ids, attention_mask)` of `prompts` left-padded to the longest, as a tokenizer with
    padding_side='left' returns them."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def with_row_oracles(drafter, references):
    """`helpers.with_oracle` for a batch: the drafter mostly knows each row's greedy continuation.

    `references[r]` is row r's sequence alone (no padding), indexed by the row's own position ids. A batch drafts
    every row in one call, in an order the oracle does not see: a block's row is the first reference with the
    block's root at the root's position (a wrong guess only costs acceptance, never exactness).
    """
    real = drafter.draft_logits

    def draft_logits(target, context, block_ids, position_ids, cache=None, num_depths=None, attention_mask=None):
        logits = real(target, context, block_ids, position_ids, cache, num_depths, attention_mask)
        for i in range(block_ids.shape[0]):
            root, root_position = int(block_ids[i, 0]), int(position_ids[i, -block_ids.shape[1]])
            row = [r for r in references if len(r) > root_position and r[root_position] == root]
            for depth in range(1, logits.shape[1] + 1):
                position = root_position + depth
                if row and position < len(row[0]):
                    logits[i, depth - 1, row[0][position]] += 40.0 if position % 3 else 4.0
        return logits

    drafter.draft_logits = draft_logits
    return drafter


def alone(target, prompts, **kwargs):
    """Each prompt's own plain greedy generate, as a list of token lists (prompt included)."""
    return [greedy(target, torch.tensor([p]), **kwargs)[0].tolist() for p in prompts]


def padded_rows(sequences, prompts, pad=0):
    """The rows plain batched generate returns for these sequences alone: left padding, right padding after
    a row that stopped early."""
    width = max(len(p) for p in prompts)
    length = width + max(len(s) - len(p) for s, p in zip(sequences, prompts, strict=True))
    rows = []
    for s, p in zip(sequences, prompts, strict=True):
        row = [pad] * (width - len(p)) + s
        rows.append(row + [pad] * (length - len(row)))
    return rows


def test_batch_greedy_equals_each_prompt_alone():
    target = make_target("qwen3")
    ids, mask = left_padded(PROMPTS)
    expected = alone(target, PROMPTS, max_new_tokens=24)
    taus = []
    for budget in (0, 6, 32, "auto"):
        for verifier in ("tev", "predraw", "residual"):  # at T=0 all are the argmax walk; each must say so
            drafter = with_row_oracles(make_drafter(target), expected)
            out = greedy(
                target,
                ids,
                attention_mask=mask,
                max_new_tokens=24,
                assistant_model=drafter,
                tev_config=TEVConfig(budget=budget, verifier=verifier),
                return_dict_in_generate=True,
            )
            assert out.sequences.tolist() == padded_rows(expected, PROMPTS), (budget, verifier)
            assert len(out.tev_stats) == len(PROMPTS)
            if budget == "auto":  # one size for the batch: while every row is in, every row's tree has it
                shared = min(s.pass_rows.count(len(PROMPTS)) for s in out.tev_stats)
                # The first cycle runs the drafter, whose oracle chain in every row is longer than any size. A later
                # cycle may run on context drafts alone (the budget paused the drafter, which depends on the
                # measured costs): a row without a match keeps 0 nodes, every other row the one size.
                assert len({s.tree_sizes[0] for s in out.tev_stats}) == 1
                for cycle in range(shared):
                    assert len({s.tree_sizes[cycle] for s in out.tev_stats} - {0}) <= 1, cycle
            for stats, prompt, sequence in zip(out.tev_stats, PROMPTS, expected, strict=True):
                # every row emits exactly its own tokens, cycle by cycle
                assert sum(stats.accepted_lengths) + 1 == len(sequence) - len(prompt)
                assert stats.coverages == [float(a) for a in stats.accepted_lengths]
                assert len(stats.pass_rows) == stats.num_cycles and max(stats.pass_rows) == len(PROMPTS)
                taus.append(stats.tau)
    assert max(taus) > 3, "the acceptance path was never exercised"


def test_batch_with_a_random_drafter_chain_and_context_drafts():
    target = make_target("llama")
    prompts = [[1, 5, 9, 5, 9, 5, 9, 5], PROMPTS[1], [1, 7, 7]]
    ids, mask = left_padded(prompts)
    expected = padded_rows(alone(target, prompts, max_new_tokens=30), prompts)
    configs = [
        (make_drafter(target), TEVConfig(budget=8, tree="chain")),
        (make_drafter(target), TEVConfig(budget=16, lookup=True)),
        (make_drafter(target), TEVConfig(lookup=True)),  # auto with context drafts
        (None, TEVConfig(budget=12, lookup=True)),  # tree lookup decoding, no drafter
    ]
    lookup_accepted = 0
    for drafter, config in configs:
        out = greedy(
            target,
            ids,
            attention_mask=mask,
            max_new_tokens=30,
            assistant_model=drafter,
            tev_config=config,
            return_dict_in_generate=True,
        )
        assert out.sequences.tolist() == expected, config
        for stats in out.tev_stats:
            assert sum(stats.accepted_by_source.values()) == sum(stats.accepted_lengths)
            lookup_accepted += stats.accepted_by_source.get("lookup", 0) + stats.accepted_by_source.get("both", 0)
    assert lookup_accepted > 0, "no context draft was ever accepted: the lookup path was not exercised"


def test_rows_stop_independently_and_leave_the_batch():
    target = make_target("qwen3")
    # a repetition penalty keeps the tiny random model out of loops (and sees each row's left padding)
    settings = dict(max_new_tokens=30, repetition_penalty=3.0)
    reference = alone(target, PROMPTS, **settings)
    # a token row 1 first emits mid-generation: rows that emit it stop there, the others run on
    generated = reference[1][len(PROMPTS[1]) :]
    eos = next(tok for i, tok in enumerate(generated) if i >= 4 and tok not in generated[:i])
    expected = alone(target, PROMPTS, eos_token_id=eos, **settings)
    lengths = [len(s) - len(p) for s, p in zip(expected, PROMPTS, strict=True)]
    assert min(lengths) < max(lengths), "no row stopped early"
    ids, mask = left_padded(PROMPTS)
    for verifier in ("tev", "predraw"):
        out = greedy(
            target,
            ids,
            attention_mask=mask,
            eos_token_id=eos,
            **settings,
            assistant_model=with_row_oracles(make_drafter(target, block_size=16), reference),
            tev_config=TEVConfig(budget=16, verifier=verifier),
            return_dict_in_generate=True,
        )
        assert out.sequences.tolist() == padded_rows(expected, PROMPTS)  # padded with pad_token_id=0
        assert out.cache is None
        stopped = min(range(len(PROMPTS)), key=lambda r: lengths[r])
        others = [stats for r, stats in enumerate(out.tev_stats) if lengths[r] == max(lengths)]
        # after the first row stops, the passes hold fewer rows: a finished row costs nothing further
        assert min(others[0].pass_rows) < len(PROMPTS)
        assert out.tev_stats[stopped].num_cycles < others[0].num_cycles


def test_batch_processors_per_row_and_prefix_constraint_rows():
    target = make_target("qwen3")
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]
    ids, mask = left_padded(prompts)

    def allowed(batch_id, input_ids):
        return list(range(10 + 20 * batch_id, 30 + 20 * batch_id))

    settings = dict(max_new_tokens=16, repetition_penalty=2.0, no_repeat_ngram_size=2, min_new_tokens=3)
    # each row's processors see its own row, left padding included, as plain batched generate's do
    expected = greedy(target, ids, attention_mask=mask, prefix_allowed_tokens_fn=allowed, **settings)
    out = greedy(
        target,
        ids,
        attention_mask=mask,
        prefix_allowed_tokens_fn=allowed,
        assistant_model=make_drafter(target),
        tev_config=TEVConfig(budget=8),
        **settings,
    )
    width = ids.shape[1]
    for r in range(len(prompts)):
        assert all(10 + 20 * r <= t < 30 + 20 * r for t in out[r, width:].tolist())
    assert out.tolist() == expected.tolist()


def test_batch_tree_pass_holes_and_compaction_match_each_row_alone():
    target = make_target("qwen3")
    prompts = [PROMPTS[0], PROMPTS[1]]  # the short row keeps a deep path, the long one its root: both have holes
    ids, mask = left_padded(prompts)
    cache = DynamicCache(config=target.config)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        target(ids, attention_mask=mask, position_ids=positions, cache=cache)
        inputs = BatchTreeInputs(~mask.bool(), torch.float32)
        torch.manual_seed(3)
        trees = [build_tree(torch.log_softmax(torch.randn(4, 96) * 3, -1), n, torch.tensor(7 + n)) for n in (12, 5)]
        past = ids.shape[1]
        tokens, tree_mask, tree_positions = inputs(trees, past, [len(p) for p in prompts])
        out = target(tokens, attention_mask=tree_mask, position_ids=tree_positions, cache=cache)
        committed = []
        for r, (tree, prompt) in enumerate(zip(trees, prompts, strict=True)):
            paths = [tree.visibility[i].nonzero()[:, 0] for i in range(tree.num_nodes)]
            for node, path in enumerate(paths):
                plain = target(torch.tensor([prompt + tree.tokens[path].tolist()])).logits[0, -1]
                torch.testing.assert_close(out.logits[r, node], plain, atol=1e-4, rtol=1e-4)
            # row 0 keeps its deepest path (not a prefix of the node order), row 1 its root alone: holes
            kept = max(paths, key=len) if r == 0 else paths[0]
            committed.append((kept, prompt + tree.tokens[kept].tolist()))
        longest = max(len(kept) for kept, _ in committed)
        padded = torch.stack([torch.cat([k, k[-1:].expand(longest - len(k))]) for k, _ in committed])
        commit_accepted_path(cache, past, padded, path_is_prefix=False)
        inputs.commit([len(kept) for kept, _ in committed])
        assert cache.get_seq_length() == past + longest and int(inputs.hidden[1].sum()) == longest - 1
        for compact in (False, True):
            if compact:
                assert inputs.compact(cache, min_share=0.0)
                assert cache.get_seq_length() == max(len(seq) for _, seq in committed)
            nxt = [torch.tensor(11), torch.tensor(12)]
            roots = [build_tree(torch.zeros(0, 96), 0, t) for t in nxt]
            tokens, step_mask, positions = inputs(roots, cache.get_seq_length(), [len(s) for _, s in committed])
            step = target(tokens, attention_mask=step_mask, position_ids=positions, cache=cache).logits
            cache.crop(-1)
            for r, (_, sequence) in enumerate(committed):
                fresh = target(torch.tensor([sequence + [int(nxt[r])]])).logits[0, -1]
                torch.testing.assert_close(step[r, 0], fresh, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("verifier,budget", [("tev", 6), ("predraw", "auto")])
def test_batch_sampling_law_per_row(verifier, budget, monkeypatch):
    if budget == "auto":  # as in test_generation: sizes that grow trees whatever this machine's load
        monkeypatch.setattr("hf_tev.generation.loop.probe_tree_costs", lambda *args, **kwargs: ([1, 64], [1e-2, 1e-2]))
        monkeypatch.setattr(hf_tev.budget.AcceptanceCalibration, "__call__", lambda self, log_q: 0.5)
    target = make_target("qwen3", vocab_size=8, hidden_size=32, num_layers=2, seed=4)
    with torch.no_grad():
        target.lm_head.weight.mul_(2.0)
    target.generation_config.eos_token_id = None
    prompts = [[1, 5, 3], [4, 6, 2, 7, 1], [3, 3]]
    ids, mask = left_padded(prompts)
    warpers = LogitsProcessorList([TemperatureLike(0.9)])
    laws = [exact_last_two_law(target, torch.tensor([p]), warpers) for p in prompts]
    drafter = make_drafter(target, block_size=4)
    width, samples = ids.shape[1], 300
    counts, deep = torch.zeros(len(prompts), 8, 8), [0] * len(prompts)
    torch.manual_seed(4321)
    for _ in range(samples):
        out = target.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=4,
            do_sample=True,
            temperature=0.9,
            top_k=0,
            top_p=1.0,
            assistant_model=drafter,
            return_dict_in_generate=True,
            tev_config=TEVConfig(budget=budget, verifier=verifier, max_budget=6),
        )
        for r in range(len(prompts)):
            counts[r, out.sequences[r, width + 2], out.sequences[r, width + 3]] += 1
            deep[r] += out.tev_stats[r].accepted_lengths[0] >= 3
    assert sum(deep) > 30, "the depth-2 paths were hardly accepted: the test has no power"
    wrong = LogitsProcessorList([TemperatureLike(1.6)])
    for r, prompt in enumerate(prompts):
        assert chi_square_pvalue(counts[r], laws[r]) > 1e-3, r
        assert deep[r] >= 3, "this row's depth-2 paths were never accepted: the test has no power for it"
        # the test has power: a different law is rejected
        assert chi_square_pvalue(counts[r], exact_last_two_law(target, torch.tensor([prompt]), wrong)) < 1e-3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_return_sequences=2, do_sample=True), "num_return_sequences"),
        (dict(right_padding=True), "right padding"),
        (dict(max_length=8), "max_length"),
        (dict(output_scores=True, return_dict_in_generate=True), "output_scores"),
        (dict(streamer=RecordingStreamer()), "stream"),
    ],
)
def test_batch_bad_inputs_are_named(kwargs, message):
    target = make_target("qwen3")
    ids, mask = left_padded(PROMPTS[:2])
    if kwargs.pop("right_padding", False):
        ids, mask = ids.flip(1), mask.flip(1)
    called = []
    target.register_forward_hook(lambda *args: called.append(1))
    if "max_length" not in kwargs:
        kwargs["max_new_tokens"] = 4
    with pytest.raises(ValueError, match=message):
        target.generate(
            ids, attention_mask=mask, assistant_model=make_drafter(target), tev_config=TEVConfig(budget=4), **kwargs
        )
    assert not called, "refused only after a model call"


def test_a_batch_of_one_is_one_prompt():
    # one cycle for every batch size: a one-row batch with its mask decodes as the prompt alone
    target = make_target("qwen3")
    out = greedy(target, torch.tensor([PROMPTS[0]]), max_new_tokens=8, assistant_model=make_drafter(target))
    assert out.tolist() == greedy(target, torch.tensor([PROMPTS[0]]), max_new_tokens=8).tolist()


def test_bench_batch_sizes_tiny_run_and_report(tmp_path):
    from hf_tev.__main__ import main as hf_tev_main
    from hf_tev.bench import BenchConfig
    from hf_tev.bench.report import BATCH_SCHEMA, markdown_report

    out = tmp_path / "bench"
    argv = ["bench", "--methods", "ar,tev,lookup_tree,assisted", "--drafters", "drafter-dflash", "--budgets", "4"]
    argv += ["--temperatures", "0,1", "--prompt-sets", "humaneval", "--max-prompts", "2", "--max-new-tokens", "6"]
    hf_tev_main([*argv, "--repeats", "1", "--batch-sizes", "1,3", "--output", str(out), "--no-progress"])
    document = json.loads((out / "bench.json").read_text())
    assert document["schema"] == BATCH_SCHEMA
    assert any("assisted" in note for note in document["warnings"])  # cannot take a batch: skipped, said so
    records = {(r["method"], r["temperature"], r["batch_size"]): r for r in document["records"]}
    assert set(records) == {(m, t, r) for m in ("ar", "tev", "lookup_tree") for t in (0.0, 1.0) for r in (1, 3)}
    for (method, temperature, size), record in records.items():
        assert record["rows"] == (2 if size == 1 else 3)  # two prompts, cycled to fill a batch of 3
        assert record["new_tokens"] == record["rows"] * 6 and record["tokens_per_s"] > 0
        if temperature == 0:
            assert record["greedy_exact"], (method, size)
        if method != "ar":
            assert len(record["tau_rows"]) == record["rows"] and record["tau"] >= 1
            assert record["pass_ms"] > 0 and record["pass_rows"] <= size and record["pass_nodes"] >= 1
    assert (out / "bench.md").read_text() == markdown_report(document)
    assert "| 3 | tev | drafter-dflash | 4 |" in (out / "bench.md").read_text()
    with pytest.raises(ValueError, match="batch_sizes"):
        BenchConfig(batch_sizes=[0])


def test_one_left_padded_prompt_with_repetition_penalty():
    # generate gives the repetition penalty each row's padding length as a tensor; a call of many tree nodes
    # must see the prompt's own length (this failed with "Incompatible `prompt_ignore_length` batch size")
    target = make_target("qwen3")
    ids, mask = left_padded([PROMPTS[0], PROMPTS[1]])
    ids, mask = ids[:1], mask[:1]
    expected = greedy(target, ids, attention_mask=mask, max_new_tokens=12, repetition_penalty=2.0)
    out = greedy(
        target,
        ids,
        attention_mask=mask,
        max_new_tokens=12,
        repetition_penalty=2.0,
        assistant_model=make_drafter(target),
        tev_config=TEVConfig(budget=8),
    )
    assert out.tolist() == expected.tolist()


class StopRowEndingIn(StoppingCriteria):
    """Stops a row whose prompt ends with `token` once it has `extra` new tokens (rows stop apart)."""

    def __init__(self, width, token, extra):
        self.width, self.token, self.extra = width, token, extra

    def __call__(self, input_ids, scores, **kwargs):
        long_enough = input_ids.shape[1] >= self.width + self.extra
        return (input_ids[:, self.width - 1] == self.token) & long_enough


def test_rows_stopped_by_a_criterion_are_padded_or_need_a_pad_token():
    target = make_target("qwen3")
    prompts = [PROMPTS[0], PROMPTS[1]]
    ids, mask = left_padded(prompts)
    criteria = StoppingCriteriaList([StopRowEndingIn(ids.shape[1], PROMPTS[0][-1], 3)])
    settings = dict(attention_mask=mask, max_new_tokens=8, stopping_criteria=criteria, eos_token_id=None)
    drafted = dict(assistant_model=make_drafter(target), tev_config=TEVConfig(budget=4))
    out = greedy(target, ids, pad_token_id=5, **settings, **drafted)
    alone = greedy(target, ids[1:], attention_mask=mask[1:], max_new_tokens=8)
    assert out[0, ids.shape[1] + 3 :].tolist() == [5] * 5 and out[1].tolist() == alone[0].tolist()
    target.generation_config.pad_token_id = None
    with pytest.raises(ValueError, match="pad_token_id"):
        greedy(target, ids, **settings, **drafted)


def test_the_batched_drafter_drafts_each_row_as_alone():
    # one drafter call for the batch, its context cache with holes: every row's trees and accepted lengths are
    # those of the prompt alone (a wrong hole or position would change the drafts, hence the trees)
    target = make_target("qwen3")
    drafter = with_row_oracles(make_drafter(target), alone(target, PROMPTS, max_new_tokens=20))
    ids, mask = left_padded(PROMPTS)
    config = dict(max_new_tokens=20, assistant_model=drafter, tev_config=TEVConfig(budget=6))
    config.update(return_dict_in_generate=True)
    out = greedy(target, ids, attention_mask=mask, **config)
    for prompt, stats in zip(PROMPTS, out.tev_stats, strict=True):
        single = greedy(target, torch.tensor([prompt]), **config).tev_stats
        assert (stats.tree_sizes, stats.accepted_lengths) == (single.tree_sizes, single.accepted_lengths)
    assert max(s.tau for s in out.tev_stats) > 2


def test_a_batch_shrunk_to_one_row_still_hides_its_padding_from_the_drafter():
    # the shorter row decodes on alone once the other stops; the drafter's cache still holds the column it did not
    # fill in the first call (too few hidden columns to compact), so its drafter calls still get the mask hiding it
    target = make_target("qwen3")
    prompts = [PROMPTS[1], PROMPTS[1][:-2] + [61]]  # row 1: one token shorter
    ids, mask = left_padded(prompts)
    drafter, masks = make_drafter(target), []
    real = drafter.draft_logits

    def draft_logits(target, context, block_ids, position_ids, cache=None, num_depths=None, attention_mask=None):
        masks.append((block_ids.shape[0], attention_mask))
        return real(target, context, block_ids, position_ids, cache, num_depths, attention_mask)

    drafter.draft_logits = draft_logits
    criteria = StoppingCriteriaList([StopRowEndingIn(ids.shape[1], PROMPTS[1][-1], 3)])
    settings = dict(attention_mask=mask, max_new_tokens=10, stopping_criteria=criteria, eos_token_id=None)
    out = greedy(target, ids, pad_token_id=0, assistant_model=drafter, tev_config=TEVConfig(budget=4), **settings)
    expected = greedy(target, ids[1:], attention_mask=mask[1:], max_new_tokens=10)
    assert out[1].tolist() == expected[0].tolist()
    alone_calls = [call_mask for rows, call_mask in masks if rows == 1]
    assert alone_calls, "the batch never shrank to one row"
    for call_mask in alone_calls:
        assert call_mask is not None and not call_mask.all()
