"""ExitTrain: exit-guided training of a DFlash drafter as a `transformers.Trainer` subclass (SPEC section 6).

```python
from hf_tev import ExitTrainer, ExitTrainingArguments, generate_training_data

rows = generate_training_data(target, prompts, tokenizer=tokenizer, max_new_tokens=512)  # target-written data
args = ExitTrainingArguments(output_dir="out", objective="exit", tree_budget=32, ce_weight=1.0,
                             tree_weight=0.1, learning_rate=1e-4, num_train_epochs=2,
                             per_device_train_batch_size=4)
trainer = ExitTrainer(model=drafter, target_model=target, args=args, train_dataset=rows)
trainer.train()
trainer.push_to_hub("me/my-exittrained-drafter", dataset_description="...")
```

The defaults of the objectives "exit" and "prefix" follow the authors' released training code (hsj576/TEV,
SpecForge `exittrain`); every difference to earlier hf_tev versions is a knob of `ExitTrainingArguments`.

One training step, per batch of target-generated sequences:
  1. context: one no-grad target forward over the sequences; only the drafter's layers are returned
     as hidden states (and, for the tree objectives, the K/V cache is kept). With objective "dflash", a
     batch that carries `context_features` (a feature cache: `CachedFeatureDataset`) skips this forward;
     the tree objectives need the target's K/V, so they run it anyway and use its own features.
  2. draft:   `anchors_per_sequence` random anchors per sequence (the token after each is supervised);
              every anchor's block `[x_a, MASK, ...]` sees the context strictly before `a` and itself, and
              all blocks of a sequence share ONE drafter forward through a block-structured 4D float mask.
  3. trees (objectives "exit" and "prefix"): with no gradient, the inference-time tree of every tree anchor
     (`tree_anchors`: by default those whose whole horizon is supervised) is built by the decoder's own
     builder (`hf_tev.tree.build_tree`) from the drafter's log q at `tree_budget`; ONE target forward per
     batch scores all trees of all sequences against the cached context (the tree of anchor `a` sees cache
     positions `< a`, or only the last `tree_context_window` of them, and its own ancestors; the root slot
     holds `x_a`).
  4. loss: `exit_loss.exittrain_loss`: `ce_weight * CE + tree_weight * tree` (CE over every anchor's block,
     no position decay unless `ce_decay` / objective "dflash"; tree loss with the target-flow node weights,
     normalised by `tree_normalization`).

Evaluation (`evaluate()`, or `eval_strategy`) reports `eval_loss` and its parts on anchors drawn the same way
at every evaluation (two evaluations of the same weights give the same numbers) and `eval_tau`: real tree
decoding (`target.generate(..., assistant_model=drafter, tev_config=TEVConfig(budget=...))`) of the first
`eval_tau_prompts` prompts of the evaluation rows, greedy unless `eval_tau_temperature` > 0.

Multi-process training uses Trainer's own engines (DDP through accelerate): on GPUs,
`accelerate launch --num_processes 8 train.py` or `torchrun --nproc_per_node 8 train.py`; every
process holds its own frozen copy of the target (not wrapped by DDP). On CPU, `torchrun` with
`ExitTrainingArguments(use_cpu=True, ddp_backend="gloo")` works the same way.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import PreTrainedModel, Trainer, TrainingArguments
from transformers.trainer import TRAINING_ARGS_NAME

from ..config import TEVConfig
from ..exit_loss import OBJECTIVES, TREE_NORMALIZATIONS, edge_probs, exittrain_loss
from ..modeling_dflash import DFlashDraftModel
from ..tree import build_tree
from . import hub
from .batch import block_attention_mask, block_labels, sample_anchors, tree_batch_inputs
from .data import CONTEXT_FEATURES, ExitDataCollator, _encode_prompt, _pad_token_id, check_rows, row_tensors
from .features import CachedFeatureDataset
from .opd import (
    OPDLoss,
    Rollout,
    accepted_depths,
    collect_rollouts,
    opd_loss,
    replay_chains,
    replay_teacher_logits,
    rollout_batch,
)

# The objectives the trainer knows: the exit_loss ones, and "opd" (Draft-OPD, `opd.py`: rollouts + replay).
TRAINING_OBJECTIVES = (*OBJECTIVES, "opd")

# Which anchors get a tree: those whose whole horizon (block_size - 1 following tokens) is supervised and
# inside the sequence (the authors' released code), or every anchor.
TREE_ANCHORS = ("full_horizon", "all")


# ----------------------------------------------------------------------------------------------
# Arguments


@dataclass
class ExitTrainingArguments(TrainingArguments):
    r"""
    Training arguments of [`ExitTrainer`]: every knob of ExitTrain (SPEC section 6) on top of
    [`~transformers.TrainingArguments`]. Only the fields below are specific to ExitTrain or have a
    different default. The defaults of `"exit"` / `"prefix"` match the authors' released training code,
    except the target context of the trees (`tree_context_window`, full context here).

    Parameters:
        objective (`str`, *optional*, defaults to `"exit"`):
            `"exit"`: tree loss with exit weight `w(v) * depth(v)` (ExitTrain); `"prefix"`: tree loss with
            prefix weight `P(v)`; `"dflash"`: the standard DFlash objective alone (no trees are built);
            `"opd"`: Draft-OPD (on-policy distillation on tree-decoded rollouts, the `opd_*` knobs below) plus
            `ce_weight` times the standard DFlash objective on the training rows.
        tree_budget (`int`, *optional*, defaults to `32`):
            Drafted nodes (root excluded) of the inference-time tree built for every tree anchor.
        ce_weight (`float`, *optional*, defaults to `1.0`):
            Weight of the cross-entropy of the blocks in the total loss.
        tree_weight (`float`, *optional*, defaults to `0.1`):
            Weight of the tree loss in the total loss (ignored by `objective="dflash"`).
        alpha (`float`, *optional*, defaults to `1e-4`):
            Floor of an edge probability `p(v)` in the product `P(v)` of the node weights.
        gamma (`float`, *optional*, defaults to `7.0`):
            Position decay of the cross-entropy when it is decayed (see `ce_decay`): block position `k` has
            weight `exp(-(k-1)/gamma)`.
        ce_decay (`bool` or `None`, *optional*, defaults to `None`):
            Whether the cross-entropy is position-decayed with `gamma`. `None`: only for `"dflash"` (the
            standard DFlash recipe); `"exit"` / `"prefix"` then use the plain mean over supervised block
            positions, as the released ExitTrain code does. `True` restores the decayed CE of earlier hf_tev.
        tree_normalization (`str`, *optional*, defaults to `"nodes"`):
            `"nodes"`: the tree loss of a batch, `sum_trees sum_v weight(v) * -log q(x_v)`, is divided by the
            number of drafted tree nodes of those trees (the released code); `"weight_sum"`: each tree is
            divided by its own weight sum and the trees are averaged (earlier hf_tev; a 27-230x larger tree
            term with exit weights, so `tree_weight` must be re-tuned).
        anchors_per_sequence (`int`, *optional*, defaults to `32`):
            Random anchor positions (starts of drafted blocks) per training sequence and step; every
            anchor's next token must be supervised. Sequences with fewer such positions use all of them.
        tree_anchors (`str`, *optional*, defaults to `"full_horizon"`):
            Which anchors get a tree: `"full_horizon"`: those whose whole horizon (the block_size - 1 following
            tokens) is supervised and inside the sequence (the released code); `"all"`: every anchor
            (earlier hf_tev). The cross-entropy covers every anchor either way.
        tree_context_window (`int` or `None`, *optional*, defaults to `None`):
            Context the target sees when it scores a tree. `None`: the whole sequence before the anchor
            (closer to inference). `W`: only the last W tokens before the anchor, hidden by the attention mask
            of the batched tree pass over the full-context cache (positions stay absolute, and the window
            tokens' cached states were computed with the full context). The released code uses 64 and re-runs
            the target on the window itself (positions restart), so `64` here is close to, not identical to it.
        max_length (`int` or `None`, *optional*, defaults to `2048`):
            Sequences are truncated to this many tokens by the default collator; `None` keeps them whole.
        learning_rate (`float`, *optional*, defaults to `1e-4`):
            Overrides the `TrainingArguments` default with the public ExitTrain recipe's value.
        remove_unused_columns (`bool`, *optional*, defaults to `False`):
            Must stay `False`: the drafter's forward does not take the dataset columns, the trainer does.
        eval_tau_prompts (`int`, *optional*, defaults to `8`):
            Prompts decoded at every evaluation to report `eval_tau` (the real decoded tau: tree decoding with
            the frozen target); the first ones of the evaluation rows (their tokens before the first
            supervised one) or of the trainer's `eval_prompts`. `0` turns the decoding off.
        eval_tau_budget (`int` or `None`, *optional*, defaults to `None`):
            Tree budget of that decoding; `None`: `tree_budget`. A fixed number (`"auto"` depends on the
            machine's timings, so it would not give the same number twice).
        eval_tau_temperature (`float`, *optional*, defaults to `0.0`):
            Its temperature: 0 is greedy; above 0, pure temperature sampling (no top-k / top-p), seeded per
            prompt from `seed` (every evaluation draws the same).
        eval_tau_max_new_tokens (`int`, *optional*, defaults to `64`):
            Tokens decoded per prompt (fewer when the target emits EOS).
        opd_weight (`float`, *optional*, defaults to `1.0`):
            `objective="opd"`: weight of the Draft-OPD loss; the total is `ce_weight * CE + opd_weight * OPD`
            (CE: the standard DFlash objective on the training rows; `ce_weight=0` is the paper's OPD stage).
        opd_accept_weight (`float`, *optional*, defaults to `1.0`), opd_reject_weight (`float`, *optional*,
            defaults to `1.0`): the weights of the accepted stream (forward KL) and of the rejected stream
            (reverse KL) inside the OPD loss (the paper's lambda_acc, lambda_rej).
        opd_reject_decay (`float`, *optional*, defaults to `0.8`):
            Position decay of the rejected stream: depth `k` of a cycle with `n` accepted has weight
            `decay^(k - n - 1)` (the paper's gamma).
        opd_refresh_steps (`int`, *optional*, defaults to `4`):
            Optimizer steps between two rollout refreshes: the rollouts are regenerated with the current drafter
            every this many steps (1: fully on-policy, a new rollout batch every step).
        opd_rollouts (`int` or `None`, *optional*, defaults to `None`):
            Prompts rolled out per refresh and process; `None`: `per_device_train_batch_size *
            gradient_accumulation_steps * opd_refresh_steps` (every rollout trained on once per refresh).
            The prompts are those of the training rows (tokens before the first supervised one), in a seeded order.
        opd_rollout_budget (`int` or `None`, *optional*, defaults to `None`):
            Tree budget of the rollouts' tree decoding; `None`: `tree_budget`.
        opd_rollout_temperature (`float`, *optional*, defaults to `1.0`):
            Temperature of the rollouts: 0 greedy, above 0 pure sampling (seeded per refresh and prompt).
        opd_rollout_max_new_tokens (`int`, *optional*, defaults to `64`):
            Tokens generated per rollout (fewer at EOS).
    """

    # The ExitTrain knobs, recorded in the model card.
    knob_names: ClassVar[tuple[str, ...]] = (
        "objective",
        "tree_budget",
        "ce_weight",
        "tree_weight",
        "alpha",
        "gamma",
        "ce_decay",
        "tree_normalization",
        "anchors_per_sequence",
        "tree_anchors",
        "tree_context_window",
        "max_length",
        "opd_weight",
        "opd_accept_weight",
        "opd_reject_weight",
        "opd_reject_decay",
        "opd_refresh_steps",
        "opd_rollouts",
        "opd_rollout_budget",
        "opd_rollout_temperature",
        "opd_rollout_max_new_tokens",
    )
    # How the decoded tau of an evaluation is measured (recorded in the model card beside the tau).
    eval_names: ClassVar[tuple[str, ...]] = (
        "eval_tau_prompts",
        "eval_tau_budget",
        "eval_tau_temperature",
        "eval_tau_max_new_tokens",
    )

    objective: str = field(
        default="exit",
        metadata={
            "help": "'exit' (tree loss weighted w(v) * depth(v), ExitTrain), 'prefix' (tree loss weighted "
            "P(v)) or 'dflash' (the standard DFlash objective alone).",
            "choices": list(TRAINING_OBJECTIVES),
        },
    )
    tree_budget: int = field(
        default=32, metadata={"help": "Drafted nodes (root excluded) of the inference-time tree of every tree anchor."}
    )
    ce_weight: float = field(default=1.0, metadata={"help": "Weight of the cross-entropy of the blocks."})
    tree_weight: float = field(
        default=0.1, metadata={"help": "Weight of the tree loss (ignored by objective='dflash')."}
    )
    alpha: float = field(
        default=1e-4, metadata={"help": "Floor of an edge probability in the product P(v) of the node weights."}
    )
    gamma: float = field(
        default=7.0,
        metadata={"help": "Position decay of the cross-entropy when decayed (ce_decay): weight exp(-(k-1)/gamma)."},
    )
    ce_decay: bool | None = field(
        default=None,
        metadata={
            "help": "Decay the cross-entropy by position with gamma. None: only for objective "
            "'dflash'; 'exit'/'prefix' use the plain mean (the released ExitTrain code)."
        },
    )
    tree_normalization: str = field(
        default="nodes",
        metadata={
            "help": "'nodes': tree loss divided by the number of drafted tree nodes of the batch (the released "
            "code); 'weight_sum': each tree by its own weight sum, then averaged over trees.",
            "choices": list(TREE_NORMALIZATIONS),
        },
    )
    anchors_per_sequence: int = field(
        default=32, metadata={"help": "Random anchor positions (drafted blocks) per training sequence and step."}
    )
    tree_anchors: str = field(
        default="full_horizon",
        metadata={
            "help": "'full_horizon': trees only for anchors whose block_size - 1 following tokens are all "
            "supervised (the released code); 'all': a tree for every anchor. The CE covers all anchors.",
            "choices": list(TREE_ANCHORS),
        },
    )
    tree_context_window: int | None = field(
        default=None,
        metadata={
            "help": "Tokens before the anchor the target sees when it scores a tree. None: the full context; "
            "W: the last W only, by attention mask over the full-context cache (the released code "
            "re-runs the target on a 64-token window)."
        },
    )
    max_length: int | None = field(
        default=2048, metadata={"help": "Truncate training sequences to this many tokens (None: no truncation)."}
    )
    learning_rate: float = field(default=1e-4, metadata={"help": "The initial learning rate for the optimizer."})
    remove_unused_columns: bool = field(
        default=False,
        metadata={"help": "Must be False: the trainer, not the drafter's forward, reads the dataset columns."},
    )

    eval_tau_prompts: int = field(
        default=8,
        metadata={"help": "Prompts tree-decoded at every evaluation for eval_tau (the real decoded tau); 0: off."},
    )
    eval_tau_budget: int | None = field(
        default=None, metadata={"help": "Tree budget of the eval_tau decoding (None: tree_budget)."}
    )
    eval_tau_temperature: float = field(
        default=0.0,
        metadata={"help": "Temperature of the eval_tau decoding: 0 greedy; > 0 pure sampling, seeded per prompt."},
    )
    eval_tau_max_new_tokens: int = field(
        default=64, metadata={"help": "Tokens decoded per prompt for eval_tau (fewer at EOS)."}
    )

    opd_weight: float = field(default=1.0, metadata={"help": "objective 'opd': weight of the Draft-OPD loss."})
    opd_accept_weight: float = field(
        default=1.0, metadata={"help": "Draft-OPD: weight of the accepted stream (forward KL), lambda_acc."}
    )
    opd_reject_weight: float = field(
        default=1.0, metadata={"help": "Draft-OPD: weight of the rejected stream (reverse KL), lambda_rej."}
    )
    opd_reject_decay: float = field(
        default=0.8, metadata={"help": "Draft-OPD: position decay decay^(k - n - 1) of the rejected stream."}
    )
    opd_refresh_steps: int = field(
        default=4, metadata={"help": "Draft-OPD: optimizer steps between two refreshes of the rollouts."}
    )
    opd_rollouts: int | None = field(
        default=None,
        metadata={
            "help": "Draft-OPD: prompts rolled out per refresh and process (None: batch size x gradient "
            "accumulation x opd_refresh_steps)."
        },
    )
    opd_rollout_budget: int | None = field(
        default=None, metadata={"help": "Draft-OPD: tree budget of the rollouts (None: tree_budget)."}
    )
    opd_rollout_temperature: float = field(
        default=1.0, metadata={"help": "Draft-OPD: temperature of the rollouts (0 greedy, > 0 seeded sampling)."}
    )
    opd_rollout_max_new_tokens: int = field(
        default=64, metadata={"help": "Draft-OPD: tokens generated per rollout (fewer at EOS)."}
    )

    def __post_init__(self):
        if self.objective not in TRAINING_OBJECTIVES:
            raise ValueError(f"objective must be one of {TRAINING_OBJECTIVES}, got {self.objective!r}")
        if not _is_int(self.tree_budget) or self.tree_budget < 1:
            raise ValueError(f"tree_budget must be an int >= 1, got {self.tree_budget!r}")
        if self.ce_weight < 0 or self.tree_weight < 0:
            raise ValueError(f"ce_weight and tree_weight must be >= 0, got {self.ce_weight} and {self.tree_weight}")
        if self.objective == "opd":
            active = self.ce_weight + self.opd_weight
        else:
            active = self.ce_weight if self.objective == "dflash" else self.ce_weight + self.tree_weight
        if active <= 0:
            raise ValueError(
                f"objective {self.objective!r} with ce_weight={self.ce_weight} and "
                f"tree_weight={self.tree_weight} has no loss to train"
            )
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if not self.gamma > 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma}")
        if self.ce_decay is not None and not isinstance(self.ce_decay, bool):
            raise ValueError(f"ce_decay must be None, True or False, got {self.ce_decay!r}")
        if self.tree_normalization not in TREE_NORMALIZATIONS:
            raise ValueError(
                f"tree_normalization must be one of {TREE_NORMALIZATIONS}, got {self.tree_normalization!r}"
            )
        if not _is_int(self.anchors_per_sequence) or self.anchors_per_sequence < 1:
            raise ValueError(f"anchors_per_sequence must be an int >= 1, got {self.anchors_per_sequence!r}")
        if self.tree_anchors not in TREE_ANCHORS:
            raise ValueError(f"tree_anchors must be one of {TREE_ANCHORS}, got {self.tree_anchors!r}")
        if self.tree_context_window is not None and (
            not _is_int(self.tree_context_window) or self.tree_context_window < 1
        ):
            raise ValueError(f"tree_context_window must be None or an int >= 1, got {self.tree_context_window!r}")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"max_length must be None or >= 2, got {self.max_length}")
        if not _is_int(self.eval_tau_prompts) or self.eval_tau_prompts < 0:
            raise ValueError(f"eval_tau_prompts must be an int >= 0, got {self.eval_tau_prompts!r}")
        if self.eval_tau_budget is not None and (not _is_int(self.eval_tau_budget) or self.eval_tau_budget < 0):
            raise ValueError(f"eval_tau_budget must be None or an int >= 0, got {self.eval_tau_budget!r}")
        if not self.eval_tau_temperature >= 0:
            raise ValueError(f"eval_tau_temperature must be >= 0, got {self.eval_tau_temperature}")
        if not _is_int(self.eval_tau_max_new_tokens) or self.eval_tau_max_new_tokens < 1:
            raise ValueError(f"eval_tau_max_new_tokens must be an int >= 1, got {self.eval_tau_max_new_tokens!r}")
        for name in ("opd_weight", "opd_accept_weight", "opd_reject_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.opd_accept_weight + self.opd_reject_weight <= 0:
            raise ValueError("opd_accept_weight + opd_reject_weight must be > 0")
        if not 0 < self.opd_reject_decay <= 1:
            raise ValueError(f"opd_reject_decay must be in (0, 1], got {self.opd_reject_decay}")
        if not _is_int(self.opd_refresh_steps) or self.opd_refresh_steps < 1:
            raise ValueError(f"opd_refresh_steps must be an int >= 1, got {self.opd_refresh_steps!r}")
        if self.opd_rollouts is not None and (not _is_int(self.opd_rollouts) or self.opd_rollouts < 1):
            raise ValueError(f"opd_rollouts must be None or an int >= 1, got {self.opd_rollouts!r}")
        if self.opd_rollout_budget is not None and (
            not _is_int(self.opd_rollout_budget) or self.opd_rollout_budget < 1
        ):
            raise ValueError(f"opd_rollout_budget must be None or an int >= 1, got {self.opd_rollout_budget!r}")
        if not self.opd_rollout_temperature >= 0:
            raise ValueError(f"opd_rollout_temperature must be >= 0, got {self.opd_rollout_temperature}")
        if not _is_int(self.opd_rollout_max_new_tokens) or self.opd_rollout_max_new_tokens < 1:
            raise ValueError(f"opd_rollout_max_new_tokens must be an int >= 1, got {self.opd_rollout_max_new_tokens!r}")
        if self.remove_unused_columns:
            raise ValueError(
                "ExitTrainer needs remove_unused_columns=False: the drafter's forward does not take "
                "the dataset columns (input_ids, loss_mask), the trainer reads them"
            )
        super().__post_init__()


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@torch.no_grad()
def decoded_block_lengths(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    budget: int,
    temperature: float = 0.0,
    max_new_tokens: int = 64,
    seed: int = 0,
    first_index: int = 0,
    index_step: int = 1,
) -> list[int]:
    """Accepted block lengths (accepted draft tokens + 1, one per cycle) of real tree decoding of each prompt:
    `target.generate(ids, assistant_model=drafter, tev_config=TEVConfig(budget=budget, seed=...))`.

    Greedy at `temperature` 0; otherwise pure temperature sampling (top-k / top-p off), the draws of prompt
    `first_index + i * index_step` from a private generator seeded `seed + that index` (the global RNG is
    untouched, and the same prompts give the same lengths). Their mean is tau.
    """
    device = next(target.parameters()).device
    if temperature == 0:
        sampling = dict(do_sample=False)
    else:
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    lengths = []
    for i, prompt in enumerate(prompts):
        input_ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
        output = target.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            assistant_model=drafter,
            tev_config=TEVConfig(budget=budget, seed=seed + first_index + i * index_step),
            max_new_tokens=max_new_tokens,
            return_dict_in_generate=True,
            pad_token_id=_pad_token_id(target, None),
            **sampling,
        )
        lengths += output.tev_stats.accepted_lengths
    return lengths


# ----------------------------------------------------------------------------------------------
# Trainer


class ExitTrainer(Trainer):
    """Trains a DFlash drafter against a frozen target with the standard, prefix-weighted or exit-weighted
    objective (SPEC section 6; the objective and every knob are in [`ExitTrainingArguments`]).

    Args:
        model ([`DFlashDraftModel`]): the drafter, the only trained (and saved) model.
        target_model ([`~transformers.PreTrainedModel`]): the frozen target. It stays on the trainer:
            `requires_grad_(False)`, `eval()`, never optimised, saved or wrapped by DDP; its `embed_tokens`
            and `lm_head` are used by the drafter at run time without becoming drafter submodules.
        args ([`ExitTrainingArguments`], *optional*): defaults to `ExitTrainingArguments("tmp_trainer")`.
        train_dataset / eval_dataset: rows with an `input_ids` column and optionally `prompt_length` or
            `loss_mask` (see [`ExitDataCollator`], [`generate_training_data`]); a list or `datasets.Dataset`.
            A [`CachedFeatureDataset`] (rows with the target's features from a `FeatureCache`) spares the
            target forward of every step with objective `"dflash"`; the tree objectives still run the target
            (they score the trees against its K/V cache) and ignore the cached features.
            Every row is checked before training starts (`check_rows`): a wrong row (no tokens, text, floats or
            nested lists as `input_ids`, a token id outside the target's vocabulary, a negative `prompt_length`,
            ...) raises a ValueError naming it; rows with no supervised token to predict are skipped with a
            counted warning, and if none is left, ValueError. An empty dataset is refused.
        data_collator (*optional*): defaults to `ExitDataCollator(pad_token_id, args.max_length, vocab_size)`.
        processing_class (*optional*): a tokenizer saved next to the drafter (and used for string `eval_prompts`).
        callbacks, optimizers, **kwargs: as for [`~transformers.Trainer`].
        eval_prompts (*optional*): the prompts decoded for `eval_tau` (strings, chat conversations or token-id
            lists; the first `args.eval_tau_prompts` are used) instead of the prompts of the evaluation rows.

    Logged per step (averaged over the logging window and across processes; `eval_`-prefixed in
    `evaluate`): `loss_dflash`, the cross-entropy term (decayed or not, see `ce_decay`); for the tree
    objectives `loss_tree`, the tree term before `tree_weight`, and `tree_1_plus_c`: the mean over the
    training trees of `1 + C` under the target, C = sum of the unfloored prefix probabilities `P(v)` of the
    drafted nodes (raw target softmax at temperature 1, with the context the tree loss uses). It is the tau an
    exact verifier would reach on those trees, not a decoding measurement. Steps where no tree was built
    (no anchor with a full horizon) leave both tree metrics out of the averages; a logging window without
    any tree does not log them. Objective `"opd"` logs `loss_dflash` (when `ce_weight` > 0), `loss_opd`,
    `loss_opd_accept`, `loss_opd_reject` (the two streams of the Draft-OPD loss, left out when a batch has none)
    and `opd_rollout_tau`, the mean block length of the current rollouts (the decoded tau of the drafter that made
    them); its `eval_loss` is the standard objective's cross-entropy.

    Evaluation: `eval_loss`, `eval_loss_dflash` (and the tree metrics) on anchors that are drawn the same at every
    evaluation, and `eval_tau`, the mean accepted block length (accepted draft tokens + 1) of real tree decoding
    with the frozen target over the first `eval_tau_prompts` prompts, at `eval_tau_budget` and
    `eval_tau_temperature` (greedy by default), with `eval_tau_cycles` (the decoding cycles it averages).
    `total_flos` counts the FLOPs of the steps (an estimate like `Trainer`'s: see `floating_point_ops`).

    Multi-process: launch the same script with `accelerate launch` or `torchrun` (DDP on the drafter; every
    process keeps its own target). On CPU pass `use_cpu=True, ddp_backend="gloo"`.
    """

    # compute_loss returns a per-batch mean; Trainer divides it by the accumulation steps.
    loss_is_scaled_for_ga = False

    def __init__(
        self,
        model: DFlashDraftModel,
        target_model: PreTrainedModel,
        args: ExitTrainingArguments | None = None,
        train_dataset=None,
        eval_dataset=None,
        data_collator=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        eval_prompts=None,
        **kwargs,
    ):
        if not isinstance(model, DFlashDraftModel):
            raise TypeError(f"model must be a hf_tev.DFlashDraftModel (the drafter), got {type(model).__name__}")
        if not isinstance(target_model, PreTrainedModel) or target_model.get_output_embeddings() is None:
            raise TypeError(
                f"target_model must be a transformers causal LM with an LM head, got {type(target_model).__name__}"
            )
        model.check_target(target_model)
        if args is None:
            args = ExitTrainingArguments(output_dir="tmp_trainer")
        if not isinstance(args, ExitTrainingArguments):
            raise TypeError(f"args must be ExitTrainingArguments, got {type(args).__name__}")
        eval_datasets = eval_dataset if isinstance(eval_dataset, Mapping) else {None: eval_dataset}
        for dataset in (train_dataset, *eval_datasets.values()):
            if isinstance(dataset, CachedFeatureDataset) and dataset.cache.layer_ids != model.config.target_layer_ids:
                raise ValueError(
                    f"the feature cache {dataset.cache.path} holds target layers "
                    f"{dataset.cache.layer_ids}, the drafter reads {model.config.target_layer_ids}"
                )
        # Every row is checked before training starts; rows with nothing to train are dropped (counted warning).
        vocab_size = target_model.get_input_embeddings().weight.shape[0]
        train_dataset = check_rows(train_dataset, "train_dataset", vocab_size, args.max_length)
        eval_datasets = {
            split: check_rows(
                dataset, "eval_dataset" if split is None else f"eval_dataset[{split!r}]", vocab_size, args.max_length
            )
            for split, dataset in eval_datasets.items()
        }
        eval_dataset = dict(eval_datasets) if isinstance(eval_dataset, Mapping) else eval_datasets[None]
        if data_collator is None:
            data_collator = ExitDataCollator(
                pad_token_id=_pad_token_id(target_model, processing_class),
                max_length=args.max_length,
                vocab_size=vocab_size,
            )

        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            **kwargs,
        )
        self.model_accepts_loss_kwargs = False  # the drafter's forward takes **kwargs but computes no loss
        target_model.requires_grad_(False).eval()
        if getattr(target_model, "hf_device_map", None) is None:  # a device-mapped target stays where it is
            target_model.to(self.args.device)
        self.target_model = target_model
        self.eval_prompts = (
            None
            if eval_prompts is None
            else [_encode_prompt(prompt, processing_class, False) for prompt in eval_prompts]
        )
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._anchor_draw = (None, 0)  # ((mode, global_step), draws at that step) for the anchor seeds
        self._eval_draws = 0  # evaluation batches since the evaluation began (their anchor seeds)
        # FLOPs of the steps (floating_point_ops): the parameters that touch each token.
        lm_head = target_model.get_output_embeddings().weight.numel()
        self._flop_params = {
            "drafter": model.num_parameters(),
            "fc": model.fc.weight.numel(),
            "lm_head": lm_head,
            "target_body": target_model.num_parameters(exclude_embeddings=True) - lm_head,
        }
        self._step_flos = 0
        # Draft-OPD: the current rollouts, the refresh they belong to, the training rows' prompts, and
        # (global_step, micro-batches drawn at that step).
        self._opd_rollouts: list[Rollout] = []
        self._opd_refresh: int | None = None
        self._opd_prompts: list[list[int]] | None = None
        self._opd_draw = (None, 0)

    # -- loss ---------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if model.training else "eval"
        drafter = self.accelerator.unwrap_model(model)
        if self.args.objective == "opd":
            loss, metrics, draft_logits = self._opd_step(model, drafter, inputs, mode)
        else:
            loss, metrics, draft_logits = self._rows_loss(
                model, drafter, inputs, mode, self.args.objective, self.args.ce_weight
            )
        self._record(mode, metrics)
        return (loss, {"draft_logits": draft_logits}) if return_outputs else loss

    def _rows_loss(self, model, drafter, inputs, mode: str, objective: str, ce_weight: float):
        """The loss of objective "exit", "prefix" or "dflash" on a batch of training rows: `(loss, metrics,
        draft_logits)`."""
        args = self.args
        if "input_ids" not in inputs or "loss_mask" not in inputs:
            raise ValueError(
                f"ExitTrainer batches need 'input_ids' and 'loss_mask' (ExitDataCollator builds them), "
                f"got {sorted(inputs)}"
            )
        input_ids, loss_mask = inputs["input_ids"], inputs["loss_mask"].bool()  # [B, T]
        anchors, valid = sample_anchors(loss_mask, args.anchors_per_sequence, self._anchor_generator(mode))  # [B, A]
        with_trees = objective != "dflash"

        # 1. Context features (and, for the trees, the context K/V) from the frozen target, or from the cache.
        cached = not with_trees and inputs.get(CONTEXT_FEATURES) is not None
        if cached:
            features = inputs[CONTEXT_FEATURES]  # [B, T, k*H], cast to the drafter's dtype when used
            width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
            if features.shape != (*input_ids.shape, width):
                raise ValueError(
                    f"batch '{CONTEXT_FEATURES}' has shape {tuple(features.shape)}, expected "
                    f"{(*input_ids.shape, width)} (the drafter's target layers x hidden size)"
                )
        else:
            with torch.no_grad():
                context = self.target_model(
                    input_ids,
                    output_hidden_states=drafter.target_hidden_indices,
                    use_cache=with_trees,
                    logits_to_keep=1,
                )
            features = drafter.context_features(context.hidden_states)  # [B, T, k*H]

        # 2. All blocks of a sequence in one drafter forward.
        draft_logits = self._draft_blocks(model, drafter, input_ids, features, anchors)  # [B, A, D, V]
        B, A, D, V = draft_logits.shape
        labels, supervised = block_labels(input_ids, loss_mask, anchors, valid, D)  # [B, A, D]

        # 3. Inference-time trees scored by the target, for the tree anchors.
        trees, tree_blocks, tree_probs = [], [], []
        if with_trees:
            has_tree = supervised.all(-1) if args.tree_anchors == "full_horizon" else valid  # [B, A]
            trees, tree_blocks, tree_probs = self._score_trees(
                draft_logits, input_ids, anchors, has_tree, context.cache
            )

        # 4. ce_weight * CE + tree_weight * tree.
        parts = exittrain_loss(
            draft_logits.reshape(B * A, D, V),
            labels.reshape(B * A, D),
            supervised.reshape(B * A, D),
            trees,
            tree_blocks,
            tree_probs,
            objective,
            ce_weight=ce_weight,
            tree_weight=args.tree_weight,
            alpha=args.alpha,
            gamma=args.gamma,
            ce_decay=args.ce_decay,
            tree_normalization=args.tree_normalization,
        )
        if mode == "train":
            nodes = [0] * B  # tree rows per sequence; the tree pass pads them to the most
            for tree, block in zip(trees, tree_blocks, strict=True):
                nodes[block // A] += tree.num_nodes
            self._step_flos += self._flos(B, input_ids.shape[1], A, D + 1, cached, B * max(nodes))
        metrics = {"loss_dflash": parts.ce}
        if with_trees:  # NaN when no tree was built: left out of the averages (every process logs the same names)
            missing = parts.ce.new_tensor(math.nan)
            metrics.update(
                loss_tree=missing if parts.tree is None else parts.tree,
                tree_1_plus_c=missing if parts.tree_block_length is None else parts.tree_block_length,
            )
        return parts.loss, metrics, draft_logits

    # -- Draft-OPD (objective "opd", opd.py) ---------------------------------------------------------

    def _opd_step(self, model, drafter, inputs, mode: str):
        """`ce_weight * CE` on the training rows (the standard objective) + `opd_weight * OPD` on rollouts.
        Evaluation reports the standard objective's CE as the loss (the rollouts are a training device; the
        decoded `eval_tau` measures the drafter)."""
        args = self.args
        if mode == "eval":
            return self._rows_loss(model, drafter, inputs, mode, "dflash", 1.0)
        loss, metrics, draft_logits = 0.0, {}, None
        if args.ce_weight > 0:
            loss, metrics, draft_logits = self._rows_loss(model, drafter, inputs, mode, "dflash", args.ce_weight)
        parts, tau = self._opd_loss(model, drafter)
        metrics.update(loss_opd=parts.loss, loss_opd_accept=parts.accept, loss_opd_reject=parts.reject)
        metrics["opd_rollout_tau"] = parts.loss.new_tensor(tau)
        return loss + args.opd_weight * parts.loss, metrics, draft_logits

    def _opd_loss(self, model, drafter) -> tuple[OPDLoss, float]:
        """Draft-OPD on this micro-batch's rollouts: the drafter's blocks at (up to `anchors_per_sequence` of)
        their cycles' anchors, the chains replayed through the target (one forward over the rollouts, one over
        the chains), the acceptance-aware loss. Returns the loss parts and the rollouts' tau."""
        args = self.args
        rollouts, tau = self._opd_batch(drafter)
        device = self.args.device
        pad = _pad_token_id(self.target_model, self.processing_class)
        generator = self._seeded_generator(f"{args.seed}/opd/{self.state.global_step}/{self._opd_draw[1]}")
        input_ids, lengths, anchors, valid, accepted, rejected = (
            t.to(device) for t in rollout_batch(rollouts, args.anchors_per_sequence, generator, pad)
        )
        with torch.no_grad():
            context = self.target_model(
                input_ids, output_hidden_states=drafter.target_hidden_indices, use_cache=True, logits_to_keep=1
            )
        features = drafter.context_features(context.hidden_states)
        draft_logits = self._draft_blocks(model, drafter, input_ids, features, anchors)  # [B, A, D, V]
        B, A, D, _ = draft_logits.shape
        chains = replay_chains(input_ids, anchors, accepted, lengths, draft_logits)
        teacher = replay_teacher_logits(self.target_model, chains, anchors, valid, context.cache, input_ids.shape[1])
        if teacher is None:  # no cycle to train (e.g. every rollout stopped at once)
            nan = draft_logits.new_tensor(math.nan)
            parts = OPDLoss(draft_logits.sum() * 0.0, nan, nan)
        else:
            parts = opd_loss(
                draft_logits,
                teacher,
                accepted_depths(anchors, accepted, lengths),
                rejected,
                valid,
                accept_weight=args.opd_accept_weight,
                reject_weight=args.opd_reject_weight,
                decay=args.opd_reject_decay,
            )
        chain_rows = int(valid.sum(1).max()) * D
        self._step_flos += self._flos(B, input_ids.shape[1], A, D + 1, False, B * chain_rows)
        return parts, tau

    def _opd_batch(self, drafter) -> tuple[list[Rollout], float]:
        """This micro-batch's `per_device_train_batch_size` rollouts, refreshing the rollouts first when due
        (every `opd_refresh_steps` optimizer steps), and the tau of the current rollouts."""
        args = self.args
        step = self.state.global_step
        refresh = step // args.opd_refresh_steps
        if self._opd_refresh != refresh:
            self._refresh_rollouts(drafter, refresh)
        draws = self._opd_draw[1] + 1 if self._opd_draw[0] == step else 0
        self._opd_draw = (step, draws)
        size = args.per_device_train_batch_size
        first = ((step - refresh * args.opd_refresh_steps) * args.gradient_accumulation_steps + draws) * size
        batch = [self._opd_rollouts[(first + j) % len(self._opd_rollouts)] for j in range(size)]
        lengths = [length for r in self._opd_rollouts for length in r.block_lengths]
        return batch, sum(lengths) / max(len(lengths), 1)

    def _refresh_rollouts(self, drafter, refresh: int) -> None:
        """Roll out this refresh's prompts with the current drafter (tree decoding, the frozen target verifying).
        Refresh r, rollout j of process p takes prompt number `(r * count + j) * world_size + p` of a seeded
        order of the training rows' prompts, and sampling seed `seed` + that number: resumable and distinct."""
        args = self.args
        count = args.opd_rollouts or (
            args.per_device_train_batch_size * args.gradient_accumulation_steps * args.opd_refresh_steps
        )
        prompts = self._opd_prompt_list()
        numbers = [(refresh * count + j) * max(args.world_size, 1) + args.process_index for j in range(count)]
        self._opd_rollouts = collect_rollouts(
            self.target_model,
            drafter,
            [prompts[n % len(prompts)] for n in numbers],
            budget=args.tree_budget if args.opd_rollout_budget is None else args.opd_rollout_budget,
            temperature=args.opd_rollout_temperature,
            max_new_tokens=args.opd_rollout_max_new_tokens,
            seeds=[args.seed + n for n in numbers],
            pad_token_id=_pad_token_id(self.target_model, self.processing_class),
        )
        self._opd_refresh = refresh

    def _opd_prompt_list(self) -> list[list[int]]:
        """The training rows' prompts (tokens before the first supervised one), in a seeded order."""
        if self._opd_prompts is None:
            rows = self.train_dataset.rows if isinstance(self.train_dataset, CachedFeatureDataset) else None
            rows = self.train_dataset if rows is None else rows
            prompts = []
            for index in range(len(rows)):
                ids, mask = row_tensors(rows[index], where=f"training row {index}")
                first = int(mask.nonzero()[0]) if mask.any() else len(ids)
                prompts.append(ids[: max(1, first)].tolist())
            order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(self.args.seed)).tolist()
            self._opd_prompts = [prompts[i] for i in order]
        return self._opd_prompts

    def _save_rng_state(self, output_dir: str) -> None:
        # Every process writes its current rollouts into the checkpoint: a resumed run trains on the same ones.
        super()._save_rng_state(output_dir)
        if self.args.objective == "opd" and self._opd_rollouts:
            state = {"refresh": self._opd_refresh, "rollouts": [r.to_dict() for r in self._opd_rollouts]}
            Path(output_dir, f"opd_rollouts_{self.args.process_index}.json").write_text(json.dumps(state))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        super()._load_rng_state(checkpoint)
        path = None if checkpoint is None else Path(checkpoint, f"opd_rollouts_{self.args.process_index}.json")
        if self.args.objective == "opd" and path is not None and path.is_file():
            state = json.loads(path.read_text())
            self._opd_rollouts = [Rollout(**r) for r in state["rollouts"]]
            self._opd_refresh = state["refresh"]

    def _draft_blocks(self, model, drafter, input_ids, features, anchors) -> torch.Tensor:
        """Drafter logits `[B, A, D, V]` of the blocks `[x_a, MASK, ...]` at every anchor (one forward)."""
        B, T = input_ids.shape
        A = anchors.shape[1]
        L = drafter.config.block_size
        block_ids = torch.full((B, A, L), drafter.config.mask_token_id, dtype=torch.long, device=input_ids.device)
        block_ids[:, :, 0] = input_ids.gather(1, anchors)
        noise_embeds = self.target_model.get_input_embeddings()(block_ids.view(B, A * L)).to(drafter.dtype)
        block_positions = (anchors[..., None] + torch.arange(L, device=anchors.device)).view(B, A * L)
        position_ids = torch.cat([torch.arange(T, device=anchors.device).expand(B, T), block_positions], dim=1)
        mask = block_attention_mask(anchors, T, L, drafter.dtype)
        # The DDP-wrapped model is called, so gradient synchronisation sees this forward.
        hidden = model(
            noise_embeds=noise_embeds,
            context_hidden_states=features.to(drafter.dtype),
            position_ids=position_ids,
            attention_mask=mask,
        ).last_hidden_state  # [B, A*L, H]
        hidden = hidden.view(B, A, L, -1)[:, :, 1:]  # block positions 1..D
        lm_head = self.target_model.get_output_embeddings()
        return lm_head(hidden.to(lm_head.weight.dtype))

    def _score_trees(self, draft_logits, input_ids, anchors, has_tree, cache):
        """Build the tree of every anchor with `has_tree` and score its nodes with ONE target forward.

        Returns `(trees, tree_blocks, edge_probs)`: tree k hangs at block `tree_blocks[k]` (flat index
        `b * A + slot` into `draft_logits` `[B, A, D, V]`) and has the target's edge probabilities
        `p(v) = p_{parent(v)}(x_v)` `[N_k]` (only these are kept, not the `[N, V]` distributions).
        """
        args = self.args
        B, T = input_ids.shape
        A = anchors.shape[1]
        # One host sync: the builder works anchor by anchor on the host anyway.
        anchor_list = torch.cat([has_tree.nonzero(), anchors[has_tree][:, None]], dim=1).tolist()  # [(b, slot, a)]
        if not anchor_list:
            return [], [], []
        draft_logprobs = draft_logits.detach().float().log_softmax(-1)  # [B, A, D, V]
        trees = [build_tree(draft_logprobs[b, slot], args.tree_budget, input_ids[b, a]) for b, slot, a in anchor_list]
        owners = [b for b, _, _ in anchor_list]
        tokens, positions, mask, offsets = tree_batch_inputs(
            trees,
            owners,
            [a for _, _, a in anchor_list],
            B,
            T,
            self.target_model.dtype,
            context_window=args.tree_context_window,
        )
        with torch.no_grad():
            node_logits = self.target_model(tokens, position_ids=positions, attention_mask=mask, cache=cache).logits
        edges = [
            edge_probs(tree, node_logits[owner, offset : offset + tree.num_nodes].float().softmax(-1))
            for tree, owner, offset in zip(trees, owners, offsets, strict=True)
        ]
        edges = [torch.cat([edge.new_ones(1), edge]) for edge in edges]  # [N]: the root's entry is 1
        return trees, [b * A + slot for b, slot, _ in anchor_list], edges

    def _anchor_generator(self, mode: str) -> torch.Generator:
        """A generator seeded by (seed, mode, step, draw within the step, process): anchors are reproducible,
        and a run resumed from a checkpoint draws exactly the anchors of an uninterrupted one. Evaluation
        anchors are seeded by (seed, batch of the evaluation, process) only: every evaluation draws the same."""
        if mode == "eval":
            self._eval_draws += 1
            text = f"{self.args.seed}/eval/batch{self._eval_draws - 1}/{self.args.process_index}"
            return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little"))
        key = (mode, self.state.global_step)
        draws = self._anchor_draw[1] + 1 if self._anchor_draw[0] == key else 0
        self._anchor_draw = (key, draws)
        return self._seeded_generator(f"{self.args.seed}/{mode}/{self.state.global_step}/{draws}")

    def _seeded_generator(self, text: str) -> torch.Generator:
        """A CPU generator seeded by `text` and the process index."""
        text = f"{text}/{self.args.process_index}"
        return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little"))

    def _flos(self, batch: int, length: int, anchors: int, block: int, cached: bool, tree_rows: int) -> int:
        """FLOPs of one training step (forward + backward), counted like `Trainer` counts them (6 per parameter
        and trained token, 2 per parameter and no-grad token): the drafter over its `batch * anchors * block`
        block rows, its `fc` over the `batch * length` context rows, the target's LM head over the drafted rows
        (4: forward and the gradient of its input), the target's context forward (unless the features are
        cached) and its tree pass over `tree_rows` rows."""
        n = self._flop_params
        drafted = batch * anchors * block
        flos = (
            6 * n["drafter"] * drafted + 6 * n["fc"] * batch * length + 4 * n["lm_head"] * batch * anchors * (block - 1)
        )
        if not cached:
            flos += 2 * n["target_body"] * batch * length
        flos += 2 * (n["target_body"] + n["lm_head"]) * tree_rows
        return flos

    def floating_point_ops(self, inputs) -> int:
        """The FLOPs of the training steps since the last call (see `_flos`); `Trainer` sums them into
        `state.total_flos`."""
        flos, self._step_flos = self._step_flos, 0
        return flos

    # -- evaluation -----------------------------------------------------------------------------

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ):
        """Trainer's loop (the loss and its parts, on the same anchors at every evaluation), then the decoded
        tau of the evaluation prompts: `{metric_key_prefix}_tau` and `{metric_key_prefix}_tau_cycles`."""
        self._eval_draws = 0
        output = super().evaluation_loop(
            dataloader,
            description,
            prediction_loss_only=prediction_loss_only,
            ignore_keys=ignore_keys,
            metric_key_prefix=metric_key_prefix,
        )
        prompts = self._tau_prompts(getattr(dataloader, "dataset", None))
        if prompts:
            tau, cycles = self._decoded_tau(prompts)
            output.metrics[f"{metric_key_prefix}_tau"] = tau
            output.metrics[f"{metric_key_prefix}_tau_cycles"] = cycles
        return output

    def _tau_prompts(self, dataset) -> list[list[int]]:
        """The first `eval_tau_prompts` prompts: `eval_prompts`, else the evaluation rows' tokens before their
        first supervised one (at least one token)."""
        count = self.args.eval_tau_prompts
        if count == 0:
            return []
        if self.eval_prompts is not None:
            return self.eval_prompts[:count]
        if isinstance(dataset, CachedFeatureDataset):
            dataset = dataset.rows  # the rows, without reading their features
        if dataset is None or not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            return []
        prompts = []
        for index in range(min(count, len(dataset))):
            ids, mask = row_tensors(dataset[index], where=f"evaluation row {index}")
            first = int(mask.nonzero()[0]) if mask.any() else len(ids)
            prompts.append(ids[: max(1, first)].tolist())
        return prompts

    def _decoded_tau(self, prompts: list[list[int]]) -> tuple[float, int]:
        """Mean accepted block length of tree decoding over `prompts` (split across processes) and its cycles."""
        args = self.args
        drafter = self.accelerator.unwrap_model(self.model)
        was_training = drafter.training
        drafter.eval()
        lengths = decoded_block_lengths(
            self.target_model,
            drafter,
            prompts[args.process_index :: max(args.world_size, 1)],
            budget=args.tree_budget if args.eval_tau_budget is None else args.eval_tau_budget,
            temperature=args.eval_tau_temperature,
            max_new_tokens=args.eval_tau_max_new_tokens,
            seed=args.seed,
            first_index=args.process_index,
            index_step=max(args.world_size, 1),
        )
        drafter.train(was_training)
        totals = torch.tensor([float(sum(lengths)), float(len(lengths))], device=args.device)
        total, cycles = self.accelerator.gather(totals).view(-1, 2).sum(0).tolist()
        return total / max(cycles, 1.0), int(cycles)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation = the training loss under no_grad (with its metrics); no logits are gathered."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    # -- metrics --------------------------------------------------------------------------------

    def _record(self, mode: str, metrics: dict[str, torch.Tensor]) -> None:
        # One small all-gather per step (every process records the same names); no host sync here.
        values = torch.stack([value.detach().float().reshape(()) for value in metrics.values()])  # [m]
        values = self.accelerator.gather(values).view(-1, len(metrics)).nanmean(0)
        for name, value in zip(metrics, values, strict=True):
            self._metrics[mode][name].append(value)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        averaged = {
            name: torch.stack(values).nanmean().item() for name, values in self._metrics[mode].items() if values
        }
        averaged = {name: value for name, value in averaged.items() if not math.isnan(value)}  # e.g. no tree built
        if mode == "eval":
            averaged = {f"eval_{name}": value for name, value in averaged.items()}
        logs.update(averaged)  # in place: evaluate() returns this dict
        super().log(logs, start_time)
        self._metrics[mode].clear()

    # -- saving and the Hub ---------------------------------------------------------------------

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The drafter alone through its `save_pretrained` (published DFlash layout, loadable by
        `DFlashDraftModel.from_pretrained`); the target is never written."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        drafter = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        drafter.save_pretrained(output_dir, state_dict=state_dict)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def create_model_card(
        self,
        repo_id: str | None = None,
        target_model_id: str | None = None,
        dataset_description: str | None = None,
        measured_tau: Mapping[Any, float] | None = None,
        tau_temperature: float | None = None,
        license: str = "apache-2.0",
        datasets: Sequence[str] | None = None,
        **_unused,
    ) -> str:
        """Write `README.md` into `args.output_dir` (main process) from the package's card template
        (`hf_tev/training/drafter_card.md`, see `hub.render_model_card`) and return its text.

        Args:
            repo_id: Hub id the drafter is published under (used in the usage snippet).
            target_model_id: the target's Hub id (the card's `base_model`); defaults to the target's
                `name_or_path`. A local folder or a description is shown in the text, never as `base_model`.
            dataset_description: free text on the training data (prompts, how responses were generated).
            measured_tau: mean tau measured with this drafter: `{64: 6.1}` (budget -> tau), `{(64, 0.0): 6.1}`
                (budget, temperature) or `{"HumanEval, budget 64, T=0": 6.1}`; omitted when not given.
            tau_temperature: the sampling temperature of `measured_tau` entries that do not carry one.
            license: the card's license (metadata). datasets: Hub ids of the training data (metadata).
        """
        card = hub.trainer_model_card(
            self,
            repo_id=repo_id,
            target_model_id=target_model_id,
            dataset_description=dataset_description,
            measured_tau=measured_tau,
            tau_temperature=tau_temperature,
            license=license,
            datasets=datasets,
        )
        if self.is_world_process_zero():
            card.save(Path(self.args.output_dir, "README.md"))
        return card.content

    def _hub_api(self, token: str | None):
        return hub.hub_api(token if token is not None else self.args.hub_token)

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """Create (or reuse) the Hub repo `args.hub_model_id` (default: the output folder's name)."""
        if not self.is_world_process_zero():
            return
        repo_id = self.args.hub_model_id or Path(self.args.output_dir).absolute().name
        private = private if private is not None else self.args.hub_private_repo
        self.hub_model_id = self._hub_api(token).create_repo(repo_id, private=private, exist_ok=True).repo_id
        self.push_in_progress = None

    def push_to_hub(
        self,
        repo_id: str | None = None,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        target_model_id: str | None = None,
        dataset_description: str | None = None,
        measured_tau: Mapping[Any, float] | None = None,
        tau_temperature: float | None = None,
        license: str = "apache-2.0",
        datasets: Sequence[str] | None = None,
        **_unused,
    ):
        """Upload the drafter (published layout: `config.json` + safetensors) and a filled model card.

        Creates the repo first (so offline, or without access, it fails before anything is written), then
        saves into `args.output_dir` and uploads it with `huggingface_hub.HfApi.upload_folder`; checkpoints,
        `training_args.bin` and `_*` files stay local. `repo_id` defaults to `args.hub_model_id`, then the
        output folder's name. See `create_model_card` for the card fields. Returns the `upload_folder` result
        (a future when `blocking=False`); None on processes other than the main one.
        """
        if repo_id is not None:
            self.args.hub_model_id = repo_id
            self.hub_model_id = None
        if getattr(self, "hub_model_id", None) is None:
            self.init_hf_repo(token=token, private=private)
        self.save_model(_internal_call=True)  # every process: some engines gather weights collectively
        if not self.is_world_process_zero():
            return None
        self.create_model_card(
            repo_id=self.hub_model_id,
            target_model_id=target_model_id,
            dataset_description=dataset_description,
            measured_tau=measured_tau,
            tau_temperature=tau_temperature,
            license=license,
            datasets=datasets,
        )
        self._finish_current_push()
        return hub.upload_folder(
            self._hub_api(token),
            self.hub_model_id,
            self.args.output_dir,
            ignore_patterns=[*hub.UPLOAD_IGNORE, TRAINING_ARGS_NAME],
            commit_message=commit_message,
            revision=revision if revision is not None else self.args.hub_revision,
            blocking=blocking,
        )
