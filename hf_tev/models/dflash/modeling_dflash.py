"""DFlash block-diffusion drafter (docs/design.md#the-dflash-drafter) as a transformers `PreTrainedModel`.

The drafter is a small Qwen3-style stack without embeddings or LM head. Per draft cycle it reads
 - context rows: target hidden states of committed tokens, concatenated over `target_layer_ids`
   (hidden-state index `l + 1`) and projected by `fc` + `hidden_norm`;
 - block rows: the target's embeddings of `[root, MASK, ..., MASK]`.
Queries come from the block rows only; keys/values from the context rows followed by the block rows, so
the block sees every context row and itself bidirectionally (in a sliding-window draft layer, only the rows at
most `sliding_window` positions away, as transformers' own DFlash drafter). The target's LM head on the
final-normed block rows 1..L-1 gives the per-depth draft marginals q_1..q_D.

Context K/V are cached across cycles; block K/V are appended by the forward and must be cropped by the
caller before the next cycle (`draft_logits` does it; transformers' native `speculation_type="dflash"`
generator does it itself), so the same forward serves both hf_tev's tree decoder and
`target.generate(..., assistant_model=drafter, speculation_type="dflash")`.

Checkpoints load from and save to the published layout (`layers.N...`, `fc.weight`, `hidden_norm.weight`,
`norm.weight`), from safetensors only, strictly.
"""

from collections.abc import Callable

import torch
from torch import nn
from transformers import AutoModel, DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Attention,
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)
from transformers.utils.deprecation import deprecate_kwarg

from .configuration_dflash import DFlashConfig, default_target_layer_ids, drafter_mlp_width
from .files import check_tensor_dtypes, safetensors_files
from .masks import SlidingWindowMask, attention_bias
from .vocabulary import D2T, T2D, DraftVocabularyMixin, check_vocabulary_buffers, to_target_vocab

NOT_AN_ASSISTANT = (
    "DFlashDraftModel is a DFlash drafter, not a classic assistant model: transformers' assisted generation cannot "
    "run it (it has no generation_config and does not generate alone). Decode with hf_tev's draft trees "
    "(`import hf_tev; hf_tev.enable()`, then `generate(..., assistant_model=drafter)`), or pass "
    '`speculation_type="dflash"` for transformers\' own DFlash chain.'
)


