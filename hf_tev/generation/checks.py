"""What the decoder checks of a prepared call: the drafter, the inputs generate prepared, the models and the cache.

Every refusal names the argument and comes before any model call. The call's options were refused when it was
resolved (`hf_tev.generate_call`: one table, `REFUSED_OPTIONS`); the checks here read shapes and settings only.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import (
    DummyLayer,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionLayer,
    StaticCache,
)
from transformers.utils import logging

from ..config import TEVConfig, tree_memory_bytes
from ..models.dflash.native import drafter_sliding_window, native_drafter_problems
from ..target_layers import BufferLayer, TreeStateLayer, check_tree_layers, sliding_window, tree_state_bytes

logger = logging.get_logger(__name__)

TREE_ATTENTION = ("sdpa", "eager")  # implementations that take an arbitrary float 4D mask
TREE_MEMORY_WARNING_BYTES = 1 << 30  # a call whose largest tree takes more per cycle warns with the estimate


def is_unset(value) -> bool:
    return value is None or (isinstance(value, dict) and not value)


# the model kwargs the decoder takes (`use_cache` and `logits_to_keep` it chooses itself per forward)
MODEL_KWARGS = ("attention_mask", "position_ids", "cache", "use_cache", "logits_to_keep")
# what the decoder calls on a drafter (hf_tev's DFlashDraftModel, or the adapter of a native one, models.dflash.native)
DRAFTER_INTERFACE = ("draft_logits", "check_target", "target_hidden_indices", "context_features", "new_cache", "config")
# the modalities generate encodes before the decoder runs (`mm_encoder_outputs`), by the model's `get_<m>_features`
ENCODED_MODALITIES = ("image", "video")


def check_supported(model, drafter, input_ids, generation_config, tev_config: TEVConfig, model_kwargs) -> None:
    """Raise a clear error, naming the argument, for everything of the prepared call (the drafter, the inputs, the
    models, the cache) the tree decoder cannot do exactly as plain `generate` (the call's options were checked when
    it was resolved: `hf_tev.generate_call.resolve_call`); warn when the largest tree takes much memory. Reads
    shapes and settings only (no model call)."""
    check_drafter(drafter)
    check_text_prompt(model, model_kwargs.get("mm_encoder_outputs") or {})
    check_inputs(input_ids, model_kwargs)
    if input_ids.shape[0] > 1:
        check_batch_drafter(drafter)
    check_tree_layers(model)  # target layers that cannot branch in a tree pass, before their cache is looked at
    check_cache(model_kwargs.get("cache"), input_ids)
    check_pair(model, drafter, tev_config)
    warn_tree_memory(model, drafter, generation_config, tev_config, input_ids.shape[0])


def check_drafter(drafter) -> None:
    """A DFlash drafter with its weights loaded (none for tree lookup decoding, which `resolve_call` allowed): hf_tev's
    own, or one transformers' DFlash chain drives (`hf_tev.models.dflash.native.tree_drafter` made it hf_tev's
    interface before this check)."""
    if drafter is not None and not hasattr(drafter, "draft_logits"):
        raise TypeError(
            "`assistant_model` must be a DFlash drafter: hf_tev.DFlashDraftModel, or a drafter transformers' "
            "speculation_type='dflash' chain drives (such as MuseGlimmerAssistantModel); "
            f"{type(drafter).__name__} has no {', '.join(native_drafter_problems(drafter))}. "
            "Classic assistant models use transformers' assisted generation: drop `tev_config`."
        )
    lacking = [name for name in DRAFTER_INTERFACE if drafter is not None and not hasattr(drafter, name)]
    if lacking:
        raise TypeError(
            f"`assistant_model` ({type(drafter).__name__}) has `draft_logits` but is not a DFlash drafter: it lacks "
            f"{', '.join(lacking)} (what tree decoding calls on a drafter: {', '.join(DRAFTER_INTERFACE)}). Pass an "
            "hf_tev.DFlashDraftModel, or a drafter transformers' speculation_type='dflash' chain drives."
        )
    if drafter is not None and any(p.is_meta for p in drafter.parameters()):
        raise ValueError(
            "`assistant_model` (the DFlash drafter) is on the meta device (no weights loaded): load its weights "
            "first (DFlashDraftModel.from_pretrained, or from_target for a fresh drafter)."
        )


def encoder_inputs(model, modality: str) -> list[str]:
    """The `generate` arguments a multimodal model encodes as `modality` input (`pixel_values`, `image_grid_thw`,
    ...: the parameters of its `get_<modality>_features`); none for a text-only model."""
    encode = getattr(getattr(model, "base_model", None), f"get_{modality}_features", None)
    if encode is None or modality not in getattr(model, "input_modalities", ()):
        return []
    kinds = (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    return [p.name for p in inspect.signature(encode).parameters.values() if p.kind not in kinds]


def text_prompt_refusal(modality: str, names: list[str], encoded: bool = False) -> ValueError:
    given = ", ".join(f"`{name}`" for name in names)
    given += "; generate encoded it as `mm_encoder_outputs`" if encoded else ""
    return ValueError(
        f"hf_tev's tree decoding takes text prompts only, and this call passes {modality} input ({given}): decode "
        "it with plain generate (without the DFlash drafter or `tev_config`)."
    )


def check_text_prompt(model, encoded: dict) -> None:
    """Refuse the image or video input generate encoded before the decoder (`mm_encoder_outputs`), naming the
    arguments it came from; the route refuses them before generate (`refuse_encoded_inputs`)."""
    for modality in ENCODED_MODALITIES:
        if encoded.get(modality) is not None:
            raise text_prompt_refusal(modality, encoder_inputs(model, modality) or ["mm_encoder_outputs"], True)


def refuse_encoded_inputs(model, kwargs: dict) -> None:
    """Refuse, before generate runs the model's image or video encoder, a call that passes that input (raw, or
    encoded already as `mm_encoder_outputs`)."""
    check_text_prompt(model, kwargs.get("mm_encoder_outputs") or {})
    for modality in ENCODED_MODALITIES:
        given = [name for name in encoder_inputs(model, modality) if kwargs.get(name) is not None]
        if any(name.startswith(("pixel_values", "image_patches")) for name in given):
            raise text_prompt_refusal(modality, given)


def check_inputs(input_ids, model_kwargs) -> None:
    """Text `input_ids` with left-padding masks only, and no model input the decoder would not pass on
    (`inputs_embeds` is refused when the call is resolved)."""
    # generate sets `mm_encoder_outputs={}` (no pre-encoded images/audio) for a multimodal wrapper's text prompt
    unknown = sorted(k for k, v in model_kwargs.items() if not is_unset(v) and k not in MODEL_KWARGS)
    if unknown:
        raise ValueError(
            f"hf_tev's tree decoding does not pass {unknown} to the target's forward (it decodes text input_ids "
            "with attention_mask / position_ids / cache only)."
        )
    attention_mask = model_kwargs.get("attention_mask")
    check_prompt(input_ids, attention_mask, model_kwargs.get("position_ids"))
    if attention_mask is None:
        return
    if not bool(attention_mask.any()):
        raise ValueError("`attention_mask` masks the whole prompt: there is no token to decode from.")
    if not bool(attention_mask[:, -1].all()):
        rows = (~attention_mask[:, -1].bool()).nonzero()[:, 0].tolist()
        raise ValueError(
            f"`attention_mask` masks the last token of prompt row(s) {rows} (right padding or an empty "
            "prompt); tree decoding takes left-padded prompts whose last token is real "
            "(tokenizer(..., padding_side='left'))."
        )


def check_prompt(input_ids, attention_mask=None, position_ids=None) -> None:
    """Token ids `[R, n]` with, when given, an attention mask and position ids of the same shape. The route checks
    the caller's before generate runs: generate drops an all-ones mask before the decoder sees it."""
    if input_ids is None:
        return
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(
            f"The prompt (`inputs` / `input_ids`) must be a 2D tensor of token ids [batch, length] (one prompt: "
            f"`ids[None]`, or `tokenizer(..., return_tensors='pt').input_ids`), got {shape}"
        )
    for name, value in (("attention_mask", attention_mask), ("position_ids", position_ids)):
        if isinstance(value, torch.Tensor) and value.shape != input_ids.shape:
            raise ValueError(
                f"`{name}` of shape {tuple(value.shape)} does not match `input_ids` of shape "
                f"{tuple(input_ids.shape)}: hf_tev's tree decoding takes `{name}` for the whole sequence, one row "
                "per prompt."
            )


