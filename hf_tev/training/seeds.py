"""Seeds of the trainer's random draws (anchors, the Draft-OPD cycles it replays): each draw gets its own CPU
generator seeded by what identifies it (seed, step, draw within the step, process), so a run resumed from a
checkpoint draws exactly what an uninterrupted one would, every process draws its own, and the global RNG is
left alone."""

from __future__ import annotations

import hashlib
from collections.abc import Hashable

import torch


def seeded_generator(*parts) -> torch.Generator:
    """A CPU generator seeded by a hash of `parts` joined by "/" (e.g. `seed, "train", step, draw, process`)."""
    text = "/".join(str(part) for part in parts)
    return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little"))


class DrawCounter:
    """Numbers the draws made under one key (e.g. an optimizer step): 0, 1, ... while the key stays the same, 0
    again when it changes (gradient accumulation draws several times per step)."""

    def __init__(self):
        self.key, self.draws = None, 0

    def next(self, key: Hashable) -> int:
        self.draws = self.draws + 1 if self.key == key else 0
        self.key = key
        return self.draws
