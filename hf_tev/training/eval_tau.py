"""The decoded tau of an evaluation: real tree decoding (`rollout.tree_decode`, the decoding of the Draft-OPD
rollouts too) of the evaluation prompts with the frozen target, greedy unless `eval_tau_temperature` > 0, with the
drafter's trees alone (context drafts off: the tau is the drafter's own); tau is the mean accepted block length
(accepted drafted tokens + 1) over the decoding cycles of all processes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .data import plain_rows
from .rollout import tree_decode
from .rows import pad_token_id_of, row_prompt


def decoded_block_lengths(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    budget: int,
    temperature: float = 0.0,
    max_new_tokens: int = 64,
    seed: int = 0,
    first_index: int = 0,
    index_step: int = 1,
) -> list[int]:
    """Accepted block lengths (accepted draft tokens + 1, one per cycle) of real tree decoding of each prompt:
    `target.generate(ids, assistant_model=drafter, tev_config=TEVConfig(budget=budget, seed=..., lookup=False))`.

    Greedy at `temperature` 0; otherwise pure temperature sampling (top-k / top-p off), the draws of prompt
    `first_index + i * index_step` from a private generator seeded `seed + that index` (the global RNG is
    untouched, and the same prompts give the same lengths). Their mean is tau.
    """
    seeds = [seed + first_index + i * index_step for i in range(len(prompts))]
    decoded = tree_decode(
        target, drafter, prompts, budget, temperature, max_new_tokens, seeds, pad_token_id_of(target, None)
    )
    return [length for one in decoded for length in one.block_lengths]


def tau_prompts(dataset, eval_prompts: list[list[int]] | None, count: int) -> list[list[int]]:
    """The first `count` prompts to decode: `eval_prompts` when given, else the prompts of the evaluation rows
    (their tokens before the first supervised one); none when the dataset cannot be indexed."""
    if count == 0:
        return []
    if eval_prompts is not None:
        return eval_prompts[:count]
    rows = plain_rows(dataset)
    if rows is None or not hasattr(rows, "__len__") or not hasattr(rows, "__getitem__"):
        return []
    return [row_prompt(rows[index], where=f"evaluation row {index}") for index in range(min(count, len(rows)))]


def decoded_tau(target, drafter, prompts: list[list[int]], args, gather: Callable) -> tuple[float, int]:
    """`(tau, cycles)` of decoding `prompts` with the `eval_tau_*` settings of `args` (`ExitTrainingArguments`),
    the prompts split across processes and the totals summed by `gather` (`accelerator.gather`)."""
    processes = max(args.world_size, 1)
    lengths = decoded_block_lengths(
        target,
        drafter,
        prompts[args.process_index :: processes],
        budget=args.eval_tau_tree_budget,
        temperature=args.eval_tau_temperature,
        max_new_tokens=args.eval_tau_max_new_tokens,
        seed=args.seed,
        first_index=args.process_index,
        index_step=processes,
    )
    totals = torch.tensor([float(sum(lengths)), float(len(lengths))], device=args.device)
    total, cycles = gather(totals).view(-1, 2).sum(0).tolist()
    return total / max(cycles, 1.0), int(cycles)