MATMUL_ROWS = 4  # `draft_logits` computes the last layer for at least this many rows (see there)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, heads, S, head_dim]; cos, sin: [B, S, head_dim]
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class DFlashAttention(Qwen3Attention):
    """Qwen3 attention (same weights and names) with queries from the block rows only and keys/values from
    the context rows followed by the block rows."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.is_causal = False  # the block attends to itself bidirectionally (and to every context row)

    def forward(self, hidden_states, context, position_embeddings, attention_mask=None, cache=None, rows=None):
        # hidden_states: [B, L, H] normed block rows; context: [B, c, H] projected context rows
        # position_embeddings: (cos, sin) [B, c + L, head_dim]; attention_mask: None or [B|1, 1, L, kv] additive
        # rows (a slice, optional): the block rows whose outputs are wanted; every row still gives its K/V
        batch, block_len = hidden_states.shape[:2]
        kv_inputs = torch.cat([context, hidden_states], dim=1)  # [B, c + L, H]
        cos, sin = (part[:, -block_len:] for part in position_embeddings)
        if rows is not None:
            hidden_states, cos, sin = hidden_states[:, rows], cos[:, rows], sin[:, rows]
        query = self.q_norm(self.q_proj(hidden_states).unflatten(-1, (-1, self.head_dim))).transpose(1, 2)
        key = self.k_norm(self.k_proj(kv_inputs).view(batch, kv_inputs.shape[1], -1, self.head_dim)).transpose(1, 2)
        value = self.v_proj(kv_inputs).view(batch, kv_inputs.shape[1], -1, self.head_dim).transpose(1, 2)

        query = _rotate(query, cos, sin)
        key = _rotate(key, *position_embeddings)
        if cache is not None:  # appends context + block K/V; returns everything cached so far
            key, value = cache.update(key, value, self.layer_idx)
        if isinstance(attention_mask, SlidingWindowMask):  # a sliding layer: its mask depends on the keys it got
            attention_mask = attention_mask.for_keys(key.shape[-2])
        if rows is not None and attention_mask is not None and attention_mask.shape[-2] > 1:
            attention_mask = attention_mask[:, :, rows]

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, _ = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
        )
        return self.o_proj(attn_output.flatten(-2))  # [B, queries, heads * head_dim]


class DFlashDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm residual layer like Qwen3's; the context rows enter the attention un-normed."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, context, position_embeddings, attention_mask=None, cache=None, rows=None):
        """`rows` (a slice, optional): compute only those block rows' outputs (`[B, len(rows), H]`); every row
        still gives its keys and values."""
        attended = self.self_attn(
            self.input_layernorm(hidden_states), context, position_embeddings, attention_mask, cache, rows
        )
        hidden_states = (hidden_states if rows is None else hidden_states[:, rows]) + attended
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


@torch.no_grad()
def _bound_fresh_logits(drafter, head_weight: torch.Tensor) -> None:
    """Scale a fresh drafter's final norm so that its first logits are of order 1, not of order sqrt(H) |w_v|.

    The block rows leave the final RMS norm with norm sqrt(H) times its weight, and the target's head scores them.
    On a target that ties its embeddings, the mask token's row is a real token's, so a fresh drafter (whose layers
    barely change the mask rows) scores every token with huge logits (SmolLM2: cross-entropy 59-69, ln V 10.8).
    With the norm weight 1 / (sqrt(H) r), r the RMS of the head rows' norms, every logit is bounded by |w_v| / r,
    so the first loss sits near ln V on any target. Loaded checkpoints keep their trained norm.
    """
    rows_rms = head_weight.float().pow(2).sum(dim=-1).mean().sqrt()
    scale = 1.0 / (drafter.config.hidden_size**0.5 * rows_rms.clamp_min(1e-6))
    drafter.norm.weight.fill_(scale.item())


class DFlashDraftModel(DraftVocabularyMixin, PreTrainedModel):
    """DFlash drafter. Uses the target's `embed_tokens` and `lm_head` at run time, never owns them."""

    config_class = DFlashConfig
    config: DFlashConfig
    main_input_name = "noise_embeds"
    _no_split_modules = ["DFlashDecoderLayer"]
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _hf_tev_drafter = True  # `generate(assistant_model=<this>)` goes to hf_tev's tree decoder (hf_tev.route)

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        if config.target_layer_ids is None:
            raise ValueError(
                "DFlash drafter config has no target_layer_ids: set dflash_config.target_layer_ids "
                "or num_target_layers (for the default rule)"
            )
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.draft_vocab_size is not None:  # filled by the checkpoint or `set_draft_vocab`
            self.register_buffer(D2T, torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer(T2D, torch.zeros(config.vocab_size, dtype=torch.bool))
        self._head_rows_memo = None
        self.post_init()

    def __getattr__(self, name: str):
        # A drafter has no generation config: transformers' classic assisted generation reads the assistant's
        # first, so a `generate(assistant_model=<this>)` that hf_tev does not route stops here with what to do.
        # An AttributeError, so that `hasattr(drafter, "generation_config")` stays False (the Trainer asks).
        if name == "generation_config":
            raise AttributeError(NOT_AN_ASSISTANT)
        return super().__getattr__(name)

    # ------------------------------------------------------------------ forward

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_hidden_states: torch.Tensor,
        position_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        rows: slice | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """Draft one block (transformers' native DFlash drafter interface).

        Args:
            noise_embeds (`torch.Tensor` of shape `[B, L, H]`): target embeddings of `[root, MASK, ...]`.
            context_hidden_states (`torch.Tensor` of shape `[B, c, k * H]`): new context rows, i.e. target
                hidden states at `target_hidden_indices` concatenated (`context_features`); `c` may be 0.
            position_ids (`torch.LongTensor` of shape `[B|1, c + L]`): positions of the context rows, then
                of the block rows.
            attention_mask (`torch.Tensor`, *optional*): None (block sees all cached and new context rows
                and itself), a 2D padding mask `[B, past + c + L]` (1 = visible; the native path's), or a
                4D additive float mask `[B|1, 1, L, past + c + L]` used as given (bool: True = visible).
                Sliding-window layers also hide every key more than `sliding_window` positions from the query;
                cached rows count as the positions just before the first new row's.
            cache (`Cache`, *optional*): context + block K/V are appended; cropping the block rows is the
                caller's job.
            rows (`slice`, *optional*): the block rows whose outputs are wanted. The last layer computes its
                queries, attention output and MLP for those rows only (every row still gives the keys and values,
                and the earlier layers run every row); `last_hidden_state` is then `[B, len(rows), H]`.
        Returns:
            `BaseModelOutputWithPast` with `last_hidden_state` `[B, L, H]` (final-normed block rows, in the dtype
            and on the device of `noise_embeds`), `cache`.
        """
        kwargs.pop("use_cache", None)  # the presence of `cache` decides
        if kwargs:
            raise TypeError(f"DFlashDraftModel.forward got unexpected arguments: {sorted(kwargs)}")
        if rows is not None and not isinstance(rows, slice):
            raise TypeError(f"DFlashDraftModel.forward(rows=...) takes a slice of rows, not {type(rows).__name__}")
        # The drafter runs in its own dtype on its own device: inputs (the target's embeddings and features) are
        # cast at the boundary, and the block rows go back in the dtype and device of `noise_embeds`, where the
        # target's LM head reads them. All no-ops when drafter and target agree.
        weight = self.fc.weight
        out_dtype, out_device = noise_embeds.dtype, noise_embeds.device
        noise_embeds = noise_embeds.to(device=weight.device, dtype=weight.dtype)
        context_hidden_states = context_hidden_states.to(device=weight.device, dtype=weight.dtype)
        position_ids = position_ids.to(weight.device)
        if attention_mask is not None:
            attention_mask = attention_mask.to(weight.device)
        block_len = noise_embeds.shape[1]
        context = self.hidden_norm(self.fc(context_hidden_states))  # [B, c, H]
        if position_ids.shape[-1] != context.shape[1] + block_len:
            raise ValueError(
                f"position_ids cover {position_ids.shape[-1]} rows, expected context "
                f"{context.shape[1]} + block {block_len}"
            )
        past = cache.get_seq_length() if cache is not None else 0
        mask = attention_bias(attention_mask, block_len, past + context.shape[1] + block_len, noise_embeds.dtype)
        position_embeddings = self.rotary_emb(noise_embeds, position_ids)
        window, dtype = self.config.sliding_window, noise_embeds.dtype
        windowed = None if window is None else SlidingWindowMask(mask, position_ids, block_len, window, dtype)

        hidden_states = noise_embeds
        for layer in self.layers:
            layer_mask = windowed if layer.self_attn.sliding_window is not None else mask
            layer_rows = rows if layer is self.layers[-1] else None  # earlier layers' rows all feed K/V
            hidden_states = layer(hidden_states, context, position_embeddings, layer_mask, cache, layer_rows)
        hidden_states = self.norm(hidden_states).to(device=out_device, dtype=out_dtype)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache)

    # ------------------------------------------------------------- tree decoder API

    @property
    def target_hidden_indices(self) -> list[int]:
        """Indices into the target's `output_hidden_states` tuple (index 0 is the embedding output)."""
        return [i + 1 for i in self.config.target_layer_ids]

    def context_features(self, hidden_states) -> torch.Tensor:
        """Context rows from a target output's `hidden_states` tuple -> `[B, T, k * H]`.

        Works with the full tuple and with transformers' selective one (`output_hidden_states=<list>`,
        None at unselected indices).
        """
        return torch.cat([hidden_states[i] for i in self.target_hidden_indices], dim=-1)

    def new_cache(self) -> Cache:
        """The cache `draft_logits` keeps context K/V in (one per generation). Sliding-window layers keep every
        row too (their window is applied by the mask), so the block rows can be cropped again."""
        cache = DynamicCache(config=self.config)
        if self.config.sliding_window is not None:
            cache.layers = [DynamicLayer() for _ in cache.layers]
        return cache

    def draft_logits(
        self,
        target,
        context_hidden_states,
        block_ids,
        position_ids,
        cache=None,
        num_depths: int | None = None,
        attention_mask=None,
        target_vocab: bool = True,
    ) -> torch.Tensor:
        """Draft marginals of one block: `[B, L - 1, V]` logits q_1..q_D from the target's LM head.

        Args:
            target: the target model (its input embeddings embed the block, its output embeddings score it).
            context_hidden_states (`[B, c, k * H]`): new context rows (all of them when `cache` is None).
            block_ids (`[B, L]`): `[root, mask, ..., mask]`, `L <= block_size`.
            position_ids (`[B|1, c + L]`): positions of the context rows, then of the block rows.
            cache: `new_cache()` or None. The new context K/V are kept; the block rows are removed again.
            num_depths (`int`, *optional*): score only q_1..q_num_depths (`[B, num_depths, V]`); the block is
                still drafted whole (every row's keys and values), and only the last layer's outputs that the
                scores read are computed, so these rows are the same as without it.
            attention_mask (*optional*): as for `forward` (e.g. a 2D `[B, past + c + L]` mask, 1 = visible, for
                rows whose cached or new context columns include padding).
            target_vocab (`bool`, defaults to `True`): for a drafter with a draft vocabulary, False returns its
                logits as scored, `[B, d, draft_vocab_size]` with column j the target id `draft_vocab[j]` (the
                decoder's tree builders map the few ids they pick, `hf_tev.tree.build_tree`'s `token_ids`),
                instead of spreading them over the target's V columns with -inf between: at V = 49,152 and an
                8,192-token draft vocabulary, that spread and the log-softmax and top-k over it cost about 1 ms
                a cycle on one CPU thread, 1.5% of a plain step of SmolLM2-135M
                (`benchmarks/cycle_overhead.py --baseline`, B = 16, T = 0).
        """
        depths = check_num_depths(num_depths, block_ids.shape[1] - 1)
        noise_embeds = target.get_input_embeddings()(block_ids)  # [B, L, H]
        # The last layer's outputs and the LM head only for rows 1..depths (the depths scored), and never fewer
        # than MATMUL_ROWS rows: a CPU matmul of fewer rows takes another kernel, whose rounding differs from the
        # same rows' inside a larger product; from MATMUL_ROWS rows on, a row comes out the same whatever else
        # shares its call (tests/drafter/test_draft_rows.py), so the scores equal a whole block's, bit for bit.
        computed = max(depths, MATMUL_ROWS)
        rows = slice(1, 1 + computed) if computed < block_ids.shape[1] - 1 else None  # None: the whole block
        block_rows = self(
            noise_embeds, context_hidden_states, position_ids, attention_mask, cache=cache, rows=rows
        ).last_hidden_state
        block_rows = block_rows[:, 1:] if rows is None else block_rows  # rows 1, 2, ...
        if cache is not None:
            cache.crop(-block_ids.shape[1])  # a view: only context K/V remain, no copy
        logits = self.head_logits(target, block_rows)[:, :depths]  # the head on >= MATMUL_ROWS rows (above)
        if self.draft_vocab is not None and target_vocab:
            logits = to_target_vocab(logits, self.draft_vocab.to(logits.device), self.config.vocab_size)
        return logits

    def check_target(self, target) -> None:
        """Raise ValueError naming every way this drafter does not fit `target`."""
        text_config = target.config.get_text_config()
        head = target.get_output_embeddings()
        embeddings = target.get_input_embeddings()
        cfg = self.config
        problems = []
        if text_config.hidden_size != cfg.hidden_size:
            problems.append(f"hidden size: drafter {cfg.hidden_size}, target {text_config.hidden_size}")
        if head is None:
            problems.append("the target has no output embeddings (LM head)")
        elif head.weight.shape[0] != cfg.vocab_size:
            problems.append(f"vocabulary: drafter {cfg.vocab_size}, target LM head {head.weight.shape[0]}")
        if cfg.mask_token_id is None:
            problems.append("mask_token_id is not set")
        elif not 0 <= cfg.mask_token_id < embeddings.weight.shape[0]:
            problems.append(
                f"mask_token_id {cfg.mask_token_id} outside the target's {embeddings.weight.shape[0]} embeddings"
            )
        target_cap = getattr(text_config, "final_logit_softcapping", None) or None
        if (cfg.final_logit_softcapping or None) not in (None, target_cap):
            problems.append(
                f"final_logit_softcapping: drafter {cfg.final_logit_softcapping}, target {target_cap} (the drafter's "
                "marginals get the target's own capping)"
            )
        if cfg.num_target_layers is not None and cfg.num_target_layers != text_config.num_hidden_layers:
            problems.append(
                f"layers: drafter built for {cfg.num_target_layers} target layers, target has "
                f"{text_config.num_hidden_layers}"
            )
        if not cfg.target_layer_ids or min(cfg.target_layer_ids) < 0:
            problems.append(f"target_layer_ids {cfg.target_layer_ids} must be a non-empty list of layer indices >= 0")
        elif max(cfg.target_layer_ids) >= text_config.num_hidden_layers:
            problems.append(
                f"target_layer_ids {cfg.target_layer_ids} reach past the target's "
                f"{text_config.num_hidden_layers} layers"
            )
        if problems:
            raise ValueError("DFlash drafter does not fit the target: " + "; ".join(problems))

    # ------------------------------------------------------------- construction

    @classmethod
    def from_target(
        cls,
        target,
        num_layers: int = 1,
        block_size: int = 16,
        mask_token_id: int | None = None,
        target_layer_ids: list[int] | None = None,
        layer_types: list[str] | None = None,
        sliding_window: int | None = None,
    ):
        """A freshly initialised drafter sized for `target` (same dtype and device, eval mode like
        `from_pretrained`).

        Hidden size, heads, head_dim, KV heads, intermediate size (for a mixture-of-experts target without one,
        the experts' width per token: `drafter_mlp_width`), activation, rope parameters, rms eps and
        vocabulary are the target's. Without `target_layer_ids` (which target layers' outputs the drafter
        reads, any number of them), the default rule picks them. Without `mask_token_id`, the mask token is
        `default_mask_token_id(target.config)`. `layer_types` (`"full_attention"` or `"sliding_attention"` per
        draft layer) with `sliding_window` makes sliding-window draft layers (`sliding_window` alone: every layer
        slides); by default every layer is full.
        """
        tc = target.config.get_text_config()
        _check_from_target_arguments(tc, target, num_layers, block_size, mask_token_id, target_layer_ids)
        heads = _base_attribute(tc, "num_attention_heads")
        config = DFlashConfig(
            vocab_size=target.get_output_embeddings().weight.shape[0],
            hidden_size=tc.hidden_size,
            intermediate_size=drafter_mlp_width(tc, _base_attribute(tc, "intermediate_size")),  # MoE: experts
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=_base_attribute(tc, "num_key_value_heads") or heads,
            head_dim=_base_attribute(tc, "head_dim") or tc.hidden_size // heads,
            hidden_act=_base_attribute(tc, "hidden_act") or tc.hidden_activation,  # Gemma: `hidden_activation`
            max_position_embeddings=tc.max_position_embeddings,
            rms_norm_eps=tc.rms_norm_eps,
            rope_parameters=_full_attention_rope(tc.rope_parameters),
            bos_token_id=tc.bos_token_id,
            eos_token_id=tc.eos_token_id,
            pad_token_id=tc.pad_token_id,
            block_size=block_size,
            num_target_layers=tc.num_hidden_layers,
            target_layer_ids=(
                default_target_layer_ids(tc.num_hidden_layers, num_layers)
                if target_layer_ids is None
                else [int(i) for i in target_layer_ids]
            ),
            mask_token_id=default_mask_token_id(tc) if mask_token_id is None else mask_token_id,
            final_logit_softcapping=getattr(tc, "final_logit_softcapping", None),
            layer_types=_draft_layer_types(num_layers, layer_types, sliding_window),
            sliding_window=sliding_window,
        )
        drafter = cls._from_config(config, dtype=target.dtype).to(target.device)
        drafter.check_target(target)
        _bound_fresh_logits(drafter, target.get_output_embeddings().weight)
        return drafter.eval()

    @classmethod
    def _from_config(cls, config, **kwargs):
        return super()._from_config(as_drafter_config(config), **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Load a published-layout DFlash checkpoint (local folder or Hub id), safetensors only, strictly:
        a missing local folder, a folder without `config.json`, pickle weights (also behind a safetensors index),
        a tensor that is not floating point, and a missing, unexpected or mis-shaped weight each raise an error
        naming it."""
        if pretrained_model_name_or_path is None:  # e.g. `packaged.default_drafter` where no drafter ships
            raise ValueError(
                "DFlashDraftModel.from_pretrained(None): no drafter was named. hf_tev.packaged.default_drafter "
                "returns None where no drafter ships for the target, or where a local folder is spelled like its Hub "
                "id; pass a drafter folder or Hub id, or decode with context drafts alone (no assistant_model)"
            )
        if kwargs.get("use_safetensors") is False:
            raise ValueError("DFlashDraftModel loads safetensors only (use_safetensors=False is not supported)")
        check_tensor_dtypes(safetensors_files(pretrained_model_name_or_path, kwargs))
        if isinstance(kwargs.get("config"), PretrainedConfig):
            kwargs["config"] = as_drafter_config(kwargs["config"])
        want_info = kwargs.pop("output_loading_info", False)
        kwargs.update(use_safetensors=True, ignore_mismatched_sizes=True)  # mismatches are reported below
        model, info = super().from_pretrained(
            pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
        )
        problems = []
        if info["missing_keys"]:
            problems.append(f"missing weights {sorted(info['missing_keys'])}")
        if info["unexpected_keys"]:
            problems.append(f"unexpected weights {sorted(info['unexpected_keys'])}")
        if info["mismatched_keys"]:
            problems.append(
                "weights of the wrong shape "
                + ", ".join(
                    f"{name} (checkpoint {tuple(ckpt)}, model {tuple(ours)})"
                    for name, ckpt, ours in sorted(info["mismatched_keys"])
                )
            )
        if problems:
            raise ValueError(
                f"{pretrained_model_name_or_path} is not a DFlash drafter checkpoint this config "
                "describes: " + "; ".join(problems)
            )
        if model.config.draft_vocab_size is not None:
            check_vocabulary_buffers(model.d2t, model.t2d, model.config.vocab_size, str(pretrained_model_name_or_path))
        return (model, info) if want_info else model


def as_drafter_config(config: PretrainedConfig) -> DFlashConfig:
    """`config` as a `DFlashConfig`: `AutoModel` reads a published-layout drafter as a plain `Qwen3Config`."""
    return config if isinstance(config, DFlashConfig) else DFlashConfig.from_dict(config.to_dict())


def check_num_depths(num_depths, depths: int) -> int:
    """The number of depths `draft_logits` scores: `num_depths` (an int in [0, depths]) or all `depths`."""
    if num_depths is None:
        return depths
    if isinstance(num_depths, bool) or not isinstance(num_depths, int) or not 0 <= num_depths <= depths:
        raise ValueError(f"num_depths must be an int in [0, {depths}] (the block's drafted depths), got {num_depths!r}")
    return num_depths


def _base_attribute(text_config, name: str):
    """A text-config attribute as one value for the drafter's uniform layers (None when the config has none).

    Gemma 4 keeps some attributes per layer (`per_layer_config[i].head_dim`: the full-attention layers' differ)
    and refuses global access to them; the drafter then takes the config's own base value, the one every layer
    without an override (the sliding-window layers) uses.
    """
    if name in getattr(text_config, "__dict__", {}):
        return text_config.__dict__[name]
    return getattr(text_config, name, None)


def _full_attention_rope(rope_parameters: dict) -> dict:
    """The rope parameters of the target's full-attention layers (Gemma 3/4 keep one set per layer type): the
    drafter attends over the whole context, as those layers do."""
    if "full_attention" in rope_parameters and isinstance(rope_parameters["full_attention"], dict):
        return dict(rope_parameters["full_attention"])
    return dict(rope_parameters)


def default_mask_token_id(text_config) -> int:
    """Mask token for a new drafter: the target's pad token when it has one that is not also an EOS token
    (it never appears inside generated text), else the last vocabulary id (on published tokenizers a reserved
    or unused slot, like the `<|MASK|>` id the published Qwen3 drafters add after the tokenizer's tokens)."""
    eos = text_config.eos_token_id
    eos_ids = set(eos) if isinstance(eos, (list, tuple)) else {eos}
    pad = text_config.pad_token_id
    if pad is not None and pad not in eos_ids:
        return pad
    return text_config.vocab_size - 1


def _check_from_target_arguments(text_config, target, num_layers, block_size, mask_token_id, target_layer_ids):
    """Raise ValueError naming the `from_target` argument that cannot make a drafter for this target."""

    def is_int(value):
        return isinstance(value, int) and not isinstance(value, bool)

    if not is_int(num_layers) or num_layers < 1:
        raise ValueError(f"from_target(num_layers={num_layers!r}): a drafter needs an int >= 1 of draft layers")
    if not is_int(block_size) or block_size < 2:
        raise ValueError(f"from_target(block_size={block_size!r}): a block is the root and >= 1 mask, an int >= 2")
    vocab = target.get_input_embeddings().weight.shape[0]
    if mask_token_id is not None and (not is_int(mask_token_id) or not 0 <= mask_token_id < vocab):
        raise ValueError(f"from_target(mask_token_id={mask_token_id!r}): must be a token id in [0, {vocab})")
    if target_layer_ids is not None:
        layers = text_config.num_hidden_layers
        ids = list(target_layer_ids) if isinstance(target_layer_ids, (list, tuple)) else None
        if not ids or not all(is_int(i) and 0 <= i < layers for i in ids):
            raise ValueError(
                f"from_target(target_layer_ids={target_layer_ids!r}): must be a non-empty list of the target's "
                f"layer indices, each in [0, {layers})"
            )


def _draft_layer_types(num_layers: int, layer_types, sliding_window) -> list[str] | None:
    """`from_target`'s draft layer types (None: Qwen3's default, all full), or ValueError naming the argument."""
    if sliding_window is not None and (
        isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1
    ):
        raise ValueError(f"from_target(sliding_window={sliding_window!r}): the window is an int >= 1 of positions")
    if layer_types is None:
        return None if sliding_window is None else ["sliding_attention"] * num_layers
    types = list(layer_types) if isinstance(layer_types, (list, tuple)) else None
    known = ("full_attention", "sliding_attention")
    if types is None or len(types) != num_layers or any(t not in known for t in types):
        raise ValueError(
            f"from_target(layer_types={layer_types!r}): must list one of {known} for each of the {num_layers} "
            "draft layers"
        )
    if "sliding_attention" in types and sliding_window is None:
        raise ValueError("from_target(layer_types=...) lists sliding_attention layers: pass sliding_window= too")
    return types


# `AutoModel.from_config(DFlashConfig(...))`; `AutoModel.from_pretrained` on a saved drafter: hf_tev.models.dflash.auto
AutoModel.register(DFlashConfig, DFlashDraftModel, exist_ok=True)
