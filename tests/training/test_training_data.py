"""Training data of ExitTrainer: bad rows refused before training with the row that is wrong, rows with nothing to
train skipped with a counted warning, and `generate_training_data` writing its rows as it goes (resume, settings,
progress with tokens/s)."""

import json

import pytest
import torch
from helpers import make_target, training_args, training_drafter, transformers_log

from hf_tev.training import (
    CachedFeatureDataset,
    ExitDataCollator,
    ExitTrainer,
    FeatureCache,
    check_rows,
    generate_training_data,
)
from hf_tev.training.data import settings_file

VOCAB = 96  # make_target's vocabulary


@pytest.fixture(scope="module")
def target():
    return make_target("qwen3")


def good(n=3, length=10, prompt_length=2):
    generator = torch.Generator().manual_seed(n)
    return [
        {"input_ids": torch.randint(3, VOCAB, (length,), generator=generator).tolist(), "prompt_length": prompt_length}
        for _ in range(n)
    ]


def make_trainer(target, tmp_path, train_dataset=None, eval_dataset=None, **overrides):
    args = training_args(tmp_path, **(dict(tree_budget=4, max_steps=1, max_length=8) | overrides))
    return ExitTrainer(
        model=training_drafter(target),
        target_model=target,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
    )


# ---------------------------------------------------------------------------------------------
# Bad rows


