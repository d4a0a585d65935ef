"""Drafters that are not hf_tev's own: any drafter transformers' `speculation_type="dflash"` chain drives (its own
`MuseGlimmerAssistantModel` first) drafts hf_tev's trees through `NativeDFlashDrafter` (docs/usage.md#drafters).

Such a drafter has `config.target_layer_ids`, `config.block_size`, `config.mask_token_id` and a
`forward(noise_embeds=, context_hidden_states=, position_ids=, attention_mask=, cache=)` returning the block's
final states. `NativeDFlashDrafter` feeds it exactly as transformers' `DFlashTokenCandidateGenerator` does:
 - context rows: the target's hidden states at `target_layer_ids + 1`, concatenated (the drafter projects them
   itself), the committed tokens before the block's root, each once, in order;
 - block rows: the target's input embeddings of `[root, MASK, ...]` WITHOUT an `embed_norm` the embedding module
   may apply after its lookup (Muse Glimmer's), as transformers' chain embeds them;
 - a `DFlashCache` told how many new context rows come (`set_previous_accepted_tokens`), whose block rows are
   cropped after each draft; position ids of the new context rows then of the block (the root's position first);
   no attention mask for one prompt (a 2D one over cached + new context + block rows for a batch);
 - marginals: the target's output embeddings (LM head) on block rows 1..D, with no logit scaling or capping.
So the per-depth draft marginals are the ones transformers' chain drafts from. The one difference: the cache
keeps every layer at full length (transformers' own keeps only a sliding layer's window), and the drafter's own
masks apply the window, as they do in transformers' chain (the window never needs a row its cache dropped).
"""

from __future__ import annotations

import inspect
import threading
import weakref

import torch
from torch import nn
from transformers.cache_utils import DFlashCache

from .modeling_dflash import check_num_depths

NATIVE_FORWARD_ARGUMENTS = ("noise_embeds", "context_hidden_states", "position_ids", "attention_mask", "cache")
_ADAPTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # drafter -> its one NativeDFlashDrafter
_LOCK = threading.Lock()


def native_drafter_problems(model) -> list[str]:
    """What `model` lacks to be a drafter transformers' DFlash chain drives (empty: it is one)."""
    config = getattr(model, "config", None)
    fields = ("target_layer_ids", "block_size", "mask_token_id")
    problems = [f"config.{name}" for name in fields if getattr(config, name, None) is None]
    forward = getattr(model, "forward", None)
    try:
        parameters = inspect.signature(forward).parameters if callable(forward) else {}
    except (TypeError, ValueError):  # a builtin without a signature
        parameters = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    missing = [name for name in NATIVE_FORWARD_ARGUMENTS if name not in parameters and not takes_any]
    if missing or not callable(forward):
        problems.append(f"forward({', '.join(f'{name}=' for name in NATIVE_FORWARD_ARGUMENTS)})")
    return problems


def tree_drafter(drafter):
    """The drafter the tree decoder uses for `assistant_model=drafter`: hf_tev's own drafter (anything with
    `draft_logits`) as it is, a drafter transformers' DFlash chain drives as its `NativeDFlashDrafter` (one per
    drafter, so what the automatic budget learns about it is kept across calls), anything else as it is (the
    decoder's checks refuse it, naming what it lacks)."""
    if drafter is None or hasattr(drafter, "draft_logits") or native_drafter_problems(drafter):
        return drafter
    with _LOCK:
        adapter = _ADAPTERS.get(drafter)
        if adapter is None:
            adapter = _ADAPTERS[drafter] = NativeDFlashDrafter(drafter)
    return adapter


def drafter_sliding_window(drafter) -> int | None:
    """The window of a drafter's sliding-window layers (None: every layer attends to all rows)."""
    config = drafter.config
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types is not None:
        return window if any(t != "full_attention" for t in types) else None
    return window


def noise_embeddings(target, block_ids: torch.Tensor) -> torch.Tensor:
    """The target's input embeddings of `block_ids`, without the `embed_norm` an embedding module may apply after
    its lookup (Muse Glimmer's normed embedding), as transformers' DFlash chain embeds a block. The module is not
    changed on the way (a thread decoding with the same target may be using it)."""
    embeddings = target.get_input_embeddings()
    if getattr(embeddings, "embed_norm", None) is not None and isinstance(embeddings, nn.Embedding):
        return nn.Embedding.forward(embeddings, block_ids)  # the lookup alone
    return embeddings(block_ids)


