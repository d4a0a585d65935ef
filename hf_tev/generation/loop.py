"""The tree decoding loop of one resolved call (`decode_with_trees`): one decoding cycle for every batch size.

A prompt is a batch of one: the same cycle decodes one prompt and R left-padded prompts, each row exactly as it
would decode alone (docs/design.md#the-decoding-loop).

  0. prefill:  `start` - the prompts' cache, their context features and each row's first root.
  1. draft:    `TreeCandidateGenerator.get_candidates` - ONE drafter call for every row's block,
  2. build:    then each row's tree, cut to its size (`auto.TreeSizes`).
  3. forward:  `tree_pass_and_verify` - ONE target forward over every row's tree with the tree mask,
  4. verify:   then each row's logits processors and exact verifier, one cache commit.
  5. commit:   `commit_row` - tokens, stops and outputs; the row's outcome goes back to the candidate generator
               (`update_candidate_strategy`).
  6. observe:  the size stage learns from the cycle; rows that stopped leave the batch and the cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.utils import logging

from ..config import TEVStats
from ..generate_call import TreeCall
from ..models.dflash.native import tree_drafter
from ..target_layers import full_length_cache, settle_tree_states
from ..tree import host_long, to_device
from ..verify import VERIFIERS, coverage
from .auto import TreeSizes, automatic_budget, probe_ratio
from .cache import BatchTreeInputs, PromptTreeInputs
from .candidates import TreeCandidateGenerator
from .checks import check_batch, check_batch_target, check_supported
from .forward import prefill, probe_tree_costs, prompt_positions, tree_forward
from .hybrid import text_position_ids
from .outputs import Outputs, StageClock, first_stop, host_eos_ids
from .processors import processors_for_row, processors_for_tree
from .static import StaticTreeInputs, check_static, static_cache, static_nodes, wants_static
from .verifier import first_token, verifier_stage

logger = logging.get_logger(__name__)


@dataclass
class Row:
    """One prompt while it decodes."""

    index: int  # its row in the caller's batch
    sequence: torch.Tensor  # [1, L]: the (padded) prompt, the committed tokens and the root
    next_position: int  # the root's position id
    processors: object  # its LogitsProcessorList (`processors_for_row`)
    root_id: int = -1  # the root's token on the host (read with the bonus tokens, once per cycle)
    stats: TEVStats = field(default_factory=TEVStats)
    coverages: list = field(default_factory=list)  # 1 + C per cycle (floats, or tensors read once at the end)

    @property
    def root(self) -> torch.Tensor:
        return self.sequence[0, -1:]


@dataclass
class Decoding:
    """A call's state between cycles."""

    model: object
    cache: object
    rows: list[Row]  # unfinished rows, in cache order
    done: dict  # finished rows by index
    candidates: TreeCandidateGenerator
    inputs: PromptTreeInputs | BatchTreeInputs
    sizes: TreeSizes
    verify: object  # a verifier of `hf_tev.verify.VERIFIERS`
    generator: torch.Generator | None
    stopping_criteria: object
    generation_config: object
    eos_ids: frozenset | None  # the EOS criteria's token ids on the host (`outputs.host_eos_ids`)
    outputs: Outputs
    clock: StageClock
    batch: bool  # more than one prompt: rows can leave, per-cycle pass statistics are kept
    # stages 3-4 (`tree_pass_and_verify`; the bench's same-tree replay times every verifier on the same trees)
    tree_pass: Callable = None

    def __post_init__(self):
        self.tree_pass = self.tree_pass or tree_pass_and_verify


