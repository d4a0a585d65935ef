"""transformers' auto classes on DFlash drafters: `AutoModel` builds `hf_tev.DFlashDraftModel` from a saved or
published drafter, every other auto class refuses it by name, and every other Qwen3 config loads as before."""

import json
import shutil
import sys

import pytest
import torch
from helpers import make_drafter, make_target, published_config, published_weights, run_command, write_checkpoint
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, Qwen3Config, Qwen3Model

from hf_tev import DFlashDraftModel


def same_weights(a, b) -> bool:
    ours, theirs = a.state_dict(), b.state_dict()
    return sorted(ours) == sorted(theirs) and all(torch.equal(ours[name], theirs[name]) for name in ours)


@pytest.fixture
def saved_drafter(tmp_path):
    drafter = make_drafter(make_target("qwen3"), num_layers=2)
    drafter.save_pretrained(tmp_path / "drafter")
    return tmp_path / "drafter", drafter


def test_auto_model_loads_a_saved_drafter_as_the_drafter(saved_drafter):
    folder, drafter = saved_drafter
    loaded = AutoModel.from_pretrained(folder)
    assert type(loaded) is DFlashDraftModel and same_weights(loaded, drafter)
    assert loaded.config.target_layer_ids == drafter.config.target_layer_ids
    assert loaded.config.mask_token_id == drafter.config.mask_token_id
    # from the config alone too (random weights, the drafter's shapes)
    built = AutoModel.from_config(AutoConfig.from_pretrained(folder))
    assert type(built) is DFlashDraftModel and {n: p.shape for n, p in built.named_parameters()} == {
        n: p.shape for n, p in drafter.named_parameters()
    }
    assert type(AutoModel.from_config(drafter.config)) is DFlashDraftModel


def test_auto_model_loads_a_published_checkpoint_with_hf_tev_code_even_with_trust_remote_code(tmp_path):
    config = published_config()
    assert config["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}  # the publishers' remote code
    folder = write_checkpoint(tmp_path / "published", config, published_weights(num_layers=2, num_features=2))
    expected = DFlashDraftModel.from_pretrained(folder)
    for trust in (None, True):  # no dflash.py in the folder: remote code would fail to load
        loaded = AutoModel.from_pretrained(folder, trust_remote_code=trust)
        assert type(loaded) is DFlashDraftModel and same_weights(loaded, expected)


def test_other_auto_classes_refuse_a_drafter_naming_the_class_to_use(saved_drafter):
    folder, _ = saved_drafter
    with pytest.raises(ValueError, match=r"DFlash drafter.*hf_tev\.DFlashDraftModel\.from_pretrained.*assistant_model"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_every_other_qwen3_config_loads_as_before(tmp_path):
    target = make_target("qwen3")
    target.save_pretrained(tmp_path / "target")
    loaded = AutoModel.from_pretrained(tmp_path / "target")
    assert type(loaded) is Qwen3Model and same_weights(loaded, target.model)
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "target")) is type(target)
    bare = Qwen3Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    assert bare.architectures is None and type(AutoModel.from_config(bare)) is Qwen3Model


RELOAD_FACTORY = "import importlib, transformers.models.auto.auto_factory as af; importlib.reload(af)"
IMPORT_ORDERS = {
    "hf_tev first": ["import hf_tev", "from transformers import AutoModel"],
    "transformers first": ["from transformers import AutoModel", "import hf_tev"],
    "transformers lazily first": ["import transformers", "import hf_tev", "from transformers import AutoModel"],
    "auto classes, hf_tev, a reload": ["from transformers import AutoModel", "import hf_tev", RELOAD_FACTORY],
    "hf_tev, auto classes, two reloads": [
        "import hf_tev", "from transformers import AutoModel", RELOAD_FACTORY, RELOAD_FACTORY,
    ],
    "hf_tev's modules reloaded too": [
        "from transformers import AutoModel", "import hf_tev", "import importlib, hf_tev.models.dflash.auto",
        "importlib.reload(hf_tev.import_hooks); importlib.reload(hf_tev.models.dflash.auto); importlib.reload(hf_tev)",
        RELOAD_FACTORY,
    ],
}  # fmt: skip


@pytest.mark.parametrize("order", IMPORT_ORDERS)
def test_auto_model_knows_drafters_in_every_import_order_and_after_reloads(saved_drafter, tmp_path, order):
    """In a fresh process: the saved drafter loads as hf_tev's class, also when `architectures` is one name as a
    string; a config whose architectures merely contain the name (a list or a string) is transformers' own."""
    folder, _ = saved_drafter
    as_string = tmp_path / "as_string"
    shutil.copytree(folder, as_string)
    config = json.loads((as_string / "config.json").read_text())
    (as_string / "config.json").write_text(json.dumps({**config, "architectures": "DFlashDraftModel"}))
    code = "\n".join(
        [
            *IMPORT_ORDERS[order],
            "from transformers import AutoModel, AutoModelForCausalLM, Qwen3Config",
            f"for folder in ({str(folder)!r}, {str(as_string)!r}):",
            "    model = AutoModel.from_pretrained(folder)",
            "    name = type(model).__module__ + '.' + type(model).__name__",
            "    assert name == 'hf_tev.models.dflash.modeling_dflash.DFlashDraftModel', (folder, name)",
            "dims = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,",
            "            num_attention_heads=2, num_key_value_heads=1, head_dim=16)",
            "for names in ('NotADFlashDraftModelAtAll', ['NotADFlashDraftModelAtAll'], 'Qwen3Model'):",
            "    config = Qwen3Config(**dims, architectures=names)",
            "    assert type(AutoModel.from_config(config)).__name__ == 'Qwen3Model', names",
            "    assert type(AutoModelForCausalLM.from_config(config)).__name__ == 'Qwen3ForCausalLM', names",
            "print('ok')",
        ]
    )
    assert run_command([sys.executable, "-c", code], tmp_path).stdout.strip().endswith("ok")


def test_a_transformers_without_the_hook_point_warns_once_naming_what_no_longer_works(tmp_path):
    code = "\n".join(
        [
            "import transformers.models.auto.auto_factory as af",
            "del af._get_model_class  # a transformers whose auto classes choose their model class elsewhere",
            "import hf_tev, hf_tev.models.dflash.auto",
            "hf_tev.models.dflash.auto.install(af)  # a second try (e.g. after a reload) warns no more",
            "assert not hasattr(af, '_get_model_class')",
        ]
    )
    stderr = run_command([sys.executable, "-c", code], tmp_path).stderr
    lines = [line for line in stderr.splitlines() if "_get_model_class" in line]
    assert len(lines) == 1, stderr
    assert "AutoModel cannot load DFlash drafters" in lines[0] and "DFlashDraftModel.from_pretrained" in lines[0]
