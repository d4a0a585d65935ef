"""The verifier stage on the same trees (the paper's Table 3): `same_tree_verifier_stage`.

`hf-tev bench` replays every (drafter, budget) of the methods with a `replay_verifier` at T > 0;
`benchmarks/bench_stages.py` calls it on a random target.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig
from transformers.generation import MaxLengthCriteria, StoppingCriteriaList

from ..config import TEVConfig
from ..generation import decode_cycle, start, tree_pass_and_verify
from ..generation.outputs import StageClock
from ..verify import VERIFIERS


@torch.no_grad()
def same_tree_verifier_stage(
    target, drafter, prompts, budget, logits_processor, max_new_tokens, verifiers=("predraw", "tev"), seed=0
) -> dict[str, list[float]]:
    """Per-cycle verifier-stage time of each verifier on the same realised trees, measured in place.

    Decodes every prompt by sampling with trees of `budget` nodes through the decoder's own loop
    (`hf_tev.generation`), with one change: in every cycle each verifier gets its own target tree pass over the
    same tree and the same cache (the cache is cropped back between them; the pass is deterministic, so the
    logits are the same), and its stage right after it is timed: per-node logits processing + decision + cache
    commit, the tree forward excluded (the paper's Table 3). Timing each stage right after a real tree pass
    keeps the allocator and caches in the state decoding leaves them in (on CPU a fresh multi-MB buffer can
    cost more in page faults than its arithmetic). `tev` (else the last verifier) goes last; its commit is
    kept, so the trajectory is TEV decoding.

    Args:
        prompts (`list[torch.LongTensor]` of shape `(1, n)` each).
        logits_processor (`LogitsProcessorList`): the sampling processors (e.g. a temperature warper).
    Returns:
        `dict[str, list[float]]`: verifier name -> seconds per cycle (one entry per cycle, all prompts).
    """
    driver = "tev" if "tev" in verifiers else verifiers[-1]
    order = [name for name in verifiers if name != driver] + [driver]
    times = {name: [] for name in verifiers}

    def every_verifier(state, trees, past, first_positions):
        for name in order:
            state.cache.crop(past - state.cache.get_seq_length())  # undo the previous verifier's commit
            state.verify = VERIFIERS[name]
            verified = tree_pass_and_verify(state, trees, past, first_positions)
            times[name].append(verified.verify_s)
        return verified  # the driver's: its commit stays

    for i, input_ids in enumerate(prompts):
        end = input_ids.shape[1] + max_new_tokens
        config = GenerationConfig(do_sample=True, max_length=end)
        stopping = StoppingCriteriaList([MaxLengthCriteria(end)])
        tev_config = TEVConfig(budget=budget, verifier=driver, seed=seed + i).for_call(config, drafter is not None)
        state = start(target, drafter, input_ids, logits_processor, stopping, config, tev_config, None, {})
        state.tree_pass = every_verifier
        state.clock = StageClock(input_ids.device)  # each verifier's stage timed at its end (on CUDA: waits)
        while state.rows:
            decode_cycle(state)
    return times