def decode_with_trees(
    model, input_ids: torch.LongTensor, logits_processor, stopping_criteria, generation_config, *, call: TreeCall,
    **model_kwargs,
):  # fmt: skip
    """The tree decoding loop of one resolved call, with the signature of a transformers `custom_generate` callable
    once `call` is bound (hf_tev's route binds it; `custom_generate.tree_speculative_decode` calls it).

    Args:
        input_ids (`torch.LongTensor` of shape `(R, prompt_length)`): the prompt (with a pre-filled `cache`, the
            whole sequence; only the tokens the cache does not hold are prefilled), or R > 1 left-padded prompts.
        call (`hf_tev.generate_call.TreeCall`): the drafter, the `TEVConfig` and the streamer, read, coerced and
            checked by `resolve_call` (every way into `generate` resolves its call there, once).
    Returns:
        `torch.LongTensor` of shape `(R, total_length)`, or a `TEVGenerateOutput` with
        `return_dict_in_generate=True`, whose `cache` holds every returned token but the last, as plain
        `generate`'s does. For a batch, rows that stopped early are padded with `pad_token_id` as plain
        generate pads them, `tev_stats` is a list with each row's `TEVStats`, and no cache is returned (rows
        leave the cache as they stop).
    """
    tev_config = call.tev_config.for_call(generation_config, call.drafter is not None)  # lookup="auto" decided
    drafter = tree_drafter(call.drafter)  # a drafter transformers' DFlash chain drives: fed as that chain feeds it
    streamer = call.streamer
    model_kwargs = text_position_ids(model_kwargs)  # a multimodal wrapper's rope axes of a text prompt: its text ids
    check_supported(model, drafter, input_ids, generation_config, tev_config, model_kwargs)
    if input_ids.shape[0] > 1:
        check_batch(input_ids, generation_config, model_kwargs, streamer)
        check_batch_target(model)
    state = start(
        model, drafter, input_ids, logits_processor, stopping_criteria, generation_config, tev_config, streamer,
        model_kwargs,
    )  # fmt: skip
    while state.rows:
        decode_cycle(state)
    return finish(state, input_ids.shape[1])


def start(model, drafter, input_ids, logits_processor, stopping_criteria, generation_config, tev_config, streamer,
          model_kwargs) -> Decoding:  # fmt: skip
    """Stage 0: prefill every prompt (each row's real tokens at positions 0, 1, ... as it would be alone), draw
    each row's first root, and set up the call's state. `tev_config.lookup` is decided (`TEVConfig.for_call`)."""
    batch, device = input_ids.shape[0], input_ids.device
    attention_mask = model_kwargs.get("attention_mask")
    clock = StageClock(device, deferred=True)  # no wait per stage (`StageClock.settle`)
    cache, padded_nodes = call_cache(model, generation_config, tev_config, model_kwargs.get("cache"), batch)
    past = int(cache.get_seq_length())
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    positions = model_kwargs.get("position_ids")
    positions = prompt_positions(real) if positions is None else positions
    raw, features = prefill(
        model, drafter, input_ids, cache, attention_mask, positions, generation_config.prefill_chunk_size
    )
    generator = None if tev_config.seed is None else torch.Generator(device=device).manual_seed(tev_config.seed)
    outputs = Outputs(generation_config, streamer)
    rows, done = first_roots(
        input_ids, raw, positions, processors_for_tree(logits_processor), stopping_criteria, generation_config,
        generator, outputs,
    )  # fmt: skip
    for row, root_id in zip(rows, torch.cat([row.root for row in rows]).tolist() if rows else [], strict=True):
        row.root_id = root_id  # the first roots' one host read
    candidates = TreeCandidateGenerator(drafter, model, tev_config, len(rows), device)
    for i, row in enumerate(rows):  # the prompt's real tokens: the drafter's first context, the context index
        keep, new = real[row.index], None if features is None else features[row.index : row.index + 1]
        new_positions = positions[row.index : row.index + 1, past:]
        if not bool(keep.all()):
            new = None if new is None else new[:, keep[past:]]
            new_positions = new_positions[:, keep[past:]]
        tokens = input_ids[row.index, keep].tolist() if tev_config.lookup else None
        candidates.update_candidate_strategy(i, new, new_positions, tokens)
    inputs = tree_pass_inputs(model, real, rows, cache, generation_config.max_length, padded_nodes)
    budget, probe_s = None, 0.0
    if tev_config.is_auto:
        budget = automatic_budget(model, drafter, tev_config, generation_config, batch)
        ratio = probe_ratio(tev_config, drafter)
        probe_s = probe_once(budget, model, cache, inputs, rows, candidates.hidden_indices, ratio)
    prefill_s = clock.lap("prefill", synchronize=True)  # once per call: the prefill's time at once
    for row in [*rows, *done.values()]:
        row.stats.prefill_time, row.stats.probe_time = prefill_s, probe_s
    verify = VERIFIERS[tev_config.verifier if generation_config.do_sample else "greedy"]
    sizes = TreeSizes(budget, tev_config.lookup, batch)
    return Decoding(
        model, cache, rows, done, candidates, inputs, sizes, verify, generator, stopping_criteria,
        generation_config, host_eos_ids(stopping_criteria), outputs, clock, batch > 1,
    )  # fmt: skip


