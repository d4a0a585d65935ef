"""`generate(..., custom_generate=hf_tev.tree_speculative_decode)`: the tree decoder as transformers' own hook.

While hf_tev's route is enabled, such a call goes through the route (`hf_tev.route.routed_generate`), which
resolves it before generate runs. Without the route (`hf_tev.disable()`, or a wrapper of `generate` that hides it)
transformers calls `tree_speculative_decode` itself, and 5.24 hands a callable `custom_generate` only the keyword
arguments its signature adds to `_sample`'s: `assistant_model`, `streamer`, `synced_gpus` and the negative prompts
(arguments of `generate` itself), `tokenizer` and `assistant_tokenizer` never reach it, and a call would decode
without the drafter or the streamer without a word.

The generate call that called the decoder still holds its own arguments, so they are read from its frame
(`calling_generate_arguments`), the one place hf_tev reads transformers' locals: with them the call is resolved as
the route resolves it (`hf_tev.generate_call.resolve_call`: `assistant_model` is the drafter, `streamer` streams,
`synced_gpus` and the negative prompts are refused by name). The tokenizer is gone for good (generate pops it before
the callable's arguments are picked), so `stop_strings` and `token_healing`, which need it, are refused by name; the
decoder's signature takes them, so that generate does not act on them (or fail on them) first. `assistant_tokenizer`
is lost the same way and cannot be seen.
"""

from __future__ import annotations

import sys

import torch

from ..config import TEVConfig
from ..generate_call import resolve_call
from .loop import decode_with_trees

GENERATE_MODULE = "transformers.generation.utils"
# generate's own arguments that its callable hook drops (read from the calling generate's frame)
DROPPED_ARGUMENTS = (
    "assistant_model",
    "streamer",
    "synced_gpus",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
)
ROUTE_HINT = "or use hf_tev's generate route (`hf_tev.enable()`, then `generate(..., assistant_model=drafter)`)"


def tree_speculative_decode(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    *,
    drafter=None,
    tev_config: TEVConfig | dict | None = None,
    streamer=None,
    tokenizer=None,
    stop_strings=None,
    token_healing=None,
    **model_kwargs,
):
    """The tree decoding loop as a transformers `custom_generate` callable:
    `generate(..., custom_generate=hf_tev.tree_speculative_decode, assistant_model=drafter)`.

    Called by transformers' own hook (without hf_tev's route), it resolves the call from its arguments, the
    generation config and what the calling generate held, and refuses by name what cannot work there
    (`stop_strings`, `token_healing`: the tokenizer is dropped; `tokenizer` is in the signature for the same reason:
    generate hands it on to no callable). Arguments and returns: `hf_tev.generation.decode_with_trees`.
    """
    refuse_without_tokenizer(stop_strings, token_healing)
    given = {**model_kwargs, **calling_generate_arguments(sys._getframe(1))}  # the caller: generate, on its hook
    for name, value in (("drafter", drafter), ("tev_config", tev_config), ("streamer", streamer)):
        if value is not None:  # passed to the decoder itself (a `functools.partial`, or `drafter=`): these win
            given[name] = value
    call = resolve_call(given, (generation_config,))
    return decode_with_trees(
        model, input_ids, logits_processor, stopping_criteria, generation_config, call=call, **model_kwargs
    )


tree_speculative_decode._hf_tev_decode = True  # the route recognises this entry in `custom_generate=`


def calling_generate_arguments(frame) -> dict:
    """The `DROPPED_ARGUMENTS` of the transformers `generate` call whose frame is `frame` (the decoder's caller);
    empty when the decoder was called otherwise (directly, or by other code)."""
    if frame is None or frame.f_code.co_name != "generate" or frame.f_globals.get("__name__") != GENERATE_MODULE:
        return {}
    local = frame.f_locals
    return {name: local.get(name) for name in DROPPED_ARGUMENTS if local.get(name) is not None}


def refuse_without_tokenizer(stop_strings, token_healing) -> None:
    """Refuse, naming the option, what needs the tokenizer transformers' callable hook drops before the decoder."""
    if stop_strings:
        raise ValueError(
            "`stop_strings` cannot be matched on transformers' callable `custom_generate` route, which drops "
            "`tokenizer=` before the decoder: pass `stopping_criteria=[StopStringCriteria(tokenizer, stop_strings)]` "
            f"instead, {ROUTE_HINT}, which matches stop strings itself."
        )
    if token_healing:
        raise ValueError(
            "`token_healing` needs the tokenizer, which transformers' callable `custom_generate` route drops before "
            f"the decoder: heal the prompt first (`model.heal_tokens(input_ids, tokenizer)`), {ROUTE_HINT}."
        )
