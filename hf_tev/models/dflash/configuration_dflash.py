"""Configuration of DFlash block-diffusion drafters, in the layout the published checkpoints use.

A published DFlash drafter (e.g. `z-lab/Qwen3-8B-DFlash-b16`) ships a Qwen3-style `config.json`
(`model_type: "qwen3"`, `architectures: ["DFlashDraftModel"]`) with three additions (docs/design.md#the-dflash-drafter):
top-level `block_size` and `num_target_layers`, and a `dflash_config` dict holding `target_layer_ids` and
`mask_token_id` (newer checkpoints also put `block_size` there). `DFlashConfig` reads every place these
can live, exposes them as plain attributes (`config.block_size`, `config.mask_token_id`,
`config.target_layer_ids`, which is also what transformers' native `speculation_type="dflash"` path reads),
and writes the published layout back, including the legacy rope fields transformers 4.x reads
(`rope_theta`, and `rope_scaling` for a rope that is not the default one), so saved drafters stay loadable by the
publishers' code and reload in transformers 5 without a deprecation warning.

Sliding-window draft layers (`layer_types` listing `"sliding_attention"`, with `sliding_window`) attend as
transformers' own DFlash drafter's do: a block row sees a context row or another block row only when their
positions are at most `sliding_window` apart (docs/usage.md#drafters). Newer DFlash variants add more
fields (logit soft-capping, convolution and selector modules, ...). What this implementation does not compute is
refused with an error naming the field, never loaded silently wrong.
"""

from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import Qwen3Config

# Keys of `dflash_config` this implementation understands.
DFLASH_KEYS = ("target_layer_ids", "mask_token_id", "block_size")

# Fields of newer DFlash variants (read from `dflash_config` or the top level by the publishers' code) that
# change the computation. Their neutral values are accepted; anything else is refused.
NEUTRAL_VARIANT_FIELDS: dict[str, tuple] = {
    "input_embedding_scale": (1, 1.0),
    "output_multiplier": (1, 1.0),
    "final_logit_softcapping": (None, 0, 0.0),  # inside dflash_config; the top-level field is the target's
    "is_causal": (None, False),
    "conv_kernel_size": (None,),
    "conv_group_size": (None,),
    "selector_rank": (None,),
    "selector_top_k": (None,),
    "projector_type": (None,),
}

# Extra (non-field) top-level keys that carry no computation: metadata and legacy spellings that
# transformers itself converts (`rope_theta` / `rope_scaling` -> `rope_parameters`, `torch_dtype` -> `dtype`).
BENIGN_EXTRA_KEYS = frozenset(
    {
        "auto_map",
        "transformers_version",
        "torch_dtype",
        "rope_theta",
        "rope_scaling",
        "name_or_path",
        "_name_or_path",
        "_commit_hash",
        "attn_implementation",
        "experts_implementation",
        "output_attentions",
        "num_labels",
        "model_type",
    }
)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The publishers' default choice of target layers (docs/design.md#the-dflash-drafter), used when a config has none.

    One draft layer reads the middle target layer; several read evenly spaced layers from 1 to T - 3.
    Python's `round` (half to even) is what the publishers' code uses, so it is used here too.
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def drafter_mlp_width(text_config, dense_width: int | None) -> int:
    """A fresh drafter's MLP width (`intermediate_size`): the target's dense `dense_width` when it has one, else,
    for a target whose every layer is a mixture of experts (Qwen3.5-MoE has no `intermediate_size`), the width of
    the expert MLPs a token runs through: `num_experts_per_tok * moe_intermediate_size +
    shared_expert_intermediate_size`."""
    if dense_width is not None:
        return dense_width
    expert = getattr(text_config, "moe_intermediate_size", None)
    if expert is None:
        raise ValueError(
            f"{type(text_config).__name__} has neither intermediate_size nor moe_intermediate_size: a fresh drafter "
            "cannot take its MLP width from this target"
        )
    routed = getattr(text_config, "num_experts_per_tok", None) or 1
    return routed * expert + (getattr(text_config, "shared_expert_intermediate_size", None) or 0)


