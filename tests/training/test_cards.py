"""Model cards the Hub indexes (docs/training.md#model-cards): parsed back with `huggingface_hub.ModelCard` for Hub
ids, local folders, the objectives and the card's datasets; no local path anywhere; uploads refused offline before
anything is written (a recording fake `HfApi`)."""

import json
from pathlib import Path

import pytest
from helpers import make_target, training_args, training_drafter
from huggingface_hub import ModelCard, constants
from huggingface_hub.errors import OfflineModeIsEnabled

import hf_tev.training.hub as hub
from hf_tev.models.dflash.modeling_dflash import DFlashDraftModel
from hf_tev.training import ExitTrainer, ExitTrainingArguments, render_model_card

EVAL_TAU = [{"split": "eval_dataset", "tau": 2.5, "budget": 32, "temperature": 0.0, "max_new_tokens": 8, "step": 3}]
ALL_KNOBS = {name: getattr(ExitTrainingArguments(output_dir="x"), name) for name in ExitTrainingArguments.knob_names}


def render(tmp_path, **kwargs) -> ModelCard:
    settings = dict(target_model_id="Qwen/Qwen3-4B", objective="exit", block_size=16, target_layer_ids=[1, 9, 17])
    card = render_model_card(**(settings | kwargs))
    path = tmp_path / "README.md"
    card.save(path)
    return ModelCard.load(path)  # parsed back from the file, as the Hub reads it


def model_index_dataset(card: ModelCard) -> tuple:
    (result,) = card.data.eval_results
    return result.dataset_type, result.dataset_name


def test_hub_ids_make_the_metadata(tmp_path):
    card = render(
        tmp_path,
        repo_id="me/tiny-drafter",
        init_from="z-lab/Qwen3-4B-DFlash-b16",
        datasets=["openai/openai_humaneval"],
        eval_tau=EVAL_TAU,
    )
    data = card.data
    assert data.base_model == ["Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16"]
    assert data.base_model_relation == "adapter"  # one of the Hub's relations: it runs on its target's weights
    assert data.library_name == "hf_tev" and data.pipeline_tag is None  # a drafter does not generate alone
    assert data.datasets == ["openai/openai_humaneval"]
    assert {"speculative-decoding", "dflash", "exit"} <= set(data.tags)
    assert data.model_name == "tiny-drafter" and card.text.lstrip().startswith("# tiny-drafter\n")
    assert model_index_dataset(card) == ("openai/openai_humaneval", "openai/openai_humaneval")
    assert "| initialised from | `z-lab/Qwen3-4B-DFlash-b16` |" in card.text
    assert 'DFlashDraftModel.from_pretrained("me/tiny-drafter")' in card.text
    # A target alone: one base model, the same relation; without --card_datasets the tau's dataset is custom.
    card = render(tmp_path, repo_id="me/tiny-drafter", eval_tau=EVAL_TAU)
    assert card.data.base_model == "Qwen/Qwen3-4B" and card.data.base_model_relation == "adapter"
    assert card.data.datasets is None and model_index_dataset(card) == ("custom", "held-out prompts")


def test_local_folders_never_appear_as_paths(tmp_path, monkeypatch):
    target, drafter = tmp_path / "models" / "tiny-target", tmp_path / "runs" / "drafter-dflash-l135"
    for folder in (target, drafter):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    out = tmp_path / "runs" / "out"
    described = f"4 prompts of `{tmp_path}/data/train.json` (split `train`), rows from {tmp_path}/data/rows.jsonl."
    card = render(
        tmp_path,
        target_model_id=str(target),
        init_from=str(drafter),
        repo_id=str(out),
        eval_tau=EVAL_TAU,
        dataset_description=described,
    )
    text = (tmp_path / "README.md").read_text()
    assert str(tmp_path) not in text and "/runs/" not in text and "/models/" not in text
    assert card.data.base_model is None and card.data.get("base_model_relation") is None
    assert "| initialised from | `drafter-dflash-l135` (a local model folder) |" in card.text
    assert "| target model | `tiny-target` (a local model folder) |" in card.text
    assert "Data: 4 prompts of `train.json` (split `train`), rows from rows.jsonl." in card.text
    # No Hub id: the title and model-index name follow the published drafters' naming, not the output folder.
    assert card.data.model_name == "tiny-target-DFlash-b16" and "# tiny-target-DFlash-b16\n" in card.text
    assert "# out\n" not in card.text and 'from_pretrained("path/to/tiny-target-DFlash-b16")' in card.text
    # A user-given name wins; a relative folder is named by its folder name too.
    monkeypatch.chdir(tmp_path)
    card = render(
        tmp_path, target_model_id="models/tiny-target", init_from="./runs/drafter-dflash-l135", model_name="mine"
    )
    assert card.data.model_name is None and "# mine\n" in card.text  # model-index only with results
    assert "`drafter-dflash-l135` (a local model folder)" in card.text and "./runs" not in card.text


