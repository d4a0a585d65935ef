"""The verifier stage on the same trees (the paper's Table 3): `same_tree_verifier_stage`.

`hf-tev bench` replays every (drafter, budget) of the methods with a `replay_verifier` at T > 0;
`benchmarks/bench_stages.py` calls it on a random target.
"""

from __future__ import annotations

import torch

from ..config import TEVConfig
from ..generation import (
    DFlashTreeCandidateGenerator,
    StageClock,
    next_token,
    prefill,
    tree_forward,
    verifier_stage,
)
from ..target_layers import full_length_cache
from ..tree import TreeInputs
from ..verify import VERIFIERS


@torch.no_grad()
def same_tree_verifier_stage(
    target, drafter, prompts, budget, logits_processor, max_new_tokens, verifiers=("predraw", "tev"), seed=0
) -> dict[str, list[float]]:
    """Per-cycle verifier-stage time of each verifier on the same realised trees, measured in place.

    Decodes every prompt with trees of `budget` nodes through the decoder's own stages
    (`hf_tev.generation`: prefill, draft, build, tree forward, verifier stage, commit). In every cycle each
    verifier gets its own target tree pass over the same tree and the same cache (the cache is cropped back
    between them; the pass is deterministic, so the logits are the same), and its stage right after it is
    timed: per-node logits processing + decision + cache commit, the tree forward excluded (the paper's
    Table 3). Timing each stage right after a real tree pass keeps the allocator and caches in the state
    decoding leaves them in (on CPU a fresh multi-MB buffer can cost more in page faults than its arithmetic).
    `tev` (else the last verifier) goes last; its commit is kept, so the trajectory is TEV decoding.

    Args:
        prompts (`list[torch.LongTensor]` of shape `(1, n)` each).
    Returns:
        `dict[str, list[float]]`: verifier name -> seconds per cycle (one entry per cycle, all prompts).
    """
    device = target.get_input_embeddings().weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    driver = "tev" if "tev" in verifiers else verifiers[-1]
    order = [name for name in verifiers if name != driver] + [driver]
    times = {name: [] for name in verifiers}
    hidden = drafter.target_hidden_indices
    clock = StageClock(device)
    for input_ids in prompts:
        candidates = DFlashTreeCandidateGenerator(drafter, target, TEVConfig(budget=budget))
        cache = full_length_cache(target)  # sliding-window layers at full length, as the decoder keeps them
        raw, features, positions, _ = prefill(target, drafter, input_ids, cache)
        candidates.update_candidate_strategy(features, positions)
        root = next_token(logits_processor(input_ids, raw), True, generator)
        sequence = torch.cat([input_ids, root[None]], dim=1)
        end = input_ids.shape[1] + max_new_tokens
        tree_inputs = TreeInputs(end, target.dtype, device)
        while sequence.shape[1] < end:
            past = cache.get_seq_length()
            tree = candidates.build(candidates.draft(root, past, end - sequence.shape[1] - 1), root)
            mask, tree_positions = tree_inputs(tree, past, past)
            for name in order:
                cache.crop(past - cache.get_seq_length())  # undo the previous verifier's commit (none before the first)
                out = tree_forward(target, tree, cache, mask, tree_positions, hidden)
                logits = out.logits[0].float()  # [N, V]
                clock.lap()
                path, bonus, _ = verifier_stage(
                    tree, logits, sequence[:, :-1], logits_processor, VERIFIERS[name], generator, cache, past
                )
                times[name].append(clock.lap())
            # the driver's commit stays
            accepted = path.numel()
            candidates.update_candidate_strategy(
                drafter.context_features(out.hidden_states)[:, path],
                torch.arange(past, past + accepted, device=device)[None],
            )
            sequence = torch.cat([sequence, tree.tokens[path[1:]][None], bonus.view(1, 1)], 1)
            root = bonus.view(1)
    return times
