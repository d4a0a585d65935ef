"""Tree speculative decoding inside `model.generate`.

`import hf_tev` wraps `GenerationMixin.generate` (reversibly, `hf_tev.disable()` / `hf_tev.enable()`): a call
that carries `tev_config=` and `assistant_model=` is turned into transformers' supported `custom_generate`
route, so generate still prepares the logits processors, stopping criteria, special tokens, length limits
and cache, and then hands the loop to `tree_speculative_decode` below. Every other call passes through
untouched.

One decoding cycle (SPEC section 1):
  1. draft:   the DFlash drafter reads the newly committed tokens' target features and `[root, MASK...]`
              and returns per-depth logits q_1..q_D (`DFlashTreeCandidateGenerator`).
  2. build:   the best-first tree of at most `budget` nodes (`hf_tev.tree.build_tree`).
  3. forward: ONE target forward over the tree with a float 4D tree mask.
  4. decide:  the logits processors per node (`process_tree_logits`), then an exact verifier picks the
              accepted path and the bonus token (`hf_tev.verify`).
  5. commit:  compact the target KV cache to the accepted path; its hidden states become the drafter's
              next context.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch
from transformers import GenerationMixin
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.generation import (
    EosTokenCriteria,
    GenerateDecoderOnlyOutput,
    MaxLengthCriteria,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .tree import DraftTree, build_tree, chain_tree, tree_attention_mask, tree_position_ids
from .verify import VERIFIERS, target_flow, verify_greedy

TREE_SHAPES = ("best_first", "chain")
TREE_ATTENTION = ("sdpa", "eager")  # implementations that take an arbitrary float 4D mask


@dataclass
class TEVConfig:
    """How `generate(..., assistant_model=drafter, tev_config=TEVConfig(...))` decodes.

    Args:
        budget (`int`, defaults to 64): drafted tree nodes per cycle, the root excluded. 0 is plain decoding.
        verifier (`str`, defaults to `"tev"`): `"tev"` (Tree Exit Verification), `"predraw"` (DDTree's
            predraw-and-follow) or `"residual"` (sequential residual). All are exact and share one output law;
            at temperature 0 (greedy) all three reduce to the same argmax walk.
        tree (`str`, defaults to `"best_first"`): `"best_first"` (DDTree's builder) or `"chain"` (one argmax
            child per depth, plain DFlash; at most `min(budget, block_size - 1)` nodes).
        block_size (`int`, *optional*): drafting block (root + masks), at most the drafter's own block size.
        seed (`int`, *optional*): seeds a private `torch.Generator` for the verifier's draws. `None` uses torch's
            global RNG, like `generate` itself, so `torch.manual_seed` before the call reproduces a run.
    """

    budget: int = 64
    verifier: str = "tev"
    tree: str = "best_first"
    block_size: int | None = None
    seed: int | None = None

    def __post_init__(self):
        if isinstance(self.budget, bool) or not isinstance(self.budget, int):
            raise TypeError(f"TEVConfig.budget must be an int, got {type(self.budget).__name__}")
        if self.budget < 0:
            raise ValueError(f"TEVConfig.budget must be >= 0 (0 = plain decoding), got {self.budget}")
        if self.verifier not in VERIFIERS:
            raise ValueError(f"TEVConfig.verifier must be one of {sorted(VERIFIERS)}, got {self.verifier!r}")
        if self.tree not in TREE_SHAPES:
            raise ValueError(f"TEVConfig.tree must be one of {TREE_SHAPES}, got {self.tree!r}")
        if self.block_size is not None and (not isinstance(self.block_size, int) or self.block_size < 2):
            raise ValueError(f"TEVConfig.block_size must be an int >= 2 (root + at least one mask), got {self.block_size!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise TypeError(f"TEVConfig.seed must be an int or None, got {type(self.seed).__name__}")


@dataclass
class TEVStats:
    """Per-cycle statistics of one tree-decoding call (one entry per cycle, seconds for times).

    `accepted_lengths[i]` is the cycle's block length as the paper counts it (tau: accepted drafted nodes + 1
    for the bonus token); `coverages[i]` is the tree's expected block length under the target, 1 + C.
    Stage times: `draft` (drafter forward), `build` (tree builder), `forward` (target tree pass),
    `verify` (the verifier stage: logits processing, decision and cache commit).
    """

    accepted_lengths: list[int] = field(default_factory=list)
    coverages: list[float] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    draft_times: list[float] = field(default_factory=list)
    build_times: list[float] = field(default_factory=list)
    forward_times: list[float] = field(default_factory=list)
    verify_times: list[float] = field(default_factory=list)
    prefill_time: float = 0.0

    @property
    def num_cycles(self) -> int:
        return len(self.accepted_lengths)

    @property
    def tau(self) -> float:
        """Mean output-block length including the bonus token."""
        return sum(self.accepted_lengths) / max(1, self.num_cycles)

    @property
    def mean_coverage(self) -> float:
        return sum(self.coverages) / max(1, len(self.coverages))

    def summary(self) -> dict:
        mean = lambda xs: sum(xs) / max(1, len(xs))  # noqa: E731
        return {
            "cycles": self.num_cycles,
            "tau": self.tau,
            "coverage": self.mean_coverage,
            "tree_size": mean(self.tree_sizes),
            "draft_s": mean(self.draft_times),
            "build_s": mean(self.build_times),
            "forward_s": mean(self.forward_times),
            "verify_s": mean(self.verify_times),
            "prefill_s": self.prefill_time,
        }


@dataclass
class TEVGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus the per-cycle statistics of the tree decoder."""

    tev_stats: TEVStats | None = None


