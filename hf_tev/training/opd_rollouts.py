"""The Draft-OPD rollouts of a training run (`RolloutPool`): rolled out again with the current drafter every
`opd_refresh_steps` optimizer steps, handed out one micro-batch at a time, and saved in every checkpoint so that a
resumed run trains on the rollouts an uninterrupted one would."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .data import plain_rows
from .opd import Rollout, collect_rollouts
from .rows import row_prompt
from .seeds import DrawCounter, seeded_generator


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
