"""Tree decoding of prompts by the frozen target verifying a drafter's trees (`collect_rollouts`): the one decoding
behind both the decoded tau of evaluations (`decoded_block_lengths`, `decoded_tau`) and the Draft-OPD rollouts of a
run (`RolloutPool`).

It goes through the package's public route only, as a user would decode:
`target.generate(ids, assistant_model=drafter, tev_config=TEVConfig(budget=..., seed=..., lookup=False),
return_dict_in_generate=True)`, whose `tev_stats.accepted_lengths` are the cycles' block lengths.

Context drafts are off (`lookup=False`), whatever `TEVConfig`'s default: a tau that measures a drafter, and
rollouts that train one, must be the drafter's own trees. With `lookup="auto"` greedy decoding would add
continuations found in the text itself, and a drafter that proposes nothing would still read a tau of 4 on code.

A rollout (`Rollout`) is the decoded sequence with its cycles: every cycle's root position (its anchor) and accepted
length, so the positions where verification rejected a draft are known (cycle `c` drafted from anchor `a` and had
`n` drafted tokens accepted; depth `n + 1`, position `a + n + 1` where the bonus token went, is the exposed error).
The sequence follows the target's distribution (target-assisted rollout: stable continuations).

The decoded tau of an evaluation is the mean block length (accepted drafted tokens + 1) of the evaluation prompts'
rollouts, greedy unless `eval_tau_temperature` > 0, over the decoding cycles of all processes. Draft-OPD's
`RolloutPool` rolls the training prompts out again with the current drafter every `opd_refresh_steps` optimizer
steps, hands them out one micro-batch at a time, and saves them in every checkpoint so that a resumed run trains on
the rollouts an uninterrupted one would.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import TEVConfig, temperature_sampling
from .checkpoints import DrawCounter, seeded_generator
from .data import plain_rows
from .rows import pad_token_id_of, row_prompt


@dataclass
class Rollout:
    """One tree-decoded sequence with its cycles.

    Attributes:
        input_ids: prompt + generated tokens (the whole returned sequence).
        prompt_length: tokens of the prompt.
        anchors: the root position of every cycle (the block it drafted starts there).
        accepted: drafted tokens accepted in every cycle (the cycle's block length minus the bonus token).
        rejected: whether verification exposed a draft error in the cycle: fewer than the drafter's depth
            accepted, the tree not cut short by `max_new_tokens`, and the bonus position inside the sequence
            (the last cycle of a sequence cut at EOS / the token limit exposes none).
    """

    input_ids: list[int]
    prompt_length: int
    anchors: list[int]
    accepted: list[int]
    rejected: list[bool]

    @property
    def block_lengths(self) -> list[int]:
        return [n + 1 for n in self.accepted]

    def to_dict(self) -> dict:
        return dict(
            input_ids=self.input_ids,
            prompt_length=self.prompt_length,
            anchors=self.anchors,
            accepted=self.accepted,
            rejected=self.rejected,
        )


def rollout_from_lengths(
    sequence: Sequence[int], prompt_length: int, block_lengths: Sequence[int], depth: int, max_new_tokens: int
) -> Rollout:
    """The cycles of a tree-decoded sequence from its block lengths (`tev_stats.accepted_lengths`).

    The decoder's first root is the token the prefill drew (position `prompt_length`); a cycle with block length
    `L` commits `L - 1` drafted tokens and a bonus token, so the next root sits `L` positions later. The tree of a
    cycle at anchor `a` was at most `min(depth, prompt_length + max_new_tokens - a - 2)` deep (the decoder's
    token limit); a cycle that accepted that many exposed no error.
    """
    sequence = [int(token) for token in sequence]
    anchors, accepted, rejected = [], [], []
    anchor = prompt_length
    for length in block_lengths:
        n = int(length) - 1
        cap = min(depth, prompt_length + max_new_tokens - anchor - 2)
        anchors.append(anchor)
        accepted.append(n)
        rejected.append(n < cap and anchor + n + 1 <= len(sequence) - 1)
        anchor += int(length)
    return Rollout(sequence, prompt_length, anchors, accepted, rejected)


@torch.no_grad()
def collect_rollouts(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    budget: int,
    temperature: float,
    max_new_tokens: int,
    seeds: Sequence[int],
    pad_token_id: int,
) -> list[Rollout]:
    """Tree-decode every prompt (token ids) with the frozen target verifying `drafter`'s trees at `budget`, up to
    `max_new_tokens` new tokens, and return the rollouts.

    Greedy at `temperature` 0; otherwise pure temperature sampling (top-k / top-p off), prompt `i` drawing from a
    private generator seeded `seeds[i]` (reproducible, and the global RNG is untouched). Trees are the drafter's
    alone (no context drafts). The drafter decodes in eval mode, as at inference, and is given back in the mode
    it came in.
    """
    device = next(target.parameters()).device
    sampling = temperature_sampling(temperature)
    depth = drafter.config.block_size - 1
    was_training = drafter.training
    drafter.eval()
    try:
        rollouts = []
        for prompt, seed in zip(prompts, seeds, strict=True):
            input_ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
            output = target.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                assistant_model=drafter,
                tev_config=TEVConfig(budget=budget, seed=int(seed), lookup=False),  # the drafter's own trees
                max_new_tokens=max_new_tokens,
                return_dict_in_generate=True,
                pad_token_id=pad_token_id,
                **sampling,
            )
            lengths = list(output.tev_stats.accepted_lengths)
            sequence = output.sequences[0].tolist()
            rollouts.append(rollout_from_lengths(sequence, len(prompt), lengths, depth, max_new_tokens))
        return rollouts
    finally:
        drafter.train(was_training)


# ----------------------------------------------------------------------------------------------
# The decoded tau of an evaluation


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
    """Accepted block lengths (accepted draft tokens + 1, one per cycle) of real tree decoding of each prompt
    (`collect_rollouts`, the decoding of the Draft-OPD rollouts).

    Greedy at `temperature` 0; otherwise pure temperature sampling (top-k / top-p off), the draws of prompt
    `first_index + i * index_step` from a private generator seeded `seed + that index` (the global RNG is
    untouched, and the same prompts give the same lengths). Their mean is tau.
    """
    seeds = [seed + first_index + i * index_step for i in range(len(prompts))]
    pad_token_id = pad_token_id_of(target, None)
    rollouts = collect_rollouts(target, drafter, prompts, budget, temperature, max_new_tokens, seeds, pad_token_id)
    return [length for rollout in rollouts for length in rollout.block_lengths]


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


# ----------------------------------------------------------------------------------------------
# The Draft-OPD rollouts of a run


class RolloutPool:
    """The current rollouts of one process.

    Args:
        args: the run's `ExitTrainingArguments` (the `opd_*` knobs, batch sizes, seed, process).
        target: the frozen target that verifies the rollouts' trees.
        train_dataset: the training rows; their prompts (tokens before the first supervised one) are rolled out.
        pad_token_id: the padding id of the decoding and of the replay batches.
    """

    def __init__(self, args, target, train_dataset, pad_token_id: int):
        self.args = args
        self.target = target
        self.train_dataset = train_dataset
        self.pad_token_id = pad_token_id
        self.rollouts: list[Rollout] = []
        self.refresh: int | None = None  # the refresh the rollouts belong to
        self._prompts: list[list[int]] | None = None
        self._draws = DrawCounter()  # micro-batches drawn at the current step

    def next_batch(self, step: int, drafter) -> tuple[list[Rollout], torch.Generator]:
        """The `per_device_train_batch_size` rollouts of this micro-batch of optimizer step `step`, rolling out
        anew first when a refresh is due, and the generator that picks the cycles to replay (seeded by step and
        micro-batch)."""
        args = self.args
        refresh = step // args.opd_refresh_steps
        if self.refresh != refresh:
            self._roll_out(drafter, refresh)
        draw = self._draws.next(step)
        size = args.per_device_train_batch_size
        first = ((step - refresh * args.opd_refresh_steps) * args.gradient_accumulation_steps + draw) * size
        batch = [self.rollouts[(first + j) % len(self.rollouts)] for j in range(size)]
        return batch, seeded_generator(args.seed, "opd", step, draw, args.process_index)

    @property
    def tau(self) -> float:
        """The mean block length of the current rollouts: the decoded tau of the drafter that made them."""
        lengths = [length for rollout in self.rollouts for length in rollout.block_lengths]
        return sum(lengths) / max(len(lengths), 1)

    def _roll_out(self, drafter, refresh: int) -> None:
        """Roll out refresh `refresh`'s prompts with the current drafter. Rollout j of process p takes prompt number
        `(refresh * count + j) * world_size + p` of a seeded order of the training prompts, and sampling seed
        `seed` + that number: resumable, and distinct across processes."""
        args = self.args
        count = args.opd_rollouts or (
            args.per_device_train_batch_size * args.gradient_accumulation_steps * args.opd_refresh_steps
        )
        prompts = self._training_prompts()
        numbers = [(refresh * count + j) * max(args.world_size, 1) + args.process_index for j in range(count)]
        self.rollouts = collect_rollouts(
            self.target,
            drafter,
            [prompts[n % len(prompts)] for n in numbers],
            budget=args.opd_rollout_tree_budget,
            temperature=args.opd_rollout_temperature,
            max_new_tokens=args.opd_rollout_max_new_tokens,
            seeds=[args.seed + n for n in numbers],
            pad_token_id=self.pad_token_id,
        )
        self.refresh = refresh

    def _training_prompts(self) -> list[list[int]]:
        """The training rows' prompts, in an order seeded by `seed` (read once)."""
        if self._prompts is None:
            rows = plain_rows(self.train_dataset)
            prompts = [row_prompt(rows[index], where=f"training row {index}") for index in range(len(rows))]
            order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(self.args.seed)).tolist()
            self._prompts = [prompts[i] for i in order]
        return self._prompts

    def _file(self, folder) -> Path:
        return Path(folder, f"opd_rollouts_{self.args.process_index}.json")

    def save(self, folder) -> None:
        """Write the current rollouts (if any) into a checkpoint folder."""
        if self.rollouts:
            state = {"refresh": self.refresh, "rollouts": [rollout.to_dict() for rollout in self.rollouts]}
            self._file(folder).write_text(json.dumps(state))

    def load(self, folder) -> None:
        """Read the rollouts a checkpoint folder holds (none: nothing changes)."""
        path = self._file(folder)
        if path.is_file():
            state = json.loads(path.read_text())
            self.rollouts = [Rollout(**rollout) for rollout in state["rollouts"]]
            self.refresh = state["refresh"]