def first_roots(input_ids, raw, positions, processors, stopping_criteria, generation_config, generator, outputs):
    """Each row's first root, drawn from its prefill logits `raw` `[R, V]` by its own processors: the rows that
    decode on, and those done at their first token (by index)."""
    rows, done = [], {}
    for r in range(input_ids.shape[0]):
        row_processors = processors_for_row(processors, r)
        processed = row_processors(input_ids[r : r + 1], raw[r : r + 1])
        root = first_token(processed, generation_config.do_sample, generator)  # [1]
        row = Row(r, torch.cat([input_ids[r : r + 1], root[None]], 1), int(positions[r, -1]) + 1, row_processors)
        outputs.add(processed, raw[r : r + 1])
        outputs.stream(root)
        if first_stop(stopping_criteria, row.sequence, input_ids.shape[1], outputs.scores) is None:
            rows.append(row)
        else:
            done[r] = row
    return rows, done


def probe_once(budget, model, cache, inputs, rows: list[Row], hidden_indices, max_ratio: float) -> float:
    """The automatic budget's tree-pass cost curve, measured at the start of a call where it lacks sizes the
    budget could choose (`CostAwareBudget.probe_plan`): on the first call for these models and settings, for
    larger sizes once the budget's cap has grown past the probed ones, and again once it is stale (not while the
    drafter is paused); never past the size no tree can repay (`auto.probe_ratio`). Returns the seconds it took
    (0 when nothing was probed)."""
    started = time.perf_counter()
    plan = budget.probe_plan()
    if not rows or not plan.sizes:
        return 0.0
    if not budget.cost.probed:
        logger.warning_once(
            "The automatic budget measures the target's tree-pass costs once for these models and settings"
        )
    roots, first_positions = [row.root for row in rows], [row.next_position for row in rows]
    measured = probe_tree_costs(model, cache, inputs, roots, first_positions, hidden_indices, plan.sizes, max_ratio)
    budget.cost.take_probe(plan, *measured)
    return time.perf_counter() - started


def call_cache(model, generation_config, tev_config, cache, batch: int):
    """The call's target cache, and the node count its trees are padded to (None: not padded). By default a
    DynamicCache whose sliding layers are kept at full length (windowed by the mask); with static shapes
    (`cache_implementation="static"` or a StaticCache passed in) transformers' StaticCache, the trees padded to
    the budget (`generation/static.py`)."""
    if not wants_static(generation_config, cache):
        return full_length_cache(model, cache), None
    nodes = static_nodes(tev_config)
    cache = static_cache(model, cache, generation_config.max_length, nodes)
    check_static(model, cache, batch)
    return cache, nodes


def tree_pass_inputs(model, real: torch.Tensor, rows: list[Row], cache, max_length: int, padded_nodes=None):
    """The call's tree-pass inputs: one prompt's (its left padding hidden for good; in static shapes with its
    trees padded to `padded_nodes`), or the batch's (each row's hidden columns tracked as the cache grows), for
    the rows still decoding."""
    if real.shape[0] == 1:
        pad_columns = None if bool(real.all()) else (~real[0]).nonzero(as_tuple=True)[0]
        if padded_nodes is not None:
            columns, past = cache.get_max_length(), int(cache.get_seq_length())  # once per call
            return StaticTreeInputs(model, padded_nodes, columns, real.device, pad_columns, past)
        return PromptTreeInputs(model, max_length, real.device, pad_columns)
    inputs = BatchTreeInputs(~real, model.dtype, model, max_length)
    if len(rows) < real.shape[0]:
        inputs.select(cache, [row.index for row in rows])
    return inputs


