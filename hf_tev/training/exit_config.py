"""`ExitTrainingArguments`: every knob of ExitTrain on top of `transformers.TrainingArguments`, with the objectives
and tree-anchor rules it accepts (the arguments apart from the trainer, as trl splits `*_config.py` from
`*_trainer.py`; `ExitTrainer` is in `exit_trainer.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from transformers import TrainingArguments

from ..exit_loss import OBJECTIVES, TREE_NORMALIZATIONS

# The objectives the trainer knows: the exit_loss ones, and "opd" (Draft-OPD: `rollouts.py`, `losses.py`).
TRAINING_OBJECTIVES = (*OBJECTIVES, "opd")

# Which anchors get a tree: those whose whole horizon (block_size - 1 following tokens) is supervised and
# inside the sequence (the authors' released code), or every anchor.
TREE_ANCHORS = ("full_horizon", "all")


@dataclass
class ExitTrainingArguments(TrainingArguments):
    r"""
    Training arguments of [`ExitTrainer`]: every knob of ExitTrain (docs/design.md#exittrain) on top of
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
            positions, as the released ExitTrain code does. `True` restores the decayed CE of hf_tev before 0.1.0.
        tree_normalization (`str`, *optional*, defaults to `"nodes"`):
            `"nodes"`: the tree loss of a batch, `sum_trees sum_v weight(v) * -log q(x_v)`, is divided by the
            number of drafted tree nodes of those trees (the released code); `"weight_sum"`: each tree is
            divided by its own weight sum and the trees are averaged (hf_tev before 0.1.0; a 27-230x larger tree
            term with exit weights, so `tree_weight` must be re-tuned).
        anchors_per_sequence (`int`, *optional*, defaults to `32`):
            Random anchor positions (starts of drafted blocks) per training sequence and step; every
            anchor's next token must be supervised. Sequences with fewer such positions use all of them.
        tree_anchors (`str`, *optional*, defaults to `"full_horizon"`):
            Which anchors get a tree: `"full_horizon"`: those whose whole horizon (the block_size - 1 following
            tokens) is supervised and inside the sequence (the released code); `"all"`: every anchor
            (hf_tev before 0.1.0). The cross-entropy covers every anchor either way.
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
        dataloader_pin_memory (`bool`, *optional*, defaults to `True`):
            As in `TrainingArguments`, but turned off where torch finds no accelerator: there is nothing to pin
            for, and torch would warn once per data loader (training, every evaluation).
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
            "P(v)), 'dflash' (the standard DFlash objective alone) or 'opd' (Draft-OPD: on-policy distillation on "
            "tree-decoded rollouts).",
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
        self._check_exittrain_knobs()
        self._check_anchor_knobs()
        self._check_eval_knobs()
        self._check_opd_knobs()
        if self.remove_unused_columns:
            raise ValueError(
                "ExitTrainer needs remove_unused_columns=False: the drafter's forward does not take "
                "the dataset columns (input_ids, loss_mask), the trainer reads them"
            )
        if self.dataloader_pin_memory and not torch.accelerator.is_available():
            self.dataloader_pin_memory = False  # what torch's data loader does then, without its warning
        super().__post_init__()

    def _check_exittrain_knobs(self) -> None:
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

    def _check_anchor_knobs(self) -> None:
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

    def _check_eval_knobs(self) -> None:
        if not _is_int(self.eval_tau_prompts) or self.eval_tau_prompts < 0:
            raise ValueError(f"eval_tau_prompts must be an int >= 0, got {self.eval_tau_prompts!r}")
        if self.eval_tau_budget is not None and (not _is_int(self.eval_tau_budget) or self.eval_tau_budget < 0):
            raise ValueError(f"eval_tau_budget must be None or an int >= 0, got {self.eval_tau_budget!r}")
        if not self.eval_tau_temperature >= 0:
            raise ValueError(f"eval_tau_temperature must be >= 0, got {self.eval_tau_temperature}")
        if not _is_int(self.eval_tau_max_new_tokens) or self.eval_tau_max_new_tokens < 1:
            raise ValueError(f"eval_tau_max_new_tokens must be an int >= 1, got {self.eval_tau_max_new_tokens!r}")

    def _check_opd_knobs(self) -> None:
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

    @property
    def eval_tau_tree_budget(self) -> int:
        """The tree budget of the `eval_tau` decoding: `eval_tau_budget`, else `tree_budget`."""
        return self.tree_budget if self.eval_tau_budget is None else self.eval_tau_budget

    @property
    def opd_rollout_tree_budget(self) -> int:
        """The tree budget of the Draft-OPD rollouts: `opd_rollout_budget`, else `tree_budget`."""
        return self.tree_budget if self.opd_rollout_budget is None else self.opd_rollout_budget


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
