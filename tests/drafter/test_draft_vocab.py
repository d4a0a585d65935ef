"""A drafter's reduced draft vocabulary (EAGLE-3's `d2t` / `t2d`): the mapping, the drafter's scores, its files
(strict loading, clear errors), exact decoding with it, and training with it."""

import json
import math

import pytest
import torch
from helpers import (
    assert_tree_sampling_law,
    flattened,
    greedy,
    make_drafter,
    make_target,
    training_args,
    training_drafter,
    training_rows,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hf_tev import DFlashDraftModel, TEVConfig
from hf_tev.models.dflash.vocabulary import (
    draft_index,
    draft_token_ids,
    most_frequent_tokens,
    to_target_vocab,
    vocabulary_buffers,
)
from hf_tev.training import ExitTrainer, ExitTrainingArguments, draft_vocab_from_rows

VOCAB_IDS = [2, *range(3, 96, 2)]  # EOS and every odd token: 48 of the tiny targets' 96


@pytest.fixture(scope="module")
def target():
    return make_target()


def vocab_drafter(target, ids=VOCAB_IDS, **kwargs):
    drafter = make_drafter(target, **kwargs)
    drafter.set_draft_vocab(ids)
    return drafter


# ------------------------------------------------------------------ the mapping


def test_buffers_map_draft_ids_to_target_ids_and_back():
    d2t, t2d = vocabulary_buffers([7, 3, 90, 4], 96)
    assert d2t.dtype == torch.long and t2d.dtype == torch.bool
    assert draft_token_ids(d2t).tolist() == [3, 4, 7, 90]  # ascending target ids, EAGLE-3's offsets
    assert d2t.tolist() == [3, 3, 5, 87]
    assert t2d.nonzero().flatten().tolist() == [3, 4, 7, 90]
    index = draft_index(t2d)
    assert index[[3, 4, 7, 90]].tolist() == [0, 1, 2, 3] and int((index == -1).sum()) == 92


@pytest.mark.parametrize(
    ("ids", "message"), [([], "at least one"), ([3, 96], r"\[0, 96\)"), ([-1, 4], r"\[0, 96\)"), ([4, 4], "distinct")]
)
def test_bad_vocabularies_are_refused_by_what_is_wrong(ids, message):
    with pytest.raises(ValueError, match=message):
        vocabulary_buffers(ids, 96)


def test_most_frequent_tokens_ranks_by_count_then_by_lower_id_and_keeps_the_eos():
    counts = torch.zeros(10, dtype=torch.long)
    counts[[5, 8, 1]] = torch.tensor([9, 9, 3])  # 5 and 8 tie: the lower id first
    assert most_frequent_tokens(counts, 3).tolist() == [1, 5, 8]
    assert most_frequent_tokens(counts, 2).tolist() == [5, 8]
    assert most_frequent_tokens(counts, 3, always=[9]).tolist() == [5, 8, 9]
    assert most_frequent_tokens(counts, 5).tolist() == [0, 1, 2, 5, 8]  # never-seen ids: lowest first
    with pytest.raises(ValueError, match="draft_vocab_size"):
        most_frequent_tokens(counts, 11)
    with pytest.raises(ValueError, match="smaller than"):
        most_frequent_tokens(counts, 1, always=[2, 3])


def test_to_target_vocab_gives_every_other_token_probability_zero():
    logits = torch.tensor([[1.0, 2.0]])
    full = to_target_vocab(logits, torch.tensor([1, 3]), 5)
    assert full.tolist() == [[-math.inf, 1.0, -math.inf, 2.0, -math.inf]]
    assert full.softmax(-1)[0, [0, 2, 4]].eq(0).all()


def test_the_draft_vocabulary_comes_from_the_target_written_tokens_of_the_rows():
    rows = [{"input_ids": [9, 9, 9, 4, 4, 5], "prompt_length": 3}, {"input_ids": [7, 4, 6], "loss_mask": [0, 1, 1]}]
    # supervised: 4, 4, 5 and 4, 6 -> 4 (3 times), then 5 and 6 (once); the prompt's 9s do not count
    assert draft_vocab_from_rows(rows, 3, 10).tolist() == [4, 5, 6]
    assert draft_vocab_from_rows(rows, 3, 10, always=[2]).tolist() == [2, 4, 5]


# ------------------------------------------------------------------ the drafter's scores


def test_a_drafter_scores_its_vocabulary_as_the_full_head_does_and_nothing_else(target):
    full, reduced = make_drafter(target), vocab_drafter(target)
    context = torch.randn(1, 5, len(full.config.target_layer_ids) * 64)
    block = torch.tensor([[5] + [full.config.mask_token_id] * 7])
    positions = torch.arange(13)[None]
    expected = full.draft_logits(target, context, block, positions)
    got = reduced.draft_logits(target, context, block, positions)
    assert got.shape == expected.shape
    inside = torch.tensor(VOCAB_IDS)
    torch.testing.assert_close(got[..., inside], expected[..., inside])
    outside = torch.ones(96, dtype=torch.bool)
    outside[inside] = False
    assert got[..., outside].eq(-math.inf).all()
    assert reduced.head_logits(target, torch.randn(2, 64)).shape == (2, len(VOCAB_IDS))
    as_scored = reduced.draft_logits(target, context, block, positions, target_vocab=False)  # columns: VOCAB_IDS
    assert torch.equal(as_scored, got[..., inside])
    assert torch.equal(full.draft_logits(target, context, block, positions, target_vocab=False), expected)


def test_the_head_rows_follow_a_changed_head(target):
    drafter = vocab_drafter(target)
    hidden = torch.randn(1, 64)
    before = drafter.head_logits(target, hidden)
    head = target.get_output_embeddings()
    saved = head.weight.detach().clone()
    try:
        with torch.no_grad():
            head.weight.mul_(2.0)  # in place: the memo of the gathered rows must not serve the old ones
        torch.testing.assert_close(drafter.head_logits(target, hidden), 2 * before)
    finally:
        with torch.no_grad():
            head.weight.copy_(saved)


def test_the_head_rows_are_gathered_once_while_decoding(target):
    """A target's weights require grad even where it only decodes: under no_grad the rows are gathered once; where
    autograd records (a head being trained), every call gathers them, with their gradient."""
    drafter = vocab_drafter(target)
    head = target.get_output_embeddings()
    assert head.weight.requires_grad
    with torch.no_grad():
        assert drafter._draft_head_rows(head)[0] is drafter._draft_head_rows(head)[0]
    rows = drafter._draft_head_rows(head)[0]
    assert rows.requires_grad and rows is not drafter._draft_head_rows(head)[0]


def test_removing_the_vocabulary_scores_every_token_again(target):
    drafter = vocab_drafter(target)
    drafter.set_draft_vocab(None)
    assert drafter.draft_vocab is None and drafter.config.draft_vocab_size is None
    assert "d2t" not in drafter.state_dict()
    assert drafter.head_logits(target, torch.randn(1, 64)).shape == (1, 96)


# ------------------------------------------------------------------ files


def test_save_and_load_keep_the_vocabulary_in_the_published_files(target, tmp_path):
    drafter = vocab_drafter(target)
    drafter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["draft_vocab_size"] == len(VOCAB_IDS)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert f.get_slice("d2t").get_dtype() == "I64" and f.get_slice("t2d").get_dtype() == "BOOL"
    loaded = DFlashDraftModel.from_pretrained(tmp_path)
    assert loaded.draft_vocab.tolist() == VOCAB_IDS
    hidden = torch.randn(3, 64)
    torch.testing.assert_close(loaded.head_logits(target, hidden), drafter.head_logits(target, hidden))


def test_a_folder_whose_mapping_does_not_fit_is_refused_by_name(target, tmp_path):
    vocab_drafter(target).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["t2d"][0] = True  # marks a token d2t does not map to
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{tmp_path}.*d2t and t2d disagree"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_a_config_with_a_vocabulary_needs_its_buffers(target, tmp_path):
    make_drafter(target).save_pretrained(tmp_path)  # weights without d2t / t2d
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "draft_vocab_size": 8}))
    with pytest.raises(ValueError, match=r"missing weights \['d2t', 't2d'\]"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_a_vocabulary_of_another_target_is_refused(target, tmp_path):
    vocab_drafter(target).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["t2d"] = torch.cat([weights["t2d"], torch.zeros(4, dtype=torch.bool)])  # a 100-token target's
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"t2d \(checkpoint \(100,\), model \(96,\)\)"):
        DFlashDraftModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("size", [0, 97, 2.5])
