"""Tree speculative decoding inside `model.generate`: the cycle's stages and the loop that calls them.

`hf_tev.route` turns `generate(..., assistant_model=drafter, tev_config=...)` into transformers' supported
`custom_generate` route, so generate still prepares the logits processors, stopping criteria, special tokens,
length limits and cache, and then hands the loop to `tree_speculative_decode` below. The same function is
also a documented entry of its own: `generate(custom_generate=hf_tev.tree_speculative_decode, drafter=...,
tev_config=...)`.

One decoding cycle (SPEC section 1), one function or method per stage, shared by every caller (the decode
loop, the bench's same-tree replay):
  0. prefill:  `prefill` — the prompt's cache, its context features and the first root.
  1. draft:    `DFlashTreeCandidateGenerator.draft` — per-depth drafter log-probs q_1..q_d.
  2. build:    `DFlashTreeCandidateGenerator.build` — a tree source of `hf_tev.tree.TREE_BUILDERS`.
  3. forward:  `tree_forward` — ONE target forward over the tree with a float 4D tree mask.
  4. verify:   `verifier_stage` — the logits processors per node, an exact verifier (`hf_tev.verify`) picks
               the accepted path and the bonus token, and the target KV cache keeps only that path (the
               paper's verifier stage).
  5. commit:   `DFlashTreeCandidateGenerator.update_candidate_strategy` — the accepted nodes' hidden states
               become the drafter's next context.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
import time
import warnings
import weakref
from dataclasses import dataclass

import torch
from transformers.cache_utils import DummyLayer, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.generation import (
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    EosTokenCriteria,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ExponentialDecayLengthPenalty,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    GenerateDecoderOnlyOutput,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsProcessor,
    LogitsProcessorList,
    MaxLengthCriteria,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    StoppingCriteriaList,
    StopStringCriteria,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
    WatermarkLogitsProcessor,
)

from .budget import AcceptanceCalibration, CostAwareBudget, CycleCost
from .config import TEVConfig, TEVStats, tree_memory_bytes
from .lookup import ContextIndex, LookupStats, build_merged_tree, lookup_path_logprobs
from .route import generation_setting
from .target_layers import check_tree_layers, full_length_cache, sliding_window, tree_attention_masks
from .tree import TREE_BUILDERS, DraftTree, TreeInputs, chain_tree
from .verify import VERIFIERS, target_flow

TREE_ATTENTION = ("sdpa", "eager")  # implementations that take an arbitrary float 4D mask
TREE_MEMORY_WARNING_BYTES = 1 << 30  # a call whose largest tree takes more per cycle warns with the estimate


@dataclass
class TEVGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus the per-cycle statistics of the tree decoder."""

    tev_stats: TEVStats | None = None


# --------------------------------------------------------------------------------------------------------
# Stages 1, 2 and 5: drafting, the tree counterpart of transformers' `CandidateGenerator`
# --------------------------------------------------------------------------------------------------------
class DFlashTreeCandidateGenerator:
    """Proposes a draft tree per cycle from a DFlash drafter and/or the context (transformers'
    `CandidateGenerator`, for trees).

    `update_candidate_strategy` hands it the newly committed tokens (for the context index, with
    `TEVConfig(lookup=True)`) and their target features; the features wait until the next `draft`, which
    appends them to the drafter's cache of context K/V (so a cycle that drafts nothing loses nothing), drafts
    the full block `[root, MASK * (L-1)]` and returns the log-probs of the depths a tree can use; `build` turns
    them into a tree with the configured tree source, merged with the context's continuations when lookup is
    on (`hf_tev.lookup`). With no drafter (lookup alone) `draft` returns None and the tree is the context's.
    """

    def __init__(self, drafter, target, tev_config: TEVConfig):
        self.drafter, self.target, self.budget = drafter, target, tev_config.largest_tree
        self.builder = TREE_BUILDERS[tev_config.tree]
        self.lookup = self.lookup_stats = None
        if tev_config.lookup:
            self.lookup = ContextIndex(
                tev_config.lookup_min_ngram,
                tev_config.lookup_max_ngram,
                tev_config.lookup_length,
                tev_config.lookup_branches,
            )
            self.lookup_stats = LookupStats()
        self.context = self.context_positions = None  # committed tokens not yet in the drafter's cache
        self.hidden_indices = None if drafter is None else drafter.target_hidden_indices
        if drafter is None:
            return
        self.block_size = tev_config.block_size or drafter.config.block_size
        self.cache = drafter.new_cache()
        device = target.get_input_embeddings().weight.device
        self.block_ids = torch.full((1, self.block_size), drafter.config.mask_token_id, dtype=torch.long, device=device)
        self.block_offsets = torch.arange(self.block_size, device=device)[None]  # [1, L]

    def features(self, hidden_states, rows=None) -> torch.Tensor | None:
        """The drafter's context features `[1, c, k * hidden]` from a target output's hidden states (the `rows`
        of the accepted path); None without a drafter."""
        if self.drafter is None:
            return None
        features = self.drafter.context_features(hidden_states)
        return features if rows is None else features[:, rows]

    def update_candidate_strategy(self, features, positions: torch.LongTensor, tokens: list[int] | None = None):
        """Stage 5: the newly committed tokens (host ids, for the context index), their target features
        `[1, c, k * hidden]` and positions `[1, c]`."""
        if self.lookup is not None and tokens:
            self.lookup.extend(tokens)
        if features is None:
            return
        if self.context is None:
            self.context, self.context_positions = features, positions
        else:
            self.context = torch.cat([self.context, features], dim=1)
            self.context_positions = torch.cat([self.context_positions, positions], dim=1)

    def draft(self, root: torch.LongTensor, root_position: int, max_depth: int, budget: int | None = None):
        """Stage 1: drafter log-probs `[d, V]` of depths 1..d, or None when no tree can be drafted.

        Args:
            root (`torch.LongTensor` of shape `(1,)`): the not-yet-verified token that starts the block.
            root_position (`int`): its position id.
            max_depth (`int`): the deepest depth that can still be emitted (fewer tokens may remain).
            budget (`int`, *optional*): this cycle's largest tree (default: the configured budget).

        The block is always the drafter's full block (it is trained on full blocks and attends inside them
        bidirectionally); only the LM head is limited to the `d = min(L - 1, max_depth, budget)` usable depths.
        """
        if self.drafter is None:
            return None
        depths = min(self.block_size - 1, max_depth, self.budget if budget is None else budget)
        if depths <= 0:
            return None
        self.block_ids[:, :1] = root.view(1, 1)
        positions = torch.cat([self.context_positions, root_position + self.block_offsets], dim=1)
        logits = self.drafter.draft_logits(
            self.target, self.context, self.block_ids, positions, cache=self.cache, num_depths=depths
        )  # [1, d, V]
        self.context = self.context_positions = None  # in the drafter's cache now
        return torch.log_softmax(logits[0].float(), dim=-1)

    def build(self, draft_logprobs, root, size_rule=None, budget: int | None = None, max_depth: int | None = None):
        """Stage 2: the tree of at most `budget` nodes (default: the configured budget; fewer where `size_rule`
        stops it, see `hf_tev.budget`), with the context's continuations when lookup is on; the root alone
        when nothing was proposed (a plain decoding step). `max_depth` bounds the context's continuations (the
        drafter's depths are bounded in `draft`)."""
        budget = self.budget if budget is None else budget
        if self.lookup is not None:
            continuations = self.lookup.continuations(int(root))  # one host read of the root
            if max_depth is not None:
                continuations = [(tokens[:max_depth], n) for tokens, n in continuations if max_depth > 0]
            self.continuations = continuations
            return build_merged_tree(
                draft_logprobs, budget, root, continuations, self.lookup_stats, size_rule, device=root.device
            )
        if draft_logprobs is None:
            return chain_tree(root.new_zeros((0, 1), dtype=torch.float32), 0, root)
        return self.builder(draft_logprobs, budget, root, size_rule=size_rule)

    def observe(self, tree: DraftTree, path: list[int]) -> None:
        """The verifier's outcome (accepted node indices, host): what the lookup statistics learn from."""
        if self.lookup_stats is not None:
            self.lookup_stats.update(tree, path)

    def get_candidates(self, root: torch.LongTensor, root_position: int, max_depth: int) -> DraftTree:
        """Draft and build one tree (stages 1 and 2 together, for callers that do not time them apart)."""
        return self.build(self.draft(root, root_position, max_depth), root)