# --------------------------------------------------------------------------------------------------------
# Drafting: the tree counterpart of transformers' `CandidateGenerator`
# --------------------------------------------------------------------------------------------------------
class DFlashTreeCandidateGenerator:
    """Proposes a draft tree per cycle from a DFlash drafter (transformers' `CandidateGenerator`, for trees).

    It owns the drafter's cache of context K/V: `get_candidates` appends the newly committed tokens' target
    features, drafts `[root, MASK * (L-1)]` and builds the tree; the drafter drops its block rows itself.
    """

    def __init__(self, drafter, target, tev_config: TEVConfig):
        self.drafter = drafter
        self.target = target
        self.config = tev_config
        self.block_size = tev_config.block_size or drafter.config.block_size
        self.cache = drafter.new_cache()
        device = target.get_input_embeddings().weight.device
        self.masks = torch.full((1, self.block_size - 1), drafter.config.mask_token_id, dtype=torch.long, device=device)

    def get_candidates(self, root: torch.Tensor, context: torch.Tensor, context_positions: torch.Tensor,
                       root_position: int, max_depth: int, timer) -> DraftTree:
        """Draft and build one tree.

        Args:
            root (`torch.LongTensor` of shape `(1,)`): the not-yet-verified token that starts the block.
            context (`torch.FloatTensor` of shape `(1, c, k * hidden)`): target features of the tokens committed
                since the last call (the drafter's cache holds the earlier ones).
            context_positions (`torch.LongTensor` of shape `(1, c)`): their position ids.
            root_position (`int`): position id of the root.
            max_depth (`int`): deepest useful depth (fewer tokens may remain before `max_length`).
        """
        depth = min(self.block_size - 1, max_depth)
        if self.config.budget == 0 or depth <= 0:
            return build_tree(root.new_zeros((1, 1), dtype=torch.float32), 0, root)  # the root alone
        block_ids = torch.cat([root.view(1, 1), self.masks[:, :depth]], dim=1)  # [1, depth + 1]
        block_positions = torch.arange(root_position, root_position + depth + 1, device=root.device)[None]
        logits = self.drafter.draft_logits(
            self.target, context, block_ids, torch.cat([context_positions, block_positions], dim=1), cache=self.cache,
            num_depths=min(depth, self.config.budget),  # a tree of B nodes is at most B deep: skip the LM head below
        )  # [1, min(depth, budget), V]
        draft_logprobs = torch.log_softmax(logits[0].float(), dim=-1)  # [min(depth, budget), V]
        timer("draft")
        if self.config.tree == "chain":
            tree = chain_tree(draft_logprobs, root, length=min(self.config.budget, depth))
        else:
            tree = build_tree(draft_logprobs, self.config.budget, root)
        timer("build")
        return tree


# --------------------------------------------------------------------------------------------------------
# Logits processing per tree node
# --------------------------------------------------------------------------------------------------------
# Processors whose output for a row depends only on that row's scores (not on input_ids or its length):
# all tree nodes can go through them in one call.
ROW_WISE_PROCESSORS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)


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
    if all(isinstance(p, ROW_WISE_PROCESSORS) for p in logits_processor):
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