def decode_cycle(state: Decoding) -> None:
    """One cycle for every unfinished row: draft -> build -> tree pass -> verify -> commit -> observe.

    Its host waits (docs/design.md#host-waits): the drafter's top-k for the tree build, the verifier's read of its
    decision, and one read of every row's bonus token (stops, the context index and the stage clock read the
    host tokens); nothing else reads the device or waits for it."""
    rows, cache, clock = state.rows, state.cache, state.clock
    past = state.inputs.cache_length(cache)
    # 1.-2. Draft and build. The tokens still allowed after the root bound each tree's depth (the bonus is one).
    max_depths = [state.generation_config.max_length - row.sequence.shape[1] - 1 for row in rows]
    roots, first_positions = [row.root for row in rows], [row.next_position for row in rows]
    root_ids = [row.root_id for row in rows]
    candidates = state.candidates.get_candidates(roots, first_positions, max_depths, state.sizes, clock, root_ids)
    trees = candidates.trees
    # 3.-4. Tree pass and verify.
    result = state.tree_pass(state, trees, past, first_positions)
    bonus_ids = torch.stack(result.bonuses).tolist()  # the cycle's one read of its outcome, every row's bonus
    settle_times(state, candidates, result)
    # 5. Commit each row's tokens; its outcome goes back to the candidate generator.
    features = state.candidates.features(result.hidden_states)  # [R, N, k * H] or None
    result.hidden_states = None  # the pass's hidden states are not needed any more
    processed, host_paths, logits, nodes = result.processed, result.host_paths, result.logits, result.nodes
    stopped = []
    for i, row in enumerate(rows):
        emitted = (processed[i], logits[i])
        stopped.append(commit_row(state, i, trees[i], host_paths[i], bonus_ids[i], emitted, features))
        times = (candidates.draft_s, candidates.build_s[i], result.forward_s, result.verify_s)
        record_cycle(state, row, trees[i], host_paths[i], processed[i], times, nodes)
        if candidates.predicted is not None:
            row.stats.predicted_lengths.append(candidates.predicted[i])
    rest_s = clock.lap("rest")  # (on CUDA its host time: what it launches is small, and read next cycle)
    # 6. Observe: the size stage learns what the trees accepted and what the pass cost; stopped rows leave.
    other_s = sum(candidates.build_s) + result.verify_s + rest_s
    state.sizes.observe(trees, host_paths, nodes - 1, result.forward_s, other_s)
    leave(state, stopped)


def settle_times(state: Decoding, candidates, result) -> None:
    """On CUDA, the cycle's stage times from the device's timeline (`StageClock.settle`, no wait after the bonus
    read) replace the host laps; the drafter's time goes to the size stage now (its rule got none)."""
    seconds = state.clock.settle()
    if not seconds:
        return
    candidates.draft_s = seconds.get("draft", 0.0)
    candidates.build_s = [seconds.get(("build", i), 0.0) for i in range(len(candidates.build_s))]
    result.forward_s, result.verify_s = seconds.get("forward", 0.0), seconds.get("verify", 0.0)
    if candidates.drafted:
        state.sizes.observe_draft(candidates.draft_s)


@dataclass
class Verified:
    """What stages 3-4 give the loop: each row's accepted path (host tensor and list), bonus and processed scores,
    the pass's raw logits `[R, N, V]` and hidden states, its padded node count N, and the two stage times."""

    paths: list
    bonuses: list
    processed: list
    host_paths: list
    logits: torch.Tensor
    hidden_states: tuple | None
    nodes: int
    forward_s: float
    verify_s: float


def tree_pass_and_verify(state: Decoding, trees, past: int, first_positions: list[int]) -> Verified:
    """Stages 3-4: ONE target forward over every row's tree, then each row's processors and exact decision; the
    cache keeps every row's accepted path."""
    tokens, mask, positions = state.inputs(trees, past, first_positions)
    out = tree_forward(state.model, tokens, state.cache, mask, positions, state.candidates.hidden_indices)
    logits = out.logits.float()  # [R, N, V]
    forward_s = state.clock.lap("forward")
    # each row's committed tokens, which only logits processors read
    committed = [row.sequence[:, :-1] if len(row.processors) else None for row in state.rows]
    processors = [row.processors for row in state.rows]
    paths, bonuses, processed, host_paths = verifier_stage(
        trees, logits, committed, processors, state.verify, state.generator, state.cache, past
    )
    state.inputs.commit([len(path) for path in host_paths])
    verify_s = state.clock.lap("verify")
    return Verified(
        paths, bonuses, processed, host_paths, logits, out.hidden_states, tokens.shape[1], forward_s, verify_s
    )