# --------------------------------------------------------------------------------------------------------
# Stages 0 and 3: target forwards
# --------------------------------------------------------------------------------------------------------
def prefill(model, drafter, input_ids, cache, attention_mask=None, position_ids=None, chunk_size=None):
    """Stage 0: the prompt's tokens that `cache` does not hold yet, into `cache`.

    For an empty cache that is the whole prompt; for a pre-filled cache of `past` tokens (a continuation,
    `generate(out.sequences, cache=out.cache)`) only `input_ids[:, past:]`, and the drafter's context starts
    there. `chunk_size` splits the forward into chunks of that many tokens (generate's `prefill_chunk_size`).

    Returns:
        `(logits, features, positions, pad_columns)`: raw next-token logits `[R, V]` float32, the drafter's
        context features `[R, n, k * hidden]` of the new tokens and their position ids `[R, n]` (for one prompt,
        pad rows of a left-padded prompt dropped: the drafter never sees them; a batch keeps every column, its
        caller drops each row's pads), and the pad columns the tree mask must keep hidden (`None` without
        padding, and for a batch).
    """
    past, length = cache.get_seq_length(), input_ids.shape[1]
    if position_ids is None:
        position_ids = torch.arange(length, device=input_ids.device)[None]
    step = chunk_size or length - past
    features = []
    for start in range(past, length, step):
        end = min(start + step, length)
        out = model(
            input_ids=input_ids[:, start:end],
            attention_mask=None if attention_mask is None else attention_mask[:, :end],
            position_ids=position_ids[:, start:end],
            cache=cache,
            output_hidden_states=None if drafter is None else drafter.target_hidden_indices,
            logits_to_keep=1,
            use_cache=True,
        )
        if drafter is not None:
            features.append(drafter.context_features(out.hidden_states))  # [1, end - start, k * H]
    features = None if not features else features[0] if len(features) == 1 else torch.cat(features, dim=1)
    positions, pad_columns = position_ids[:, past:], None
    if attention_mask is not None and input_ids.shape[0] == 1 and not bool(attention_mask.all()):
        real = attention_mask[0].bool()
        pad_columns = (~real).nonzero(as_tuple=True)[0]
        positions = positions[:, real[past:]]
        features = None if features is None else features[:, real[past:]]
    return out.logits[:, -1].float(), features, positions, pad_columns


def tree_forward(model, tree, cache, mask: torch.Tensor, position_ids: torch.LongTensor, hidden_indices):
    """Stage 3: ONE target forward over the tree's tokens with the tree mask, appended to `cache`.

    `tree` is a `DraftTree`, or for a batch the rows' trees padded to N nodes, `[R, N]` token ids (mask
    `[R, 1, N, past + N]`, position ids `[R, N]`, see `BatchTreeInputs`).
    Returns the model output: `logits` `[R, N, V]` of every node and the `hidden_states` the drafter reads.
    A one-prompt tree on a target with sliding-window layers gets the mask per layer type (`hf_tev.target_layers`;
    batches refuse such targets).
    """
    return model(
        input_ids=tree if isinstance(tree, torch.Tensor) else tree.tokens[None],
        position_ids=position_ids,
        attention_mask=mask if isinstance(tree, torch.Tensor) else tree_attention_masks(model, tree.depths, mask),
        cache=cache,
        output_hidden_states=hidden_indices,
        logits_to_keep=0,
        use_cache=True,
    )


# --------------------------------------------------------------------------------------------------------
# Stage 4: the verifier stage (logits processing per node, decision, cache commit)
# --------------------------------------------------------------------------------------------------------
# The contract for logits processors: every tree node is one row of a call, with that node's own sequence
# (committed tokens + its path from the root) as its `input_ids` row; nodes of one depth share a call. So a
# processor must be a function of (input_ids row, scores row) alone: how many calls are made, and how many rows
# each has, differ from plain generate. transformers' own processors below are such functions.
#
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
_WARNED_PROCESSORS: set = set()  # classes already warned about (once per process, like warnings' default)


