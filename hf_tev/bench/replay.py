"""The verifier stage on the same trees (the paper's Table 3): `same_tree_verifier_stage`.

`hf-tev bench` replays every (drafter, budget) of the methods with a `replay_verifier` at T > 0;
`benchmarks/bench_stages.py` calls it on a random target.
"""

from __future__ import annotations

import time

import torch

from ..generation import DFlashTreeCandidateGenerator, TEVConfig, verifier_stage
from ..tree import tree_attention_mask, tree_position_ids
from ..verify import VERIFIERS


@torch.no_grad()
def same_tree_verifier_stage(target, drafter, prompts, budget, logits_processor, max_new_tokens,
                             verifiers=("predraw", "tev"), seed=0) -> dict[str, list[float]]:
    """Per-cycle verifier-stage time of each verifier on the same realised trees, measured in place.

    Decodes every prompt with trees of `budget` nodes. In every cycle each verifier gets its own target tree pass
    over the same tree and the same cache (the cache is cropped back between them; the pass is deterministic, so
    the logits are the same), and its stage right after it is timed: per-node logits processing + decision +
    cache commit, the tree forward excluded (the paper's Table 3). Timing each stage right after a real tree
    pass keeps the allocator and caches in the state decoding leaves them in (on CPU a fresh multi-MB buffer
    can cost more in page faults than its arithmetic). `tev` (else the last verifier) goes last; its commit is
    kept, so the trajectory is TEV decoding.

    Args:
        prompts (`list[torch.LongTensor]` of shape `(1, n)` each).
    Returns:
        `dict[str, list[float]]`: verifier name -> seconds per cycle (one entry per cycle, all prompts).
    """
    device = target.get_input_embeddings().weight.device
    sync = device.type == "cuda"
    generator = torch.Generator(device=device).manual_seed(seed)
    driver = "tev" if "tev" in verifiers else verifiers[-1]
    order = [name for name in verifiers if name != driver] + [driver]
    times = {name: [] for name in verifiers}
    hidden = drafter.target_hidden_indices
    for input_ids in prompts:
        candidates = DFlashTreeCandidateGenerator(drafter, target, TEVConfig(budget=budget))
        cache = _new_cache(target)
        out = target(input_ids, cache=cache, output_hidden_states=hidden, logits_to_keep=1)
        features = drafter.context_features(out.hidden_states)
        positions = torch.arange(input_ids.shape[1], device=device)[None]
        scores = logits_processor(input_ids, out.logits[:, -1].float())
        sequence = torch.cat([input_ids, torch.multinomial(torch.softmax(scores, -1), 1, generator=generator)], 1)
        end = input_ids.shape[1] + max_new_tokens
        while sequence.shape[1] < end:
            past = cache.get_seq_length()
            tree = candidates.get_candidates(sequence[0, -1:], features, positions, past, end - sequence.shape[1],
                                             lambda stage: None)
            mask = tree_attention_mask(tree, past, target.dtype, device=device)
            tree_positions = tree_position_ids(tree, past)
            for name in order:
                cache.crop(past - cache.get_seq_length())  # undo the previous verifier's commit (none before the first)
                out = target(tree.tokens[None], position_ids=tree_positions, attention_mask=mask, cache=cache,
                             output_hidden_states=hidden, logits_to_keep=0)
                logits = out.logits[0].float()  # [N, V]
                if sync:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                path, bonus, _ = verifier_stage(tree, logits, sequence[:, :-1], logits_processor, VERIFIERS[name],
                                                   generator, cache, past)
                if sync:
                    torch.cuda.synchronize()
                times[name].append(time.perf_counter() - start)
            features = drafter.context_features(out.hidden_states)[:, path]  # the driver's commit stays
            positions = torch.arange(past, past + path.numel(), device=device)[None]
            sequence = torch.cat([sequence, tree.tokens[path[1:]][None], bonus.view(1, 1)], 1)
    return times


def _new_cache(target):
    from transformers import DynamicCache

    return DynamicCache(config=target.config)
