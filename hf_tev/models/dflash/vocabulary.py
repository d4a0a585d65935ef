"""A drafter's reduced draft vocabulary (docs/usage.md#a-reduced-draft-vocabulary), as EAGLE-3 and FR-Spec have one.

A DFlash drafter scores its block rows with the target's LM head, so most of a small drafter's call is that head:
on SmolLM2-135M, 0.44 of a plain target step of the drafter's 0.50 is the 49,152-row head. A drafter with a draft
vocabulary scores only `draft_vocab_size` of the target's tokens (the most frequent ones in what the target
writes); every other token gets probability 0, so it is never drafted. Exactness does not depend on it: the
target verifies every drafted token in its full vocabulary, and a token the drafter cannot propose is simply
never proposed.

Stored as EAGLE-3 stores it, so the files read alike: two integer buffers in the drafter's safetensors,
 - `d2t` (int64, `[draft_vocab_size]`): offsets, `target id = draft id + d2t[draft id]` (draft ids in ascending
   target id order);
 - `t2d` (bool, `[vocab_size]`): which target ids the drafter scores;
and `draft_vocab_size` in `config.json`. This module is plain tensor code: building, checking and applying the
mapping.
"""

import torch

D2T, T2D = "d2t", "t2d"
VOCABULARY_BUFFER_DTYPES = {D2T: "I64", T2D: "BOOL"}  # safetensors dtypes of the two buffers