# --------------------------------------------------------------------------------------------------------
# KV cache surgery
# --------------------------------------------------------------------------------------------------------
def commit_accepted_path(cache: DynamicCache, past: int, path: torch.Tensor, path_is_prefix: bool) -> None:
    """Keep only the accepted path's rows of the tree window appended after `past` cached positions.

    Rows `past + path` move to `past .. past + len(path) - 1` on every layer, then the rest is cropped.
    When the path is the first `len(path)` nodes (often: node order is best-first), nothing moves.
    """
    kept = path.numel()
    if not path_is_prefix:
        index = past + path
        for layer in cache.layers:
            layer.keys[:, :, past : past + kept] = layer.keys.index_select(2, index)
            layer.values[:, :, past : past + kept] = layer.values.index_select(2, index)
    excess = cache.get_seq_length() - (past + kept)
    if excess:
        cache.crop(-excess)


def verifier_stage(tree, logits, committed_ids, logits_processor, verify, generator, cache, past):
    """The verifier stage the paper times: per-node logits processing, the decision, and the cache commit.

    Args:
        logits (`torch.FloatTensor` of shape `(N, V)`): raw target logits of the tree pass, float32.
        committed_ids (`torch.LongTensor` of shape `(1, past)`): the tokens in the cache.
        verify: one of `hf_tev.verify.VERIFIERS`, or `None` for greedy decoding (the T=0 limit of them all).
    Returns:
        `(path, bonus, processed)`: accepted node indices root first `[k + 1]`, the bonus token (0-dim) and the
        processed scores `[N, V]` (each verifier normalises only the rows it needs).
    """
    processed = process_tree_logits(logits_processor, committed_ids, tree, logits)
    if verify is None:
        path, bonus = verify_greedy(tree, processed)
    else:
        path, bonus = verify(tree, processed, generator=generator)
    path_list = path.tolist()  # verifiers return the path on the host (their one host sync)
    path = path.to(logits.device, non_blocking=True)
    commit_accepted_path(cache, past, path, path_list == list(range(len(path_list))))
    return path, bonus, processed


# --------------------------------------------------------------------------------------------------------
# Stopping
# --------------------------------------------------------------------------------------------------------
def first_stop(stopping_criteria, sequence: torch.Tensor, start: int, scores) -> int | None:
    """Index (into `sequence`) of the first token at or after `start` after which generation stops, or None.

    Plain `generate` checks the criteria after every appended token; so do we, in closed form for the usual
    max-length / EOS criteria and token by token for any other criterion.
    """
    length = sequence.shape[1]
    if all(isinstance(c, (MaxLengthCriteria, EosTokenCriteria)) for c in stopping_criteria):
        stops = [length]
        for criterion in stopping_criteria:
            if isinstance(criterion, MaxLengthCriteria):
                stops.append(max(start, criterion.max_length - 1))
            else:
                eos = torch.isin(sequence[0, start:], criterion.eos_token_id.to(sequence.device))
                if eos.any():
                    stops.append(start + int(eos.nonzero()[0, 0]))
        stop = min(stops)
        return stop if stop < length else None
    for end in range(start + 1, length + 1):
        if stopping_criteria(sequence[:, :end], scores).any():
            return end - 1
    return None


# --------------------------------------------------------------------------------------------------------
# The decode loop (called by generate through `custom_generate`)
# --------------------------------------------------------------------------------------------------------
def _check_supported(model, drafter, input_ids, generation_config, tev_config, cache):
    if drafter is None:
        raise ValueError("`tev_config` needs `assistant_model=` a DFlash drafter (hf_tev.DFlashDraftModel).")
    if not hasattr(drafter, "draft_logits"):
        raise TypeError(
            f"`assistant_model` must be a DFlash drafter (hf_tev.DFlashDraftModel), got {type(drafter).__name__}. "
            "Classic assistant models use transformers' assisted generation: drop `tev_config`."
        )
    drafter.check_target(model)
    if tev_config.block_size is not None and tev_config.block_size > drafter.config.block_size:
        raise ValueError(
            f"TEVConfig.block_size={tev_config.block_size} exceeds the drafter's block_size={drafter.config.block_size}"
        )
    if input_ids.shape[0] != 1:
        raise ValueError(f"hf_tev tree decoding supports batch size 1 only, got a batch of {input_ids.shape[0]}.")
    if generation_config.num_beams != 1 or generation_config.num_return_sequences != 1:
        raise ValueError("hf_tev tree decoding supports num_beams=1 and num_return_sequences=1 only.")
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError("hf_tev tree decoding does not return attentions or hidden states; use output_scores/logits.")
    attn = model.config._attn_implementation
    if attn not in TREE_ATTENTION:
        raise ValueError(
            f"The tree pass needs an attention implementation that takes an arbitrary 4D mask ({TREE_ATTENTION}); "
            f"this model uses {attn!r}. Call `model.set_attn_implementation('sdpa')` first."
        )
    if cache is not None:
        if type(cache) is not DynamicCache or any(type(layer) is not DynamicLayer for layer in cache.layers):
            raise ValueError(
                f"hf_tev tree decoding supports a full-attention DynamicCache only, got {type(cache).__name__} "
                f"with layers {sorted({type(layer).__name__ for layer in cache.layers})} "
                "(sliding-window, static, quantized and linear-attention caches are not supported)."
            )
        if cache.get_seq_length() > 0:
            raise ValueError("hf_tev tree decoding starts from an empty cache; do not pass a pre-filled cache.")


