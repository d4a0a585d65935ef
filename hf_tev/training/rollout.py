"""Tree decoding of prompts by the frozen target verifying a drafter's trees: the one rollout behind both the
decoded tau of evaluations (`eval_tau.decoded_block_lengths`) and the Draft-OPD rollouts (`opd.collect_rollouts`).

It goes through the package's public route only, as a user would decode:
`target.generate(ids, assistant_model=drafter, tev_config=TEVConfig(budget=..., seed=..., lookup=False),
return_dict_in_generate=True)`, whose `tev_stats.accepted_lengths` are the cycles' block lengths.

Context drafts are off (`lookup=False`), whatever `TEVConfig`'s default: a tau that measures a drafter, and
rollouts that train one, must be the drafter's own trees. With `lookup="auto"` greedy decoding would add
continuations found in the text itself, and a drafter that proposes nothing would still read a tau of 4 on code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import TEVConfig, temperature_sampling


@dataclass
class Decoded:
    """One tree-decoded prompt: `sequence` (prompt + generated tokens) and the block length of every cycle
    (accepted drafted tokens + 1)."""

    sequence: list[int]
    block_lengths: list[int]


@torch.no_grad()
def tree_decode(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    budget: int,
    temperature: float,
    max_new_tokens: int,
    seeds: Sequence[int],
    pad_token_id: int,
) -> list[Decoded]:
    """Tree-decode every prompt (token ids) with `drafter` at tree `budget`, up to `max_new_tokens` new tokens.

    Greedy at `temperature` 0; otherwise pure temperature sampling (top-k / top-p off), prompt `i` drawing from a
    private generator seeded `seeds[i]` (reproducible, and the global RNG is untouched). Trees are the drafter's
    alone (no context drafts). The drafter decodes in eval mode, as at inference, and is given back in the mode
    it came in.
    """
    device = next(target.parameters()).device
    sampling = temperature_sampling(temperature)
    was_training = drafter.training
    drafter.eval()
    try:
        decoded = []
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
            decoded.append(Decoded(output.sequences[0].tolist(), list(output.tev_stats.accepted_lengths)))
        return decoded
    finally:
        drafter.train(was_training)
