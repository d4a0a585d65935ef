"""The automatic budget inside decoding: its state kept per models and settings, and the size stage of a call.

`hf_tev.budget` holds the rule (plain Python); here it meets the models. One calibration per (drafter, target,
sampling, lookup), one cost model per (target, device, dtype, threads, attention, batch size), and the budget
itself (its pauses, probes and cap) per both: a call continues where the last one on the same models stopped.
Each of these stores keeps the few most recently used states (`RecentStates`), and a calibration for a new
temperature starts from the one learnt at the nearest temperature (docs/auto_budget.md). `TreeSizes` is a call's
size stage: a fixed budget, or the automatic budget's choice.
"""

from __future__ import annotations

import copy
import itertools
import threading
import weakref
from collections import OrderedDict

import torch

from ..budget import AcceptanceCalibration, CostAwareBudget, CycleCost
from ..config import TEVConfig
from ..lookup import lookup_path_logprobs

KEPT_STATES = 8  # states each store keeps per drafter (cost models: per target), the least recently used go first
PROBE_MARGIN = 2  # see `probe_ratio`


class RecentStates:
    """Learnt states by key, at most `size` of them: using a state makes it the most recent, and a new one pushes
    out the least recently used (a process that decodes at thousands of temperatures keeps a few)."""

    def __init__(self, size: int = KEPT_STATES):
        self.size, self.states = size, OrderedDict()

    def get(self, key):
        state = self.states.get(key)
        if state is not None:
            self.states.move_to_end(key)
        return state

    def put(self, key, state):
        self.states[key] = state
        self.states.move_to_end(key)
        while len(self.states) > self.size:
            self.states.popitem(last=False)
        return state

    def __len__(self) -> int:
        return len(self.states)


# owner -> RecentStates, the owner a drafter (a target for cost models, and for context drafts alone)
_CALIBRATIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BUDGETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()  # calls in several threads share the stores
# A target's number in those keys. Not `id(target)`: a target made after another was freed may get its address,
# and would inherit its calibration and budget.
_TARGET_NUMBERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TARGET_COUNTER = itertools.count()


def target_number(model) -> int:
    if model not in _TARGET_NUMBERS:
        _TARGET_NUMBERS[model] = next(_TARGET_COUNTER)
    return _TARGET_NUMBERS[model]


def automatic_budget(model, drafter, tev_config: TEVConfig, generation_config, batch: int = 1) -> CostAwareBudget:
    """The `CostAwareBudget` of these models and settings (for one row of a batch of `batch` prompts), with the
    calibration and cost model learnt by earlier calls (kept as long as the models live, `KEPT_STATES` of each).
    A batch's cost model is the pass of `batch` rows: it has its own entry per batch size.

    The budget itself is kept too: a call starts with the drafter's pause and the cap the last call on the same
    models left (only its probes start over, `CostAwareBudget.start_call`). Short calls would otherwise each
    start by trying the drafter after 1, 2, 4, ... cycles, and where it does not pay (the kit at T = 1) those
    tries are most of the cost of `budget="auto"`. A budget whose calibration or cost model was dropped starts
    afresh with the new ones."""
    temperature = generation_config.temperature if generation_config.do_sample else 0
    owner = model if drafter is None else drafter  # lookup alone: the calibration of the target's context drafts
    key = (target_number(model), (generation_config.do_sample, temperature), tev_config.lookup)
    device = model.get_input_embeddings().weight.device
    cost_key = (str(device), model.dtype, torch.get_num_threads(), model.config._attn_implementation)
    if batch > 1:
        cost_key += (batch,)
    with _LOCK:
        calibration = calibration_for(_kept(_CALIBRATIONS, owner), key)
        costs = _kept(_COSTS, model)
        cost = costs.get(cost_key) or costs.put(cost_key, CycleCost())
        budgets, budget_key = _kept(_BUDGETS, owner), (key, cost_key, tev_config.max_budget)
        budget = budgets.get(budget_key)
        if budget is None or budget.calibration is not calibration or budget.cost is not cost:
            budget = budgets.put(budget_key, CostAwareBudget(tev_config.max_budget, calibration, cost))
        budget.start_call()
    return budget


def _kept(registry: weakref.WeakKeyDictionary, owner) -> RecentStates:
    if owner not in registry:
        registry[owner] = RecentStates()
    return registry[owner]


def calibration_for(calibrations: RecentStates, key: tuple) -> AcceptanceCalibration:
    """The calibration of `key` = (target number, (do_sample, temperature), lookup). A new one starts as a copy of
    the calibration learnt at the nearest temperature (greedy counts as 0; on a tie the most recently used) for
    the same target and lookup setting, else from the prior: acceptance changes smoothly with the temperature,
    and a copy learns on without touching the other."""
    calibration = calibrations.get(key)
    if calibration is not None:
        return calibration
    target, (_, temperature), lookup = key
    learnt = [
        (abs(other[1][1] - temperature), state)
        for other, state in reversed(calibrations.states.items())  # most recent first: min keeps the first
        if other[0] == target and other[2] == lookup
    ]
    start = copy.deepcopy(min(learnt, key=lambda pair: pair[0])[1]) if learnt else AcceptanceCalibration()
    return calibrations.put(key, start)


