"""Stages 1 and 2: drafting, transformers' `CandidateGenerator` for trees.

`TreeCandidateGenerator.get_candidates` proposes one draft tree per row of the batch (a prompt is a batch of
one): ONE drafter call drafts every row's block, then each row's tree is built by the configured tree source
(`hf_tev.tree.TREE_BUILDERS`), merged with the row's context drafts when lookup is on (`hf_tev.lookup`), and cut
to its size (`auto.TreeSizes`). `update_candidate_strategy` reports a row's outcome back: its accepted path, the
newly committed tokens (for the context index) and their target features, which wait until the next draft
appends them to the drafter's cache of context K/V (so a cycle that drafts nothing loses nothing).

The drafter's context K/V of every row live in one cache with masked holes, like the target's
(`cache.BatchTreeInputs`): each call appends every row's waiting context rows (different counts per row)
padded to the longest, and the padding stays hidden from that row's blocks. A row drafts what it would draft
alone (up to rounding; exactly, for a batch of one, which passes no mask).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers.utils import logging

from ..config import TEVConfig
from ..lookup import ContextIndex, LookupStats, build_merged_tree
from ..tree import TREE_BUILDERS, DraftTree, RootTrees, build_tree, prefetch_host_topk, to_device
from .cache import compact_columns, select_rows

logger = logging.get_logger(__name__)


@dataclass
class RowDrafts:
    """One row's draft state: committed features not yet in the drafter's cache, its context index.

    The waiting features are kept as the list of what each cycle committed and joined once, when the drafter
    reads them (a cycle that does not draft adds no copy); their positions are a `range` per cycle (committed
    tokens sit at consecutive positions), or the prompt's position ids."""

    context: list = field(default_factory=list)  # [1, c_i, k * hidden] each
    context_positions: list = field(default_factory=list)  # a `range`, or a LongTensor [1, c_i], each
    index: ContextIndex | None = None
    lookup_stats: LookupStats | None = None
    root: int | None = None  # this cycle's root on the host (lookup only: read once, by `continuations`)


@dataclass
class Candidates:
    """What stages 1-2 give the loop: each row's tree, the stage times and the predicted block lengths."""

    trees: list[DraftTree]
    draft_s: float  # the drafter's call, for the whole batch
    build_s: list[float]  # each row's build
    predicted: list[float] | None = None  # budget="auto": each tree's predicted block length
    drafted: bool = False  # whether the drafter drafted this cycle


