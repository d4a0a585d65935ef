"""One training row: its columns, its check (`row_tensors`: its token ids and the tokens it supervises, or a
ValueError that says what is wrong with it), its prompt (`row_prompt`), prompts as token ids (`encode_prompt`:
strings, chat conversations or token-id lists) and the target's padding / EOS ids.

`data` checks every row of a dataset with `row_tensors` before training, `features` every row it computes features
for.
"""

# Apart from `data` to break a cycle: `features` checks rows here, and `data` reads `features`' datasets.
from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch

# The dataset columns of training rows and batches (see `data.ExitDataCollator`).
INPUT_IDS = "input_ids"
LOSS_MASK = "loss_mask"
PROMPT_LENGTH = "prompt_length"
CONTEXT_FEATURES = "context_features"
# Batch only: 1 on real tokens, 0 on padding.
ATTENTION_MASK = "attention_mask"


def row_tensors(
    row: Mapping[str, Any], vocab_size: int | None = None, max_length: int | None = None, where: str = "a row"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The checked `(input_ids, supervised)` of one row, both `[n]` (`long`, `bool`), cut to `max_length`.

    Raises ValueError, naming the row by `where` (e.g. `"train_dataset row 7"`), when `input_ids` is missing,
    empty, text, floats or nested, holds an id < 0 or >= `vocab_size`, or when `loss_mask` / `prompt_length`
    are malformed (a `loss_mask` of another length or not 0/1, a `prompt_length` that is not an int >= 0).
    """
    if not isinstance(row, Mapping) or INPUT_IDS not in row:
        found = sorted(row) if isinstance(row, Mapping) else type(row).__name__
        raise ValueError(
            f"ExitTrainer rows need an '{INPUT_IDS}' column (token ids of target-generated "
            f"sequences), optionally '{PROMPT_LENGTH}' or '{LOSS_MASK}'; {where} has {found}"
        )
    ids = _token_ids(row[INPUT_IDS], where)
    if vocab_size is not None or ids.min() < 0:
        outside = (ids < 0) if vocab_size is None else (ids < 0) | (ids >= vocab_size)
        if outside.any():
            position = int(outside.nonzero()[0])
            vocabulary = "token ids are never negative" if vocab_size is None else f"ids 0..{vocab_size - 1}"
            raise ValueError(
                f"{where}: token id {int(ids[position])} at position {position} of '{INPUT_IDS}' is outside the "
                f"target's vocabulary ({vocabulary}); were the rows tokenized for another model?"
            )
    mask = torch.ones(len(ids), dtype=torch.bool)
    if row.get(LOSS_MASK) is not None:
        try:
            given = torch.as_tensor(row[LOSS_MASK])
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(f"{where}: '{LOSS_MASK}' must be a flat list of 0/1 ({error})") from None
        if given.dim() != 1 or len(given) != len(ids):
            raise ValueError(f"{where}: '{LOSS_MASK}' has {given.numel()} entries for {len(ids)} '{INPUT_IDS}'")
        if given.dtype != torch.bool and not ((given == 0) | (given == 1)).all():
            raise ValueError(f"{where}: '{LOSS_MASK}' must hold 0/1 or booleans, got {given.unique().tolist()[:5]}")
        mask &= given.bool()
    if row.get(PROMPT_LENGTH) is not None:
        mask[: _prompt_length(row[PROMPT_LENGTH], where)] = False
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return ids, mask


def _token_ids(value, where: str) -> torch.Tensor:
    if isinstance(value, (str, bytes)):
        raise ValueError(
            f"{where}: '{INPUT_IDS}' is text ({value[:40]!r}), not token ids; tokenize it (or turn prompts into "
            "rows with hf_tev.generate_training_data)"
        )
    try:
        ids = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"{where}: '{INPUT_IDS}' must be a flat list of int token ids ({error})") from None
    if ids.numel() == 0:
        raise ValueError(f"{where} has no tokens ('{INPUT_IDS}' is empty)")
    if ids.dim() != 1:
        raise ValueError(f"{where}: '{INPUT_IDS}' must be a flat list of token ids, got shape {tuple(ids.shape)}")
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise ValueError(
            f"{where}: '{INPUT_IDS}' must be int token ids, got {str(ids.dtype).removeprefix('torch.')} values "
            f"(first: {ids[0].item()!r}); they are not truncated silently"
        )
    return ids.long()


def _prompt_length(value, where: str) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(
            f"{where}: '{PROMPT_LENGTH}' must be an int >= 0 (prompt tokens, not supervised), got {value!r}"
        )
    return int(value)


def row_prompt(row: Mapping[str, Any], where: str = "a row") -> list[int]:
    """The prompt of a row: its tokens before the first supervised one (at least one token)."""
    ids, mask = row_tensors(row, where=where)
    first = int(mask.nonzero()[0]) if mask.any() else len(ids)
    return ids[: max(1, first)].tolist()


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
