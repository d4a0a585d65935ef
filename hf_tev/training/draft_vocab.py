"""A drafter's draft vocabulary from the target's own token frequencies (`hf_tev.models.dflash.vocabulary`): the
tokens the target writes most often in the training rows' responses, as EAGLE-3 and FR-Spec choose theirs."""

from collections.abc import Iterable, Mapping

import torch

from ..models.dflash.vocabulary import most_frequent_tokens
from .rows import row_tensors


def response_token_counts(rows: Iterable[Mapping], vocab_size: int) -> torch.Tensor:
    """How often each target id appears among the supervised (target-written) tokens of `rows` `[vocab_size]`."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for index, row in enumerate(rows):
        ids, supervised = row_tensors(row, vocab_size, where=f"row {index}")
        counts += torch.bincount(ids[supervised], minlength=vocab_size)
    return counts


def draft_vocab_from_rows(rows: Iterable[Mapping], size: int, vocab_size: int, always: Iterable[int] = ()):
    """The `size` target ids (ascending) a drafter trained on `rows` should score: `always` (the target's EOS ids,
    so a drafted answer can end) and the ones the target writes most often in them (`most_frequent_tokens`).
    Pass the result to `DFlashDraftModel.set_draft_vocab`."""
    return most_frequent_tokens(response_token_counts(rows, vocab_size), size, always)
