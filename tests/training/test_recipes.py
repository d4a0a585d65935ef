"""The example training recipes (`examples/recipes/`): the kit's runs as shipped (shortened by flags) and prints no
warning twice; the Qwen3-4B one parses into the settings it documents. The SmolLM2 Table 2 study's stage recipes
(`research/smollm2_table2/recipes/`), with what its runner adds, parse into the settings its README states. Plus: no
pinned-memory warning on a CPU."""

import dataclasses
import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import torch
import yaml
from helpers import make_target, training_args, training_drafter, training_rows

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "examples" / "recipes"
TABLE2 = REPO / "research" / "smollm2_table2"


def repeated_warnings(stderr: str) -> list[str]:
    """Warning lines (Python warnings and logged ones) that appear more than once."""
    lines = [line.strip() for line in stderr.splitlines() if "warn" in line.lower() or "deprecat" in line.lower()]
    return sorted({line for line in lines if lines.count(line) > 1})


def test_the_kit_recipe_trains_as_shipped_and_prints_no_warning_twice(tmp_path):
    recipe = yaml.safe_load((RECIPES / "exit_kit.yaml").read_text())
    for key in ("target", "drafter"):
        assert (REPO / recipe[key] / "config.json").is_file(), key  # paths from the repository root
    assert all((REPO / path).is_file() for path in recipe["train_data"])
    shorter = ["--max_steps", "2", "--max_train_rows", "24", "--eval_size", "4", "--eval_tau_prompts", "1"]
    shorter += ["--eval_tau_max_new_tokens", "8", "--output_dir", str(tmp_path / "out"), "--threads", "1"]
    result = subprocess.run(
        [sys.executable, "-m", "hf_tev.train", "examples/recipes/exit_kit.yaml", *shorter],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "out" / "model.safetensors").is_file() and (tmp_path / "out" / "README.md").is_file()
    assert '"steps": 2' in result.stdout + result.stderr
    assert "pin_memory" not in result.stderr
    assert not repeated_warnings(result.stderr), repeated_warnings(result.stderr)


def test_the_qwen3_4b_recipe_parses_into_the_settings_it_documents():
    from hf_tev.training.cli import parse_args

    recipe = yaml.safe_load((RECIPES / "exit_qwen3_4b.yaml").read_text())
    script, args = parse_args([str(RECIPES / "exit_qwen3_4b.yaml"), "--bf16", "false"])  # bf16 needs a GPU here
    assert recipe["bf16"] is True
    assert (script.target, script.drafter, script.target_dtype) == (
        "Qwen/Qwen3-4B",
        "z-lab/Qwen3-4B-DFlash-b16",
        "bfloat16",
    )
    assert (script.prompts, script.prompts_split, script.apply_chat_template) == (
        "HuggingFaceH4/ultrachat_200k",
        "train_sft",
        True,
    )
    assert (args.objective, args.tree_budget, args.learning_rate, args.max_steps) == ("exit", 32, 1e-4, 2000)
    assert args.report_to == []  # "none"
    for key, value in recipe.items():  # every other key of the file reached the arguments as written
        if key not in ("bf16", "report_to"):
            got = getattr(script, key, getattr(args, key, None))
            assert str(getattr(got, "value", got)) == str(value), key


def test_the_smollm2_table2_stages_parse_into_the_settings_its_readme_states(tmp_path, monkeypatch):
    from hf_tev.training.cli import parse_args

    monkeypatch.syspath_prepend(str(TABLE2))  # the study's scripts import their shared `study` module
    monkeypatch.chdir(REPO)  # the runner runs hf-tev train from the repository root: the recipes' paths are from it
    runner = importlib.import_module("train_drafters")
    runs = tmp_path / "runs"
    (runs / "exit" / "checkpoint-25").mkdir(parents=True)  # a stopped exit stage
    parsed = {}
    for stage in ("init", "dflash", "exit"):
        args, overrides = runner.parse_args([stage, "--runs", str(runs)])
        command = runner.train_command(args, "packaged-target", overrides)
        assert command[0] == f"research/smollm2_table2/recipes/{stage}.yaml"
        parsed[stage] = parse_args(command)
    assert (REPO / "research/smollm2_table2/data/train.jsonl").is_file()
    for stage, (script, args) in parsed.items():  # what the runner adds, then the settings every stage shares
        assert (script.target, script.threads, args.output_dir) == ("packaged-target", 2, str(runs / stage))
        assert args.resume_from_checkpoint == ("last" if stage == "exit" else None)
        assert script.train_data == ["research/smollm2_table2/data/train.jsonl"]
        assert (args.per_device_train_batch_size, args.anchors_per_sequence, args.seed) == (8, 16, 0)
        assert (args.lr_scheduler_type, args.save_steps, args.use_cpu) == ("cosine", 25, True)
    init_script, init = parsed["init"]  # 300 steps at 1e-3 from a fresh 1-layer drafter, blocks of 8, cached features
    assert (init.objective, init.max_steps, init.learning_rate, init.warmup_steps) == ("dflash", 300, 1e-3, 30)
    assert (init_script.drafter, init_script.num_draft_layers, init_script.block_size) == (None, 1, 8)
    assert init_script.target_layer_ids == [1, 14, 27]
    assert (init_script.feature_cache, init_script.feature_cache_dtype) == (
        "research/smollm2_table2/cache/features",
        "float16",
    )
    for stage in ("dflash", "exit"):  # 100 steps at 3e-4 from init (the one of --runs), tree budget 32
        script, args = parsed[stage]
        assert script.drafter == str(runs / "init")
        assert (args.objective, args.max_steps, args.learning_rate, args.warmup_steps) == (stage, 100, 3e-4, 10)
        assert args.tree_budget == 32
    (dflash_script, dflash), (exit_script, exit_args) = parsed["dflash"], parsed["exit"]
    assert (dflash.tree_weight, exit_args.tree_weight) == (0.0, 0.1)
    assert (dflash_script.feature_cache, exit_script.feature_cache) == (init_script.feature_cache, None)
    differ = {
        field.name
        for ours, theirs in ((dflash_script, exit_script), (dflash, exit_args))
        for field in dataclasses.fields(ours)
        if getattr(ours, field.name) != getattr(theirs, field.name)
    }
    assert differ == {"objective", "tree_weight", "feature_cache", "output_dir", "resume_from_checkpoint"}
    args, _ = runner.parse_args(["exit"])  # the default runs/: the recipe's own drafter, its paths from the repo root
    script, args = parse_args(runner.train_command(args, "packaged-target"))
    assert (script.drafter, args.output_dir) == (
        "research/smollm2_table2/runs/init",
        "research/smollm2_table2/runs/exit",
    )


def test_no_pinned_memory_without_an_accelerator_and_no_warning_when_training_and_evaluating(tmp_path):
    from hf_tev.training import ExitTrainer

    args = training_args(tmp_path, eval_strategy="steps", eval_steps=1)
    assert args.dataloader_pin_memory is torch.accelerator.is_available()  # off where there is nothing to pin for
    target = make_target("qwen3")
    trainer = ExitTrainer(
        model=training_drafter(target),
        target_model=target,
        args=args,
        train_dataset=training_rows(4),
        eval_dataset=training_rows(2, seed=2),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert not [str(w.message) for w in caught if "pin_memory" in str(w.message)]