def check_cache(cache, input_ids) -> None:
    """A pre-filled cache to continue from: a full-attention DynamicCache that holds less than the sequence."""
    if cache is None or isinstance(cache, StaticCache):  # the static mode checks its own (generation/static.py)
        return
    # an empty sliding layer is made full-length; a dummy layer is one that reuses another's K/V (Gemma 4); the
    # linear-attention layers of a target check_tree_layers let through keep per-node states (TreeStateLayer)
    layer_classes = (
        DynamicLayer,
        BufferLayer,
        DynamicSlidingWindowLayer,
        DummyLayer,
        LinearAttentionLayer,
        TreeStateLayer,
    )
    if type(cache) is not DynamicCache or any(type(layer) not in layer_classes for layer in cache.layers):
        raise ValueError(
            f"hf_tev tree decoding supports a DynamicCache only, got {type(cache).__name__} "
            f"with layers {sorted({type(layer).__name__ for layer in cache.layers})} "
            "(static, quantized and hybrid-layer caches are not supported; sliding-window layers are kept "
            "at full length)."
        )
    if getattr(cache, "offloading", False):
        raise ValueError("hf_tev tree decoding does not support an offloaded cache (`cache_implementation`).")
    past = cache.get_seq_length()
    if past >= input_ids.shape[1]:
        raise ValueError(
            f"The cache already holds {past} tokens and `input_ids` has {input_ids.shape[1]}: to continue from "
            "a cache, pass the whole sequence (the cache holds all of it but at least the last token, like "
            "the cache generate returns)."
        )


