"""What transformers' own callable route drops on its way to the decoder, recovered or refused by name.

`generate(..., custom_generate=hf_tev.tree_speculative_decode)` goes through hf_tev's route while it is enabled
(`hf_tev.route.routed_generate` binds what transformers drops). Without the route (`hf_tev.disable()`, or a
wrapper of `generate` that hides it) the call is transformers' plain hook, and transformers 5.24 hands a callable
`custom_generate` only the keyword arguments its signature adds to `_sample`'s: `assistant_model`, `streamer`,
`synced_gpus` and the negative prompts (arguments of `generate` itself), `tokenizer` and `assistant_tokenizer`
never reach it, and a call would decode without the drafter or the streamer without a word.

The generate call that called the decoder still holds its own arguments, so they are read from its frame
(`generate_arguments`): `assistant_model` is the drafter, `streamer` streams, and what the route refuses
(`synced_gpus`, negative prompts) is refused here too. The tokenizer is gone for good (generate pops it before the
callable's arguments are picked), so `stop_strings` and `token_healing`, which need it, are refused by name; the
decoder's signature takes them, so that generate does not act on them (or fail on them) first. `assistant_tokenizer`
is lost the same way and cannot be seen.
"""

from __future__ import annotations

from .checks import refusal

GENERATE_MODULE = "transformers.generation.utils"
# generate's own arguments that the callable route drops (read from the calling generate's frame)
DROPPED_ARGUMENTS = (
    "assistant_model",
    "streamer",
    "synced_gpus",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
)
ROUTE_HINT = "or use hf_tev's generate route (`hf_tev.enable()`, then `generate(..., assistant_model=drafter)`)"


def generate_arguments(frame) -> dict:
    """The `DROPPED_ARGUMENTS` of the transformers `generate` call whose frame is `frame` (the decoder's caller);
    empty when the decoder was called otherwise (directly, or by other code)."""
    if frame is None or frame.f_code.co_name != "generate" or frame.f_globals.get("__name__") != GENERATE_MODULE:
        return {}
    local = frame.f_locals
    return {name: local.get(name) for name in DROPPED_ARGUMENTS}


def recovered_arguments(frame, generation_config, drafter, streamer, tev_config, stop_strings, token_healing):
    """`(drafter, streamer, tev_config)` of a decoder call made by transformers' callable route (`frame`: the
    calling generate's): the drafter passed as `assistant_model=` (or `drafter=`, not both), the streamer, and the
    generation config's `tev_config` when the call passes none. Raises, naming the option, for what cannot work
    there (`stop_strings`, `token_healing`: the tokenizer is dropped) and what the route refuses too."""
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
    given = generate_arguments(frame)
    if given.get("synced_gpus"):
        raise refusal("synced_gpus", True, "multi-GPU lockstep decoding (DeepSpeed ZeRO-3 / FSDP)")
    for name in ("negative_prompt_ids", "negative_prompt_attention_mask"):
        if given.get(name) is not None:
            raise refusal(name, given[name], "classifier-free guidance")
    assistant = given.get("assistant_model")
    if assistant is not None and drafter is not None:
        raise ValueError("Pass the DFlash drafter once: `assistant_model=` or `drafter=`, not both.")
    if tev_config is None:
        tev_config = getattr(generation_config, "tev_config", None)
    return (
        drafter if drafter is not None else assistant,
        streamer if streamer is not None else given.get("streamer"),
        tev_config,
    )
