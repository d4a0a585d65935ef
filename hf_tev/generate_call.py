"""One resolution of a tree-decoding `generate` call, shared by every way in.

There are three ways into the tree decoder: hf_tev's route (`hf_tev.route`: `import hf_tev`, then
`generate(..., assistant_model=drafter)`), one bound model (`hf_tev.bind`, which hands its calls to the route's
entry), and transformers' own `custom_generate=hf_tev.tree_speculative_decode` hook without the route
(`hf_tev.generation.custom_generate`). Each hands what its call was given to `resolve_call`, which reads the drafter,
the tree settings and the streamer, coerces the settings to a `TEVConfig` (once per call), and refuses, by name and
before any model call, what tree decoding cannot do. As transformers' `generate` resolves its generation config once
and hands the decoding method the result, the decoder then takes the resolved `TreeCall` and reads nothing again.

The refusals are data: `REFUSED_OPTIONS`, one table with one message per option (`refusal`), and
`NEEDS_A_DRAFTER`. Plain Python: importing this module imports neither torch nor transformers (the route, which
`import hf_tev` loads, reads options with `generate_option`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

NEEDS_A_DRAFTER = (
    "hf_tev's tree decoding needs a DFlash drafter (hf_tev.DFlashDraftModel) as `assistant_model=` (or `drafter=`, "
    "or bound with `hf_tev.bind(model, drafter)`), or `TEVConfig(lookup=True)` for tree lookup decoding without one."
)
DRAFTER_TWICE = "Pass the DFlash drafter once: `assistant_model=` or `drafter=`, not both."
ANOTHER_CUSTOM_GENERATE = "`tev_config` and `custom_generate` cannot be combined."


def is_set(value) -> bool:
    return value is not None


# generate options tree decoding refuses: (name, refused when, what the option asks for). Arguments of `generate` and
# `GenerationConfig` fields alike: `resolve_call` reads each as generate resolves it, before generate acts on it
# (it would build an offloaded or quantized cache, run classifier-free guidance's second prompt, or drop the option
# on its way to a callable `custom_generate`).
REFUSED_OPTIONS = (
    ("num_beams", lambda v: v not in (None, 1), "beam search (tree decoding keeps one sequence: num_beams=1)"),
    ("num_return_sequences", lambda v: v not in (None, 1), "several sequences per prompt (one only)"),
    ("constraints", is_set, "constrained beam search"),
    ("force_words_ids", is_set, "constrained beam search"),
    ("penalty_alpha", lambda v: v is not None and v > 0, "contrastive search"),
    ("dola_layers", is_set, "DoLa decoding"),
    ("guidance_scale", lambda v: v not in (None, 1), "classifier-free guidance (an unconditional forward per step)"),
    ("negative_prompt_ids", is_set, "classifier-free guidance"),
    ("negative_prompt_attention_mask", is_set, "classifier-free guidance"),
    ("use_mtp", bool, "multi-token-prediction self-speculation, another speculative method"),
    ("prompt_lookup_num_tokens", is_set, "prompt lookup decoding, another speculative method"),
    ("assistant_early_exit", is_set, "early-exit self-speculation, another speculative method"),
    ("speculation_type", is_set, "transformers' own speculative path (for its DFlash chain path drop `tev_config`)"),
    ("assistant_ensemble_weight", is_set, "ensemble verification, which is not lossless (hf_tev's verifiers are)"),
    ("assistant_tokenizer", is_set, "an assistant with another tokenizer (a DFlash drafter shares the target's)"),
    ("is_assistant", bool, "the model as another model's assistant"),
    ("synced_gpus", bool, "multi-GPU lockstep decoding (DeepSpeed ZeRO-3 / FSDP)"),
    ("inputs_embeds", is_set, "decoding from embeddings (the drafter reads the target's features of token ids)"),
    ("output_attentions", bool, "returned attentions (output_scores / output_logits are returned)"),
    ("output_hidden_states", bool, "returned hidden states (output_scores / output_logits are returned)"),
    ("cache_implementation", lambda v: v not in (None, "dynamic", "static"), "a cache other than dynamic or static"),
    (
        "watermarking_config",
        lambda v: "synthid" in type(v).__name__.lower() or (isinstance(v, dict) and "ngram_len" in v),
        "SynthID watermarking, whose processor keeps state across calls",
    ),
)


def refusal(name: str, value, what: str) -> ValueError:
    """The one error of refused option `name` (a row of `REFUSED_OPTIONS`), showing a plain value as given."""
    shown = repr(value) if isinstance(value, (str, int, float, bool)) else f"<{type(value).__name__}>"
    return ValueError(f"`{name}={shown}` asks for {what}, which hf_tev's tree decoding does not support.")


@dataclass(frozen=True)
class TreeCall:
    """A resolved tree-decoding call: what the decoder takes besides generate's own arguments."""

    drafter: Any  # the DFlash drafter as given (None: tree lookup decoding)
    tev_config: Any  # a validated `TEVConfig`; `lookup="auto"` is decided by the decoder (`TEVConfig.for_call`)
    streamer: Any = None


def generate_option(name: str, given: Mapping, configs: Sequence = ()):
    """The value of generate option `name` for a call, as generate resolves it: the argument given, else the first
    of `configs` (the passed generation config, then the model's) that sets it; None when unset everywhere."""
    if given.get(name) is not None:
        return given[name]
    for config in configs:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def resolve_call(given: Mapping, configs: Sequence = ()) -> TreeCall:
    """Read, coerce and check one tree-decoding call, before any model call.

    Args:
        given (`Mapping`): the call's arguments by name: generate's keyword arguments on the route; on transformers'
            own hook, the decoder's arguments and what the calling generate held (`custom_generate`).
        configs (`Sequence`): the generation configs an option `given` does not set is read from, in order.
    Returns:
        `TreeCall`: the drafter (`assistant_model=` or `drafter=`, not both), the `TEVConfig` (`tev_config=`, else
        the generation config's `tev_config`, else `TEVConfig()`), the streamer.
    Raises:
        `ValueError` / `TypeError` naming the argument: a second `custom_generate`, the drafter twice, a bad
        `tev_config`, no drafter without context drafts, any option of `REFUSED_OPTIONS`.
    """
    from .config import TEVConfig

    custom = given.get("custom_generate")
    if custom is not None and not getattr(custom, "_hf_tev_decode", False):
        raise ValueError(ANOTHER_CUSTOM_GENERATE)
    drafter, assistant = given.get("drafter"), given.get("assistant_model")
    if drafter is not None and assistant is not None:
        raise ValueError(DRAFTER_TWICE)
    drafter = assistant if drafter is None else drafter
    tev_config = generate_option("tev_config", given, configs)
    tev_config = TEVConfig() if tev_config is None else TEVConfig.coerce(tev_config)
    check_drafter_or_lookup(drafter, tev_config.lookup)
    for name, refused, what in REFUSED_OPTIONS:
        value = generate_option(name, given, configs)
        if refused(value):
            raise refusal(name, value, what)
    return TreeCall(drafter, tev_config, given.get("streamer"))


def check_drafter_or_lookup(drafter, lookup) -> None:
    """Something to draft with: a drafter, or context drafts (`lookup`: True, or "auto", which a call without a
    drafter decides to be on)."""
    if drafter is None and not lookup:
        raise ValueError(NEEDS_A_DRAFTER)