def check_pair(model, drafter, tev_config: TEVConfig) -> None:
    """The drafter fits the target, and the target's attention takes a tree mask."""
    if drafter is not None:
        drafter.check_target(model)
    if drafter is not None and tev_config.block_size is not None and tev_config.block_size > drafter.config.block_size:
        raise ValueError(
            f"TEVConfig.block_size={tev_config.block_size} exceeds the drafter's block_size={drafter.config.block_size}"
        )
    attn = model.config._attn_implementation
    if attn not in TREE_ATTENTION:
        raise ValueError(
            f"The tree pass needs an attention implementation that takes an arbitrary 4D mask ({TREE_ATTENTION}); "
            f"this model uses {attn!r}. Call `model.set_attn_implementation('sdpa')` first."
        )


def warn_tree_memory(model, drafter, generation_config, tev_config: TEVConfig, rows: int = 1) -> None:
    """Warn, with the estimate, when a cycle's largest trees (one per prompt of the batch) take more than
    `TREE_MEMORY_WARNING_BYTES`. The probe of `budget="auto"` passes no more tokens per row than its largest tree
    (docs/auto_budget.md), so the estimate covers it too."""
    nodes = tev_config.largest_tree + 1
    if tev_config.tree == "chain" and drafter is not None and not tev_config.lookup:
        nodes = min(nodes, (tev_config.block_size or drafter.config.block_size))
    vocab = model.get_output_embeddings().weight.shape[0]
    estimate = rows * tree_memory_bytes(nodes, vocab, generation_config.max_length, model.dtype.itemsize)
    states = tree_state_bytes(model)  # a hybrid target's per-node linear-attention states (generation/hybrid.py)
    estimate += rows * nodes * states
    if estimate > TREE_MEMORY_WARNING_BYTES:
        trees = f"a tree of {nodes} nodes" if rows == 1 else f"a batch of {rows} trees of {nodes} nodes"
        per_node = f", and {states / 2**20:.1f} MiB of linear-attention states per node" if states else ""
        logger.warning_once(
            f"TEVConfig: {trees} takes about {estimate / 2**30:.1f} GiB per cycle ({rows} x {nodes} x {vocab} "
            f"logits in several copies, and {rows} x {nodes} x {generation_config.max_length + nodes} mask "
            f"entries{per_node}); lower `budget` (or `max_budget` for budget='auto'), or the batch, if that is too "
            "much."
        )


def check_batch(input_ids, generation_config, model_kwargs, streamer) -> None:
    """What a batch of prompts cannot ask for (one prompt can), each named before any model call."""
    batch, width = input_ids.shape
    cache = model_kwargs.get("cache")
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError(
            f"A batch of {batch} prompts cannot continue from a pre-filled cache with hf_tev tree decoding: "
            "pass the whole sequences without `cache`, or continue each prompt alone."
        )
    if streamer is not None:
        raise ValueError("A streamer takes one sequence; hf_tev tree decoding of a batch does not stream.")
    for name in ("output_scores", "output_logits"):
        if generation_config.return_dict_in_generate and getattr(generation_config, name, False):
            raise ValueError(
                f"`{name}=True` with a batch of {batch} prompts is not supported by hf_tev tree decoding (rows "
                "emit different numbers of tokens per cycle); decode the prompts one at a time for scores."
            )
    if width >= generation_config.max_length:
        mask = model_kwargs.get("attention_mask")
        lengths = [width] * batch if mask is None else mask.sum(dim=1).tolist()
        rows = [r for r, n in enumerate(lengths) if n >= generation_config.max_length] or list(range(batch))
        raise ValueError(
            f"Prompt row(s) {rows} are at least `max_length`={generation_config.max_length} tokens long (the "
            f"batch is {width} columns with its left padding): nothing can be generated; raise `max_length` "
            "or set `max_new_tokens`."
        )


def check_batch_drafter(drafter) -> None:
    """A batch's holed drafter-cache columns would shift each row's draft window, as for the target's layers."""
    window = None if drafter is None else drafter_sliding_window(drafter)
    if window is not None:
        raise ValueError(
            f"hf_tev tree decoding of a batch supports drafters whose layers attend to every row; this drafter has "
            f"sliding-window layers (window {window}): decode its prompts one at a time."
        )


def check_batch_target(model) -> None:
    """A batch's holed cache columns would shift each row's window: the windowed tree mask is one-prompt only."""
    layers = DynamicCache(config=model.config).layers
    kept_per_row = (DynamicLayer, LinearAttentionLayer)  # linear attention: a state per row (check_tree_layers)
    if sliding_window(model) is not None or any(type(layer) not in kept_per_row for layer in layers):
        raise ValueError(
            "hf_tev tree decoding of a batch supports full-attention models only; this model has sliding-window "
            f"attention (window {sliding_window(model)}; cache layers "
            f"{sorted({type(layer).__name__ for layer in layers})}): decode its prompts one at a time."
        )
