"""Resuming from a checkpoint that cannot be resumed completely (no model.safetensors / optimizer.pt / scheduler.pt /
trainer_state.json, or one of them damaged) is refused before any step, naming the file and what to do, from
Python (`ExitTrainer.train`) and from `hf-tev train` (before any model is loaded); one of another drafter, naming the
weight that differs."""

import re
import shutil

import pytest
import torch
from helpers import (
    KIT_ROWS,
    TRAINING_BLOCK_SIZE,
    make_drafter,
    make_target,
    training_args,
    training_drafter,
    training_rows,
)

from hf_tev.packaged import kit_path
from hf_tev.training import ExitTrainer, cli
from hf_tev.training.checkpoints import SETTINGS_NAME


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """checkpoint-2 of a 2-step run of the test target (drafter, optimizer, scheduler, trainer state)."""
    folder = tmp_path_factory.mktemp("run")
    target = make_target("qwen3")
    args = training_args(folder, max_steps=2, save_strategy="steps", save_steps=2)
    ExitTrainer(model=training_drafter(target), target_model=target, args=args, train_dataset=training_rows()).train()
    return folder / "out" / "checkpoint-2"


def damaged(checkpoint, tmp_path, change):
    """A copy of `checkpoint` changed by `change(folder)`."""
    copy = tmp_path / "checkpoint-2"
    shutil.copytree(checkpoint, copy)
    change(copy)
    return copy


def cut_in_half(file):
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


DAMAGES = {
    "no optimizer.pt": (
        lambda c: (c / "optimizer.pt").unlink(),
        r"has no optimizer.pt, so the run would go on with a fresh optimizer; resume from a complete checkpoint, "
        r"or start a new run from its weights \(hf-tev train --drafter .*checkpoint-2",
    ),
    "no scheduler.pt": (
        lambda c: (c / "scheduler.pt").unlink(),
        r"has no scheduler.pt, so the run would go on with a fresh learning-rate schedule",
    ),
    "no trainer_state.json": (
        lambda c: (c / "trainer_state.json").unlink(),
        r"has no trainer_state.json: not a Trainer checkpoint",
    ),
    "truncated trainer_state.json": (
        lambda c: cut_in_half(c / "trainer_state.json"),
        r"trainer_state.json is damaged \(not valid JSON: line \d+ column \d+",
    ),
    "garbage optimizer.pt": (
        lambda c: (c / "optimizer.pt").write_bytes(b"not a torch file" * 10),
        r"optimizer.pt is damaged \(not a torch.save file",
    ),
    "garbage rng_state.pth": (
        lambda c: (c / "rng_state.pth").write_bytes(b"\0" * 100),
        r"rng_state.pth is damaged \(not a torch.save file",
    ),
    "truncated opd_rollouts_0.json": (
        lambda c: (c / "opd_rollouts_0.json").write_text('{"refresh": 0, "rollouts": [{"input_ids": [1, 2'),
        r"opd_rollouts_0.json is damaged \(not valid JSON: line 1 column \d+",
    ),
    "no model.safetensors": (
        lambda c: (c / "model.safetensors").unlink(),
        r"has no model.safetensors \(the drafter's weights\); resume from another, complete checkpoint of the run",
    ),
    "truncated model.safetensors": (
        lambda c: cut_in_half(c / "model.safetensors"),
        r"model.safetensors is damaged \(\d+ bytes, its header describes \d+: cut off\); resume from another",
    ),
    "model.safetensors with a broken header": (
        lambda c: (c / "model.safetensors").write_bytes(b"\xff" * 64),
        r"model.safetensors is damaged \(no readable safetensors header: was it cut off\?\)",
    ),
    "truncated optimizer.pt": (
        lambda c: cut_in_half(c / "optimizer.pt"),
        r"optimizer.pt is damaged \(not a torch.save file",
    ),
}


@pytest.mark.parametrize("case", sorted(DAMAGES))
def test_an_incomplete_or_damaged_checkpoint_is_refused_before_any_step(case, checkpoint, tmp_path):
    change, message = DAMAGES[case]
    folder = damaged(checkpoint, tmp_path, change)
    target = make_target("qwen3")
    drafter = training_drafter(target, seed=5)
    before = {name: value.clone() for name, value in drafter.state_dict().items()}
    args = training_args(tmp_path / "resumed", max_steps=4)
    trainer = ExitTrainer(model=drafter, target_model=target, args=args, train_dataset=training_rows())
    with pytest.raises(ValueError, match=message):
        trainer.train(resume_from_checkpoint=str(folder))
    assert trainer.state.global_step == 0
    assert all(torch.equal(value, before[name]) for name, value in drafter.state_dict().items())


