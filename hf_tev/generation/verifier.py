"""Stage 4, the verifier stage the paper times: per-node logits processing, the exact decision, the cache commit.

The decision is one of `hf_tev.verify.VERIFIERS` (`"greedy"` for greedy decoding); it returns the accepted
path on the host (its one host sync) and the bonus token on the device.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import StaticCache

from ..tree import to_device
from ..verify import VERIFIER_STEPS, VERIFIERS, run_steps, run_together, sample_scores
from .cache import commit_accepted_path
from .processors import process_tree_logits


def first_token(scores: torch.Tensor, do_sample: bool, generator=None) -> torch.LongTensor:
    """The prefill's root from processed scores `[1, V]` -> `[1]`: plain `generate`'s first step, drawn as it
    draws, so that a call's first token is plain sampling's under the same seed.

    Sampling draws what `torch.multinomial(probs, 1)` draws, by the same exponential race and the same random
    numbers (torch's one-sample path: argmax of p / Exp(1)), without its two host reads that check the
    probabilities (a wait for the device each). Once per call: its V random numbers cost a millisecond at
    V = 49,152, which the cycles do not pay (`next_token`)."""
    if do_sample:
        probs = torch.softmax(scores, dim=-1)
        race = torch.empty_like(probs).exponential_(1, generator=generator)
        return probs.div_(race).argmax(dim=-1, keepdim=True)[0]
    return scores.argmax(dim=-1)


def next_token(scores: torch.Tensor, do_sample: bool, generator=None) -> torch.LongTensor:
    """A root-only cycle's bonus, the target's own next token, from processed scores `[1, V]` -> `[1]`.

    Sampling draws as every verifier draws its bonus, by the inverse CDF of one uniform
    (`hf_tev.verify.sample_scores`): the law of `torch.multinomial(probs, 1)`, whose exponential race takes V
    random numbers (a millisecond at V = 49,152 on a CPU, 1.5% of a 135M target's step, which a plain cycle would
    pay beyond plain `generate`'s step)."""
    if do_sample:
        return sample_scores(scores, generator)
    return scores.argmax(dim=-1)


def verify_tree(tree, logits, committed_ids, logits_processor, verify, generator):
    """One row's processing and decision.

    Args:
        logits (`torch.FloatTensor` of shape `(N, V)`): raw target logits of the row's tree, float32.
        committed_ids (`torch.LongTensor` of shape `(1, past)`): the row's committed tokens (its left padding
            included, as plain generate's processors see them).
    Returns:
        `(path, bonus, processed)`: accepted node indices root first `[k + 1]` (host), the bonus token (0-dim,
        device) and the processed scores `[N, V]` (each verifier normalises only the rows it needs).
    """
    return run_steps(verify_tree_steps(tree, logits, committed_ids, logits_processor, verify, generator))


def verify_tree_steps(tree, logits, committed_ids, logits_processor, verify, generator):
    """`verify_tree` as steps (`hf_tev.verify.run_steps`): it yields the one tensor its verifier reads. A verifier
    without steps (`VERIFIER_STEPS`) is called as it is, with its own read."""
    processed = process_tree_logits(logits_processor, committed_ids, tree, logits)
    if tree.num_nodes == 1:  # the root alone, a plain decoding step: its bonus is the target's own next token
        bonus = next_token(processed, verify is not VERIFIERS["greedy"], generator)[0]
        return torch.zeros(1, dtype=torch.long), bonus, processed
    steps = VERIFIER_STEPS.get(verify)
    if steps is None:
        path, bonus = verify(tree, processed, generator=generator)
    else:  # path on the host: the verifier's one host sync
        path, bonus = yield from steps(tree, processed, generator)
    return path, bonus, processed


def verifier_stage(trees, logits, committed_ids, logits_processors, verify, generator, cache, past):
    """Stage 4 for every row: `verify_tree` per row, then one commit of every row's path into the cache. On an
    accelerator a batch's rows read their decisions together (`run_together`: one wait, not one per row).

    Args:
        logits (`torch.FloatTensor` of shape `(R, N, V)`): raw target logits of the tree pass, float32.
        committed_ids (`list` of `torch.LongTensor` of shape `(1, past_i)`): each row's committed tokens (None for
            a row without logits processors: nothing reads them).
        logits_processors (`list` of `LogitsProcessorList`): each row's processors (`processors_for_row`).
        cache: the target cache whose tree window after `past` keeps each row's accepted path.
    Returns:
        `(paths, bonuses, processed, host_paths)`, one entry per row, as `verify_tree` returns them, and each path
        as a host list.
    """
    runs = (
        verify_tree_steps(tree, logits[i, : tree.num_nodes], committed_ids[i], logits_processors[i], verify, generator)
        for i, tree in enumerate(trees)
    )
    if logits.device.type == "cpu" or len(trees) == 1:  # reads cost no wait: row by row, each as it comes
        results = [run_steps(run) for run in runs]
    else:
        results = run_together(list(runs))
    paths, bonuses, processed = (list(column) for column in zip(*results, strict=True))
    # Whether every row kept its tree's first nodes 0..k (often: nodes are stored best first), so that nothing
    # moves in the cache. Read from the host paths: indices increase along a path from 0, so a path of k + 1
    # nodes is 0..k exactly when it ends at k.
    host_paths = [path.tolist() for path in paths]
    longest = max(len(path) for path in host_paths)
    is_prefix = all(len(path) == longest and path[-1] == longest - 1 for path in host_paths)
    if is_prefix:  # only the path length is read
        commit_accepted_path(cache, past, paths[0], True)
    elif isinstance(cache, StaticCache):  # one copy of one shape every cycle: the path padded to the pass's width
        padded = _padded(paths[0], logits.shape[1])
        commit_accepted_path(cache, past, to_device(padded, logits.device), False, length=longest)
    elif len(paths) == 1:  # one row: the columns out of place are copied one by one when they are few
        moves = [(node, j) for j, node in enumerate(host_paths[0]) if node != j]
        moves = moves if len(moves) <= 2 else None
        commit_accepted_path(cache, past, to_device(paths[0], logits.device), False, moves)
    else:
        padded = torch.stack([_padded(path, longest) for path in paths])
        commit_accepted_path(cache, past, to_device(padded, logits.device), False)
    return paths, bonuses, processed, host_paths


def _padded(path: torch.Tensor, length: int) -> torch.Tensor:
    """A row's path `[k + 1]` padded to `length` by repeating its last node (`commit_accepted_path`)."""
    return torch.cat([path, path[-1:].expand(length - path.numel())])