def processors_for_tree(logits_processor) -> LogitsProcessorList:
    """generate's processors as the tree decoder calls them: `prefix_allowed_tokens_fn` per node with its batch
    row, and a one-time warning for every processor class outside transformers' own pure ones (the contract
    above: a processor that keeps state across calls gives output different from plain generate)."""
    processors = LogitsProcessorList()
    for processor in logits_processor:
        if type(processor) is PrefixConstrainedLogitsProcessor:
            processor = PerRowPrefixConstraint(processor)
        ignored = getattr(processor, "prompt_ignore_length", None)  # the repetition penalty's padding lengths
        if (
            type(processor) is RepetitionPenaltyLogitsProcessor
            and isinstance(ignored, torch.Tensor)
            and len(ignored) == 1
        ):
            processor = _processor_for_row(processor, 0)  # one prompt's padding length, for calls of many nodes
        kind = type(processor)
        if kind not in INPUT_IDS_PURE_PROCESSORS and kind not in _WARNED_PROCESSORS:
            _WARNED_PROCESSORS.add(kind)
            warnings.warn(
                f"hf_tev tree decoding calls logits processors once per tree depth per cycle, each row one tree node "
                f"with that node's own input_ids (committed tokens + its path). {kind.__name__} is not one of "
                "transformers' row-wise or input_ids-pure processors: if it keeps state across calls (counts "
                "calls, remembers earlier rows), its output differs from plain generate.",
                UserWarning,
                stacklevel=4,
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
    # path_tokens[u, d] = token of u's ancestor at depth d (root at depth 0).
    num_nodes = tree.num_nodes
    node, ancestor = tree.visibility.nonzero(as_tuple=True)
    path_tokens = tree.tokens.new_zeros(num_nodes, tree.max_depth + 1)
    path_tokens[node, tree.depths[ancestor]] = tree.tokens[ancestor]
    scores = torch.empty_like(logits)
    for depth in range(tree.max_depth + 1):
        rows = (tree.depths == depth).nonzero(as_tuple=True)[0]
        ids = torch.cat([committed_ids.expand(rows.numel(), -1), path_tokens[rows, : depth + 1]], dim=1)
        scores[rows] = logits_processor(ids, logits[rows])
    return scores


def commit_accepted_path(cache: DynamicCache, past: int, path: torch.Tensor, path_is_prefix: bool) -> None:
    """Keep only the accepted path's rows of the tree window appended after `past` cached positions.

    Rows `past + path` move to `past .. past + len(path) - 1` on every layer, then the rest is cropped.
    When the path is the first `len(path)` nodes (often: node order is best-first), nothing moves.

    For a batch, `path` is `[R, K]`: each row's accepted nodes padded to the longest path K (repeating its last
    node); the rows move in one gather per layer and the window is cropped to `past + K`. A row whose path is
    shorter than K keeps holes in its last `K - len` columns, which its mask hides (`BatchTreeInputs`).
    """
    kept = path.shape[-1]
    if not path_is_prefix:
        index = past + path
        for layer in cache.layers:
            if layer.keys is None:  # a KV-sharing layer (Gemma 4) that stores nothing of its own
                continue
            if path.dim() == 1:
                layer.keys[:, :, past : past + kept] = layer.keys.index_select(2, index)
                layer.values[:, :, past : past + kept] = layer.values.index_select(2, index)
                continue
            for states in (layer.keys, layer.values):  # [R, heads, past + N, head_dim]
                rows = index[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[3])
                states[:, :, past : past + kept] = states.gather(2, rows)
    excess = cache.get_seq_length() - (past + kept)
    if excess:
        cache.crop(-excess)


def verifier_stage(tree, logits, committed_ids, logits_processor, verify, generator, cache, past):
    """Stage 4, the verifier stage the paper times: per-node logits processing, the decision, the cache commit.

    Args:
        logits (`torch.FloatTensor` of shape `(N, V)`): raw target logits of the tree pass, float32.
        committed_ids (`torch.LongTensor` of shape `(1, past)`): the tokens in the cache.
        verify: a verifier of `hf_tev.verify.VERIFIERS` (`"greedy"` for greedy decoding).
        cache: the target cache whose tree window after `past` keeps the accepted path; None leaves it as it is.
    Returns:
        `(path, bonus, processed)`: accepted node indices root first `[k + 1]` (on the host, as the verifiers
        return it: indexing device tensors with it needs no sync), the bonus token (0-dim, on the device) and the
        processed scores `[N, V]` (each verifier normalises only the rows it needs).
    """
    processed = process_tree_logits(logits_processor, committed_ids, tree, logits)
    if tree.num_nodes == 1:  # the root alone, a plain decoding step: its bonus is the target's own next token
        return (
            torch.zeros(1, dtype=torch.long),
            next_token(processed, verify is not VERIFIERS["greedy"], generator)[0],
            processed,
        )
    path, bonus = verify(tree, processed, generator=generator)  # path on the host: the verifier's one host sync
    if cache is not None:  # (a batch commits every row's path at once: `batch_verifier_stage`)
        is_prefix = bool((path == torch.arange(path.numel())).all())
        commit_accepted_path(cache, past, path.to(logits.device, non_blocking=True), is_prefix)
    return path, bonus, processed


# --------------------------------------------------------------------------------------------------------
# Batches (SPEC section 10): one tree pass for every row's tree, each row's cache kept with masked holes
# --------------------------------------------------------------------------------------------------------
class BatchTreeInputs:
    """The batch's tree-pass inputs, and which committed cache columns each row must not see.

    All rows share one cache layout `[R, heads, C, head_dim]`. A row does not see its left padding, nor the
    holes it keeps when it accepts a shorter path than the longest of the cycle (`commit_accepted_path` crops
    the window to the longest path); `hidden` `[R, C]` marks those columns. A row sees its own committed tokens
    at their own position ids, so its attention is the one it would have alone (the hidden columns add exact
    zeros). `compact` removes holes once they are a large share of the cache; `select` drops finished rows.

    Args:
        hidden (`torch.BoolTensor` of shape `(R, C)`): committed columns each row must not see.
        dtype (`torch.dtype`): the target's floating dtype (the additive mask's).
    """

    def __init__(self, hidden: torch.Tensor, dtype: torch.dtype):
        self.hidden, self.dtype, self.min = hidden, dtype, torch.finfo(dtype).min

    def __call__(self, trees: list[DraftTree], past: int, first_positions: list[int]):
        """`(tokens [R, N], mask [R, 1, N, past + N], position_ids [R, N])` for the rows' trees padded to the
        largest node count N. A padding node sees only itself and no node sees it; its outputs are ignored."""
        rows, nodes, device = len(trees), max(tree.num_nodes for tree in trees), self.hidden.device
        tokens = torch.zeros(rows, nodes, dtype=torch.long, device=device)
        depths = torch.zeros(rows, nodes, dtype=torch.long, device=device)
        visible = torch.eye(nodes, dtype=torch.bool, device=device).repeat(rows, 1, 1)  # [R, N, N]
        for i, tree in enumerate(trees):
            n = tree.num_nodes
            tokens[i, :n], depths[i, :n] = tree.tokens, tree.depths
            visible[i, :n, :n] = tree.visibility
        mask = torch.zeros(rows, 1, nodes, past + nodes, dtype=self.dtype, device=device)
        mask[..., :past].masked_fill_(self.hidden[:, None, None, :past], self.min)
        mask[:, 0, :, past:].masked_fill_(~visible, self.min)
        positions = depths + torch.tensor(first_positions, device=device)[:, None]
        return tokens, mask, positions

    def commit(self, lengths: list[int]) -> None:
        """The cache grew by the longest accepted path; row i keeps `lengths[i]` of those columns."""
        window = torch.arange(max(lengths), device=self.hidden.device)
        holes = window[None] >= torch.tensor(lengths, device=self.hidden.device)[:, None]  # [R, K]
        self.hidden = torch.cat([self.hidden, holes], dim=1)

    def select(self, cache: DynamicCache, keep: list[int]) -> None:
        """Keep only rows `keep` (in that order) of the cache and the mask state."""
        self.hidden = select_rows(cache, self.hidden, keep)

    def compact(self, cache: DynamicCache, min_share: float = 0.25) -> bool:
        """`compact_columns` of the cache and the mask state; whether it compacted."""
        hidden = compact_columns(cache, self.hidden, min_share)
        if hidden is None:
            return False
        self.hidden = hidden
        return True


def select_rows(cache: DynamicCache, hidden: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """Keep only rows `keep` (in that order) of a batch cache; returns their `hidden` `[len(keep), C]`."""
    index = torch.tensor(keep, dtype=torch.long, device=hidden.device)
    cache.batch_select_indices(index)
    return hidden[index]


def compact_columns(cache: DynamicCache, hidden: torch.Tensor, min_share: float = 0.25) -> torch.Tensor | None:
    """When at least `min_share` of a batch cache's columns can go (no row needs them), move every row's
    visible columns to the right end (in order; a row with fewer keeps hidden columns on the left, like left
    padding) and drop the rest: one gather per layer, so a full copy only every so often. Returns the new
    `hidden` `[R, C']`, or None when nothing was done."""
    columns = hidden.shape[1]
    kept = int((~hidden).sum(dim=1).max()) if hidden.shape[0] else 0
    if columns - kept < max(1.0, min_share * columns):
        return None
    # a stable sort puts each row's hidden columns first and its visible ones after, each in order
    index = torch.argsort((~hidden).to(torch.int8), dim=1, stable=True)[:, columns - kept :]  # [R, kept]
    for layer in cache.layers:
        for name in ("keys", "values"):
            states = getattr(layer, name)
            rows = index[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[3])
            setattr(layer, name, states.gather(2, rows))
    return hidden.gather(1, index)


class BatchDrafter:
    """Stage 1 for a batch: every row's block in ONE drafter call.

    The drafter's context K/V of every row live in one cache with masked holes, like the target's
    (`BatchTreeInputs`): each call appends every row's waiting context rows (the features of the tokens it
    committed since its last draft, different counts per row) padded to the longest, and the padding stays
    hidden from that row's blocks. Rows that leave the batch leave this cache too (`select`); holes go when
    they are a large share (`compact`). A row drafts what it would draft alone (up to rounding).
    """

    def __init__(self, drafter, target, rows: int, device):
        self.drafter, self.target = drafter, target
        self.cache = drafter.new_cache()
        self.hidden = torch.zeros(rows, 0, dtype=torch.bool, device=device)  # [R, C]: the cache's hidden columns

    def draft(self, rows: list[_BatchRow], max_depths: list[int], budget: int | None) -> list[torch.Tensor | None]:
        """Each row's drafter log-probs `[d_i, V]` of depths 1..d_i (None where no depth can be used),
        `d_i = min(L - 1, max_depths[i], budget)` as `DFlashTreeCandidateGenerator.draft` for one prompt."""
        candidates = [row.candidates for row in rows]
        block, budget = candidates[0].block_size, candidates[0].budget if budget is None else budget
        depths = [min(block - 1, depth, budget) for depth in max_depths]
        if max(depths) <= 0:
            return [None] * len(rows)
        device = self.hidden.device
        counts = [c.context.shape[1] for c in candidates]
        width = max(counts)
        features = candidates[0].context.new_zeros(len(rows), width, candidates[0].context.shape[2])
        positions = torch.zeros(len(rows), width + block, dtype=torch.long, device=device)
        padding = torch.ones(len(rows), width, dtype=torch.bool, device=device)  # [R, width]: the new holes
        block_ids = candidates[0].block_ids.repeat(len(rows), 1)  # [R, L]: [root, MASK, ...]
        for i, (row, c, count) in enumerate(zip(rows, candidates, counts, strict=True)):
            features[i, :count], positions[i, :count] = c.context[0], c.context_positions[0]
            positions[i, width:] = row.next_position + c.block_offsets[0]
            padding[i, :count] = False
            block_ids[i, 0] = row.root[0]
            c.context = c.context_positions = None  # in the batch's drafter cache now
        visible = torch.cat([~self.hidden, ~padding, torch.ones_like(block_ids, dtype=torch.bool)], dim=1)
        logits = self.drafter.draft_logits(
            self.target,
            features,
            block_ids,
            positions,
            cache=self.cache,
            num_depths=max(depths),
            attention_mask=visible,
        )  # [R, max d, V]
        self.hidden = torch.cat([self.hidden, padding], dim=1)
        return [torch.log_softmax(logits[i, :d].float(), dim=-1) if d > 0 else None for i, d in enumerate(depths)]

    def select(self, keep: list[int]) -> None:
        self.hidden = select_rows(self.cache, self.hidden, keep)

    def compact(self) -> None:
        hidden = compact_columns(self.cache, self.hidden)
        if hidden is not None:
            self.hidden = hidden


def batch_verifier_stage(trees, logits, committed_ids, logits_processors, verify, generator, cache, past):
    """Stage 4 for a batch: `verifier_stage` for every row's tree, then one commit of every row's path.

    Args:
        logits (`torch.FloatTensor` of shape `(R, N, V)`): raw target logits of the batch's tree pass, float32.
        committed_ids (`list` of `torch.LongTensor` of shape `(1, past_i)`): each row's committed tokens (its
            left padding included, as plain batched generate's processors see them).
        logits_processors (`list` of `LogitsProcessorList`): each row's processors (`processors_for_row`).
    Returns:
        `(paths, bonuses, processed)`, one entry per row, as `verifier_stage` returns them; the cache window
        after `past` holds every row's path in its first columns (see `commit_accepted_path`).
    """
    paths, bonuses, processed = [], [], []
    for i, tree in enumerate(trees):
        path, bonus, scores = verifier_stage(
            tree, logits[i, : tree.num_nodes], committed_ids[i], logits_processors[i], verify, generator, None, past
        )
        paths.append(path)
        bonuses.append(bonus)
        processed.append(scores)
    longest = max(path.numel() for path in paths)
    padded = torch.stack([torch.cat([path, path[-1:].expand(longest - path.numel())]) for path in paths])
    is_prefix = bool((padded == torch.arange(longest)).all())
    commit_accepted_path(cache, past, padded.to(logits.device, non_blocking=True), is_prefix)
    return paths, bonuses, processed


def processors_for_row(logits_processor: LogitsProcessorList, row: int) -> LogitsProcessorList:
    """The processors of batch row `row`, each of whose calls takes that row's tree nodes as its rows:
    `prefix_allowed_tokens_fn` is called with `batch_id=row`, and the repetition penalty skips the row's own
    left padding (generate gives it every row's padding length, one per batch row)."""
    return LogitsProcessorList(_processor_for_row(p, row) for p in logits_processor)


def _processor_for_row(processor, row: int):
    if type(processor) is PerRowPrefixConstraint and row:
        return PerRowPrefixConstraint(processor.processor, batch_id=row)
    if type(processor) is RepetitionPenaltyLogitsProcessor and isinstance(processor.prompt_ignore_length, torch.Tensor):
        return RepetitionPenaltyLogitsProcessor(processor.penalty, int(processor.prompt_ignore_length[row]))
    return processor


@dataclass
class _BatchRow:
    """One prompt of a batch while it decodes: its own sequence, drafter state, budget and statistics."""

    index: int  # its row in the caller's batch
    sequence: torch.Tensor  # [1, L]: the padded prompt, the committed tokens and the root
    next_position: int  # the root's position id
    candidates: DFlashTreeCandidateGenerator
    processors: LogitsProcessorList
    stats: TEVStats
    tree: DraftTree | None = None
    draft_logprobs: torch.Tensor | None = None
    draft_s: float = 0.0
    build_s: float = 0.0

    @property
    def root(self) -> torch.Tensor:
        return self.sequence[0, -1:]


def _decode_batch(model, input_ids, logits_processor, stopping_criteria, generation_config, drafter, tev_config, **kw):
    """The tree decoding loop for R > 1 left-padded prompts (SPEC section 10); each row's output is the one
    `tree_speculative_decode` gives for it alone.

    Each cycle one drafter call drafts every unfinished row's block (`BatchDrafter`) and each row builds its own
    tree (with `budget="auto"` one size for every row, `_draft_and_build_batch`); ONE target forward runs all trees
    padded to a common node count; each row's verifier decides its path and the cache keeps every row's path
    (`batch_verifier_stage`, `BatchTreeInputs`). A row that stops leaves the batch and the cache at once, so it
    costs nothing further.
    """
    attention_mask = kw.get("attention_mask")
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    device, do_sample, width = input_ids.device, generation_config.do_sample, input_ids.shape[1]
    verify = VERIFIERS[tev_config.verifier if do_sample else "greedy"]
    generator = None if tev_config.seed is None else torch.Generator(device=device).manual_seed(tev_config.seed)
    lookup, return_dict = tev_config.lookup, generation_config.return_dict_in_generate
    clock = StageClock(device)
    cache = DynamicCache(config=model.config)
    if sliding_window(model) is not None or any(type(layer) is not DynamicLayer for layer in cache.layers):
        # the batch's holed cache columns would shift each row's window: the windowed tree mask is one-prompt only
        raise ValueError(
            "hf_tev tree decoding of a batch supports full-attention models only; this model has sliding-window "
            f"attention (window {sliding_window(model)}; cache layers "
            f"{sorted({type(layer).__name__ for layer in cache.layers})}): decode its prompts one at a time."
        )

    # 0. Prefill: every prompt at once, each row's real tokens at positions 0, 1, ... as it would be alone (as
    # generate's own position ids for a left-padded batch).
    positions = kw.get("position_ids")
    if positions is None:
        positions = (real.long().cumsum(dim=-1) - 1).clamp(min=0)  # [R, n]
    raw, features, _, _ = prefill(
        model, drafter, input_ids, cache, attention_mask, positions, generation_config.prefill_chunk_size
    )
    rows, done = [], {}  # unfinished rows (in cache order); finished: index -> (sequence, stats)
    auto = None
    if tev_config.is_auto:  # one size for the batch, against the cost of the batch's cycle (see README)
        auto = automatic_budget(model, drafter, tev_config, generation_config, batch=input_ids.shape[0])
    for r in range(input_ids.shape[0]):
        candidates = DFlashTreeCandidateGenerator(drafter, model, tev_config)
        keep = real[r]
        candidates.update_candidate_strategy(
            None if features is None else features[r : r + 1, keep],
            positions[r : r + 1, keep],
            input_ids[r, keep].tolist() if lookup else None,
        )
        processors = processors_for_row(logits_processor, r)
        root = next_token(processors(input_ids[r : r + 1], raw[r : r + 1]), do_sample, generator)  # [1]
        row = _BatchRow(
            r, torch.cat([input_ids[r : r + 1], root[None]], 1), int(positions[r, -1]) + 1, candidates, processors,
            TEVStats(),
        )  # fmt: skip
        stop = first_stop(stopping_criteria, row.sequence, width)
        if stop is None:
            rows.append(row)
        else:
            done[r] = (row.sequence[:, : stop + 1], row.stats)
    inputs = BatchTreeInputs(~real, model.dtype)
    drafts = None if drafter is None else BatchDrafter(drafter, model, len(rows), device)
    if len(rows) < input_ids.shape[0]:
        inputs.select(cache, [row.index for row in rows])
    if rows and auto is not None and not auto.cost.probed:
        auto.cost.set_probe(*probe_batch_costs(model, cache, inputs, rows, tev_config.max_budget + 1))
    prefill_s = clock.lap()
    for row in rows:
        row.stats.prefill_time = prefill_s

    while rows:
        past = cache.get_seq_length()
        # 1.-2. Every row drafts and builds its own tree (with `auto`, of one size for the batch).
        _draft_and_build_batch(rows, drafts, auto, generation_config.max_length, lookup, clock)
        # 3. ONE target forward over every row's tree.
        tokens, mask, position_ids = inputs([row.tree for row in rows], past, [row.next_position for row in rows])
        hidden_indices = rows[0].candidates.hidden_indices
        out = tree_forward(model, tokens, cache, mask, position_ids, hidden_indices)
        logits = out.logits.float()  # [R, N, V]
        forward_s = clock.lap()
        # 4. Verifier stage: every row's decision, one cache commit.
        paths, bonuses, processed = batch_verifier_stage(
            [row.tree for row in rows],
            logits,
            [row.sequence[:, :-1] for row in rows],
            [row.processors for row in rows],
            verify,
            generator,
            cache,
            past,
        )
        inputs.commit([path.numel() for path in paths])
        verify_s = clock.lap()
        # 5. Commit per row: drafter context, tokens, stop, statistics.
        features = rows[0].candidates.features(out.hidden_states)  # [R, N, k * H] or None
        del out
        finished = []
        for i, (row, path, bonus) in enumerate(zip(rows, paths, bonuses, strict=True)):
            tree, accepted, start = row.tree, path.numel(), row.sequence.shape[1]
            row.sequence = torch.cat([row.sequence, tree.tokens[path[1:]][None], bonus.view(1, 1)], dim=1)
            row.candidates.update_candidate_strategy(
                None if features is None else features[i : i + 1, path],
                torch.arange(row.next_position, row.next_position + accepted, device=device)[None],
                row.sequence[0, start - 1 : -1].tolist() if lookup else None,
            )
            row.next_position += accepted
            stop = first_stop(stopping_criteria, row.sequence, start)
            if stop is not None:
                row.sequence = row.sequence[:, : stop + 1]
                finished.append(i)
            stats, path_nodes = row.stats, path.tolist()
            stats.record(accepted, tree.num_nodes - 1, row.draft_s, row.build_s, forward_s, verify_s)
            stats.pass_rows.append(len(rows))
            stats.pass_nodes.append(tokens.shape[1])
            stats.count_sources(tree.node_info.sources if tree.node_info else None, path_nodes)
            row.candidates.observe(tree, path_nodes)
            if return_dict:
                plain = not do_sample or tree.num_nodes == 1
                stats.coverages.append(float(accepted) if plain else float(target_flow(tree, processed[i])[0].sum()))
        rest_s = clock.lap()
        if auto is not None:
            outcomes = [(row.tree.path_logprobs, path.tolist()) for row, path in zip(rows, paths, strict=True)]
            auto.observe_batch(outcomes, tokens.shape[1] - 1, forward_s, verify_s + rest_s)
        # Finished rows leave the batch and the cache; holes go once they are a large share of the cache.
        if finished:
            for i in finished:
                done[rows[i].index] = (rows[i].sequence, rows[i].stats)
            rows = [row for i, row in enumerate(rows) if i not in finished]
            if rows:
                keep = [i for i in range(len(paths)) if i not in finished]
                inputs.select(cache, keep)
                if drafts is not None:
                    drafts.select(keep)
        if rows:
            inputs.compact(cache)
            if drafts is not None:
                drafts.compact()

    # Outputs: rows padded after their end with the pad token, as plain batched generate pads finished rows.
    sequences = [done[r][0] for r in range(input_ids.shape[0])]
    length = max(sequence.shape[1] for sequence in sequences)
    pad = generation_config._pad_token_tensor
    if pad is None and any(sequence.shape[1] < length for sequence in sequences):
        raise ValueError(
            "Rows of the batch stopped at different lengths and there is no `pad_token_id` (nor EOS) to pad the "
            "shorter ones with: pass `pad_token_id=`."
        )
    result = torch.full((len(sequences), length), 0 if pad is None else int(pad.view(-1)[0]), device=device)
    for r, sequence in enumerate(sequences):
        result[r, : sequence.shape[1]] = sequence[0]
    if not return_dict:
        return result
    stats = [done[r][1] for r in range(input_ids.shape[0])]
    if auto is not None:
        for row_stats in stats:
            row_stats.budget_model = auto.cost.summary()
    return TEVGenerateOutput(sequences=result, tev_stats=stats)


def _draft_and_build_batch(rows, drafts: BatchDrafter | None, auto: CostAwareBudget | None, max_length, lookup, clock):
    """Stages 1 and 2 for every row of a batch: one drafter call for every row (`BatchDrafter`), then each row's
    tree; sets each row's `tree`, `draft_s` (the batch's drafter call) and `build_s`.

    A fixed budget: every row's tree as it would be alone. `budget="auto"`: one size n for every row's tree
    (`CostAwareBudget.common_size`: the most expected tokens per second of the whole batch, whose pass pays for
    the largest tree in every row), the drafter on or paused for the whole batch; each row's tree is built at
    the cap, then cut to its first n nodes (best-first trees are nested). Like any size fixed before the
    target's pass, this keeps every verifier exact."""
    cap = None if auto is None else auto.cap()
    max_depths = [max_length - row.sequence.shape[1] - 1 for row in rows]
    clock.lap()
    drafted = [None] * len(rows)
    if drafts is not None and (auto is None or auto.should_draft()):
        drafted = drafts.draft(rows, max_depths, cap)
    draft_s = clock.lap()
    for row, draft_logprobs, max_depth in zip(rows, drafted, max_depths, strict=True):
        row.draft_logprobs, row.draft_s = draft_logprobs, draft_s
        row.tree = row.candidates.build(draft_logprobs, row.root, None, cap, max_depth)
        row.build_s = clock.lap()
    if auto is None:
        return
    drafted = any(row.draft_logprobs is not None for row in rows)
    if not (drafted or lookup):
        for row in rows:
            row.stats.predicted_lengths.append(1.0)
        return
    if drafted:
        auto.cost.observe_draft(draft_s)
    size, lengths = auto.common_size([(row.tree.path_logprobs or [0.0])[1:] for row in rows], drafted)
    auto.chose(size, drafted)
    for row, length in zip(rows, lengths, strict=True):
        clock.lap()
        row.tree = row.tree.truncated(size + 1)
        row.build_s += clock.lap()
        row.stats.predicted_lengths.append(length)


def probe_batch_costs(model, cache, inputs: BatchTreeInputs, rows, max_tokens: int, repeats: int = 2):
    """`probe_tree_costs` for a batch: seconds of one tree pass of every row over 1, 2, 4, ... `max_tokens` tokens
    per row (the best of `repeats`), the cache left as it was."""
    past = cache.get_seq_length()
    clock = StageClock(cache.layers[0].keys.device)
    sizes = [1 << i for i in range(max_tokens.bit_length()) if (1 << i) <= max_tokens]
    if max_tokens > 1.25 * sizes[-1]:
        sizes.append(max_tokens)
    seconds = []
    for size in sizes:
        no_logprobs = torch.zeros(size - 1, 1)
        chains = [chain_tree(no_logprobs, size - 1, row.root) for row in rows]
        best = math.inf
        for _ in range(repeats):
            clock.lap()
            tokens, mask, positions = inputs(chains, past, [row.next_position for row in rows])
            tree_forward(model, tokens, cache, mask, positions, rows[0].candidates.hidden_indices)
            best = min(best, clock.lap())
            cache.crop(past - cache.get_seq_length())
        seconds.append(best)
    return sizes, seconds


# --------------------------------------------------------------------------------------------------------
# The automatic budget's state: calibration per (drafter, target, sampling), cost per (target, device, dtype),
# and the budget itself (its pauses, probes and cap) per both: a call continues where the last one stopped
# --------------------------------------------------------------------------------------------------------
_CALIBRATIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # drafter -> {key: calibration}
_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> {key: CycleCost}
_BUDGETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # drafter -> {key: CostAwareBudget}
# A target's number in those keys. Not `id(target)`: a target made after another was freed may get its address,
# and would inherit its calibration and budget.
_TARGET_NUMBERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TARGET_COUNTER = itertools.count()


def _target_number(model) -> int:
    if model not in _TARGET_NUMBERS:
        _TARGET_NUMBERS[model] = next(_TARGET_COUNTER)
    return _TARGET_NUMBERS[model]


def automatic_budget(model, drafter, tev_config: TEVConfig, generation_config, batch: int = 1) -> CostAwareBudget:
    """The `CostAwareBudget` of these models and settings (for one row of a batch of `batch` prompts), with the
    calibration and cost model learnt by earlier calls (kept as long as the models live). A batch's cost model
    is the pass of `batch` rows: it has its own entry per batch size.

    The budget itself is kept too: a call starts with the drafter's pause and the cap the last call on the same
    models left (only its probes start over, `CostAwareBudget.start_call`). Short calls would otherwise each
    start by trying the drafter after 1, 2, 4, ... cycles, and where it does not pay (the kit at T = 1) those
    tries are most of the cost of `budget="auto"`."""
    sampling = (generation_config.do_sample, generation_config.temperature if generation_config.do_sample else 0)
    owner = model if drafter is None else drafter  # lookup alone: the calibration of the target's context drafts
    key = (_target_number(model), sampling, tev_config.lookup)
    calibration = _CALIBRATIONS.setdefault(owner, {}).setdefault(key, AcceptanceCalibration())
    device = model.get_input_embeddings().weight.device
    cost_key = (str(device), model.dtype, torch.get_num_threads(), model.config._attn_implementation)
    if batch > 1:
        cost_key += (batch,)
    cost = _COSTS.setdefault(model, {}).setdefault(cost_key, CycleCost())
    budgets = _BUDGETS.setdefault(owner, {})
    budget_key = (key, cost_key, tev_config.max_budget)
    if budget_key not in budgets:
        budgets[budget_key] = CostAwareBudget(tev_config.max_budget, calibration, cost)
    budget = budgets[budget_key]
    budget.start_call()
    return budget


def probe_tree_costs(
    model, cache, tree_inputs: TreeInputs, root, first_position: int, hidden_indices, max_tokens: int, repeats: int = 2
) -> tuple[list[int], list[float]]:
    """Seconds of target tree passes over 1, 2, 4, ... `max_tokens` tokens at the current context (the best of
    `repeats`), the cache left as it was. The automatic budget's shape of t_tree; run once per target,
    device, dtype and thread count."""
    past = cache.get_seq_length()
    clock = StageClock(root.device)
    sizes = [1 << i for i in range(max_tokens.bit_length()) if (1 << i) <= max_tokens]
    if max_tokens > 1.25 * sizes[-1]:
        sizes.append(max_tokens)
    seconds = []
    for size in sizes:
        chain = chain_tree(root.new_zeros((size - 1, 1), dtype=torch.float32), size - 1, root)
        best = math.inf
        for _ in range(repeats):
            clock.lap()
            tree_forward(model, chain, cache, *tree_inputs(chain, past, first_position), hidden_indices)
            best = min(best, clock.lap())
            cache.crop(past - cache.get_seq_length())
        seconds.append(best)
    return sizes, seconds


# --------------------------------------------------------------------------------------------------------
# Loop helpers: stopping, timing, outputs
# --------------------------------------------------------------------------------------------------------
def first_stop(stopping_criteria, sequence: torch.Tensor, start: int, scores=None) -> int | None:
    """Index (into `sequence`) of the first token at or after `start` after which generation stops, or None.

    Plain `generate` checks the criteria after every appended token; so do we, in closed form for the usual
    max-length / EOS criteria and token by token for any other criterion.

    Args:
        scores (`list[torch.FloatTensor]`, *optional*): processed scores of every generated token up to the end
            of `sequence` (kept when `output_scores` is returned). A criterion gets the tuple of those up to the
            token it checks, or None, as in plain `generate`.
    """
    length = sequence.shape[1]
    if all(type(c) in (MaxLengthCriteria, EosTokenCriteria) for c in stopping_criteria):
        stops = [length]
        for criterion in stopping_criteria:
            if type(criterion) is MaxLengthCriteria:
                stops.append(max(start, criterion.max_length - 1))
            else:
                eos = torch.isin(sequence[0, start:], criterion.eos_token_id.to(sequence.device))
                if eos.any():
                    stops.append(start + int(eos.nonzero()[0, 0]))
        stop = min(stops)
        return stop if stop < length else None
    for end in range(start + 1, length + 1):
        seen = None if scores is None else tuple(scores[: len(scores) - (length - end)])
        if stopping_criteria(sequence[:, :end], seen).any():
            return end - 1
    return None


class StageClock:
    """Seconds between consecutive `lap()` calls; on CUDA it synchronises first, so a lap is its stage's work."""

    def __init__(self, device: torch.device):
        self.device, self.sync = device, device.type == "cuda"
        self.last = time.perf_counter()

    def lap(self) -> float:
        if self.sync:
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        return elapsed


class _Outputs:
    """What `generate` returns besides the tokens: scores / raw logits per emitted token, the streamer."""

    def __init__(self, generation_config, streamer):
        self.return_dict = generation_config.return_dict_in_generate
        self.scores = [] if self.return_dict and generation_config.output_scores else None
        self.logits = [] if self.return_dict and generation_config.output_logits else None
        self.use_cache = generation_config.use_cache
        self.streamer = streamer

    def add(self, processed: torch.Tensor, raw: torch.Tensor) -> None:
        """Rows `[k, V]` of the k tokens just emitted (before any cut at a stop)."""
        if self.scores is not None:
            self.scores.extend(processed.unsqueeze(1).unbind(0))
        if self.logits is not None:
            self.logits.extend(raw.unsqueeze(1).unbind(0))

    def stream(self, tokens: torch.Tensor) -> None:
        if self.streamer is not None:
            self.streamer.put(tokens.cpu())

    def result(self, sequence, prompt_length: int, cache, stats: TEVStats):
        if self.streamer is not None:
            self.streamer.end()
        if not self.return_dict:
            return sequence
        length = sequence.shape[1] - prompt_length
        return TEVGenerateOutput(
            sequences=sequence,
            scores=tuple(self.scores[:length]) if self.scores is not None else None,
            logits=tuple(self.logits[:length]) if self.logits is not None else None,
            cache=cache if self.use_cache else None,  # as plain generate, which keeps no cache without use_cache
            tev_stats=stats,
        )


# --------------------------------------------------------------------------------------------------------
# What a call may ask for: every refusal names the option, and comes before any model call
# --------------------------------------------------------------------------------------------------------
def _is_set(value) -> bool:
    return value is not None


def _is_unset(value) -> bool:
    return value is None or (isinstance(value, dict) and not value)


# generate options (GenerationConfig fields) tree decoding refuses: (field, refused when, what the option asks for)
REFUSED_OPTIONS = (
    ("num_beams", lambda v: v not in (None, 1), "beam search (tree decoding keeps one sequence: num_beams=1)"),
    ("num_return_sequences", lambda v: v not in (None, 1), "several sequences per prompt (one only)"),
    ("constraints", _is_set, "constrained beam search"),
    ("force_words_ids", _is_set, "constrained beam search"),
    ("penalty_alpha", lambda v: v is not None and v > 0, "contrastive search"),
    ("dola_layers", _is_set, "DoLa decoding"),
    ("guidance_scale", lambda v: v not in (None, 1), "classifier-free guidance (an unconditional forward per step)"),
    ("use_mtp", bool, "multi-token-prediction self-speculation, another speculative method"),
    ("prompt_lookup_num_tokens", _is_set, "prompt lookup decoding, another speculative method"),
    ("assistant_early_exit", _is_set, "early-exit self-speculation, another speculative method"),
    ("speculation_type", _is_set, "transformers' own speculative path (for its DFlash chain path drop `tev_config`)"),
    ("assistant_ensemble_weight", _is_set, "ensemble verification, which is not lossless (hf_tev's verifiers are)"),
    ("is_assistant", bool, "the model as another model's assistant"),
    ("output_attentions", bool, "returned attentions (output_scores / output_logits are returned)"),
    ("output_hidden_states", bool, "returned hidden states (output_scores / output_logits are returned)"),
    ("cache_implementation", lambda v: v not in (None, "dynamic"), "a cache other than a full-attention DynamicCache"),
    (
        "watermarking_config",
        lambda v: "synthid" in type(v).__name__.lower() or (isinstance(v, dict) and "ngram_len" in v),
        "SynthID watermarking, whose processor keeps state across calls",
    ),
)
# the model kwargs the decoder takes (`use_cache` and `logits_to_keep` it chooses itself per forward)
MODEL_KWARGS = ("attention_mask", "position_ids", "cache", "use_cache", "logits_to_keep")


def _refuse(name: str, value, what: str) -> ValueError:
    shown = repr(value) if isinstance(value, (str, int, float, bool)) else f"<{type(value).__name__}>"
    return ValueError(f"`{name}={shown}` asks for {what}, which hf_tev's tree decoding does not support.")


def _check_supported(model, drafter, input_ids, generation_config, tev_config, model_kwargs):
    """Raise a clear error, naming the option, for everything the tree decoder cannot do exactly as plain
    `generate`; warn when the largest tree takes much memory. Reads shapes and settings only (no model call)."""
    # 1. The drafter (none for tree lookup decoding).
    if drafter is None and not tev_config.lookup:
        raise ValueError(
            "`tev_config` needs `assistant_model=` a DFlash drafter (hf_tev.DFlashDraftModel), or "
            "`TEVConfig(lookup=True)` for tree lookup decoding without a drafter."
        )
    if drafter is not None and not hasattr(drafter, "draft_logits"):
        raise TypeError(
            f"`assistant_model` must be a DFlash drafter (hf_tev.DFlashDraftModel), got {type(drafter).__name__}. "
            "Classic assistant models use transformers' assisted generation: drop `tev_config`."
        )
    if drafter is not None and any(p.is_meta for p in drafter.parameters()):
        raise ValueError(
            "`assistant_model` (the DFlash drafter) is on the meta device (no weights loaded): load its weights "
            "first (DFlashDraftModel.from_pretrained, or from_target for a fresh drafter)."
        )
    # 2. generate options that select something else than one greedy or sampled sequence.
    for name, refused, what in REFUSED_OPTIONS:
        value = getattr(generation_config, name, None)
        if refused(value):
            raise _refuse(name, value, what)
    # 3. Inputs: text input_ids of one prompt, a left-padding mask, a full-attention DynamicCache.
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError(
            "`inputs_embeds` is not supported by hf_tev's tree decoding (the drafter reads the target's features "
            "of token ids): pass `input_ids`."
        )
    # generate sets `mm_encoder_outputs={}` (no pre-encoded images/audio) for a multimodal wrapper's text prompt
    unknown = sorted(k for k, v in model_kwargs.items() if not _is_unset(v) and k not in MODEL_KWARGS)
    if unknown:
        raise ValueError(
            f"hf_tev's tree decoding does not pass {unknown} to the target's forward (it decodes text input_ids "
            "with attention_mask / position_ids / cache only)."
        )
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is not None:
        if not bool(attention_mask.any()):
            raise ValueError("`attention_mask` masks the whole prompt: there is no token to decode from.")
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"`attention_mask` of shape {tuple(attention_mask.shape)} does not cover `input_ids` of shape "
                f"{tuple(input_ids.shape)}: hf_tev's tree decoding takes the full sequence and its full mask."
            )
        if not bool(attention_mask[:, -1].all()):
            rows = (~attention_mask[:, -1].bool()).nonzero()[:, 0].tolist()
            raise ValueError(
                f"`attention_mask` masks the last token of prompt row(s) {rows} (right padding or an empty "
                "prompt); tree decoding takes left-padded prompts whose last token is real "
                "(tokenizer(..., padding_side='left'))."
            )
    check_tree_layers(model)  # target layers that cannot branch in a tree pass, before their cache is looked at
    cache = model_kwargs.get("cache")
    if cache is not None:
        # an empty sliding layer is made full-length; a dummy layer is one that reuses another's K/V (Gemma 4)
        layer_classes = (DynamicLayer, DynamicSlidingWindowLayer, DummyLayer)
        if type(cache) is not DynamicCache or any(type(layer) not in layer_classes for layer in cache.layers):
            raise ValueError(
                f"hf_tev tree decoding supports a full-attention DynamicCache only, got {type(cache).__name__} "
                f"with layers {sorted({type(layer).__name__ for layer in cache.layers})} "
                "(static, quantized and linear-attention caches are not supported; sliding-window layers are kept "
                "at full length)."
            )
        if getattr(cache, "offloading", False):
            raise ValueError("hf_tev tree decoding does not support an offloaded cache (`cache_implementation`).")
        past = cache.get_seq_length()
        if past >= input_ids.shape[1]:
            raise ValueError(
                f"The cache already holds {past} tokens and `input_ids` has {input_ids.shape[1]}: to continue from "
                "a cache, pass the whole sequence (the cache holds all of it but at least the last token, like "
                "the cache generate returns)."
            )
    # 4. Drafter and target together.
    if drafter is not None:
        drafter.check_target(model)
    if drafter is not None and tev_config.block_size is not None and tev_config.block_size > drafter.config.block_size:
        raise ValueError(
            f"TEVConfig.block_size={tev_config.block_size} exceeds the drafter's block_size={drafter.config.block_size}"
        )
    attn = model.config._attn_implementation
    if attn not in TREE_ATTENTION:
        raise ValueError(
            f"The tree pass needs an attention implementation that takes an arbitrary 4D mask ({TREE_ATTENTION}); "
            f"this model uses {attn!r}. Call `model.set_attn_implementation('sdpa')` first."
        )
    # 5. Memory of the largest tree.
    nodes = tev_config.largest_tree + 1
    if tev_config.tree == "chain" and drafter is not None and not tev_config.lookup:
        nodes = min(nodes, (tev_config.block_size or drafter.config.block_size))
    vocab = model.get_output_embeddings().weight.shape[0]
    estimate = tree_memory_bytes(nodes, vocab, generation_config.max_length, model.dtype.itemsize)
    if estimate > TREE_MEMORY_WARNING_BYTES:
        warnings.warn(
            f"TEVConfig: a tree of {nodes} nodes takes about {estimate / 2**30:.1f} GiB per cycle ({nodes} x "
            f"{vocab} logits in several copies, and a {nodes} x {generation_config.max_length + nodes} mask); "
            "lower `budget` (or `max_budget` for budget='auto') if that is too much.",
            UserWarning,
            stacklevel=3,
        )


def _check_batch(input_ids, generation_config, model_kwargs, streamer) -> None:
    """What a batch of prompts cannot ask for (one prompt can), each named before any model call."""
    batch, width = input_ids.shape
    cache = model_kwargs.get("cache")
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError(
            f"A batch of {batch} prompts cannot continue from a pre-filled cache with hf_tev tree decoding: "
            "pass the whole sequences without `cache`, or continue each prompt alone."
        )
    if streamer is not None:
        raise ValueError("A streamer takes one sequence; hf_tev tree decoding of a batch does not stream.")
    for name in ("output_scores", "output_logits"):
        if generation_config.return_dict_in_generate and getattr(generation_config, name, False):
            raise ValueError(
                f"`{name}=True` with a batch of {batch} prompts is not supported by hf_tev tree decoding (rows "
                "emit different numbers of tokens per cycle); decode the prompts one at a time for scores."
            )
    if width >= generation_config.max_length:
        mask = model_kwargs.get("attention_mask")
        lengths = [width] * batch if mask is None else mask.sum(dim=1).tolist()
        rows = [r for r, n in enumerate(lengths) if n >= generation_config.max_length] or list(range(batch))
        raise ValueError(
            f"Prompt row(s) {rows} are at least `max_length`={generation_config.max_length} tokens long (the "
            f"batch is {width} columns with its left padding): nothing can be generated; raise `max_length` "
            "or set `max_new_tokens`."
        )


def next_token(scores: torch.Tensor, do_sample: bool, generator=None) -> torch.LongTensor:
    """The target's own next token from processed scores `[1, V]` -> `[1]` (the prefill's root)."""
    if do_sample:
        return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator)[0]
    return scores.argmax(dim=-1)


