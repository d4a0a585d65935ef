"""`hf-tev train` before any model work: trl's option names as aliases (flags and config files, both spellings),
`--help` with this script's options and the ExitTrain knobs first, mistakes in the data files, the model folders
and a pickle-only target reported in one line naming the file (and line) or the folder, and the safetensors-only
target loading with its opt-out `--allow_pickle_target`."""

import json
import shutil

import pytest
import torch
from helpers import KIT_ROWS
from safetensors.torch import load_file

from hf_tev.models.dflash.modeling_dflash import DFlashDraftModel
from hf_tev.packaged import kit_path
from hf_tev.training import cli

# ---------------------------------------------------------------------------------------------
# Aliases and --help


ALIASES = {
    "drafter": ("--model_name_or_path", "--model-name-or-path", "--drafter"),
    "target": ("--teacher_model_name_or_path", "--teacher-model-name-or-path", "--target"),
    "prompts": ("--dataset_name", "--dataset-name", "--prompts"),
    "prompts_config": ("--dataset_config", "--dataset-config", "--prompts_config", "--prompts-config"),
    "prompts_split": ("--dataset_train_split", "--dataset-train-split", "--prompts_split", "--prompts-split"),
}


@pytest.mark.parametrize("name", sorted(ALIASES))
def test_trl_names_are_aliases_in_both_spellings(name, tmp_path):
    base = {"target": "t", "prompts": "p.jsonl"}
    for flag in ALIASES[name]:
        given = {**base, name: "value"}
        argv = [text for key, value in given.items() if key != name for text in (f"--{key}", value)]
        script, _ = cli.parse_args([*argv, flag, "value", "--output_dir", str(tmp_path)])
        assert getattr(script, name) == "value", flag


def test_a_config_file_may_use_the_trl_names(tmp_path):
    config = tmp_path / "recipe.yaml"
    config.write_text(
        "teacher_model_name_or_path: t\nmodel_name_or_path: d\ndataset_name: org/prompts\n"
        f"dataset-train-split: test\noutput_dir: {tmp_path}\n"
    )
    script, _ = cli.parse_args([str(config)])
    assert (script.target, script.drafter, script.prompts, script.prompts_split) == ("t", "d", "org/prompts", "test")
    script, _ = cli.parse_args([str(config), "--drafter", "flag-wins"])
    assert script.drafter == "flag-wins"
    config.write_text("target: t\nteacher_model_name_or_path: t2\nprompts: p\n")
    with pytest.raises(SystemExit):
        cli.parse_args([str(config)])


def test_help_lists_the_script_and_exittrain_options_before_the_trainer_ones():
    text = cli.build_parser().format_help()
    order = [text.index(heading) for heading in ("\nscript options:", "\nExitTrain options:", "\ntraining options:")]
    assert order == sorted(order)
    assert text.index("--target TARGET") < text.index("--objective") < text.index("--per_device_train_batch_size")
    assert text.index("--tree_budget") < text.index("--gradient_accumulation_steps")
    assert text.index("--model_name_or_path") < text.index("\nExitTrain options:")
    assert text.splitlines()[0].startswith("usage: hf-tev train [RECIPE.yaml") and len(text.splitlines()[0]) < 200


# ---------------------------------------------------------------------------------------------
# Mistakes in files and folders: one line on stderr, before any model is loaded


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if hf-tev train loads a model."""
    monkeypatch.setattr(cli, "load_training_models", lambda *a, **k: pytest.fail("a model was loaded"))


def one_line_error(capsys, argv) -> str:
    """Run `hf-tev train argv` (CPU, no reports); it must stop with status 2 and one line on stderr."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--use_cpu", "--report_to", "none"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and error.startswith("hf-tev train: error: "), error
    return error


def rows_argv(tmp_path, *files):
    return ["--target", str(kit_path("target")), "--train_data", *map(str, files), "--output_dir", str(tmp_path / "o")]


def test_an_empty_rows_file_is_named(tmp_path, capsys, no_model):
    empty = tmp_path / "rows.jsonl"
    empty.write_text("\n")
    error = one_line_error(capsys, rows_argv(tmp_path, empty))
    assert f"{empty} holds no rows (the file is empty)" in error and "eval_size" not in error
    (tmp_path / "rows.json").write_text("[]")
    assert "rows.json holds no rows" in one_line_error(capsys, rows_argv(tmp_path, KIT_ROWS, tmp_path / "rows.json"))