def vocabulary_buffers(token_ids, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(d2t, t2d)` of the draft vocabulary `token_ids` (target ids, any order; stored ascending)."""
    ids = torch.as_tensor(token_ids)
    if ids.numel() and (ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool):
        raise ValueError(f"token_ids: a draft vocabulary is a list of integer token ids, got {ids.dtype} values")
    ids = ids.long().flatten().sort().values.cpu()
    check_token_ids(ids, vocab_size, "token_ids")
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(len(ids)), t2d


def check_token_ids(ids: torch.Tensor, vocab_size: int, where: str) -> None:
    """Raise ValueError (naming `where`) unless `ids` are distinct, ascending target ids in `[0, vocab_size)`."""
    if ids.numel() == 0:
        raise ValueError(f"{where}: a draft vocabulary needs at least one token id")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(
            f"{where}: draft vocabulary ids must lie in [0, {vocab_size}) (the target's vocabulary), got ids from "
            f"{int(ids.min())} to {int(ids.max())}"
        )
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError(f"{where}: draft vocabulary ids must be distinct (and stored in ascending order)")


def draft_token_ids(d2t: torch.Tensor) -> torch.Tensor:
    """The target ids the drafter scores, in draft id order `[draft_vocab_size]`."""
    return d2t + torch.arange(len(d2t), device=d2t.device)


def check_vocabulary_buffers(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int, where: str) -> None:
    """Raise ValueError naming `where` unless `d2t` and `t2d` describe one draft vocabulary of a `vocab_size`
    target: `t2d` covers the target's vocabulary and marks exactly the ids `d2t` maps to."""
    if t2d.shape != (vocab_size,):
        raise ValueError(
            f"{where}: t2d has shape {tuple(t2d.shape)}, expected ({vocab_size},) (the target's vocabulary)"
        )
    ids = draft_token_ids(d2t.long())
    check_token_ids(ids, vocab_size, where)
    if int(t2d.sum()) != len(ids) or not bool(t2d[ids.to(t2d.device)].all()):
        raise ValueError(f"{where}: d2t and t2d disagree: t2d marks other target ids than the ones d2t maps to")


def draft_index(t2d: torch.Tensor) -> torch.Tensor:
    """Each target id's draft id, -1 for a token outside the draft vocabulary `[vocab_size]`."""
    return torch.where(t2d, t2d.long().cumsum(0) - 1, -1)


def to_target_vocab(logits: torch.Tensor, token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft-vocabulary logits `[..., draft_vocab_size]` as target-vocabulary logits `[..., vocab_size]`: -inf (a
    probability of 0) for every token outside the draft vocabulary."""
    full = logits.new_full((*logits.shape[:-1], vocab_size), -torch.inf)
    return full.index_copy_(-1, token_ids, logits)


def most_frequent_tokens(counts: torch.Tensor, size: int, always=()) -> torch.Tensor:
    """The `size` target ids of a draft vocabulary, ascending: `always` (e.g. the EOS ids, so that a drafted answer
    can end), then the ids with the highest `counts` `[vocab_size]`, ties and never-seen ids by lower id first (a
    BPE vocabulary lists its earlier, more frequent merges at lower ids, so that is the next best guess where the
    counts say nothing)."""
    vocab_size = counts.shape[0]
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= vocab_size:
        raise ValueError(
            f"draft_vocab_size must be an int in [1, {vocab_size}] (the target's vocabulary), got {size!r}"
        )
    always = sorted({int(i) for i in always})
    if len(always) > size:
        raise ValueError(f"draft_vocab_size={size} is smaller than the {len(always)} tokens it must hold ({always})")
    score = counts.double().clone()
    score[always] = torch.inf
    # A stable sort by descending count keeps equal counts in ascending id order.
    order = torch.sort(-score, stable=True).indices
    return order[:size].sort().values


class DraftVocabularyMixin:
    """The draft vocabulary of a drafter (`DFlashDraftModel`): its `d2t` / `t2d` buffers when
    `config.draft_vocab_size` is set, and the target's LM head restricted to it."""

    @property
    def draft_vocab(self) -> torch.Tensor | None:
        """The target ids this drafter scores, ascending (`[draft_vocab_size]`), or None: every token."""
        return draft_token_ids(self.d2t) if self.config.draft_vocab_size is not None else None

    @property
    def draft_index(self) -> torch.Tensor | None:
        """Each target id's column in `head_logits` (-1: not scored) `[vocab_size]`, or None: every token."""
        return draft_index(self.t2d) if self.config.draft_vocab_size is not None else None

    def set_draft_vocab(self, token_ids) -> None:
        """Score only the target ids `token_ids` from now on (None: every token again); saved with the drafter
        (`d2t` / `t2d` and `config.draft_vocab_size`, `hf_tev.models.dflash.vocabulary`). Build it from what the
        target writes with `hf_tev.training.draft_vocab_from_rows`."""
        for name in (D2T, T2D):
            self._buffers.pop(name, None)
        self._head_rows_memo, self.config.draft_vocab_size = None, None
        if token_ids is None:
            return
        d2t, t2d = vocabulary_buffers(token_ids, self.config.vocab_size)
        self.register_buffer(D2T, d2t.to(self.fc.weight.device))
        self.register_buffer(T2D, t2d.to(self.fc.weight.device))
        self.config.draft_vocab_size = len(d2t)

    def head_logits(self, target, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head on final-normed block rows `[..., H]`: logits over the draft vocabulary
        (`[..., draft_vocab_size]`, in `draft_vocab` order) or over the whole target vocabulary, soft-capped as
        the target caps its own (Gemma's `final_logit_softcapping`). Drafting and training both score here, so
        the drafter learns the very logits it drafts with."""
        head = target.get_output_embeddings()
        hidden = hidden.to(device=head.weight.device, dtype=head.weight.dtype)
        if self.config.draft_vocab_size is None:
            logits = head(hidden)
        else:
            weight, bias = self._draft_head_rows(head)
            logits = torch.nn.functional.linear(hidden, weight, bias)
        cap = getattr(target.config.get_text_config(), "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    def _draft_head_rows(self, head) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head's rows (and bias) of the draft vocabulary. Gathered once and kept while the head's weight and
        the vocabulary stay the same tensors, unchanged (their version counters), since a copy of the rows costs
        as much as scoring a few block rows with them (a target's weights require grad even where it only
        decodes: what counts is whether autograd records); gathered afresh where the head is being trained."""
        trained = head.weight.requires_grad and torch.is_grad_enabled()  # rows gathered under autograd
        key = (head.weight.data_ptr(), head.weight._version, self.d2t.data_ptr(), self.d2t._version, head.weight.device)
        memo = self._head_rows_memo
        if memo is not None and memo[0] == key and not trained:
            return memo[1]
        ids = self.draft_vocab.to(head.weight.device)
        rows = (head.weight[ids], None if head.bias is None else head.bias[ids])
        if not trained:
            rows = tuple(None if part is None else part.detach() for part in rows)
        self._head_rows_memo = None if trained else (key, rows)
        return rows