# --------------------------------------------------------------------------------------------------------
# The decode loop (a transformers `custom_generate` callable)
# --------------------------------------------------------------------------------------------------------
def tree_speculative_decode(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    *,
    drafter=None,
    tev_config: TEVConfig | dict | None = None,
    streamer=None,
    tokenizer=None,
    **model_kwargs,
):
    """The tree decoding loop, with the signature of a transformers `custom_generate` callable.

    Args:
        input_ids (`torch.LongTensor` of shape `(R, prompt_length)`): the prompt (with a pre-filled `cache`, the
            whole sequence; only the tokens the cache does not hold are prefilled), or R > 1 left-padded
            prompts (`_decode_batch`).
        drafter (`DFlashDraftModel`): the drafter (`assistant_model=` on the `generate` route).
        tev_config (`TEVConfig` or `dict`, *optional*): defaults to `TEVConfig()`.
        streamer, tokenizer: as for `generate` (the route uses the tokenizer for `stop_strings` and
            `token_healing`).
    Returns:
        `torch.LongTensor` of shape `(R, total_length)`, or a `TEVGenerateOutput` with
        `return_dict_in_generate=True`, whose `cache` holds every returned token but the last, as plain
        `generate`'s does. For a batch, rows that stopped early are padded with `pad_token_id` as plain
        generate pads them, `tev_stats` is a list with each row's `TEVStats`, and no cache is returned (rows
        leave the cache as they stop).
    """
    tev_config = TEVConfig() if tev_config is None else TEVConfig.coerce(tev_config)
    _check_supported(model, drafter, input_ids, generation_config, tev_config, model_kwargs)
    logits_processor = processors_for_tree(logits_processor)
    if input_ids.shape[0] > 1:
        _check_batch(input_ids, generation_config, model_kwargs, streamer)
        return _decode_batch(
            model, input_ids, logits_processor, stopping_criteria, generation_config, drafter, tev_config,
            **model_kwargs,
        )  # fmt: skip
    cache = full_length_cache(model, model_kwargs.get("cache"))  # sliding layers at full length, windowed by mask
    device, do_sample = input_ids.device, generation_config.do_sample
    verify = VERIFIERS[tev_config.verifier if do_sample else "greedy"]
    generator = None if tev_config.seed is None else torch.Generator(device=device).manual_seed(tev_config.seed)
    candidates = DFlashTreeCandidateGenerator(drafter, model, tev_config)
    outputs, stats, coverages = _Outputs(generation_config, streamer), TEVStats(), []
    clock = StageClock(device)

    # 0. Prefill: the prompt's cache and context features, and the first token (the first root).
    raw, features, positions, pad_columns = prefill(
        model,
        drafter,
        input_ids,
        cache,
        model_kwargs.get("attention_mask"),
        model_kwargs.get("position_ids"),
        generation_config.prefill_chunk_size,
    )
    lookup = candidates.lookup is not None
    candidates.update_candidate_strategy(features, positions, input_ids[0].tolist() if lookup else None)
    next_position = int(positions[0, -1]) + 1
    processed = logits_processor(input_ids, raw)
    root = next_token(processed, do_sample, generator)  # [1]
    sequence = torch.cat([input_ids, root[None]], dim=1)  # committed tokens + the root
    outputs.add(processed, raw)
    outputs.stream(root)
    tree_inputs = TreeInputs(generation_config.max_length, model.dtype, device, pad_columns)
    stop = first_stop(stopping_criteria, sequence, sequence.shape[1] - 1, outputs.scores)
    auto = automatic_budget(model, drafter, tev_config, generation_config) if tev_config.is_auto else None
    if auto is not None and not auto.cost.probed and stop is None:
        auto.cost.set_probe(
            *probe_tree_costs(
                model, cache, tree_inputs, root, next_position, candidates.hidden_indices, tev_config.max_budget + 1
            )
        )
    stats.prefill_time = clock.lap()

    while stop is None:
        past = cache.get_seq_length()
        # 1.-2. Draft and build. Tokens still allowed after the root bound the depth (the bonus is one of them).
        # The automatic budget may skip the drafter, and cuts the tree where expected tokens per second peak.
        max_depth = generation_config.max_length - sequence.shape[1] - 1
        draft_logprobs, cap = None, None if auto is None else auto.cap()
        if auto is None or auto.should_draft():
            draft_logprobs = candidates.draft(root, next_position, max_depth, cap)
        draft_s = clock.lap()
        size_rule, drafted = None, draft_logprobs is not None
        if auto is not None and (drafted or lookup):
            if drafted:
                auto.cost.observe_draft(draft_s)
            size_rule = auto.size_rule(drafted=drafted)
        tree = candidates.build(draft_logprobs, root, size_rule, cap, max_depth)
        if size_rule is not None:
            tree = tree.truncated(size_rule.size() + 1)  # where the expected tokens per second peak
            # With context drafts, a cycle without the drafter still has a tree: the drafter must beat that.
            alternative = 0.0
            if drafted and lookup:
                alternative = auto.best_rate(
                    lookup_path_logprobs(candidates.continuations, candidates.lookup_stats), False
                )
            stats.predicted_lengths.append(auto.chose(tree.num_nodes - 1, drafted, alternative))
        elif auto is not None:
            stats.predicted_lengths.append(1.0)
        build_s = clock.lap()
        # 3. Tree forward.
        out = tree_forward(model, tree, cache, *tree_inputs(tree, past, next_position), candidates.hidden_indices)
        logits = out.logits[0].float()  # [N, V]
        forward_s = clock.lap()
        # 4. Verifier stage: processors, decision, cache commit.
        path, bonus, processed = verifier_stage(
            tree, logits, sequence[:, :-1], logits_processor, verify, generator, cache, past
        )
        verify_s = clock.lap()
        # 5. Commit: the accepted nodes' features go to the drafter, the committed tokens to the context index;
        # tokens, outputs and stats are recorded.
        accepted = path.numel()  # root + accepted drafted nodes
        start = sequence.shape[1]
        sequence = torch.cat([sequence, tree.tokens[path[1:]][None], bonus.view(1, 1)], dim=1)
        candidates.update_candidate_strategy(
            candidates.features(out.hidden_states, path),
            torch.arange(next_position, next_position + accepted, device=device)[None],
            sequence[0, start - 1 : -1].tolist() if lookup else None,  # the old root and the accepted tokens
        )
        next_position += accepted
        outputs.add(processed[path], logits[path])
        stop = first_stop(stopping_criteria, sequence, start, outputs.scores)
        if stop is not None:
            sequence = sequence[:, : stop + 1]
        outputs.stream(sequence[0, start:])
        root = bonus.view(1)
        stats.record(accepted, tree.num_nodes - 1, draft_s, build_s, forward_s, verify_s)
        path_nodes = path.tolist()
        stats.count_sources(tree.node_info.sources if tree.node_info else None, path_nodes)
        candidates.observe(tree, path_nodes)
        if outputs.return_dict:  # coverage 1 + C, only for returned statistics; read once at the end
            plain = not do_sample or tree.num_nodes == 1  # the coverage is the accepted length
            coverages.append(float(accepted) if plain else target_flow(tree, processed)[0].sum())
        del out
        rest_s = clock.lap()  # the bookkeeping above belongs to no stage
        if auto is not None:
            auto.observe(tree.path_logprobs, path_nodes, forward_s, build_s + verify_s + rest_s)

    # The cache holds every returned token but the last, as plain generate's: the rows of accepted tokens after
    # a stop inside the last block go (a continuation from this cache then equals an uninterrupted run).
    excess = cache.get_seq_length() - (sequence.shape[1] - 1)
    if excess > 0:
        cache.crop(-excess)
    stats.coverages = [float(c) for c in coverages]
    if auto is not None:
        stats.budget_model = auto.cost.summary()
    return outputs.result(sequence, input_ids.shape[1], cache, stats)