def test_a_broken_or_non_utf8_line_is_named_with_its_file_and_line(tmp_path, capsys, no_model):
    good = json.dumps({"input_ids": [5, 6, 7], "prompt_length": 1})
    rows = tmp_path / "rows.jsonl"
    rows.write_text(f"{good}\n\n{good}\n" + '{"input_ids": [5, 6\n' + f"{good}\n")
    error = one_line_error(capsys, rows_argv(tmp_path, KIT_ROWS, rows))
    assert f"{rows} line 4: not valid JSON" in error
    rows.write_bytes(f"{good}\n".encode() + b'{"input_ids": [5], "text": "caf\xe9"}\n')
    assert f"{rows} line 2: not UTF-8 text" in one_line_error(capsys, rows_argv(tmp_path, rows))
    rows.write_text(f"{good}\n[5, 6, 7]\n")
    assert f"{rows} line 2: a row must be a JSON object, got list" in one_line_error(capsys, rows_argv(tmp_path, rows))
    listed = tmp_path / "rows.json"
    listed.write_text(f"[\n{good},\n{good}\n")
    assert f"{listed} line 4 column 1: not valid JSON" in one_line_error(capsys, rows_argv(tmp_path, listed))
    missing = tmp_path / "missing.jsonl"
    assert f"rows file {missing} does not exist" in one_line_error(capsys, rows_argv(tmp_path, missing))


def test_a_folder_given_as_rows_is_named_a_folder(tmp_path, capsys, no_model):
    folder = tmp_path / "_data"
    folder.mkdir()
    (folder / "train.jsonl").write_text(json.dumps({"input_ids": [5, 6, 7], "prompt_length": 1}) + "\n")
    error = one_line_error(capsys, rows_argv(tmp_path, folder))
    assert f"rows file {folder} is a folder, not a file: give rows files, JSONL" in error
    assert "(it holds train.jsonl)" in error and "does not exist" not in error


def test_broken_prompt_and_config_files_are_named(tmp_path, capsys, no_model):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b}\n')
    argv = ["--target", str(kit_path("target")), "--output_dir", str(tmp_path / "o")]
    assert f"{prompts} line 2: not valid JSON" in one_line_error(capsys, [*argv, "--prompts", str(prompts)])
    missing = tmp_path / "nope.json"
    assert f"prompts file {missing} does not exist" in one_line_error(capsys, [*argv, "--prompts", str(missing)])
    config = tmp_path / "recipe.json"
    config.write_text('{"target": "t",\n "prompts": }')
    assert f"{config} line 2 column 13: not valid JSON" in one_line_error(capsys, [str(config)])
    config = tmp_path / "recipe.yaml"
    config.write_text("target: t\nprompts: [p\n")
    error = one_line_error(capsys, [str(config)])
    assert f"{config} line 3 column 1: not valid YAML (while parsing a flow sequence" in error
    assert "<unicode string>" not in error


@pytest.mark.parametrize("option", ["--target", "--drafter", "--teacher_model_name_or_path", "--model_name_or_path"])
def test_a_missing_model_folder_is_named(option, tmp_path, capsys, no_model):
    argv = ["--train_data", str(KIT_ROWS), "--output_dir", str(tmp_path / "o")]
    if option in ("--drafter", "--model_name_or_path"):
        argv += ["--target", str(kit_path("target"))]
    missing = tmp_path / "no-such-model"
    error = one_line_error(capsys, [*argv, option, str(missing)])
    shown = "--target" if "teacher" in option or option == "--target" else "--drafter"
    assert f"{shown} {missing}: the folder does not exist" in error and "Repo id" not in error
    assert "./relative/model: the folder does not exist" in one_line_error(capsys, [*argv, option, "./relative/model"])
    (tmp_path / "file").write_text("x")
    assert "is a file; give the model's folder" in one_line_error(capsys, [*argv, option, str(tmp_path / "file")])
    (tmp_path / "empty").mkdir()
    assert "has no config.json: not a saved model folder" in one_line_error(
        capsys, [*argv, option, str(tmp_path / "empty")]
    )


TWO_NAMES = [
    ("--drafter", "--model_name_or_path"),
    ("--model-name-or-path", "--drafter"),
    ("--target", "--teacher_model_name_or_path"),
    ("--dataset_name", "--prompts"),
    ("--prompts_split", "--dataset-train-split"),
]


@pytest.mark.parametrize("first, second", TWO_NAMES)
def test_an_argument_given_under_two_names_is_refused_naming_both(first, second, tmp_path, capsys, no_model):
    """argparse keeps the last of two aliases and drops the other without a word: hf-tev train refuses them."""
    given = {"--target": "t", "--prompts": "p.jsonl"}
    argv = [text for key, value in given.items() for text in (key, value) if key not in (first, second)]
    argv = [*argv, first, "a", second, "b", "--output_dir", str(tmp_path / "o")]
    error = one_line_error(capsys, argv)
    named = [name.replace("-", "_").lstrip("_") for name in (first, second)]
    assert f"--{named[0]} and --{named[1]} are two names of one argument" in error and "give it once" in error
    # one name given twice is argparse's usual last-wins
    script, _ = cli.parse_args([*argv[:-6], first, "a", first, "b", "--output_dir", str(tmp_path / "o")])
    assert "b" in (script.drafter, script.target, script.prompts, script.prompts_split)


def test_a_boolean_and_its_no_flag_given_together_are_refused(tmp_path, capsys, no_model):
    argv = ["--target", "t", "--prompts", "p.jsonl", "--output_dir", str(tmp_path / "o")]
    error = one_line_error(capsys, [*argv, "--dataloader_pin_memory", "true", "--no_dataloader_pin_memory"])
    assert "--dataloader_pin_memory and --no_dataloader_pin_memory are two names of one argument" in error