def test_a_config_size_outside_the_vocabulary_is_refused(size):
    from huggingface_hub.errors import StrictDataclassError

    from hf_tev import DFlashConfig

    # a float is refused by the config's typed fields (huggingface_hub's strict dataclass), a size by hf_tev
    with pytest.raises((ValueError, StrictDataclassError), match="draft_vocab_size"):
        DFlashConfig(vocab_size=96, num_target_layers=4, draft_vocab_size=size)


# ------------------------------------------------------------------ exact decoding


def test_greedy_decoding_with_a_draft_vocabulary_equals_the_targets(target):
    prompt = torch.tensor([[1, 5, 9, 13, 4]])
    drafter = vocab_drafter(target)
    out = target.generate(prompt, max_new_tokens=24, assistant_model=drafter, tev_config=TEVConfig(budget=8))
    assert torch.equal(out, greedy(target, prompt, max_new_tokens=24))


def test_the_decoder_drafts_over_the_draft_vocabulary_as_scored(target):
    """The decoder asks for the drafter's logits as scored (`target_vocab=False`: `[B, d, draft_vocab_size]`, not
    spread over the target's vocabulary) and decodes exactly (its builders map the columns to target ids:
    `tests/core/test_tree.py`)."""
    drafter, widths = vocab_drafter(target), []
    real = drafter.draft_logits

    def draft_logits(*args, **kwargs):
        logits = real(*args, **kwargs)
        widths.append((kwargs.get("target_vocab"), logits.shape[-1]))
        return logits

    drafter.draft_logits = draft_logits
    prompt = torch.tensor([[1, 5, 9, 13, 4]])
    out = target.generate(
        prompt, max_new_tokens=24, assistant_model=drafter, tev_config=TEVConfig(budget=8, lookup=False),
        return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(out.sequences, greedy(target, prompt, max_new_tokens=24))
    assert widths and set(widths) == {(False, len(VOCAB_IDS))}


def test_sampling_with_a_draft_vocabulary_follows_the_targets_law():
    target = make_target("qwen3", vocab_size=8, hidden_size=32, num_layers=2, seed=4)
    target.generation_config.eos_token_id = None  # the law of two free tokens
    # Half the vocabulary: the target's likely tokens are often outside it, where a verifier that trusted the
    # drafter's zeros would show.
    drafter = flattened(vocab_drafter(target, ids=[1, 3, 4, 6], block_size=4))
    assert_tree_sampling_law(target, torch.tensor([[1, 5, 3]]), drafter, ["tev", "predraw", "residual"])


# ------------------------------------------------------------------ training


def test_training_with_a_draft_vocabulary_supervises_only_the_tokens_it_scores(target, tmp_path):
    drafter = training_drafter(target)
    drafter.set_draft_vocab(VOCAB_IDS)
    rows = training_rows(n=4)
    for objective in ("dflash", "exit"):
        args = training_args(tmp_path / objective, objective=objective)
        trainer = ExitTrainer(model=drafter, target_model=target, args=args, train_dataset=rows)
        trainer.train()
        assert all(math.isfinite(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry)
    assert drafter.draft_vocab.tolist() == VOCAB_IDS  # the buffers are not trained


def test_draft_opd_refuses_a_drafter_with_a_draft_vocabulary(target, tmp_path):
    drafter = training_drafter(target)
    drafter.set_draft_vocab(VOCAB_IDS)
    args = training_args(tmp_path, objective="opd")
    with pytest.raises(ValueError, match="'opd' does not train a drafter with a draft vocabulary"):
        ExitTrainer(model=drafter, target_model=target, args=args, train_dataset=training_rows(n=2))


def test_labels_outside_the_vocabulary_are_not_supervised(target):
    from hf_tev.training.losses import rows_loss

    drafter = training_drafter(target)
    drafter.set_draft_vocab(VOCAB_IDS)
    args = ExitTrainingArguments(output_dir="unused", use_cpu=True, anchors_per_sequence=2, report_to=[])
    even = {"input_ids": torch.tensor([[1, 4, 6, 8, 10, 12, 14, 16]]), "loss_mask": torch.ones(1, 8, dtype=torch.long)}
    step, _ = rows_loss(drafter, drafter, target, even, args, "dflash", 1.0, torch.Generator().manual_seed(0))
    assert float(step.loss.detach()) == 0.0  # every label is even, outside the vocabulary: nothing to learn from
    odd = {**even, "input_ids": torch.tensor([[1, 5, 7, 9, 11, 13, 15, 17]])}
    step, _ = rows_loss(drafter, drafter, target, odd, args, "dflash", 1.0, torch.Generator().manual_seed(0))
    assert float(step.loss.detach()) > 0.0


# ------------------------------------------------------------------ what a careless caller tries


def test_float_or_bool_ids_are_refused_not_rounded():
    with pytest.raises(ValueError, match="integer token ids, got torch.float32"):
        vocabulary_buffers([1.5, 3.0], 96)
    with pytest.raises(ValueError, match="integer token ids"):
        vocabulary_buffers(torch.ones(96, dtype=torch.bool), 96)  # a t2d mask where ids were meant


def test_auto_model_and_another_dtype_keep_the_integer_buffers(target, tmp_path):
    from transformers import AutoModel

    vocab_drafter(target).save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert isinstance(loaded, DFlashDraftModel) and loaded.fc.weight.dtype == torch.bfloat16
    assert loaded.d2t.dtype == torch.long and loaded.t2d.dtype == torch.bool
    assert loaded.draft_vocab.tolist() == VOCAB_IDS


def test_default_settings_and_a_batch_decode_exactly_with_a_draft_vocabulary(target):
    drafter = vocab_drafter(target)
    prompt = torch.tensor([[1, 5, 9, 13, 4]])
    out = target.generate(prompt, max_new_tokens=24, assistant_model=drafter, tev_config=TEVConfig())  # lookup on
    assert torch.equal(out, greedy(target, prompt, max_new_tokens=24))
    batch = torch.tensor([[0, 0, 1, 5, 9], [1, 7, 11, 3, 8]])
    mask = (batch != 0).long()
    mask[1, 0] = 1
    out = target.generate(
        batch, attention_mask=mask, max_new_tokens=16, assistant_model=drafter, tev_config=TEVConfig(budget=6)
    )
    expected = greedy(target, batch, attention_mask=mask, max_new_tokens=16)
    assert torch.equal(out, expected)
