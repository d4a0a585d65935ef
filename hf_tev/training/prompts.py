"""Prompts as token ids (`encode_prompt`: strings, chat conversations or token-id lists) and the target's
special ids (`pad_token_id_of`, `eos_token_ids`), shared by the data generation and the trainer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def encode_prompt(prompt, tokenizer, apply_chat_template: bool) -> list[int]:
    """The token ids of one prompt: a chat conversation (the turns before the first assistant turn, always through
    the chat template), a token-id list, or a string (the tokenizer; one user turn with `apply_chat_template`)."""
    if is_conversation(prompt):
        if tokenizer is None:
            raise ValueError("chat prompts need a tokenizer with a chat template")
        turns = []
        for turn in prompt:
            if turn.get("role") == "assistant":
                break
            turns.append({"role": turn["role"], "content": turn["content"]})
        if not turns:
            raise ValueError("a chat prompt needs a turn before the first assistant turn")
        ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids)
    if not isinstance(prompt, str):
        ids = [int(token) for token in prompt]
        if not ids:
            raise ValueError("an empty prompt cannot be continued")
        return ids
    if tokenizer is None:
        raise ValueError("string prompts need a tokenizer (or pass token-id lists)")
    if apply_chat_template:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    else:
        ids = tokenizer(prompt)["input_ids"]
    return list(ids)


def pad_token_id_of(target, tokenizer) -> int:
    """The padding id: the tokenizer's, the target's generation config's or config's, else the smallest EOS id
    (else 0)."""
    for source in (tokenizer, getattr(target, "generation_config", None), target.config):
        pad = getattr(source, "pad_token_id", None)
        if pad is not None:
            return int(pad)
    eos = eos_token_ids(target, tokenizer)
    return min(eos) if eos else 0


def eos_token_ids(target, tokenizer, eos=None) -> set[int]:
    """The ids that end a response: `eos` when given, else the target's generation config's, else the
    tokenizer's."""
    if eos is None:
        eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(token) for token in eos}


def is_conversation(prompt) -> bool:
    """True for a chat conversation: a non-empty list of `{"role", "content"}` dicts."""
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str)
        and len(prompt) > 0
        and isinstance(prompt[0], Mapping)
        and "role" in prompt[0]
    )
