"""`hf-tev train` / `python -m hf_tev.train` end to end on the tiny kit in subprocesses (a YAML config, rows with a
feature cache, torchrun with 2 CPU processes), its parsing, the offline push that fails before writing anything,
and the kit's `train_drafter.py` as a thin runner of it over the recorded recipes."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    KIT_PROMPTS,
    KIT_ROWS,
    KIT_STUDY_DRAFTERS,
    REPO_ROOT,
    run_command,
    small_run_flags,
    train_summary,
)
from huggingface_hub import ModelCard
from safetensors.torch import load_file

from hf_tev.models.dflash.modeling_dflash import DFlashDraftModel
from hf_tev.packaged import KIT_MODELS, kit_path
from hf_tev.training import cli


@pytest.mark.slow
def test_hf_tev_train_from_prompts_with_a_yaml_config(tmp_path):
    out = tmp_path / "drafter"
    config = tmp_path / "recipe.yaml"
    config.write_text(
        f"target: {kit_path('target')}\n"
        f"prompts: {KIT_PROMPTS}\n"
        "max_prompts: 6\n"
        "eval_size: 2\n"
        "max_new_tokens: 12\n"
        "generation_batch_size: 4\n"
        "objective: exit\n"
        "learning_rate: 1e-3\n"  # YAML reads 1e-3 as text: parsed like the flag
        f"output_dir: {out}\n"
        "max_steps: 50\n"  # the flag below overrides it
    )
    result = run_command([sys.executable, "-m", "hf_tev", "train", str(config), *small_run_flags()], tmp_path)
    report = train_summary(result)
    assert report["steps"] == 2 and report["train_rows"] == 4 and report["total_flos"] > 0
    assert report["eval_tau"] >= 1.0 and report["eval_tau_cycles"] > 0

    # The target wrote the responses into <output_dir>/_data, with their settings.
    rows = [json.loads(line) for line in (out / "_data" / "train.jsonl").read_text().splitlines()]
    held_out = [json.loads(line) for line in (out / "_data" / "eval.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and len(held_out) == 2
    settings = json.loads((out / "_data" / "train.settings.json").read_text())
    assert settings["max_new_tokens"] == 12 and settings["metadata"]["prompts"].startswith(str(KIT_PROMPTS))
    assert all(0 < len(row["input_ids"]) - row["prompt_length"] <= 12 for row in rows)

    drafter = DFlashDraftModel.from_pretrained(out)
    assert drafter.config.block_size == 4 and drafter.config.num_hidden_layers == 1
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model is None and card.data.library_name == "hf_tev"  # a local target: text only
    (result,) = card.data.eval_results
    assert result.metric_type == "tau" and result.metric_value == pytest.approx(report["eval_tau"], abs=1e-4)
    assert result.metric_args["budget"] == 4 and result.metric_args["temperature"] == 0.0
    assert "| `learning_rate` |" not in card.text and "| learning rate | 0.001 |" in card.text
    assert "4 prompts of" in card.text and "Evaluated on 2 held-out rows" in card.text


@pytest.mark.slow
def test_python_m_hf_tev_train_from_rows_with_a_feature_cache(tmp_path):
    out, cache = tmp_path / "drafter", tmp_path / "cache"
    init = kit_path("drafter-dflash")
    command = [sys.executable, "-m", "hf_tev.train", "--target", str(kit_path("target")), "--drafter", str(init)]
    command += ["--train_data", str(KIT_ROWS), "--max_train_rows", "6", "--eval_size", "2", "--objective", "dflash"]
    command += ["--feature_cache", str(cache), "--output_dir", str(out), "--learning_rate", "1e-2"]
    command += small_run_flags(block_size=None)
    report = train_summary(run_command(command, tmp_path))
    assert report["steps"] == 2 and report["train_rows"] == 4 and report["eval_tau"] >= 1.0
    assert len(json.loads((cache / "index.json").read_text())["rows"]) == 6  # train and eval rows
    before, after = load_file(init / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)
    assert "6 target-written rows" not in (out / "README.md").read_text()
    assert "4 target-written rows from `train_generated.jsonl`" in (out / "README.md").read_text()


@pytest.mark.slow
def test_torchrun_two_processes_generate_once_and_train(tmp_path):
    out = tmp_path / "drafter"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += ["-m", "hf_tev.train", "--target", str(kit_path("target")), "--prompts", str(KIT_PROMPTS)]
    command += ["--max_prompts", "5", "--eval_size", "1", "--max_new_tokens", "8", "--output_dir", str(out)]
    command += ["--ddp_backend", "gloo", *small_run_flags(per_device_train_batch_size=1)]
    result = run_command(command, tmp_path)
    report = train_summary(result)
    assert report["steps"] == 2 and report["eval_tau_cycles"] > 0  # one eval prompt: one process decodes it
    assert result.stdout.count("hf-tev train: saved") == 1  # the main process reports
    rows = (out / "_data" / "train.jsonl").read_text().splitlines()
    assert len(rows) == 4  # generated once, by the main process; the other read them
    assert len((out / "_data" / "eval.jsonl").read_text().splitlines()) == 1
    DFlashDraftModel.from_pretrained(out)


# ---------------------------------------------------------------------------------------------
# Parsing, the command table, the offline push


def test_flags_override_the_config_file_and_mistakes_are_named(tmp_path):
    config = tmp_path / "recipe.json"
    config.write_text(json.dumps({"target": "t", "prompts": "p.jsonl", "tree_budget": 8, "target_layer_ids": [1, 3]}))
    script, args = cli.parse_args([str(config), "--tree_budget", "16", "--output_dir", str(tmp_path)])
    assert (script.target, script.prompts, script.target_layer_ids, args.tree_budget) == ("t", "p.jsonl", [1, 3], 16)
    script, args = cli.parse_args(["--config", str(config), "--objective", "prefix", "--output_dir", str(tmp_path)])
    assert args.objective == "prefix" and args.tree_budget == 8
    config.write_text(json.dumps({"target": "t", "prompts": "p.jsonl", "tree_budgett": 8}))
    with pytest.raises(SystemExit):
        cli.parse_args([str(config)])
    with pytest.raises(ValueError, match="exactly one of --train_data .* or --prompts"):
        cli.parse_args(["--target", "t", "--prompts", "p", "--train_data", "r.jsonl"])
    with pytest.raises(ValueError, match="exactly one of"):
        cli.parse_args(["--target", "t"])
    with pytest.raises(ValueError, match="--target_layer_ids builds a fresh drafter"):
        cli.parse_args(["--target", "t", "--prompts", "p", "--drafter", "d", "--target_layer_ids", "1"])


def test_hf_tev_lists_the_train_command(capsys):
    from hf_tev.__main__ import COMMANDS, main

    assert COMMANDS["train"][0] == "hf_tev.training.cli"
    main(["--help"])
    assert "train" in capsys.readouterr().out


def test_reading_prompts_and_rows(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"question": "a?"}\n{"question": "b?"}\n')
    assert cli.read_prompts(str(tmp_path / "p.jsonl")) == ["a?", "b?"]
    (tmp_path / "p.txt").write_text("first\n\nsecond\n")
    assert cli.read_prompts(str(tmp_path / "p.txt"), limit=1) == ["first"]
    assert cli.read_prompts(str(KIT_PROMPTS), limit=2) == [p["prompt"] for p in json.loads(KIT_PROMPTS.read_text())[:2]]
    (tmp_path / "bad.json").write_text('[{"body": "x"}]')
    with pytest.raises(ValueError, match="entry 0 has no prompt column among prompt, text"):
        cli.read_prompts(str(tmp_path / "bad.json"))
    assert len(cli.read_rows([str(KIT_ROWS), str(KIT_ROWS)], limit=5)) == 5
    pytest.importorskip("datasets")
    folder = tmp_path / "dataset"  # a `datasets` name or folder, its split and text column
    folder.mkdir()
    (folder / "test.jsonl").write_text('{"q": "x?", "a": "y"}\n{"q": "z?", "a": "w"}\n')
    assert cli.read_prompts(str(folder), split="test", column="q") == ["x?", "z?"]


def test_push_offline_fails_before_anything_is_loaded_or_written(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(cli, "load_training_models", lambda *a, **k: pytest.fail("a model was loaded"))
    out = tmp_path / "drafter"
    flags = ["--target", str(kit_path("target")), "--prompts", str(KIT_PROMPTS), "--output_dir", str(out)]
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*flags, "--push_to_hub", "--hub_model_id", "me/drafter", "--use_cpu", "--report_to", "none"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "--push_to_hub needs the Hugging Face Hub" in error and "offline" in error
    assert not out.exists()
    with pytest.raises(ValueError, match="offline"):  # run() raises it, for Python callers
        cli.run(*cli.parse_args([*flags, "--push_to_hub", "--use_cpu", "--report_to", "none"]))


def test_hf_tev_train_push_offline_is_one_line_on_stderr(tmp_path):
    out = tmp_path / "drafter"
    command = [sys.executable, "-m", "hf_tev", "train", "--target", str(kit_path("target"))]
    command += ["--prompts", str(KIT_PROMPTS), "--output_dir", str(out), "--push_to_hub", "--use_cpu"]
    result = run_command(command, tmp_path, check=False)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "hf-tev train: error: --push_to_hub needs the Hugging Face Hub, but offline mode is on (HF_HUB_OFFLINE=1): "
        "unset it, or train without --push_to_hub and upload the output folder later"
    ]
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# The kit's train_drafter.py: a thin runner of hf-tev train over the recorded recipes (research/tiny_kit/recipes/)


def kit_script():
    script = REPO_ROOT / "research" / "tiny_kit" / "train_drafter.py"
    spec = importlib.util.spec_from_file_location("kit_train_drafter", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "name", ["drafter-dflash", "drafter-exittrain", "drafter-prefix", "drafter-finetuned", "drafter-dflash-l135"]
)
def test_the_kit_recipe_keeps_its_meaning(name, monkeypatch):
    """The recorded drafter's recipe, run as the runner runs it (from the repository root), trains what its
    trainlog records; tests/training/test_recipes.py checks every setting against the earlier flag script."""
    script = kit_script()
    monkeypatch.chdir(REPO_ROOT)
    folder = kit_path(name) if name in KIT_MODELS else KIT_STUDY_DRAFTERS / name
    recorded = json.loads((folder / "trainlog.json").read_text())["args"]
    args, overrides = script.parse_args([name.removeprefix("drafter-")])
    command = script.train_command(args.recipe, args.init, overrides)
    assert command == [f"research/tiny_kit/recipes/{name.removeprefix('drafter-')}.yaml"]
    script_args, training = cli.parse_args(command)
    assert Path(script_args.drafter).name == Path(recorded["init"]).name  # the kit was in examples/tiny_kit
    assert [Path(f).name for f in script_args.train_data] == [Path(f).name for f in recorded["data"].split(",")]
    assert all((REPO_ROOT / f).is_file() for f in script_args.train_data)
    assert script_args.card_target_name == "tiny-code-target (examples/tiny_kit/target)"
    assert script_args.target_layer_ids is None and args.target_layers == recorded.get("target_layers")
    assert (training.objective, training.max_steps, training.learning_rate) == (
        recorded["objective"],
        recorded["max_steps"],
        recorded["learning_rate"],
    )
    assert (training.per_device_train_batch_size, training.anchors_per_sequence, training.tree_budget) == (
        recorded["batch_size"],
        recorded["anchors"],
        recorded["tree_budget"],
    )
    assert training.tree_weight == (0.0 if recorded["objective"] == "dflash" else recorded["tree_weight"])
    # the recorded tree objectives ran before hf_tev 0.1.0: CE decayed, tree loss over its weight sum, every anchor
    before_0_1_0 = (True, "weight_sum", "all") if recorded["objective"] != "dflash" else (None, "nodes", "full_horizon")
    assert (training.ce_decay, training.tree_normalization, training.tree_anchors) == before_0_1_0
    assert training.ce_weight == 1.0 and training.gamma == 7.0 and training.tree_context_window is None
    assert training.warmup_steps == min(100, recorded["max_steps"] // 10) and training.weight_decay == 0.0
    assert training.lr_scheduler_type == "cosine" and training.logging_steps == 20 and training.seed == 0
    assert training.use_cpu and training.report_to == [] and training.save_strategy == "no"
    assert script_args.threads == recorded["threads"]
    # --init names the drafter to start from and other arguments override the recipe, after it
    args, overrides = script.parse_args(["exittrain", "--init", "drafter-dflash-l135", "--ce_decay", "false"])
    command = script.train_command(args.recipe, script.paths.model_path(args.init), overrides)
    assert command[1:] == ["--drafter", "tiny_kit/hf_tev_tiny_kit/drafter-dflash-l135", "--ce_decay", "false"]
    script_args, training = cli.parse_args(command)
    assert script_args.drafter == "tiny_kit/hf_tev_tiny_kit/drafter-dflash-l135" and training.ce_decay is False


def test_the_kit_script_widens_and_trains_through_the_command(tmp_path):
    out = tmp_path / "drafter"
    torch.set_num_threads(1)
    kit_script().main(  # the dflash-l135 stage (widened to layers 1, 3, 5), from drafter-dflash, for one short step
        ["dflash-l135", "--init", str(kit_path("drafter-dflash")), "--output_dir", str(out), "--max_steps", "1"]
        + ["--max_train_rows", "2", "--per_device_train_batch_size", "2", "--anchors_per_sequence", "4"]
    )
    trained = DFlashDraftModel.from_pretrained(out)
    assert trained.config.target_layer_ids == [1, 3, 5]
    log = json.loads((out / "trainlog.json").read_text())
    assert log["rows"] == 2 and log["seconds"] > 0 and log["args"]["target_layers"] == "1,3,5"
    assert log["command"].startswith("hf-tev train research/tiny_kit/recipes/dflash-l135.yaml --drafter ")
    assert "drafter-dflash-widened" in log["command"]
    assert not (out / "training_args.bin").exists()
    assert "tiny-code-target (examples/tiny_kit/target)" in (out / "README.md").read_text()


def test_a_second_run_into_a_held_output_dir_is_refused_before_any_model_loads(tmp_path, monkeypatch, capsys):
    """One run at a time owns an output folder (and its `_data/train.jsonl`): a run finding the folder's lock taken
    stops at once, naming the folder, and appends nothing to the rows file of the run that holds it."""
    from filelock import FileLock

    monkeypatch.setattr(cli, "load_training_models", lambda *a, **k: pytest.fail("a model was loaded"))
    out = tmp_path / "drafter"
    out.mkdir()
    flags = ["--target", str(kit_path("target")), "--prompts", str(KIT_PROMPTS), "--output_dir", str(out)]
    with FileLock(str(out / "_hf_tev_train.lock"), timeout=0):  # the other run
        with pytest.raises(SystemExit) as exit_info:
            cli.main([*flags, "--use_cpu", "--report_to", "none"])
        error = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and error.count("\n") == 0
        assert f"--output_dir {out}: another hf-tev train run holds this folder" in error
        with pytest.raises(ValueError, match="another hf-tev train run holds"):  # run() too, for Python callers
            cli.run(*cli.parse_args([*flags, "--use_cpu", "--report_to", "none"]))
    assert not (out / "_data").exists()


def test_a_fresh_drafter_gets_the_draft_vocabulary_of_its_rows(tmp_path):
    """`--draft_vocab_size N`: the fresh drafter scores the N tokens the target writes most often in the training
    rows (and its EOS), trains on them and is saved with them; a checkpoint's own vocabulary of another size is
    refused by name."""
    from hf_tev.training import draft_vocab_from_rows
    from hf_tev.training.inputs import read_rows

    out = tmp_path / "drafter"
    flags = ["--target", str(kit_path("target")), "--train_data", str(KIT_ROWS), "--max_train_rows", "4"]
    flags += ["--objective", "dflash", "--draft_vocab_size", "64", "--output_dir", str(out)]
    cli.main([*flags, *small_run_flags()])
    trained = DFlashDraftModel.from_pretrained(out)
    target_config = json.loads((kit_path("target") / "config.json").read_text())
    expected = draft_vocab_from_rows(
        read_rows([str(KIT_ROWS)])[:4], 64, target_config["vocab_size"], always=[target_config["eos_token_id"]]
    )
    assert trained.config.draft_vocab_size == 64 and trained.draft_vocab.tolist() == expected.tolist()
    again = ["--drafter", str(out), *flags[2:-1], str(tmp_path / "again"), "--draft_vocab_size", "32"]
    with pytest.raises(ValueError, match=f"--draft_vocab_size 32: the drafter {out} already scores .* 64 tokens"):
        cli.run(*cli.parse_args(["--target", str(kit_path("target")), *again, *small_run_flags()]))


def test_a_draft_vocabulary_larger_than_the_targets_is_refused_before_the_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "load_data", lambda *a, **k: pytest.fail("the rows were read"))
    flags = ["--target", str(kit_path("target")), "--train_data", str(KIT_ROWS), "--draft_vocab_size", "999999"]
    with pytest.raises(ValueError, match="--draft_vocab_size 999999 is larger than the target's vocabulary"):
        cli.run(*cli.parse_args([*flags, "--output_dir", str(tmp_path / "out"), *small_run_flags()]))
