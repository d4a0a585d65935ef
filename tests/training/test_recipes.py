"""The example training recipes (`examples/recipes/`): the kit's runs as shipped (shortened by flags) and prints no
warning twice; the Qwen3-4B one parses into the settings it documents. The SmolLM2 Table 2 study's stage recipes
(`research/smollm2_table2/recipes/`), with what its runner adds, parse into the settings its README states. The tiny
kit's recipes (`research/tiny_kit/recipes/`) parse into exactly the settings the kit's earlier flag script gave its
recorded runs, and `opd_comparison.py`'s arms, built on one of them, into the settings they had. Plus: no pinned-memory
warning on a CPU."""

import dataclasses
import importlib
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from helpers import make_target, training_args, training_drafter, training_rows

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "examples" / "recipes"
TABLE2 = REPO / "research" / "smollm2_table2"
KIT = REPO / "research" / "tiny_kit"


def repeated_warnings(stderr: str) -> list[str]:
    """Warning lines (Python warnings and logged ones) that appear more than once."""
    lines = [line.strip() for line in stderr.splitlines() if "warn" in line.lower() or "deprecat" in line.lower()]
    return sorted({line for line in lines if lines.count(line) > 1})


@pytest.mark.slow
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


# The tiny kit's recorded runs: stage -> its trainlog, whose "args" are the flags of train_drafter.py at the time
KIT_RUNS = {
    "dflash-stage1": "tiny_kit/hf_tev_tiny_kit/drafter-dflash/trainlog_stage1.json",
    "dflash": "tiny_kit/hf_tev_tiny_kit/drafter-dflash/trainlog.json",
    "finetuned": "research/tiny_kit/drafters/drafter-finetuned/trainlog.json",
    "prefix": "research/tiny_kit/drafters/drafter-prefix/trainlog.json",
    "exittrain": "research/tiny_kit/drafters/drafter-exittrain/trainlog.json",
    "dflash-l135": "tiny_kit/hf_tev_tiny_kit/drafter-dflash-l135/trainlog.json",
}
# What the recorded prefix / exit runs had that their trainlogs do not list: hf_tev's objective before 0.1.0
BEFORE_0_1_0 = {"ce_decay": "yes", "tree_normalization": "weight_sum", "tree_anchors": "all"}