@strict
class DFlashConfig(Qwen3Config):
    r"""
    Qwen3 configuration of a DFlash drafter, plus:

    block_size (`int`, defaults to 16):
        Length `L` of the drafted block `[root, MASK x (L - 1)]`; the drafter proposes `L - 1` tokens.
    num_target_layers (`int`, *optional*):
        Number of decoder layers of the target model the drafter was built for.
    mask_token_id (`int`, *optional*):
        Token of the target vocabulary whose embedding fills the masked block positions.
    target_layer_ids (`list[int]`, *optional*):
        Target layers whose outputs (hidden-state index `l + 1`) are concatenated as context features.
        Defaults to `default_target_layer_ids(num_target_layers, num_hidden_layers)`.
    dflash_config (`dict`, *optional*):
        The published nested form of `target_layer_ids` / `mask_token_id` (and, in newer checkpoints,
        `block_size`). Values found there take precedence over top-level ones, as in the publishers' code.
    draft_vocab_size (`int`, *optional*):
        The drafter scores only this many of the target's tokens, its draft vocabulary (the `d2t` / `t2d` buffers
        of its weights, as EAGLE-3 stores them: `hf_tev.models.dflash.vocabulary`). None: every token.
    final_logit_softcapping (`float`, *optional*):
        The target's final logit soft-capping (Gemma), as exports for such targets copy it. The drafter's
        marginals always get the target's own capping (`draft_logits`); a value here must equal it
        (`check_target`).

    Qwen3's `layer_types` may list `"sliding_attention"` draft layers, with `sliding_window`: their block rows see
    the rows at most `sliding_window` positions away (`use_sliding_window` is then set, so the window is kept).
    """

    block_size: int = 16
    num_target_layers: int | None = None
    mask_token_id: int | None = None
    target_layer_ids: list[int] | None = None
    dflash_config: dict | None = None
    draft_vocab_size: int | None = None
    final_logit_softcapping: float | None = None

    def __post_init__(self, **kwargs):
        _refuse_unsupported(self, kwargs)
        if self.layer_types and "sliding_attention" in self.layer_types and self.sliding_window is not None:
            self.use_sliding_window = True  # Qwen3's post-init drops the window of a config without it
        nested = dict(self.dflash_config or {})
        if "block_size" in nested:
            self.block_size = nested["block_size"]
        self.mask_token_id = nested.get("mask_token_id", self.mask_token_id)
        self.target_layer_ids = nested.get("target_layer_ids", self.target_layer_ids)
        if self.target_layer_ids is None and self.num_target_layers is not None:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        self.dflash_config = nested
        super().__post_init__(**kwargs)
        _check_values(self)

    def to_dict(self) -> dict[str, Any]:
        """Serialise in the published layout: DFlash fields inside `dflash_config`, legacy 4.x rope fields added."""
        output = super().to_dict()
        nested = dict(output.get("dflash_config") or {})
        nested["target_layer_ids"] = output.pop("target_layer_ids")
        nested["mask_token_id"] = output.pop("mask_token_id")
        if "block_size" in nested:  # keep it where the loaded checkpoint had it; always also at top level
            nested["block_size"] = output["block_size"]
        output["dflash_config"] = nested
        output.pop("rope_scaling", None)
        output.update(_legacy_rope_fields(output.get("rope_parameters")))
        return output


def _legacy_rope_fields(rope_parameters: dict | None) -> dict[str, Any]:
    """`rope_theta`, and `rope_scaling` for a rope that is not the default one: transformers 4.x (the publishers'
    code) reads them, not `rope_parameters`. A default rope writes no `rope_scaling` (4.x takes its absence as
    none): a `"rope_scaling": null` makes transformers 5 warn that `rope_scaling` is deprecated whenever a plain
    `PreTrainedConfig` reads the file, as `Trainer` does when it resumes from a checkpoint."""
    if not rope_parameters or "rope_theta" not in rope_parameters:
        return {}
    scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") == "default" and len(scaling) <= 1:
        return {"rope_theta": rope_parameters["rope_theta"]}
    return {"rope_theta": rope_parameters["rope_theta"], "rope_scaling": scaling}


def _refuse_unsupported(config: DFlashConfig, extra: dict[str, Any]) -> None:
    """Raise ValueError naming every field whose value this implementation does not compute."""

    def unsupported(items, understood, prefix=""):
        return [
            f"{prefix}{key}={value!r}"
            for key, value in items
            if key not in understood and value not in NEUTRAL_VARIANT_FIELDS.get(key, ())
        ]

    problems = unsupported((config.dflash_config or {}).items(), DFLASH_KEYS, "dflash_config.") + unsupported(
        extra.items(), BENIGN_EXTRA_KEYS
    )
    if problems:
        raise ValueError(
            "DFlash drafter config has fields hf_tev does not support (a DFlash variant this implementation "
            f"would compute wrongly): {', '.join(problems)}"
        )


def _check_values(config: DFlashConfig) -> None:
    """Values of known fields that hf_tev cannot honour (called after Qwen3's own normalisation)."""
    problems = []
    other = sorted(set(config.layer_types) - {"full_attention", "sliding_attention"})
    if other:
        problems.append(f"layer_types {other} are not supported (full_attention and sliding_attention are)")
    window = config.sliding_window
    if "sliding_attention" in config.layer_types and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        problems.append(f"sliding_attention layers need sliding_window, an int >= 1, got {window!r}")
    if not isinstance(config.block_size, int) or config.block_size < 2:
        problems.append(f"block_size={config.block_size!r} must be an int >= 2")
    size = config.draft_vocab_size
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= config.vocab_size):
        problems.append(f"draft_vocab_size={size!r} must be an int in [1, vocab_size={config.vocab_size}]")
    ids = config.target_layer_ids
    if ids is not None:
        if not ids or any(not isinstance(i, int) or i < 0 for i in ids):
            problems.append(f"target_layer_ids={ids!r} must be a non-empty list of layer indices >= 0")
        elif config.num_target_layers is not None and max(ids) >= config.num_target_layers:
            problems.append(f"target_layer_ids={ids} reach past num_target_layers={config.num_target_layers}")
    if problems:
        raise ValueError("Unsupported DFlash drafter config: " + "; ".join(problems))