def test_a_checkpoint_of_another_drafter_is_named_before_any_step(checkpoint, tmp_path, monkeypatch, capsys):
    """A checkpoint whose weights are another drafter's (here 2 layers, the run's 1) fails inside Trainer with a
    size-mismatch traceback; it is refused naming the first differing weight, from Python and from hf-tev train
    (before the rows are read or written)."""
    target = make_target("qwen3")
    other = make_drafter(target, block_size=TRAINING_BLOCK_SIZE, num_layers=2)
    trainer = ExitTrainer(
        model=other, target_model=target, args=training_args(tmp_path / "a", max_steps=4), train_dataset=training_rows()
    )
    message = r"checkpoint-2 holds another drafter than the one being trained: .* (is missing there|there, .* here)"
    with pytest.raises(ValueError, match=message):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.state.global_step == 0
    target.save_pretrained(tmp_path / "target")
    monkeypatch.setattr(cli, "_rows", lambda *a, **k: pytest.fail("the rows were read before the check"))
    # a checkpoint without its settings file (written before it existed) is checked by its weights alone; the CLI's
    # default settings are not the Python run's, which the settings check would name first
    checkpoint = damaged(checkpoint, tmp_path, lambda c: (c / SETTINGS_NAME).unlink())
    flags = ["--target", str(tmp_path / "target"), "--train_data", str(KIT_ROWS), "--output_dir", str(tmp_path / "o")]
    flags += [
        "--use_cpu",
        "--report_to",
        "none",
        "--num_draft_layers",
        "2",
        "--resume_from_checkpoint",
        str(checkpoint),
    ]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(flags)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hf-tev train: error:")]
    assert exit_info.value.code == 2 and len(errors) == 1 and re.search(message, errors[0]), errors


def test_a_missing_checkpoint_folder_and_resume_true_without_checkpoints(checkpoint, tmp_path):
    target = make_target("qwen3")
    trainer = ExitTrainer(
        model=training_drafter(target), target_model=target, args=training_args(tmp_path), train_dataset=training_rows()
    )
    with pytest.raises(FileNotFoundError, match=r"resume_from_checkpoint: .*nowhere does not exist"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"resume_from_checkpoint=True: no checkpoint in"):
        trainer.train(resume_from_checkpoint=True)


def test_a_damaged_optimizer_state_inside_a_valid_file_is_named(checkpoint, tmp_path):
    # A readable torch file that holds no optimizer state: Trainer's own load fails; the file is named.
    folder = damaged(checkpoint, tmp_path, lambda c: torch.save({"not": "an optimizer"}, c / "optimizer.pt"))
    target = make_target("qwen3")
    args = training_args(tmp_path / "resumed", max_steps=4)
    trainer = ExitTrainer(model=training_drafter(target), target_model=target, args=args, train_dataset=training_rows())
    with pytest.raises(ValueError, match=r"the optimizer or scheduler state in .*checkpoint-2 cannot be resumed"):
        trainer.train(resume_from_checkpoint=str(folder))


def test_hf_tev_train_refuses_the_checkpoint_before_loading_any_model(checkpoint, tmp_path, monkeypatch, capsys):
    folder = damaged(checkpoint, tmp_path, lambda c: (c / "optimizer.pt").unlink())
    monkeypatch.setattr(cli, "load_training_models", lambda *a, **k: pytest.fail("a model was loaded"))
    flags = ["--target", str(kit_path("target")), "--train_data", str(KIT_ROWS), "--output_dir", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*flags, "--use_cpu", "--report_to", "none", "--resume_from_checkpoint", str(folder)])
    assert exit_info.value.code != 0
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "has no optimizer.pt" in error and "--drafter" in error
    with pytest.raises(SystemExit):
        cli.main([*flags, "--use_cpu", "--report_to", "none", "--resume_from_checkpoint", "last"])
    assert "no checkpoint in" in capsys.readouterr().err


@pytest.mark.parametrize("change", [{"objective": "dflash"}, {"anchors_per_sequence": 2, "tree_weight": 0.5}])
def test_a_checkpoint_written_under_other_settings_is_named_before_any_step(change, checkpoint, tmp_path, capsys):
    """Resumed under another objective, a run's steps would be two trainings under one name: refused naming each
    setting that differs, from Python and from hf-tev train (before any model loads)."""
    target = make_target("qwen3")
    args = training_args(tmp_path / "a", max_steps=4, **change)
    trainer = ExitTrainer(model=training_drafter(target), target_model=target, args=args, train_dataset=training_rows())
    first = next(iter(change))
    message = rf"checkpoint-2 was trained with other settings \({first} .* there, .* here.*\); resume with the settings"
    with pytest.raises(ValueError, match=message):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.state.global_step == 0
    flags = ["--target", str(kit_path("target")), "--train_data", str(KIT_ROWS), "--output_dir", str(tmp_path / "o")]
    flags += ["--use_cpu", "--report_to", "none", "--resume_from_checkpoint", str(checkpoint)]
    flags += [text for key, value in change.items() for text in (f"--{key}", str(value))]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(flags)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hf-tev train: error:")]
    assert exit_info.value.code == 2 and len(errors) == 1 and "was trained with other settings" in errors[0], errors