def probe_ratio(tev_config: TEVConfig, drafter) -> float:
    """How many passes of one token per row the probe's largest pass may cost (`forward.probe_tree_costs`). A cycle
    emits at most its tree's depth + 1 tokens, so a tree whose pass costs more than that many one-token passes
    cannot beat plain decoding; `PROBE_MARGIN` times that leaves room for the rest of a plain cycle."""
    depth = 0 if drafter is None else (tev_config.block_size or drafter.config.block_size) - 1
    if tev_config.lookup:
        depth = max(depth, tev_config.lookup_length)
    return PROBE_MARGIN * (depth + 1)


class TreeSizes:
    """A call's size stage (stages 1-2 ask it what to draft and where to cut each tree; stage 6 tells it what
    happened). A fixed budget (`budget` None): every tree as built. The automatic budget: one prompt streams a
    `SizeRule` into its builder and cuts the tree where the expected tokens per second peak; a batch builds every
    row's tree at the cap, then cuts them all to one size (`CostAwareBudget.common_size`: the batch's pass pays for
    its largest tree in every row). Like any size fixed before the target's pass, both keep every verifier exact.
    """

    def __init__(self, budget: CostAwareBudget | None, lookup: bool, rows: int):
        self.budget, self.lookup, self.batch = budget, lookup, rows > 1

    def cap(self) -> int | None:
        return None if self.budget is None else self.budget.cap()

    def should_draft(self) -> bool:
        return self.budget is None or self.budget.should_draft()

    def rule(self, drafted: bool, draft_s: float | None):
        """One prompt's `SizeRule` for the builder (None for a fixed budget, a batch, or nothing to size).
        `draft_s` None: the drafter's time is not known yet (on CUDA, `observe_draft` gets it after the cycle's
        read)."""
        if self.budget is None or self.batch or not (drafted or self.lookup):
            return None
        if drafted and draft_s is not None:
            self.budget.cost.observe_draft(draft_s)
        return self.budget.size_rule(drafted=drafted)

    def cut(self, trees, rule, drafted: bool, draft_s: float, continuations, lookup_stats):
        """Each row's tree cut to its size, and the predicted block lengths (None for a fixed budget).

        Args:
            continuations, lookup_stats: one prompt's context drafts this cycle, the rate of a cycle without
                the drafter (which it must beat).
        """
        if self.budget is None:
            return trees, None
        if self.batch:
            return self._cut_batch(trees, drafted, draft_s)
        if rule is None:
            return trees, [1.0]
        (tree,) = trees
        tree = tree.truncated(rule.size() + 1)  # where the expected tokens per second peak
        alternative = 0.0
        if drafted and self.lookup:  # with context drafts, a cycle without the drafter still has a tree
            alternative = self.budget.best_rate(lookup_path_logprobs(continuations, lookup_stats), False)
        return [tree], [self.budget.chose(tree.num_nodes - 1, drafted, alternative)]

    def _cut_batch(self, trees, drafted: bool, draft_s: float):
        if not (drafted or self.lookup):
            return trees, [1.0] * len(trees)
        if drafted and draft_s is not None:
            self.budget.cost.observe_draft(draft_s)
        size, lengths = self.budget.common_size([(tree.path_logprobs or [0.0])[1:] for tree in trees], drafted)
        self.budget.chose(size, drafted)
        return [tree.truncated(size + 1) for tree in trees], lengths

    def observe_draft(self, draft_s: float) -> None:
        """The drafter's time of this cycle, known after its read (on CUDA: `rule` and `cut` got None)."""
        if self.budget is not None:
            self.budget.cost.observe_draft(draft_s)

    def observe(self, trees, paths: list[list[int]], nodes: int, forward_s: float, other_s: float) -> None:
        """Stage 6: what the cycle accepted (host paths) and what its pass of `nodes` tree tokens cost."""
        if self.budget is None:
            return
        if self.batch:
            outcomes = [(tree.path_logprobs, path) for tree, path in zip(trees, paths, strict=True)]
            self.budget.observe_batch(outcomes, nodes, forward_s, other_s)
        else:
            self.budget.observe(trees[0].path_logprobs, paths[0], forward_s, other_s)


def forget_budgets() -> None:
    """Drop every kept budget (their pauses, probes and caps; calibrations and cost models stay): the next call
    starts its schedule afresh, as a first call does."""
    with _LOCK:
        _BUDGETS.clear()