class NativeDFlashDrafter:
    """hf_tev's drafter interface (`draft_logits`, `context_features`, `new_cache`, `check_target`, ...) for a
    drafter transformers' `speculation_type="dflash"` chain drives, fed as that chain feeds it.

    It holds the drafter weakly (one adapter per drafter is kept while the drafter lives: `tree_drafter`).
    """

    def __init__(self, model):
        self._model = weakref.ref(model)

    @property
    def model(self):
        model = self._model()
        if model is None:
            raise ReferenceError("the drafter this NativeDFlashDrafter served was deleted")
        return model

    @property
    def config(self):
        return self.model.config

    def parameters(self, recurse: bool = True):
        return self.model.parameters(recurse)

    def __repr__(self) -> str:
        return f"NativeDFlashDrafter({type(self.model).__name__})"

    @property
    def target_hidden_indices(self) -> list[int]:
        """Indices into the target's `output_hidden_states` tuple: `target_layer_ids + 1`, as transformers' chain."""
        return [i + 1 for i in self.config.target_layer_ids]

    def context_features(self, hidden_states) -> torch.Tensor:
        """Context rows `[B, T, k * H]`: the selected hidden states concatenated (the drafter projects them)."""
        return torch.cat([hidden_states[i] for i in self.target_hidden_indices], dim=-1)

    def new_cache(self) -> DFlashCache:
        """transformers' `DFlashCache`, every layer at full length (one per generation)."""
        return DFlashCache()

    def draft_logits(
        self, target, context_hidden_states, block_ids, position_ids, cache=None, num_depths=None, attention_mask=None
    ) -> torch.Tensor:
        """Draft marginals of one block `[B, num_depths or L - 1, V]` (`DFlashDraftModel.draft_logits`' contract):
        the target's LM head on the drafter's block rows 1.., computed as transformers' DFlash chain computes them.
        The new context K/V stay in `cache`; the block's are cropped again."""
        depths = check_num_depths(num_depths, block_ids.shape[1] - 1)
        model = self.model
        weight = next(model.parameters())
        noise_embeds = noise_embeddings(target, block_ids).to(device=weight.device, dtype=weight.dtype)
        context = context_hidden_states.to(device=weight.device, dtype=weight.dtype)
        if cache is not None:
            cache.set_previous_accepted_tokens(context.shape[1])
        block_rows = model(
            noise_embeds=noise_embeds,
            context_hidden_states=context,
            position_ids=position_ids.to(weight.device),
            attention_mask=None if attention_mask is None else attention_mask.to(weight.device),
            cache=cache,
        ).last_hidden_state
        if cache is not None:
            cache.crop(-block_ids.shape[1])
        head = target.get_output_embeddings()
        rows = block_rows[:, 1 : 1 + depths]
        return head(rows.to(device=head.weight.device, dtype=head.weight.dtype))

    def check_target(self, target) -> None:
        """Raise ValueError naming every way this drafter does not fit `target`."""
        text_config = target.config.get_text_config()
        config = self.config
        problems = []
        hidden = getattr(config, "hidden_size", None)
        if hidden is not None and hidden != text_config.hidden_size:
            problems.append(f"hidden size: drafter {hidden}, target {text_config.hidden_size}")
        if target.get_output_embeddings() is None:
            problems.append("the target has no output embeddings (LM head)")
        vocab = target.get_input_embeddings().weight.shape[0]
        mask = config.mask_token_id
        if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < vocab:
            problems.append(f"mask_token_id {mask!r} is not one of the target's {vocab} token ids")
        block = config.block_size
        if isinstance(block, bool) or not isinstance(block, int) or block < 2:
            problems.append(f"block_size {block!r} must be an int >= 2 (the root and at least one mask)")
        ids, layers = config.target_layer_ids, text_config.num_hidden_layers
        if not ids or not all(isinstance(i, int) and 0 <= i < layers for i in ids):
            problems.append(f"target_layer_ids {ids!r} must be a non-empty list of the target's {layers} layers")
        if problems:
            raise ValueError(
                f"The DFlash drafter {type(self.model).__name__} does not fit the target: " + "; ".join(problems)
            )