tree_speculative_decode._hf_tev_decode = True  # the route recognises this entry in `custom_generate=`


def routed_generate(original, model, *args, **kwargs):
    """A `generate` call routed to the tree decoder (`hf_tev.route`), made transformers' `custom_generate` call
    of `tree_speculative_decode` with the drafter, the config and the streamer bound (transformers drops the
    streamer and the tokenizer on the callable route, so `stop_strings` and `token_healing` are done here).

    The drafter is `assistant_model=` (or `drafter=` with `custom_generate=tree_speculative_decode`); the tree
    settings are `tev_config=`, else the generation config's `tev_config` (e.g. from `generation_config.json`),
    else `TEVConfig()`. Options generate would act on before the decoder runs are refused here, by name.
    """
    tev_config = kwargs.pop("tev_config", None)
    if tev_config is None:
        tev_config = generation_setting(model, kwargs, "tev_config")
    custom = kwargs.pop("custom_generate", None)
    if custom is not None and not getattr(custom, "_hf_tev_decode", False):
        raise ValueError("`tev_config` and `custom_generate` cannot be combined.")
    drafter, assistant = kwargs.pop("drafter", None), kwargs.pop("assistant_model", None)
    if drafter is not None and assistant is not None:
        raise ValueError("Pass the DFlash drafter once: `assistant_model=` or `drafter=`, not both.")
    drafter = assistant if drafter is None else drafter
    tev_config = TEVConfig() if tev_config is None else TEVConfig.coerce(tev_config)
    if drafter is None and not tev_config.lookup:
        raise ValueError(
            "`tev_config` needs `assistant_model=` a DFlash drafter (hf_tev.DFlashDraftModel), or "
            "`TEVConfig(lookup=True)` for tree lookup decoding without a drafter."
        )
    _refuse_before_generate(model, kwargs)
    args = _heal_tokens(model, args, kwargs)
    model_stop_strings = _stop_strings_as_criteria(model, kwargs)
    decode = functools.partial(
        tree_speculative_decode, drafter=drafter, tev_config=tev_config, streamer=kwargs.get("streamer")
    )
    try:
        return original(model, *args, custom_generate=decode, **kwargs)
    finally:
        if model_stop_strings is not None:
            model.generation_config.stop_strings = model_stop_strings