def kit_flag_argv(recorded: dict, files: list, drafter, out: str) -> list[str]:
    """The `hf-tev train` arguments the kit's train_drafter.py built from its flags before the recipes (its
    `train_command`, kept here as the reference) for the flag values `recorded`, with the rows files `files`, the
    drafter to start from `drafter` (None: a fresh one) and the output folder `out`."""
    flags = dict(ce_decay="auto", gamma=7.0, tree_normalization="nodes", tree_anchors="full_horizon")
    flags |= dict(tree_context_window=None, target_layers=None, max_rows=None) | recorded
    argv = ["--target", str(REPO / "tiny_kit/hf_tev_tiny_kit/target"), "--attn_implementation", "sdpa"]
    argv += ["--train_data", *map(str, files)]
    argv += ["--max_train_rows", str(flags["max_rows"])] if flags["max_rows"] else []
    if drafter is not None:
        argv += ["--drafter", str(drafter)]
    else:
        argv += ["--num_draft_layers", str(flags["num_layers"]), "--block_size", str(flags["block_size"])]
        argv += ["--target_layer_ids", *flags["target_layers"].split(",")] if flags["target_layers"] else []
    argv += [
        "--output_dir", out,
        "--objective", flags["objective"],
        "--tree_budget", str(flags["tree_budget"]),
        "--ce_weight", "1.0",
        "--tree_weight", str(flags["tree_weight"] if flags["objective"] != "dflash" else 0.0),
        "--anchors_per_sequence", str(flags["anchors"]),
        "--gamma", str(flags["gamma"]),
        "--tree_normalization", flags["tree_normalization"],
        "--tree_anchors", flags["tree_anchors"],
        "--learning_rate", str(flags["learning_rate"]),
        "--max_steps", str(flags["max_steps"]),
        "--per_device_train_batch_size", str(flags["batch_size"]),
        "--warmup_steps", str(min(100, flags["max_steps"] // 10)),
        "--lr_scheduler_type", "cosine",
        "--weight_decay", "0.0",
        "--logging_steps", "20",
        "--save_strategy", "no",
        "--report_to", "none",
        "--use_cpu",
        "--dataloader_num_workers", "0",
        "--seed", str(flags["seed"]),
        "--disable_tqdm", "true",
        "--threads", str(flags["threads"]),
        "--card_target_name", "tiny-code-target (examples/tiny_kit/target)",
        "--dataset_description",
        "Training-split prompts of the tiny kit's Python corpus with continuations written by the target "
        "(`research/tiny_kit/generate_data.py`: sampled at T=1 in `train_generated.jsonl`, greedy in "
        "`train_generated_greedy.jsonl`), from " + ", ".join(f"`{Path(p).name}`" for p in files) + ".",
    ]  # fmt: skip
    if flags["ce_decay"] != "auto":
        argv += ["--ce_decay", "true" if flags["ce_decay"] == "yes" else "false"]
    if flags["tree_context_window"] is not None:
        argv += ["--tree_context_window", str(flags["tree_context_window"])]
    return argv


def settings(parsed) -> dict:
    """Every field of parsed `(script arguments, training arguments)`, the paths resolved from the repository root."""
    values = {}
    for arguments in parsed:
        for field in dataclasses.fields(arguments):
            value = getattr(arguments, field.name)
            if field.name in ("target", "drafter", "output_dir") and value is not None:
                value = (REPO / value).resolve()
            elif field.name == "train_data":
                value = [(REPO / path).resolve() for path in value]
            values[f"{type(arguments).__name__}.{field.name}"] = value
    return values


def test_the_tiny_kit_recipes_parse_into_the_settings_of_their_recorded_runs(monkeypatch):
    from hf_tev.training.cli import parse_args

    monkeypatch.syspath_prepend(str(KIT))  # the kit's scripts import their `paths` module
    monkeypatch.chdir(REPO)  # the runner runs hf-tev train from the repository root: the recipes' paths are from it
    runner = importlib.import_module("train_drafter")
    assert set(runner.STAGES) == set(KIT_RUNS) == {path.stem for path in (KIT / "recipes").glob("*.yaml")}
    for stage, trainlog in KIT_RUNS.items():
        recorded = json.loads((REPO / trainlog).read_text())["args"]
        if recorded["objective"] != "dflash":
            recorded |= BEFORE_0_1_0
        args, overrides = runner.parse_args([stage])
        command = runner.train_command(args.recipe, args.init, overrides)
        assert command == [f"research/tiny_kit/recipes/{stage}.yaml"]
        script, training = parse_args(command)
        assert training.output_dir == f"research/tiny_kit/build/drafter-{stage}"
        # The recorded files in today's places (the kit was in examples/tiny_kit; stage 1 was written to /tmp)
        files = [runner.paths.data_file(Path(path).name) for path in recorded["data"].split(",")]
        init = recorded["init"] and Path(recorded["init"]).name
        drafter = KIT / "build" / init if init == "drafter-dflash-stage1" else init and runner.paths.model_path(init)
        before = parse_args(kit_flag_argv(recorded, files, drafter, training.output_dir))
        assert settings((script, training)) == settings(before), stage
        # The widening a recipe cannot hold: the runner's, as recorded (the drafter read layer 3 only before)
        assert args.target_layers == recorded.get("target_layers")
    for stage in ("finetuned", "prefix", "exittrain"):  # Table 2: the arms differ in the objective and its tree term
        script, training = parse_args(runner.train_command(stage))
        assert (script.drafter, training.max_steps, training.learning_rate) == (
            "tiny_kit/hf_tev_tiny_kit/drafter-dflash",
            400,
            3e-4,
        )
    args, overrides = runner.parse_args(["exittrain", "--init", "drafter-dflash-l135", "--max_steps", "300"])
    script, training = parse_args(runner.train_command(args.recipe, runner.paths.model_path(args.init), overrides))
    assert (script.drafter, training.max_steps) == ("tiny_kit/hf_tev_tiny_kit/drafter-dflash-l135", 300)


def test_the_kit_opd_comparison_arms_keep_their_settings_on_the_recipe(monkeypatch, tmp_path):
    """opd_comparison.py's arms are the standard arm's recipe with the comparison's settings: what the earlier flag
    script gave them (the recorded arms: `ablation/opd*/trainlog_*.json`)."""
    from hf_tev.training.cli import parse_args

    monkeypatch.syspath_prepend(str(KIT))
    monkeypatch.chdir(REPO)
    comparison = importlib.import_module("opd_comparison")
    args = comparison.parse_args(["--work", str(tmp_path), "--steps", "80"])
    files = args.data.split(",")
    init = str(comparison.paths.model_path(args.init))
    for arm, (objective, _) in comparison.ARMS.items():
        parsed = parse_args(comparison.arm_command(arm, args, init))
        flags = dict(objective="exit" if objective == "opd" else objective, max_steps=80, learning_rate=3e-4)
        flags |= dict(batch_size=8, anchors=8, tree_budget=32, tree_weight=0.1, threads=1, seed=0)
        before = kit_flag_argv(flags, files, init, str(tmp_path / arm.replace("+", "_")))
        before[before.index("--logging_steps") + 1] = "1"
        if objective == "opd":
            before[before.index("--objective") + 1] = "opd"
            before += ["--opd_refresh_steps", "4", "--opd_rollout_temperature", "1.0"]
            before += ["--opd_rollout_max_new_tokens", "64"]
        assert settings(parsed) == settings(parse_args(before)), arm


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


DRAFTER_STUDY = REPO / "research" / "smollm2_drafter"


def test_the_smollm2_drafter_recipes_parse_into_the_settings_its_readme_states(monkeypatch):
    """SmolLM2's strong drafter: stage 1 trains a fresh 3-layer drafter, stages 2 and 3 train the shipped one on
    (warm restarts at a half and a third of the peak), the fine-tune arms start from it at the authors' ExitTrain
    values; every schedule keeps a floor of 10% (never annealed to 0), as the README's table says."""
    from hf_tev.training.cli import parse_args

    monkeypatch.chdir(REPO)  # train_drafter.py runs hf-tev train from the repository root
    shipped = "hf_tev/shipped_drafters/SmolLM2-135M-Instruct-DFlash"

    def parsed(recipe: Path):  # what train_drafter.py adds to the recipe
        return parse_args([str(recipe), "--target", "packaged-target", "--train_data", "rows.jsonl",
                           "--output_dir", "out", "--threads", "2"])  # fmt: skip

    recipes = sorted(DRAFTER_STUDY.glob("recipe*.yaml")) + sorted((DRAFTER_STUDY / "finetune").glob("*.yaml"))
    stages = {"recipe", "recipe_stage2", "recipe_stage3"}
    assert {path.stem for path in recipes} == stages | {"dflash", "exit", "exit_heavy", "prefix"}
    for path in recipes:
        script, args = parsed(path)
        assert (args.lr_scheduler_type, args.lr_scheduler_kwargs, args.warmup_steps) == (
            "cosine_with_min_lr",
            {"min_lr_rate": 0.1},
            0.04,
        ), path.name
        assert (args.gamma, args.per_device_train_batch_size, args.seed, args.max_length) == (4.0, 4, 0, 1280)
        assert script.drafter in (None, shipped), path.name
        assert script.drafter is None or (REPO / script.drafter / "config.json").is_file()
    stage1, stage1_args = parsed(DRAFTER_STUDY / "recipe.yaml")  # fresh: 3 layers, blocks of 8, 8k vocabulary
    assert (stage1.drafter, stage1.num_draft_layers, stage1.block_size, stage1.draft_vocab_size) == (None, 3, 8, 8192)
    assert stage1.target_layer_ids == [1, 14, 27]
    assert (stage1_args.learning_rate, stage1_args.num_train_epochs, stage1_args.anchors_per_sequence) == (6e-4, 4, 64)
    for stage, peak in (("recipe_stage2", 3e-4), ("recipe_stage3", 2e-4)):  # the shipped drafter, trained on
        later, later_args = parsed(DRAFTER_STUDY / f"{stage}.yaml")
        assert (later.drafter, later.draft_vocab_size) == (shipped, None), stage  # its layers and vocabulary are kept
        assert (later_args.objective, later_args.learning_rate, later_args.num_train_epochs) == ("dflash", peak, 2)
        assert later_args.anchors_per_sequence == stage1_args.anchors_per_sequence
    for arm in ("dflash", "exit", "exit_heavy", "prefix"):  # the authors' ExitTrain values: 1e-4, 32, 2 epochs
        script, args = parsed(DRAFTER_STUDY / "finetune" / f"{arm}.yaml")
        assert (args.learning_rate, args.anchors_per_sequence, args.num_train_epochs) == (1e-4, 32, 2), arm
        assert args.objective == ("dflash" if arm == "dflash" else "exit" if arm.startswith("exit") else "prefix")