class TreeCandidateGenerator:
    """Proposes a draft tree per row and cycle from a DFlash drafter and/or the context.

    Args:
        drafter (`DFlashDraftModel`, *optional*): None for tree lookup decoding (context drafts alone).
        rows (`int`): the batch size.
    """

    def __init__(self, drafter, target, tev_config: TEVConfig, rows: int, device):
        self.drafter, self.target, self.budget = drafter, target, tev_config.largest_tree
        self.builder = TREE_BUILDERS[tev_config.tree]
        self.lookup = tev_config.lookup
        self.rows = [RowDrafts() for _ in range(rows)]
        if self.lookup:
            for row in self.rows:
                row.index = ContextIndex(
                    tev_config.lookup_min_ngram,
                    tev_config.lookup_max_ngram,
                    tev_config.lookup_length,
                    tev_config.lookup_branches,
                )
                row.lookup_stats = LookupStats()
        self.hidden_indices = None if drafter is None else drafter.target_hidden_indices
        self.root_trees = RootTrees(device)
        self.token_ids = None  # the target id of each drafted column: a draft vocabulary (None: every token)
        if drafter is None:
            return
        # A drafter with a draft vocabulary drafts over it, as scored; the builders map the ids they pick
        # (`DFlashDraftModel.draft_logits`' `target_vocab`).
        vocab = getattr(drafter, "draft_vocab", None)
        self.token_ids = None if vocab is None else vocab.to(device)
        self.block_size = tev_config.block_size or drafter.config.block_size
        self.cache = drafter.new_cache()
        # A batch tracks the drafter cache's hidden columns per row ([R, C]) and masks them, also once it has
        # shrunk to one row; one prompt's cache has none, so its calls skip that bookkeeping and pass no mask.
        self.batch = rows > 1
        self.hidden = torch.zeros(rows, 0, dtype=torch.bool, device=device)
        self.visible = [0] * rows  # each row's visible columns of `hidden`, on the host (`compact_columns`)
        # [R, L]: every row's block [root, MASK, ...]; the MASK columns are written once, each draft writes the roots
        self.block_ids = torch.full(
            (rows, self.block_size), drafter.config.mask_token_id, dtype=torch.long, device=device
        )
        self.block_offsets = torch.arange(self.block_size, device=device)  # [L]
        self.row_maxima = []  # each draft's largest log-probability per depth: -inf where its logits were not finite

    def features(self, hidden_states) -> torch.Tensor | None:
        """The drafter's context features `[R, N, k * hidden]` from a target output's hidden states; None
        without a drafter."""
        return None if self.drafter is None else self.drafter.context_features(hidden_states)

    def update_candidate_strategy(self, row: int, features, positions, tokens: list[int], tree=None, path=None):
        """A row's outcome: its newly committed tokens (host ids, for the context index), their target features
        `[1, c, k * hidden]` and positions (a `range` of c consecutive positions, or a LongTensor `[1, c]`), and
        the verified tree with its accepted path (host node indices, for the lookup statistics; None after the
        prefill)."""
        state = self.rows[row]
        if state.index is not None:
            state.index.extend(tokens)
            if tree is not None:
                state.lookup_stats.update(tree, path)
        if features is None:
            return
        state.context.append(features)
        state.context_positions.append(positions)

    def get_candidates(self, roots, root_positions, max_depths, sizes, clock, root_ids=None) -> Candidates:
        """Stages 1-2: each row's tree.

        Args:
            roots (`list[torch.LongTensor]` of shape `(1,)`): each row's not-yet-verified token.
            root_positions (`list[int]`): their position ids.
            max_depths (`list[int]`): the deepest depth each row can still emit (fewer tokens may remain).
            sizes (`auto.TreeSizes`): the call's size stage; clock (`outputs.StageClock`): times the stages.
            root_ids (`list[int]`, *optional*): the roots' tokens on the host (the context index reads them; else
                read from `roots`).
        """
        cap = sizes.cap()
        drafted = [None] * len(roots)
        if self.drafter is not None and sizes.should_draft():
            drafted = self.draft(roots, root_positions, max_depths, cap)
        draft_s = clock.lap("draft")
        if len(roots) > 1 and (self.lookup or self.builder is build_tree):  # every row's top-k in one read
            prefetch_host_topk(drafted, self.budget if cap is None else cap, self.token_ids)
        known_s = None if clock.deferred else draft_s  # on CUDA the drafter's time is known after the cycle's read
        trees, build_s, rule = [], [], None
        for i, (draft_logprobs, root, max_depth) in enumerate(zip(drafted, roots, max_depths, strict=True)):
            rule = sizes.rule(draft_logprobs is not None, known_s)
            root_id = root_ids[i] if root_ids is not None else int(root) if self.lookup else None
            continuations = self.continuations(i, root_id, max_depth)
            trees.append(self.build(draft_logprobs, root, continuations, self.rows[i].lookup_stats, rule, cap))
            build_s.append(clock.lap(("build", i)))
        any_drafted = any(q is not None for q in drafted)
        trees, predicted = sizes.cut(trees, rule, any_drafted, known_s, continuations, self.rows[0].lookup_stats)
        build_s[-1] += clock.lap(("build", len(trees) - 1))
        return Candidates(trees, draft_s, build_s, predicted, any_drafted)

    def draft(self, roots, root_positions, max_depths, budget) -> list[torch.Tensor | None]:
        """Stage 1: each row's drafter log-probs `[d_i, V]` of depths 1..d_i (None where no depth can be used),
        `d_i = min(L - 1, max_depths[i], budget)`; over the drafter's draft vocabulary where it has one
        (`[d_i, draft_vocab_size]`, column j the token `self.token_ids[j]`).

        The block is always the drafter's full block `[root, MASK * (L-1)]` (it is trained on full blocks and
        attends inside them bidirectionally); only the usable depths' last-layer rows and LM head are computed.
        """
        budget = self.budget if budget is None else budget
        depths = [min(self.block_size - 1, depth, budget) for depth in max_depths]
        if max(depths) <= 0:
            return [None] * len(roots)
        counts = [sum(part.shape[1] for part in state.context) for state in self.rows]
        features, positions, padding = self._waiting_context(root_positions)
        block_ids = self.block_ids[: len(roots)]  # [R, L]: [root, MASK, ...], the roots written in place
        block_ids[:, 0] = roots[0] if len(roots) == 1 else torch.cat(roots)
        options = {}  # one prompt hides nothing: the drafter's own unmasked call
        if self.batch:
            hidden = torch.cat([self.hidden, padding], dim=1)
            options["attention_mask"] = torch.cat([~hidden, torch.ones_like(block_ids, dtype=torch.bool)], dim=1)
        if self.token_ids is not None:  # its logits as scored, over its draft vocabulary
            options["target_vocab"] = False
        logits = self.drafter.draft_logits(
            self.target, features, block_ids, positions, cache=self.cache, num_depths=max(depths), **options
        )  # [R, max d, V or draft_vocab_size]
        if self.batch:
            self.hidden = hidden
            self.visible = [visible + count for visible, count in zip(self.visible, counts, strict=True)]
        return [self.finite_depths(logits[i, :d]) if d > 0 else None for i, d in enumerate(depths)]

    def finite_depths(self, logits: torch.Tensor) -> torch.Tensor:
        """A row's drafter log-probs `[d, V]`, the depths whose logits were not finite (inf or NaN: an fp16
        overflow, broken weights) set to -inf, so that no node is drafted there (`drafted_nodes`): decoding stays
        exact whatever the drafter says. Device ops only; the call's flag says so at its end (`warn_nonfinite`)."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        # A row with an inf or NaN logit has a normaliser that is not finite, so each of its log-probabilities is
        # NaN or -inf, and any other row has none that is NaN: NaN -> -inf makes exactly those rows -inf, in one
        # in-place pass. Their maximum is then -inf, and only theirs; the flag is read at the call's end.
        logprobs.nan_to_num_(nan=-math.inf, neginf=-math.inf)
        self.row_maxima.append(logprobs.amax(dim=-1))
        if len(self.row_maxima) >= 256:  # a long call keeps one tensor for every 256 drafts
            self.row_maxima = [torch.cat(self.row_maxima).amin(dim=0, keepdim=True)]
        return logprobs

    def warn_nonfinite(self) -> None:
        """At the end of a call (one host read): say once that the drafter's logits were not finite."""
        if self.drafter is not None and self.row_maxima and bool(torch.cat(self.row_maxima).eq(-math.inf).any()):
            name = getattr(self.drafter.config, "_name_or_path", "") or type(self.drafter).__name__
            logger.warning_once(
                f"hf_tev: the drafter ({name}) gave logits that are not finite (inf or NaN) at some depths; its "
                "trees stop above them, so decoding stays exact but gains nothing there. Check the drafter's "
                "weights and dtype (float16 can overflow: load it in bfloat16 or float32)."
            )

    def _waiting_context(self, root_positions):
        """Every row's waiting context rows, padded to the longest: features `[R, c, k * H]`, position ids
        `[R, c + L]` (the block's after them) and the padding `[R, c]` (True: hidden from the row)."""
        states, device = self.rows, self.hidden.device
        counts = [sum(part.shape[1] for part in state.context) for state in states]
        width = max(counts)
        if len(states) == 1:  # one row: its own tensors (one cycle's features are used as they are)
            (state,) = states
            features = state.context[0] if len(state.context) == 1 else torch.cat(state.context, dim=1)
            positions = self._position_ids(state.context_positions, root_positions[0], self.block_size)
            state.context, state.context_positions = [], []  # in the drafter's cache now
            padding = torch.zeros(1, width, dtype=torch.bool, device=device) if self.batch else None
            return features, positions, padding
        features = states[0].context[0].new_zeros(len(states), width, states[0].context[0].shape[2])
        positions = torch.zeros(len(states), width + self.block_size, dtype=torch.long, device=device)
        padding = torch.ones(len(states), width, dtype=torch.bool, device=device)
        for i, (state, count) in enumerate(zip(states, counts, strict=True)):
            features[i, :count] = torch.cat(state.context, dim=1)[0]
            positions[i, :count] = self._position_ids(state.context_positions, root_positions[i], 0)[0]
            positions[i, width:] = root_positions[i] + self.block_offsets
            padding[i, :count] = False
        for state in states:
            state.context, state.context_positions = [], []  # in the drafter's cache now
        return features, positions, padding

    def _position_ids(self, parts: list, root_position: int, after: int) -> torch.LongTensor:
        """`[1, c + after]`: the waiting rows' position ids (`parts`), then `after` more from the root's position
        on (the block's). One `arange` when the waiting rows are consecutive positions up to the root (every cycle
        after the first), instead of one per cycle and a join."""
        device = self.hidden.device
        if all(isinstance(part, range) for part in parts) and all(
            a.stop == b.start for a, b in zip(parts, [*parts[1:], range(root_position, root_position)], strict=True)
        ):
            return torch.arange(parts[0].start, root_position + after, device=device).view(1, -1)
        pieces = [
            part if isinstance(part, torch.Tensor) else torch.arange(part.start, part.stop)[None] for part in parts
        ]
        pieces.append(torch.arange(root_position, root_position + after)[None])
        return torch.cat([piece if piece.device == device else to_device(piece, device) for piece in pieces], dim=1)

    def continuations(self, row: int, root_id: int, max_depth: int) -> list:
        """A row's context drafts after the root token `root_id`, at most `max_depth` deep (empty without
        lookup)."""
        state = self.rows[row]
        if state.index is None:
            return []
        state.root = root_id  # `committed_tokens` reuses it
        continuations = state.index.continuations(state.root)
        return [(tokens[:max_depth], n) for tokens, n in continuations if max_depth > 0]

    def committed_tokens(self, row: int, tree: DraftTree, path: list[int]) -> list[int]:
        """The tokens row `row` commits this cycle, for its context index: its root and the accepted nodes', from
        the host (no read of the sequence: the tree's tokens are on the host since it was built or verified)."""
        tokens = tree.lists.tokens
        return [self.rows[row].root, *(tokens[node] for node in path[1:])]

    def build(self, draft_logprobs, root, continuations, lookup_stats, size_rule=None, budget=None) -> DraftTree:
        """Stage 2: the tree of at most `budget` nodes (default: the configured budget; fewer where `size_rule`
        stops it, see `hf_tev.budget`), with the context's continuations when lookup is on; the root alone
        when nothing was proposed (a plain decoding step)."""
        budget = self.budget if budget is None else budget
        if self.lookup:
            return build_merged_tree(
                draft_logprobs, budget, root, continuations, lookup_stats, size_rule, root.device, self.token_ids
            )
        if draft_logprobs is None:
            return self.root_trees(root)
        return drafted_nodes(self.builder(draft_logprobs, budget, root, size_rule=size_rule, token_ids=self.token_ids))

    def select(self, keep: list[int]) -> None:
        """Keep only rows `keep` (in that order): rows that stopped leave the drafter's cache."""
        self.rows = [self.rows[i] for i in keep]
        if self.drafter is not None:
            self.hidden = select_rows(self.cache, self.hidden, keep)
            self.visible = [self.visible[i] for i in keep]

    def compact(self) -> None:
        if self.drafter is not None:
            hidden = compact_columns(self.cache, self.hidden, kept=max(self.visible, default=0))
            if hidden is not None:
                self.hidden = hidden


def drafted_nodes(tree: DraftTree) -> DraftTree:
    """`tree` without the nodes the drafter gives probability 0 (path log-probability -inf, e.g. below a depth
    whose logits were not finite). Path log-probabilities never increase in a built tree's order, so they are its
    last nodes; a tree without host scores (a chain at a fixed budget) is kept as it is."""
    scores = tree.path_logprobs
    if not scores or scores[-1] != -math.inf:
        return tree
    return tree.truncated(scores.index(-math.inf))