def test_local_folders_named_by_the_hub_id_they_name(tmp_path):
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3-4B" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    copy = tmp_path / "copies" / "dflash"
    copy.mkdir(parents=True)
    (copy / "config.json").write_text(json.dumps({"_name_or_path": "z-lab/Qwen3-4B-DFlash-b16"}))
    card = render(tmp_path, target_model_id=str(snapshot), init_from=str(copy), repo_id="me/d")
    assert card.data.base_model == ["Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16"]
    assert "| target model | `Qwen/Qwen3-4B` |" in card.text and str(tmp_path) not in card.text
    assert 'AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-4B")' in card.text


@pytest.mark.parametrize(
    "objective, used, unused",
    [
        ("exit", ["tree_budget", "tree_weight", "ce_decay"], ["gamma", "opd_weight", "opd_refresh_steps"]),
        ("dflash", ["gamma", "ce_decay", "anchors_per_sequence"], ["tree_budget", "tree_weight", "opd_weight"]),
        ("opd", ["tree_budget", "opd_weight", "opd_refresh_steps"], ["tree_weight", "alpha", "tree_normalization"]),
    ],
)
def test_only_the_settings_the_objective_uses(tmp_path, objective, used, unused):
    card = render(tmp_path, objective=objective, knobs=ALL_KNOBS | {"objective": objective}, repo_id="me/d")
    assert "(unused)" not in card.text
    for name in used:
        assert f"| `{name}` |" in card.text, name
    for name in unused:
        assert f"| `{name}` |" not in card.text, name


def test_trainer_card_of_a_drafter_loaded_from_an_absolute_folder(tmp_path):
    target = make_target()
    initial = tmp_path / "kit" / "drafter-dflash-l135"
    training_drafter(target).save_pretrained(initial)
    drafter = DFlashDraftModel.from_pretrained(initial.absolute())
    trainer = ExitTrainer(model=drafter, target_model=target, args=training_args(tmp_path, objective="exit"))
    trainer.state.log_history = [{"eval_tau": 1.75, "eval_tau_cycles": 4, "step": 2}]
    # As `hf-tev train` without --hub_model_id calls it: the output folder as repo_id, the target as a folder.
    text = trainer.create_model_card(
        repo_id=trainer.args.output_dir, target_model_id=str(tmp_path / "target"), datasets=["openai/openai_humaneval"]
    )
    assert str(tmp_path) not in text and "(unused)" not in text
    card = ModelCard.load(Path(trainer.args.output_dir) / "README.md")
    assert "| initialised from | `drafter-dflash-l135` (a local model folder) |" in card.text
    assert card.data.model_name == "target-DFlash-b4" and card.data.pipeline_tag is None
    assert model_index_dataset(card) == ("openai/openai_humaneval", "openai/openai_humaneval")
    for name in ("gamma", "opd_weight"):  # ExitTrain without position decay: neither is read
        assert f"| `{name}` |" not in card.text


class RecordingHfApi:
    """Stands in for huggingface_hub.HfApi: records every call."""

    calls = []

    def __init__(self, **kwargs):
        RecordingHfApi.calls.append(("__init__", kwargs))

    def create_repo(self, repo_id, **kwargs):
        RecordingHfApi.calls.append(("create_repo", repo_id))
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def upload_folder(self, repo_id, folder_path, **kwargs):
        RecordingHfApi.calls.append(("upload_folder", repo_id))
        return "commit-url"


def test_hub_uploads_refuse_offline_before_anything(tmp_path, monkeypatch):
    RecordingHfApi.calls = []
    monkeypatch.setattr(hub, "HfApi", RecordingHfApi)
    folder = tmp_path / "drafter"
    folder.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        OfflineModeIsEnabled, match=r"Cannot push to the Hugging Face Hub: offline mode.*HF_HUB_OFFLINE"
    ):
        hub.hub_api()
    with pytest.raises(OfflineModeIsEnabled, match=r"Cannot upload drafter to me/d: offline mode is enabled"):
        hub.upload_folder(RecordingHfApi(), "me/d", folder)
    assert RecordingHfApi.calls == [("__init__", {})]  # the fake made by the test itself, never called
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert hub.upload_folder(hub.hub_api(), "me/d", folder) == "commit-url"
    assert RecordingHfApi.calls[-1] == ("upload_folder", "me/d")
