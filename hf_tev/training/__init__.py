"""ExitTrain: exit-guided training of DFlash drafters (SPEC section 6).

- `data`: target-written training rows (`generate_training_data`: written as they come, resumable), the check of
  every row before training (`check_rows`, `row_tensors`) and `ExitDataCollator`;
- `features`: the target features a drafter reads, computed once and memory-mapped (`FeatureCache`,
  `CachedFeatureDataset`): the standard objective then trains without target forwards;
- `batch`: anchors, block labels and the masks of the shared drafter forward and the batched tree pass;
- `trainer`: `ExitTrainingArguments` (every knob) and `ExitTrainer` (a `transformers.Trainer`);
- `opd`: Draft-OPD (`objective="opd"`): tree-decoded rollouts (`collect_rollouts`, `Rollout`), the replay of the
  drafter's blocks at their cycles with the target as teacher, and the acceptance-aware loss (`opd_loss`);
- `hub`: the model card (template `drafter_card.md`, package data; the measured eval tau in its metadata) and
  the Hub upload;
- `cli`: `hf-tev train` / `python -m hf_tev.train` (`ExitScriptArguments` + `ExitTrainingArguments`).
The loss maths itself is `hf_tev.exit_loss` (plain torch).
"""

from .batch import block_attention_mask, block_labels, sample_anchors, tree_batch_inputs
from .data import (
    CONTEXT_FEATURES,
    INPUT_IDS,
    LOSS_MASK,
    PROMPT_LENGTH,
    ExitDataCollator,
    check_dataset,
    check_rows,
    generate_training_data,
    row_tensors,
)
from .features import CachedFeatureDataset, FeatureCache, compute_context_features
from .hub import (
    OBJECTIVE_DESCRIPTIONS,
    card_metadata,
    is_hub_id,
    render_model_card,
    trainer_eval_tau,
    trainer_model_card,
)
from .opd import Rollout, collect_rollouts, opd_loss
from .trainer import TRAINING_OBJECTIVES, TREE_ANCHORS, ExitTrainer, ExitTrainingArguments, decoded_block_lengths

__all__ = [
    "CONTEXT_FEATURES",
    "INPUT_IDS",
    "LOSS_MASK",
    "OBJECTIVE_DESCRIPTIONS",
    "PROMPT_LENGTH",
    "TRAINING_OBJECTIVES",
    "TREE_ANCHORS",
    "CachedFeatureDataset",
    "ExitDataCollator",
    "ExitTrainer",
    "ExitTrainingArguments",
    "FeatureCache",
    "Rollout",
    "block_attention_mask",
    "block_labels",
    "card_metadata",
    "check_dataset",
    "check_rows",
    "collect_rollouts",
    "compute_context_features",
    "decoded_block_lengths",
    "generate_training_data",
    "is_hub_id",
    "opd_loss",
    "render_model_card",
    "row_tensors",
    "sample_anchors",
    "trainer_eval_tau",
    "trainer_model_card",
    "tree_batch_inputs",
]