# generate arguments acted on before the decoder runs (or dropped on the callable route): (name, refused when, why)
_REFUSED_ARGUMENTS = (
    ("speculation_type", _is_set, "transformers' own speculative path (for its DFlash chain path drop `tev_config`)"),
    ("cache_implementation", lambda v: v not in (None, "dynamic"), "a cache other than a full-attention DynamicCache"),
    ("synced_gpus", bool, "multi-GPU lockstep decoding (DeepSpeed ZeRO-3 / FSDP)"),
    ("negative_prompt_ids", _is_set, "classifier-free guidance"),
    ("negative_prompt_attention_mask", _is_set, "classifier-free guidance"),
    ("assistant_tokenizer", _is_set, "an assistant with another tokenizer (a DFlash drafter shares the target's)"),
    ("inputs_embeds", _is_set, "decoding from embeddings (the drafter reads features of token ids)"),
)


def _refuse_before_generate(model, kwargs: dict) -> None:
    for name, refused, what in _REFUSED_ARGUMENTS:
        value = generation_setting(model, kwargs, name)
        if refused(value):
            raise _refuse(name, value, what)


def _heal_tokens(model, args: tuple, kwargs: dict) -> tuple:
    """`token_healing` done here, as generate would (the callable route loses the tokenizer it needs); returns
    `args` with the healed prompt, and turns the option off for the call handed on."""
    if not generation_setting(model, kwargs, "token_healing"):
        return args
    tokenizer = kwargs.get("tokenizer")
    if tokenizer is None:
        raise ValueError("`token_healing` needs the tokenizer: pass `tokenizer=` to generate.")
    kwargs["token_healing"] = False
    if args:
        return (model.heal_tokens(args[0], tokenizer), *args[1:])
    key = "inputs" if kwargs.get("inputs") is not None else "input_ids"
    kwargs[key] = model.heal_tokens(kwargs[key], tokenizer)
    return args


def _stop_strings_as_criteria(model, kwargs: dict):
    """`stop_strings` as a `StopStringCriteria` in `kwargs["stopping_criteria"]`.

    On the `custom_generate` callable route transformers drops the tokenizer before it builds the stopping
    criteria ("could not locate a tokenizer"), so the route builds this one criterion itself, exactly as
    generate would, and takes the strings out of the generation configs generate reads. generate refills unset
    fields from the model's generation config, so strings set there are taken out for the call: they are
    returned, for the caller to put back (None when there were none)."""
    config = kwargs.get("generation_config")
    stop_strings = kwargs.pop("stop_strings", None) or generation_setting(model, kwargs, "stop_strings")
    if not stop_strings:
        return None
    tokenizer = kwargs.get("tokenizer")
    if tokenizer is None:
        raise ValueError("`stop_strings` need the tokenizer: pass `tokenizer=` to generate.")
    if config is not None and config.stop_strings:
        config = copy.deepcopy(config)
        config.stop_strings = None
        kwargs["generation_config"] = config
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    kwargs["stopping_criteria"] = criteria
    model_stop_strings = model.generation_config.stop_strings
    if model_stop_strings:
        model.generation_config.stop_strings = None
        return model_stop_strings
    return None