BAD_ROWS = {
    "no tokens": ({"input_ids": []}, r"train_dataset row 3 has no tokens \('input_ids' is empty\)"),
    "text": ({"input_ids": "def f(): pass"}, r"train_dataset row 3: 'input_ids' is text \('def f\(\): pass'\)"),
    "list of strings": ({"input_ids": ["def", "f"]}, r"row 3: 'input_ids' must be a flat list of int token ids"),
    "floats": ({"input_ids": [5.0, 6.5, 7.0]}, r"row 3: 'input_ids' must be int token ids, got float32 values"),
    "nested": ({"input_ids": [[5, 6], [7, 8]]}, r"row 3: 'input_ids' must be a flat list of token ids, got shape"),
    "id = vocabulary": (
        {"input_ids": [5, VOCAB, 7]},
        rf"row 3: token id {VOCAB} at position 1 of 'input_ids' is outside the target's vocabulary \(ids 0..95\)",
    ),
    "negative id": ({"input_ids": [5, 6, -1]}, r"row 3: token id -1 at position 2 of 'input_ids' is outside"),
    "negative prompt_length": (
        {"input_ids": [5, 6, 7], "prompt_length": -2},
        r"row 3: 'prompt_length' must be an int >= 0 \(prompt tokens, not supervised\), got -2",
    ),
    "float prompt_length": ({"input_ids": [5, 6, 7], "prompt_length": 1.5}, r"row 3: 'prompt_length' must be an int"),
    "loss_mask length": ({"input_ids": [5, 6, 7], "loss_mask": [1, 1]}, r"row 3: 'loss_mask' has 2 entries for 3"),
    "loss_mask values": ({"input_ids": [5, 6, 7], "loss_mask": [0, 2, 1]}, r"row 3: 'loss_mask' must hold 0/1"),
    "no input_ids": ({"text": "hello"}, r"rows need an 'input_ids' column .* train_dataset row 3 has \['text'\]"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_a_bad_row_is_refused_before_training_with_its_index(case, target, tmp_path):
    row, message = BAD_ROWS[case]
    with pytest.raises(ValueError, match=message):
        make_trainer(target, tmp_path, train_dataset=[*good(3), row])


def test_bad_rows_of_a_datasets_dataset_and_of_the_eval_dataset_are_named(target, tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [*good(4), {"input_ids": [5, 300, 7], "prompt_length": 1}]
    with pytest.raises(ValueError, match=r"train_dataset row 4: token id 300 at position 1"):
        make_trainer(target, tmp_path, train_dataset=datasets.Dataset.from_list(rows))
    with pytest.raises(ValueError, match=r"eval_dataset row 4: token id 300"):
        make_trainer(target, tmp_path, train_dataset=good(2), eval_dataset=rows)
    with pytest.raises(ValueError, match=r"eval_dataset\['held'\] row 4: token id 300"):
        make_trainer(target, tmp_path, train_dataset=good(2), eval_dataset={"held": rows})


def test_empty_datasets_are_refused(target, tmp_path):
    datasets = pytest.importorskip("datasets")
    for empty in ([], datasets.Dataset.from_dict({"input_ids": [], "prompt_length": []})):
        with pytest.raises(ValueError, match="train_dataset is empty: it has no rows to train on"):
            make_trainer(target, tmp_path, train_dataset=empty)


def test_rows_with_nothing_to_train_are_skipped_with_a_counted_warning(target, tmp_path):
    rows = [
        *good(3),
        {"input_ids": [5, 6, 7, 8], "prompt_length": 4},  # all prompt
        {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 0, 0]},  # nothing supervised
        {"input_ids": list(range(5, 17)), "prompt_length": 9},  # supervised only past max_length=8
        {"input_ids": [5]},  # one token: nothing before it to predict it from
        {"input_ids": [5, 6, 7, 8], "loss_mask": [1, 0, 0, 0]},  # only the first token, never a label
    ]
    with transformers_log() as messages:
        trainer = make_trainer(target, tmp_path, train_dataset=rows)
    (message,) = [m for m in messages if "skipped" in m]
    assert message.startswith("train_dataset: skipped 5 of 8 rows with no supervised token to predict")
    assert "max_length=8" in message and "(rows 3, 4, 5, 6, 7)" in message
    assert trainer.train_dataset == rows[:3]
    trainer.train()
    assert all(torch.isfinite(torch.tensor(entry["train_loss"])) for entry in trainer.state.log_history[-1:])

    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_list([{"input_ids": r["input_ids"], "prompt_length": 4} for r in rows[:4]])
    kept = check_rows(table, vocab_size=VOCAB)  # rows of 10 tokens keep 6 supervised ones; row 3 none
    assert isinstance(kept, datasets.Dataset) and kept["input_ids"] == table["input_ids"][:3]
    untouched = good(3)
    assert check_rows(untouched, vocab_size=VOCAB, max_length=8) is untouched  # nothing skipped: the same object

    with pytest.raises(ValueError, match=r"train_dataset: none of its 2 rows has a supervised token .*rows 0, 1"):
        make_trainer(target, tmp_path, train_dataset=rows[3:5])


def test_the_skipped_rows_warning_follows_transformers_verbosity():
    import transformers

    rows = [*good(3), {"input_ids": [5, 6, 7, 8], "prompt_length": 4}]
    verbosity = transformers.logging.get_verbosity()
    try:
        transformers.logging.set_verbosity_error()
        with transformers_log() as messages:
            check_rows(rows, vocab_size=VOCAB)
        assert messages == []
        transformers.logging.set_verbosity_warning()
        with transformers_log() as messages:
            check_rows(rows, vocab_size=VOCAB)
        assert len(messages) == 1 and messages[0].startswith("train_dataset: skipped 1 of 4 rows")
    finally:
        transformers.logging.set_verbosity(verbosity)


def test_cached_feature_rows_are_checked_without_reading_features(target, tmp_path):
    rows = [*good(2), {"input_ids": [5, 6, 7], "prompt_length": 3}]
    cache = FeatureCache(tmp_path / "cache", target, [1, 3])
    cache.update(rows, show_progress=False)
    dataset = CachedFeatureDataset(rows, cache)
    kept = check_rows(dataset, vocab_size=VOCAB)
    assert isinstance(kept, CachedFeatureDataset) and kept.cache is cache and kept.rows == rows[:2]


def test_the_collator_refuses_bad_rows_too():
    collate = ExitDataCollator(vocab_size=VOCAB)
    with pytest.raises(ValueError, match="a batch row: 'input_ids' must be int token ids, got float32"):
        collate([{"input_ids": [1.0, 2.0]}])
    with pytest.raises(ValueError, match="a batch row: token id 200"):
        collate([{"input_ids": [1, 200]}])
    with pytest.raises(ValueError, match="'prompt_length' must be an int >= 0"):
        collate([{"input_ids": [1, 2, 3], "prompt_length": -1}])
    batch = collate([{"input_ids": torch.tensor([4, 5, 6], dtype=torch.int32), "prompt_length": torch.tensor(1)}])
    assert batch["input_ids"].dtype == torch.long and batch["loss_mask"].tolist() == [[False, True, True]]


# ---------------------------------------------------------------------------------------------
# generate_training_data: written as it goes, resumed, settings recorded, progress with tokens/s


PROMPTS = [[5, 17, 33], [40, 41], [7, 8, 9, 10], [11, 12], [60, 61, 62]]


def test_rows_are_written_as_they_come_and_a_rerun_resumes(target, tmp_path, monkeypatch):
    settings = dict(max_new_tokens=5, batch_size=2, show_progress=False, do_sample=False)
    whole = generate_training_data(target, PROMPTS, **settings)
    out = tmp_path / "rows" / "train.jsonl"

    # A run that dies in its third generate call keeps the rows of the first two batches.
    real_generate, calls = target.generate, []

    def dying_generate(*args, **kwargs):
        calls.append(args[0].shape[0])
        if len(calls) == 3:
            raise RuntimeError("power cut")
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(target, "generate", dying_generate)
    with pytest.raises(RuntimeError, match="power cut"):
        generate_training_data(target, PROMPTS, output_path=out, metadata={"prompts": "test"}, **settings)
    partial = out.with_name("train.jsonl.partial")
    assert not out.exists()  # the rows file appears only whole
    written = [json.loads(line) for line in partial.read_text().splitlines()]
    assert written == whole[:4]
    with open(partial, "a") as f:
        f.write('{"input_ids": [5, 17')  # and it stopped in the middle of a line

    calls.clear()
    resumed = generate_training_data(target, PROMPTS, output_path=out, **settings)
    assert resumed == whole and calls == [1]  # only the last prompt was generated again
    assert [json.loads(line) for line in out.read_text().splitlines()] == whole and not partial.exists()
    recorded = json.loads(settings_file(out).read_text())
    assert settings_file(out).name == "train.settings.json"
    assert recorded["max_new_tokens"] == 5 and recorded["sampling"]["do_sample"] is False
    assert recorded["generate_kwargs"] == {"do_sample": False} and recorded["num_prompts"] == 5
    assert len(recorded["target_fingerprint"]) == 64 and recorded["versions"]["hf_tev"]

    calls.clear()
    assert generate_training_data(target, PROMPTS, output_path=out, **settings) == whole and calls == []
    with pytest.raises(ValueError, match="was generated with other settings .*max_new_tokens: file 5, now 6"):
        generate_training_data(target, PROMPTS, output_path=out, **{**settings, "max_new_tokens": 6})
    with pytest.raises(ValueError, match="row 1 was generated for another prompt than prompt 1"):
        generate_training_data(target, [PROMPTS[0], [1, 2], *PROMPTS[2:]], output_path=out, **settings)


def test_a_finished_rows_file_is_never_written_again_and_one_writer_at_a_time(target, tmp_path, monkeypatch):
    settings = dict(max_new_tokens=4, batch_size=2, show_progress=False, do_sample=False)
    out = tmp_path / "train.jsonl"
    first = generate_training_data(target, PROMPTS[:3], output_path=out, **settings)
    finished = out.read_bytes()
    assert generate_training_data(target, PROMPTS[:3], output_path=out, **settings) == first
    assert out.read_bytes() == finished  # read back, not appended to

    # More prompts extend the finished rows; the file is replaced whole, never appended in place.
    extended = generate_training_data(target, PROMPTS, output_path=out, **settings)
    assert extended[:3] == first and len(extended) == len(PROMPTS)
    assert out.read_bytes().startswith(finished) and not out.with_name("train.jsonl.partial").exists()

    # A second writer of the same rows file is refused by name while the first holds it.
    from filelock import FileLock

    held = pytest.raises(ValueError, match=r"train\.jsonl is being written by another process")
    with FileLock(str(out) + ".lock"), held:
        generate_training_data(target, PROMPTS, output_path=out, **settings)


def test_a_damaged_rows_file_is_named_with_its_line(target, tmp_path):
    settings = dict(max_new_tokens=4, batch_size=2, show_progress=False, do_sample=False)
    out = tmp_path / "train.jsonl"
    generate_training_data(target, PROMPTS[:3], output_path=out, **settings)
    lines = out.read_text().splitlines(keepends=True)
    out.write_text(lines[0] + "{not json\n" + lines[2])
    with pytest.raises(ValueError, match=r"train\.jsonl line 2: not valid JSON \(.* at column 2\)"):
        generate_training_data(target, PROMPTS[:3], output_path=out, **settings)
    out.write_text(lines[0] + '{"prompt_length": 3}\n' + lines[2])
    with pytest.raises(ValueError, match=r"train\.jsonl line 2: not a row of this function"):
        generate_training_data(target, PROMPTS[:3], output_path=out, **settings)
    out.write_text("".join(lines))
    settings_file(out).write_text('{"max_new_tokens": 4,')
    with pytest.raises(ValueError, match=r"train\.settings\.json line 1 column 22: not valid JSON"):
        generate_training_data(target, PROMPTS[:3], output_path=out, **settings)


def test_a_run_stopped_after_its_last_row_is_finished_by_the_rerun(target, tmp_path):
    settings = dict(max_new_tokens=4, batch_size=2, show_progress=False, do_sample=False)
    out = tmp_path / "train.jsonl"
    rows = generate_training_data(target, PROMPTS[:2], output_path=out, **settings)
    out.rename(out.with_name("train.jsonl.partial"))  # as if it stopped before the rename
    calls = []
    real_generate = target.generate
    target.generate = lambda *a, **k: calls.append(1) or real_generate(*a, **k)
    try:
        assert generate_training_data(target, PROMPTS[:2], output_path=out, **settings) == rows
    finally:
        del target.generate
    assert calls == [] and out.is_file() and not out.with_name("train.jsonl.partial").exists()


def test_progress_bar_shows_tokens_per_second(target, capsys):
    generate_training_data(target, PROMPTS[:2], max_new_tokens=3, batch_size=1, show_progress=True, do_sample=False)
    err = capsys.readouterr().err
    assert "target-written responses" in err and "tok/s" in err and "2/2" in err


def test_chat_prompts_use_the_turns_before_the_first_answer():
    from hf_tev.training.rows import encode_prompt

    class Tokenizer:
        def apply_chat_template(self, turns, add_generation_prompt, tokenize, return_dict):
            assert add_generation_prompt and tokenize and not return_dict
            return [len(turn["content"]) for turn in turns]

    conversation = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "more"},
    ]
    assert encode_prompt(conversation, Tokenizer(), apply_chat_template=False) == [8, 2]