def tree_speculative_decode(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    *,
    drafter,
    tev_config: TEVConfig,
    streamer=None,
    **model_kwargs,
):
    """The tree decoding loop. Signature of a transformers `custom_generate` callable.

    Args:
        input_ids (`torch.LongTensor` of shape `(1, prompt_length)`): the prompt.
    Returns:
        `torch.LongTensor` of shape `(1, total_length)`, or a `TEVGenerateOutput` with
        `return_dict_in_generate=True`.
    """
    cache = model_kwargs.get("cache")
    _check_supported(model, drafter, input_ids, generation_config, tev_config, cache)
    if cache is None:
        cache = DynamicCache(config=model.config)
    do_sample = generation_config.do_sample
    return_dict = generation_config.return_dict_in_generate
    keep_scores = return_dict and generation_config.output_scores
    keep_logits = return_dict and generation_config.output_logits
    scores, raw_logits = [], []
    generator = None
    if tev_config.seed is not None:
        generator = torch.Generator(device=input_ids.device).manual_seed(tev_config.seed)
    verify = VERIFIERS[tev_config.verifier]
    stats = TEVStats()
    coverages = []  # 1 + C per cycle
    candidates = DFlashTreeCandidateGenerator(drafter, model, tev_config)
    hidden_indices = drafter.target_hidden_indices
    dtype = model.dtype
    max_length = generation_config.max_length

    # Padding (batch of one with a 2D mask holding zeros): pad columns stay hidden, positions skip them.
    attention_mask = model_kwargs.get("attention_mask")
    position_ids = model_kwargs.get("position_ids")
    pad_columns = None
    if attention_mask is not None and not bool(attention_mask.all()):
        pad_columns = (attention_mask[0] == 0).nonzero(as_tuple=True)[0]

    stage_start = time.perf_counter()
    last = stage_start

    def timer(stage: str | None = None):
        nonlocal last
        if input_ids.device.type == "cuda":
            torch.cuda.synchronize(input_ids.device)
        now = time.perf_counter()
        if stage is not None:
            getattr(stats, f"{stage}_times").append(now - last)
        last = now

    # 1. Prefill: the prompt's cache, its context features, and the first token (the first root).
    out = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
        output_hidden_states=hidden_indices, logits_to_keep=1, use_cache=True,
    )
    features = drafter.context_features(out.hidden_states)  # [1, n, k * H]
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
    context_positions = position_ids
    if pad_columns is not None:  # the drafter never sees pad rows
        real = attention_mask[0].bool()
        features, context_positions = features[:, real], position_ids[:, real]
    next_position = int(context_positions[0, -1]) + 1
    raw = out.logits[:, -1].float()
    processed = logits_processor(input_ids, raw)
    if do_sample:
        root = torch.multinomial(torch.softmax(processed, dim=-1), 1, generator=generator)[0]
    else:
        root = processed.argmax(dim=-1)
    if keep_scores:
        scores.append(processed)
    if keep_logits:
        raw_logits.append(raw)
    del out
    sequence = torch.cat([input_ids, root[None]], dim=1)  # committed tokens + the root
    if streamer is not None:
        streamer.put(root.cpu())
    timer()
    stats.prefill_time = last - stage_start
    stop = first_stop(stopping_criteria, sequence, sequence.shape[1] - 1, scores[-1] if scores else None)

    # 2. Cycles.
    while stop is None:
        past = cache.get_seq_length()
        # Tokens still allowed after the root: the bonus is one of them, so deeper drafts would be cut anyway.
        useful_depth = max_length - sequence.shape[1] - 1
        tree = candidates.get_candidates(root, features, context_positions, next_position, useful_depth, timer)
        if tree.num_nodes == 1:  # nothing drafted: the cycle is a plain decoding step
            timer("draft")
            timer("build")

        mask = tree_attention_mask(tree, past, dtype, device=input_ids.device)
        if pad_columns is not None:
            mask[..., pad_columns] = torch.finfo(dtype).min
        out = model(
            input_ids=tree.tokens[None], position_ids=tree_position_ids(tree, next_position), attention_mask=mask,
            cache=cache, output_hidden_states=hidden_indices, logits_to_keep=0, use_cache=True,
        )
        timer("forward")

        # 3. Verifier stage: processors, decision, commit.
        logits = out.logits[0].float()  # [N, V]
        path, bonus, processed = verifier_stage(
            tree, logits, sequence[:, :-1], logits_processor, verify if do_sample else None, generator, cache, past
        )
        timer("verify")  # the paper's verifier stage ends with the commit
        accepted = path.numel()  # root + accepted drafted nodes
        features = drafter.context_features(out.hidden_states)[:, path]  # [1, accepted, k * H]

        context_positions = torch.arange(next_position, next_position + accepted, device=input_ids.device)[None]
        next_position += accepted
        new_tokens = torch.cat([tree.tokens[path[1:]], bonus.view(1)])[None]  # [1, accepted]
        start = sequence.shape[1]
        sequence = torch.cat([sequence, new_tokens], dim=1)
        if keep_scores:
            scores.extend(processed[path].unsqueeze(1).unbind(0))
        if keep_logits:
            raw_logits.extend(logits[path].unsqueeze(1).unbind(0))
        stop = first_stop(stopping_criteria, sequence, start, scores[-1] if scores else None)
        if stop is not None:
            sequence = sequence[:, : stop + 1]
        if streamer is not None:
            streamer.put(sequence[0, start:].cpu())
        root = bonus.view(1)

        stats.accepted_lengths.append(accepted)
        stats.tree_sizes.append(tree.num_nodes - 1)
        if return_dict and do_sample:  # only returned statistics; kept on the device, read once at the end
            coverages.append(target_flow(tree, processed)[0].sum())
        elif return_dict:
            coverages.append(float(accepted))  # at T=0 the target's flow is the argmax path
        del out
        timer()

    stats.coverages = [float(c) for c in coverages]
    if streamer is not None:
        streamer.end()
    if not return_dict:
        return sequence
    length = sequence.shape[1] - input_ids.shape[1]
    return TEVGenerateOutput(
        sequences=sequence,
        scores=tuple(scores[:length]) if keep_scores else None,
        logits=tuple(raw_logits[:length]) if keep_logits else None,
        cache=cache,
        tev_stats=stats,
    )