def test_an_abbreviated_alias_is_one_of_the_two_names(tmp_path, capsys, no_model):
    argv = ["--target", "t", "--prompts", "p.jsonl", "--model_name", "a", "--drafter", "b"]
    error = one_line_error(capsys, [*argv, "--output_dir", str(tmp_path / "o")])
    assert "--model_name_or_path and --drafter are two names of one argument (drafter)" in error


def test_a_model_passed_in_the_other_ones_place_is_named_as_such(tmp_path, capsys, no_model):
    target, drafter = str(kit_path("target")), str(kit_path("drafter-dflash"))
    argv = ["--train_data", str(KIT_ROWS), "--output_dir", str(tmp_path / "o")]
    for option in ("--model_name_or_path", "--drafter"):  # trl's habit: the name means the model trained
        error = one_line_error(capsys, [*argv, "--target", target, option, target])
        assert f"{target} is a causal LM (Qwen3ForCausalLM), not a DFlash drafter; pass it as --target" in error
    error = one_line_error(capsys, [*argv, "--target", drafter])
    assert f"--target {drafter} is a DFlash drafter, not a causal LM; pass it as --drafter" in error
    # the loader itself names a causal LM given as a drafter (a Hub id reaches it)
    with pytest.raises(ValueError, match=r"is a causal LM \(Qwen3ForCausalLM\), not a DFlash drafter.*as the target"):
        DFlashDraftModel.from_pretrained(target)


def test_a_hub_causal_lm_given_as_the_drafter_is_named_before_the_target_loads(tmp_path, monkeypatch):
    import transformers.utils

    configs = {"org/a-target": kit_path("target"), "org/a-drafter": kit_path("drafter-dflash")}
    fetched = []

    def cached_file(name, file, **kwargs):  # the Hub, as its cache answers: config.json only
        fetched.append((name, file))
        return str(configs[name] / file) if name in configs else None

    monkeypatch.setattr(transformers.utils, "cached_file", cached_file)
    argv = ["--train_data", str(KIT_ROWS), "--output_dir", str(tmp_path / "o"), "--use_cpu", "--report_to", "none"]
    script, args = cli.parse_args([*argv, "--target", "org/a-target", "--model_name_or_path", "org/a-target"])
    with pytest.raises(ValueError, match=r"org/a-target is a causal LM \(Qwen3ForCausalLM\).*pass it as --target"):
        cli.load_training_models(script, args)
    script, args = cli.parse_args([*argv, "--target", "org/a-drafter"])
    with pytest.raises(ValueError, match=r"--target org/a-drafter is a DFlash drafter, not a causal LM"):
        cli.load_training_models(script, args)
    assert {file for _, file in fetched} == {"config.json"}  # nothing but the configs was asked for


# ---------------------------------------------------------------------------------------------
# Targets load from safetensors only, unless --allow_pickle_target


@pytest.fixture(scope="module")
def pickle_target(tmp_path_factory):
    """The kit target's folder with its weights as `pytorch_model.bin` only."""
    folder = tmp_path_factory.mktemp("pickle_target")
    source = kit_path("target")
    for file in source.iterdir():
        if file.name != "model.safetensors":
            shutil.copy(file, folder / file.name)
    torch.save(load_file(source / "model.safetensors"), folder / "pytorch_model.bin")
    return folder


def test_a_pickle_only_target_is_refused_naming_the_folder_and_the_flag(pickle_target, tmp_path, capsys, no_model):
    argv = ["--target", str(pickle_target), "--train_data", str(KIT_ROWS), "--output_dir", str(tmp_path / "o")]
    error = one_line_error(capsys, argv)
    assert f"--target {pickle_target} holds only pickle weights (pytorch_model.bin)" in error
    assert "--allow_pickle_target" in error
    # A drafter never loads from pickle files (no opt-out).
    error = one_line_error(capsys, [*argv, "--allow_pickle_target", "--drafter", str(pickle_target)])
    assert f"--drafter {pickle_target} holds only pickle weights" in error and "safetensors only" in error


def test_the_loader_itself_is_safetensors_only_unless_allowed(pickle_target, tmp_path):
    argv = ["--target", str(pickle_target), "--train_data", str(KIT_ROWS), "--output_dir", str(tmp_path / "o")]
    script, args = cli.parse_args([*argv, "--use_cpu", "--report_to", "none", "--block_size", "4"])
    with pytest.raises(OSError, match=r"--target .*no file named model.safetensors.*--allow_pickle_target"):
        cli.load_training_models(script, args)  # what the check before it guards: transformers' safetensors-only load
    script, args = cli.parse_args([*argv, "--use_cpu", "--report_to", "none", "--allow_pickle_target"])
    cli.prepare(script, args)
    target, _, _ = cli.load_training_models(script, args)
    expected = load_file(kit_path("target") / "model.safetensors")
    assert all(torch.equal(target.state_dict()[name], value) for name, value in expected.items())
