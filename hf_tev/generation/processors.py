"""Logits processors on a tree: generate's processors applied to every tree node exactly as plain decoding would.

The contract for logits processors: every tree node is one row of a call, with that node's own sequence
(committed tokens + its path from the root) as its `input_ids` row; nodes of one depth share a call. So a
processor must be a function of (input_ids row, scores row) alone: how many calls are made, and how many rows
each has, differ from plain generate. transformers' own processors listed here are such functions; any other
processor class is warned about once (docs/usage.md#logits-processors).
"""

from __future__ import annotations

import torch
from transformers.generation import (
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ExponentialDecayLengthPenalty,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsProcessor,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
    WatermarkLogitsProcessor,
)
from transformers.utils import logging

from ..tree import DraftTree, host_long, to_device

logger = logging.get_logger(__name__)

# Processors whose output for a row depends only on that row's scores (not on input_ids or its length): all
# tree nodes go through them in one call (exact types: a subclass may read input_ids).
ROW_WISE_PROCESSORS = frozenset(
    {
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
        MinPLogitsWarper,
        TopHLogitsWarper,
        TypicalLogitsWarper,
        EpsilonLogitsWarper,
        EtaLogitsWarper,
        SuppressTokensLogitsProcessor,
        InfNanRemoveLogitsProcessor,
        LogitNormalization,
    }
)


class PerRowPrefixConstraint(LogitsProcessor):
    """`prefix_allowed_tokens_fn` for tree nodes: each row is called as row `batch_id` of the user's batch
    (0 for one prompt, the prompt's row in a batch) with that node's own sequence, exactly as plain decoding
    calls it (transformers' processor would number the nodes of a call as batch rows 0..N-1)."""

    def __init__(self, processor: PrefixConstrainedLogitsProcessor, batch_id: int = 0):
        self.processor = processor  # built by generate for num_beams=1
        if batch_id:
            allowed = processor._prefix_allowed_tokens_fn
            self.processor = PrefixConstrainedLogitsProcessor(lambda _, ids: allowed(batch_id, ids), 1)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[0] == 1:
            return self.processor(input_ids, scores)
        return torch.cat([self.processor(input_ids[i : i + 1], scores[i : i + 1]) for i in range(input_ids.shape[0])])


# Processors whose output for a row depends only on that row's input_ids and scores (no state across calls).
INPUT_IDS_PURE_PROCESSORS = ROW_WISE_PROCESSORS | {
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    EncoderNoRepeatNGramLogitsProcessor,
    SequenceBiasLogitsProcessor,
    NoBadWordsLogitsProcessor,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    ExponentialDecayLengthPenalty,
    SuppressTokensAtBeginLogitsProcessor,
    WatermarkLogitsProcessor,
    PerRowPrefixConstraint,
}


def processors_for_tree(logits_processor) -> LogitsProcessorList:
    """generate's processors as the tree decoder calls them: `prefix_allowed_tokens_fn` per node (each row's
    own processors: `processors_for_row`), and a one-time warning for every processor class outside
    transformers' own pure ones (the contract above: a processor that keeps state across calls gives output
    different from plain generate)."""
    processors = LogitsProcessorList()
    for processor in logits_processor:
        if type(processor) is PrefixConstrainedLogitsProcessor:
            processor = PerRowPrefixConstraint(processor)
        kind = type(processor)
        if kind not in INPUT_IDS_PURE_PROCESSORS:  # once per class and process
            logger.warning_once(
                f"hf_tev tree decoding calls logits processors once per tree depth per cycle, each row one tree node "
                f"with that node's own input_ids (committed tokens + its path). {kind.__name__} is not one of "
                "transformers' row-wise or input_ids-pure processors: if it keeps state across calls (counts "
                "calls, remembers earlier rows), its output differs from plain generate."
            )
        processors.append(processor)
    return processors


def process_tree_logits(logits_processor, committed_ids: torch.Tensor, tree: DraftTree, logits: torch.Tensor):
    """Apply generate's logits processors to every tree node exactly as plain decoding would.

    Processors that read `input_ids` (repetition penalty, n-gram blocking, minimum length, ...) must see each
    node's own sequence `committed + root..u`; nodes of one depth share a length, so they are processed
    level by level. Purely row-wise warpers take all nodes in one call.

    Args:
        committed_ids (`torch.LongTensor` of shape `(1, n)`): tokens in the target cache (the root excluded).
        logits (`torch.FloatTensor` of shape `(N, V)`): raw target logits at every node, float32.
    Returns:
        `torch.FloatTensor` of shape `(N, V)`: processed scores.
    """
    if len(logits_processor) == 0:
        return logits
    if all(type(p) in ROW_WISE_PROCESSORS for p in logits_processor):
        return logits_processor(committed_ids.expand(logits.shape[0], -1), logits)
    if tree.num_nodes == 1:  # the root alone (a copy: processors may write their scores in place)
        return logits_processor(torch.cat([committed_ids, tree.tokens[None]], dim=1), logits.clone())
    # path_tokens[u, d] = token of u's ancestor at depth d (root at depth 0), the rows of each depth: indices made
    # on the host from the tree's host structure and copied once (no read of the device: `node_paths`)
    paths, levels = node_paths(tree.lists.parents)
    width = len(levels)
    flat = [node for path in paths for node in path] + [node for level in levels for node in level]
    index = to_device(host_long(flat), logits.device)
    path_tokens = tree.tokens[index[: len(paths) * width]].view(len(paths), width)
    scores, start = torch.empty_like(logits), len(paths) * width
    for depth, level in enumerate(levels):
        rows, start = index[start : start + len(level)], start + len(level)
        ids = torch.cat([committed_ids.expand(len(level), -1), path_tokens[rows, : depth + 1]], dim=1)
        scores[rows] = logits_processor(ids, logits[rows])
    return scores


def node_paths(parents: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """Each node's path root..u padded with 0s to the tree's depth + 1 (`[N][D + 1]`), and the nodes of each
    depth (`[D + 1][...]`), from the host parents (`parents[u] < u`)."""
    paths, levels = [[0]], [[0]]
    for node in range(1, len(parents)):
        path = [*paths[parents[node]], node]
        paths.append(path)
        if len(path) > len(levels):
            levels.append([])
        levels[len(path) - 1].append(node)
    width = len(levels)
    return [path + [0] * (width - len(path)) for path in paths], levels


def processors_for_row(logits_processor: LogitsProcessorList, row: int) -> LogitsProcessorList:
    """The processors of batch row `row`, each of whose calls takes that row's tree nodes as its rows:
    `prefix_allowed_tokens_fn` is called with `batch_id=row`, and the repetition penalty skips the row's own
    left padding (generate gives it every row's padding length, one per batch row)."""
    return LogitsProcessorList(processor_for_row(p, row) for p in logits_processor)


def processor_for_row(processor, row: int):
    if type(processor) is PerRowPrefixConstraint and row:
        return PerRowPrefixConstraint(processor.processor, batch_id=row)
    if type(processor) is RepetitionPenaltyLogitsProcessor and isinstance(processor.prompt_ignore_length, torch.Tensor):
        return RepetitionPenaltyLogitsProcessor(processor.penalty, int(processor.prompt_ignore_length[row]))
    return processor
