"""What `ExitTrainer` reports besides the loss: the metrics of its steps (`StepMetrics`, averaged over the
logging window and across processes) and their FLOPs (`FlopCounter`, summed by `Trainer` into `total_flos`)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class StepSize:
    """The sizes one training step's FLOPs depend on: `batch` sequences of `length` tokens, `anchors` blocks of
    `block` rows per sequence, whether the context features came from a cache (no target forward), and the rows
    of the target's tree (or replayed chain) pass."""

    batch: int
    length: int
    anchors: int
    block: int
    cached: bool
    tree_rows: int


class FlopCounter:
    """FLOPs of the training steps, counted like `Trainer` counts them: 6 per parameter and trained token, 2 per
    parameter and no-grad token."""

    def __init__(self, drafter, target):
        # The parameters that touch each token.
        lm_head = target.get_output_embeddings().weight.numel()
        self.params = {
            "drafter": drafter.num_parameters(),
            "fc": drafter.fc.weight.numel(),
            "lm_head": lm_head,
            "target_body": target.num_parameters(exclude_embeddings=True) - lm_head,
        }
        self.pending = 0  # FLOPs of the steps not yet handed to Trainer

    def flos(self, size: StepSize) -> int:
        """FLOPs of one step (forward + backward): the drafter over its `batch * anchors * block` block rows, its
        `fc` over the `batch * length` context rows, the target's LM head over the drafted rows (4: forward and the
        gradient of its input), the target's context forward (unless the features are cached) and its tree pass
        over `tree_rows` rows."""
        n = self.params
        drafted = size.batch * size.anchors * size.block
        flos = (
            6 * n["drafter"] * drafted
            + 6 * n["fc"] * size.batch * size.length
            + 4 * n["lm_head"] * size.batch * size.anchors * (size.block - 1)
        )
        if not size.cached:
            flos += 2 * n["target_body"] * size.batch * size.length
        flos += 2 * (n["target_body"] + n["lm_head"]) * size.tree_rows
        return flos

    def add(self, size: StepSize) -> None:
        self.pending += self.flos(size)

    def pop(self) -> int:
        """The FLOPs added since the last call."""
        flos, self.pending = self.pending, 0
        return flos


class StepMetrics:
    """The metrics of the steps since the last log, per mode (`"train"`, `"eval"`)."""

    def __init__(self):
        self.values = {"train": defaultdict(list), "eval": defaultdict(list)}

    def record(self, mode: str, metrics: dict[str, torch.Tensor], gather: Callable) -> None:
        """Record one step's metrics, averaged across processes by `gather` (`accelerator.gather`): one small
        all-gather per step (every process records the same names) and no host sync."""
        values = torch.stack([value.detach().float().reshape(()) for value in metrics.values()])  # [m]
        values = gather(values).view(-1, len(metrics)).nanmean(0)
        for name, value in zip(metrics, values, strict=True):
            self.values[mode][name].append(value)

    def pop_averages(self, mode: str) -> dict[str, float]:
        """Every metric averaged over the recorded steps, NaNs left out (e.g. steps without a tree), then
        forgotten; a metric with no value at all is not returned."""
        averaged = {name: torch.stack(values).nanmean().item() for name, values in self.values[mode].items() if values}
        self.values[mode].clear()
        return {name: value for name, value in averaged.items() if not math.isnan(value)}
