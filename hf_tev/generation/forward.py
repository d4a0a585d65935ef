"""Target forwards: the prompt's prefill, the tree pass, and the probe of tree-pass costs.

The tree pass is ONE target forward over every row's tree with a float 4D tree mask (`cache.PromptTreeInputs`,
`cache.BatchTreeInputs`); attention implementations that take such a mask are SDPA and eager.
"""

from __future__ import annotations

import math

import torch

from ..tree import build_chain
from .hybrid import linear_attention_trees
from .outputs import StageClock


def prefill(model, drafter, input_ids, cache, attention_mask=None, position_ids=None, chunk_size=None):
    """Stage 0: the prompt's tokens that `cache` does not hold yet, into `cache`.

    For an empty cache that is the whole prompt; for a pre-filled cache of `past` tokens (a continuation,
    `generate(out.sequences, cache=out.cache)`) only `input_ids[:, past:]`. `chunk_size` splits the forward
    into chunks of that many tokens (generate's `prefill_chunk_size`).

    Args:
        input_ids (`torch.LongTensor` of shape `(R, n)`): left-padded prompts.
        position_ids (`torch.LongTensor` of shape `(R, n)`): each row's positions (`prompt_positions`).
    Returns:
        `(logits, features)`: raw next-token logits `[R, V]` float32 and the drafter's context features
        `[R, n - past, k * hidden]` of the new tokens (None without a drafter); pad columns are kept, each row's
        caller drops its own.
    """
    past, length = int(cache.get_seq_length()), input_ids.shape[1]  # a StaticCache counts in a tensor it updates
    step = chunk_size or length - past
    features = []
    for start in range(past, length, step):
        end = min(start + step, length)
        out = model(
            input_ids=input_ids[:, start:end],
            attention_mask=None if attention_mask is None else attention_mask[:, :end],
            position_ids=position_ids[:, start:end],
            cache=cache,
            output_hidden_states=None if drafter is None else drafter.target_hidden_indices,
            logits_to_keep=1,
            use_cache=True,
        )
        if drafter is not None:
            features.append(drafter.context_features(out.hidden_states))  # [R, end - start, k * H]
    features = None if not features else features[0] if len(features) == 1 else torch.cat(features, dim=1)
    return out.logits[:, -1].float(), features


def prompt_positions(real: torch.Tensor) -> torch.LongTensor:
    """Position ids `[R, n]` of left-padded prompts (`real` `[R, n]`, True for real tokens): each row's real
    tokens at 0, 1, ... as they would be alone, as generate's own position ids for a padded batch."""
    return (real.long().cumsum(dim=-1) - 1).clamp(min=0)


def tree_forward(model, tokens, cache, mask, position_ids: torch.LongTensor, hidden_indices):
    """Stage 3: ONE target forward over every row's tree with the tree mask, appended to `cache`.

    Args:
        tokens (`torch.LongTensor` of shape `(R, N)`): the rows' trees padded to N nodes.
        mask: `[R, 1, N, past + N]` (per layer type for a sliding-window target; None for one prompt's root alone).
        position_ids (`torch.LongTensor` of shape `(R, N)`).
    Returns:
        The model output: `logits` `[R, N, V]` of every node and the `hidden_states` the drafter reads.
    """
    with linear_attention_trees(model, mask):  # a linear-attention target's layers advance a state per node
        return model(
            input_ids=tokens,
            position_ids=position_ids,
            attention_mask=mask,
            cache=cache,
            output_hidden_states=hidden_indices,
            logits_to_keep=0,
            use_cache=True,
        )


def probe_tree_costs(
    model, cache, inputs, roots, first_positions, hidden_indices, sizes: list[int], max_ratio=math.inf, repeats=2
):
    """Seconds of target tree passes over `sizes` tokens per row (ascending, the first the reference of
    `max_ratio`; `CostAwareBudget.probe_plan`) at the current context (the best of `repeats`), the cache left as
    it was: the automatic budget's shape of t_tree, measured once per target, device, dtype, thread count and
    batch size. The probe stops after the first size whose pass takes more than `max_ratio` times the first:
    no larger tree can pay (`auto.probe_ratio`), and the cost model prices larger ones by extending the last
    probed sizes.

    Args:
        inputs: the call's tree-pass inputs (`cache.PromptTreeInputs` or `cache.BatchTreeInputs`).
        roots (`list[torch.LongTensor]` of shape `(1,)`): each row's root.
    Returns:
        `(sizes, seconds)`.
    """
    past = int(cache.get_seq_length())  # a StaticCache counts in a tensor it updates in place
    clock = StageClock(roots[0].device)  # on CUDA it waits at each lap: once per call, its times at once
    seconds = []
    for size in sizes:
        chains = [build_chain(root.new_zeros((size - 1, 1), dtype=torch.float32), size - 1, root) for root in roots]
        best = math.inf
        for _ in range(repeats):
            clock.lap()
            tokens, mask, positions = inputs(chains, past, first_positions)
            tree_forward(model, tokens, cache, mask, positions, hidden_indices)
            best = min(best, clock.lap())
            cache.crop(past - cache.get_seq_length())
        seconds.append(best)
        if best > max_ratio * seconds[0]:
            break
    return sizes[: len(seconds)], seconds