# --------------------------------------------------------------------------------------------------------
# Routing `generate(..., tev_config=...)`
# --------------------------------------------------------------------------------------------------------
_original_generate = None


def _route_generate(original):
    @functools.wraps(original)
    def generate(self, *args, tev_config: TEVConfig | None = None, **kwargs):
        if tev_config is None:
            return original(self, *args, **kwargs)
        if not isinstance(tev_config, TEVConfig):
            raise TypeError(f"`tev_config` must be an hf_tev.TEVConfig, got {type(tev_config).__name__}")
        if kwargs.get("custom_generate") is not None:
            raise ValueError("`tev_config` and `custom_generate` cannot be combined.")
        drafter = kwargs.pop("assistant_model", None)
        if drafter is None:
            raise ValueError("`tev_config` needs `assistant_model=` a DFlash drafter (hf_tev.DFlashDraftModel).")
        decode = functools.partial(
            tree_speculative_decode, drafter=drafter, tev_config=tev_config, streamer=kwargs.get("streamer")
        )
        return original(self, *args, custom_generate=decode, **kwargs)

    generate.__hf_tev_route__ = True
    return generate


def enable() -> None:
    """Route `generate` calls that carry `tev_config=` into the tree decoder (done on `import hf_tev`)."""
    global _original_generate
    if _original_generate is None:
        _original_generate = GenerationMixin.generate
        GenerationMixin.generate = _route_generate(_original_generate)


def disable() -> None:
    """Restore transformers' own `GenerationMixin.generate`."""
    global _original_generate
    if _original_generate is not None:
        GenerationMixin.generate = _original_generate
        _original_generate = None


def is_enabled() -> bool:
    return _original_generate is not None
