"""A drafter hf_tev saves has every `config.json` field vLLM's and SGLang's DFlash loaders read (docs/serving.md),
with values they accept, and the weight names they map; saved by `save_pretrained` and by the trainer.

What each loader reads, from their sources (read, not copied):
- vLLM: the architecture `DFlashDraftModel` in its model registry (-> `DFlashQwen3ForCausalLM`,
  `vllm/model_executor/models/qwen3_dflash.py`), which reads the Qwen3 fields below, `layer_types`,
  `dflash_config.mask_token_id`, and `dflash_config.target_layer_ids` (`get_eagle3_aux_layers_from_config`,
  `vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`); its weights mapper stacks `q/k/v_proj` and
  `gate/up_proj` of `layers.N`, beside `fc`, `hidden_norm`, `norm`.
- SGLang: `parse_dflash_draft_config` (`python/sglang/srt/speculative/dflash_utils.py`) reads `block_size`,
  `num_target_layers`, `target_layer_ids`, `mask_token_id` from `dflash_config` or the top level, and
  `DFlashDraftModel` (`python/sglang/srt/models/dflash.py`) the Qwen3 fields, with `hidden_act == "silu"` only.
"""

import json

import pytest
import torch
from helpers import make_target, training_args, training_rows
from safetensors import safe_open

from hf_tev import DFlashDraftModel
from hf_tev.training import ExitTrainer

# Qwen3 fields both loaders read from the top level of config.json, with the type they need
QWEN3_FIELDS = {
    "hidden_size": int,
    "num_hidden_layers": int,
    "num_attention_heads": int,
    "num_key_value_heads": int,
    "head_dim": int,
    "intermediate_size": int,
    "hidden_act": str,
    "rms_norm_eps": float,
    "max_position_embeddings": int,
    "vocab_size": int,
    "attention_bias": bool,
    "rope_theta": float,  # SGLang's get_rope_config; vLLM reads rope_parameters, transformers 5 writes both
    "rope_parameters": dict,
    "layer_types": list,
}
WEIGHTS_PER_LAYER = {
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
}


def sglang_value(config: dict, name: str):
    """SGLang's lookup: `dflash_config[name]`, else the top-level field."""
    return config["dflash_config"].get(name, config.get(name))


def check_serving_layout(folder, target, drafter) -> None:
    config = json.loads((folder / "config.json").read_text())
    # 1. the architecture both engines dispatch on, read as a Qwen3 config
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    for name, kind in QWEN3_FIELDS.items():
        assert isinstance(config.get(name), kind), (name, config.get(name))
    assert config["hidden_act"] == "silu"  # SGLang's DFlash MLP takes silu only
    assert config["num_hidden_layers"] == len(config["layer_types"]) == drafter.config.num_hidden_layers
    assert set(config["layer_types"]) == {"full_attention"}  # served as trained (docs/serving.md, sliding layers)
    # 2. the DFlash fields, where each loader looks for them
    dflash = config["dflash_config"]
    layer_ids, mask = dflash["target_layer_ids"], dflash["mask_token_id"]
    assert layer_ids == list(drafter.config.target_layer_ids) and all(type(i) is int for i in layer_ids)
    num_target_layers = sglang_value(config, "num_target_layers")
    assert num_target_layers == target.config.num_hidden_layers
    assert all(0 <= i < num_target_layers for i in layer_ids)  # SGLang's range check
    assert type(mask) is int and 0 <= mask < config["vocab_size"]
    assert sglang_value(config, "block_size") == drafter.config.block_size >= 2  # vLLM: num_speculative_tokens + 1
    # 3. the width vLLM sizes `fc` with: target hidden size (no target_hidden_size field) x the layers read
    assert config.get("target_hidden_size", config["hidden_size"]) == target.config.hidden_size
    # 4. the weights: the names both loaders map, no embedding table or LM head of its own
    with safe_open(folder / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
        fc_shape = weights.get_slice("fc.weight").get_shape()
    expected = {f"layers.{n}.{w}" for n in range(config["num_hidden_layers"]) for w in WEIGHTS_PER_LAYER}
    assert names == expected | {"fc.weight", "hidden_norm.weight", "norm.weight"}, names ^ expected
    assert fc_shape == [config["hidden_size"], len(layer_ids) * config["hidden_size"]]


@pytest.mark.parametrize("num_layers", [1, 2])
def test_a_saved_drafter_has_every_field_vllm_and_sglang_read(tmp_path, num_layers):
    target = make_target("qwen3")
    torch.manual_seed(0)
    drafter = DFlashDraftModel.from_target(target, num_layers=num_layers, block_size=8)
    drafter.save_pretrained(tmp_path / "drafter")
    check_serving_layout(tmp_path / "drafter", target, drafter)


def test_a_trained_drafter_saved_by_the_trainer_keeps_the_layout(tmp_path):
    target = make_target("qwen3")
    torch.manual_seed(0)
    drafter = DFlashDraftModel.from_target(target, num_layers=1, block_size=4, target_layer_ids=[0, 2])
    trainer = ExitTrainer(
        model=drafter, target_model=target, args=training_args(tmp_path), train_dataset=training_rows(4)
    )
    trainer.train()
    trainer.save_model(str(tmp_path / "trained"))
    check_serving_layout(tmp_path / "trained", target, drafter)


def test_the_check_fails_on_a_layout_an_engine_would_not_load(tmp_path):
    target = make_target("qwen3")
    drafter = DFlashDraftModel.from_target(target, num_layers=1, block_size=8)
    drafter.save_pretrained(tmp_path / "drafter")
    path = tmp_path / "drafter" / "config.json"
    config = json.loads(path.read_text())
    del config["dflash_config"]["mask_token_id"]  # what an older layout without dflash_config would lack
    path.write_text(json.dumps(config))
    with pytest.raises(KeyError, match="mask_token_id"):
        check_serving_layout(tmp_path / "drafter", target, drafter)