def commit_row(state: Decoding, i: int, tree, host_path: list[int], bonus_id: int, emitted, features) -> bool:
    """Stage 5 for row i: append its accepted tokens and bonus, hand the candidate generator its outcome (the
    accepted nodes' features become the drafter's next context, the tokens the context index's), keep the
    scores / logits of the emitted tokens (`emitted`: the tree's processed and raw rows, when returned), stream,
    and whether it stopped (its sequence then cut at the stop). Every token is known on the host (the tree's
    from its build, the bonus from the cycle's read): nothing here reads the device or waits for it."""
    row = state.rows[i]
    accepted, start = len(host_path), row.sequence.shape[1]
    new_ids = [*(tree.lists.tokens[node] for node in host_path[1:]), bonus_id] if accepted > 1 else [bonus_id]
    row.sequence = torch.cat([row.sequence, to_device(host_long(new_ids)[None], row.sequence.device)], dim=1)
    row.root_id = bonus_id
    positions = range(row.next_position, row.next_position + accepted)  # consecutive: no tensor needed
    tokens = state.candidates.committed_tokens(i, tree, host_path) if state.candidates.lookup else None
    in_order = host_path[-1] == accepted - 1  # the path is the first nodes 0..k (it ends at k)
    device_path = None if in_order else to_device(host_long(host_path), row.sequence.device)
    row_features = None
    if features is not None:  # a path of the first nodes is a view of them, not a copy
        row_features = features[i : i + 1, :accepted] if in_order else features[i : i + 1].index_select(1, device_path)
    state.candidates.update_candidate_strategy(i, row_features, positions, tokens, tree, host_path)
    row.next_position += accepted
    if state.outputs.scores is not None or state.outputs.logits is not None:
        rows = (lambda x: x[:accepted]) if in_order else (lambda x: x.index_select(0, device_path))
        state.outputs.add(rows(emitted[0]), rows(emitted[1]))
    stop = first_stop(state.stopping_criteria, row.sequence, start, state.outputs.scores, new_ids, state.eos_ids)
    if stop is not None:
        row.sequence = row.sequence[:, : stop + 1]
    state.outputs.stream(new_ids[: row.sequence.shape[1] - start])
    return stop is not None


def record_cycle(state: Decoding, row: Row, tree, path: list[int], processed, times, pass_nodes: int):
    """The row's statistics of this cycle (`times`: its draft, build, forward and verify seconds)."""
    stats, accepted = row.stats, len(path)
    stats.record(accepted, tree.num_nodes - 1, *times)
    stats.count_sources(tree.node_info.sources if tree.node_info else None, path)
    if state.batch:
        stats.pass_rows.append(len(state.rows))
        stats.pass_nodes.append(pass_nodes)
    if state.outputs.return_dict:  # coverage 1 + C, only for returned statistics
        plain = not state.generation_config.do_sample or tree.num_nodes == 1  # the coverage is the accepted length
        row.coverages.append(float(accepted) if plain else coverage(tree, processed))


def leave(state: Decoding, stopped: list[bool]) -> None:
    """Rows that stopped leave the batch and the caches at once (so they cost nothing further); a batch's holes
    go once they are a large share of its caches."""
    if any(stopped):
        for row, stop in zip(state.rows, stopped, strict=True):
            if stop:
                state.done[row.index] = row
        keep = [i for i, stop in enumerate(stopped) if not stop]
        state.rows = [state.rows[i] for i in keep]
        if state.rows:
            state.inputs.select(state.cache, keep)
            state.candidates.select(keep)
    if state.batch and state.rows:
        state.inputs.compact(state.cache)
        state.candidates.compact()


def finish(state: Decoding, prompt_length: int):
    """The call's result: one prompt's output with its cache, or the batch's padded rows."""
    state.candidates.warn_nonfinite()
    rows = [state.done[r] for r in sorted(state.done)]
    for row in rows:
        row.stats.coverages = [float(c) for c in row.coverages]
        if state.sizes.budget is not None:
            row.stats.budget_model = state.sizes.budget.cost.summary()
    if state.batch:
        pad = state.generation_config._pad_token_tensor
        return state.outputs.batch_result([row.sequence for row in rows], [row.stats for row in rows], pad)
    (row,) = rows
    # The cache holds every returned token but the last, as plain generate's: the rows of accepted tokens after
    # a stop inside the last block go (a continuation from this cache then equals an uninterrupted run).
    excess = state.cache.get_seq_length() - (row.sequence.shape[1] - 1)
    if excess > 0:
        state.cache.crop(-excess)
    settle_tree_states(state.cache)  # linear-attention layers: the state alone, not the last tree pass's
    return state.outputs.result(row.sequence, prompt_length, state.cache, row.stats)
