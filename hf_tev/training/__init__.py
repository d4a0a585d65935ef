"""ExitTrain: exit-guided training of DFlash drafters (docs/design.md#exittrain).

Data:
- `rows`: one row: the dataset column names, its check (`row_tensors`), its prompt; prompts as token ids
  (`encode_prompt`) and the target's padding / EOS ids;
- `data`: target-written training rows (`generate_training_data`: written as they come, resumable), the check of
  every row before training (`check_rows`) and `ExitDataCollator`;
- `features`: the target features a drafter reads, computed once and memory-mapped (`FeatureCache`,
  `CachedFeatureDataset`): the standard objective then trains without target forwards.
Training:
- `exit_config`: `ExitTrainingArguments` (every knob) and the objectives it accepts;
- `trainer`: `ExitTrainer` (a `transformers.Trainer`): the Trainer hooks, the work in the modules below;
- `checkpoints`: the check of a checkpoint before a run resumes from it (`check_checkpoint`);
- `batch`: anchors, block labels and the masks of the shared drafter forward and the batched tree pass;
- `forwards`: the target's context forward and the drafter's forward over all blocks of a batch;
- `row_loss`: the loss of objectives "exit", "prefix" and "dflash" on a batch of training rows;
- `rollout`: tree decoding with the frozen target, behind both the decoded tau and the Draft-OPD rollouts;
- `eval_tau`: the decoded tau of an evaluation (`decoded_block_lengths`);
- `opd`: Draft-OPD (`objective="opd"`): rollouts (`collect_rollouts`, `Rollout`), the replay of the drafter's
  blocks at their cycles with the target as teacher, and the acceptance-aware loss (`opd_loss`, `replay_loss`);
- `opd_rollouts`: the rollouts of a run, refreshed every `opd_refresh_steps` and kept in checkpoints;
- `seeds`, `metrics`: the seeded generators of the random draws; the logged metrics and FLOPs.
Publishing:
- `hub`: the model card (template `drafter_card.md`, package data; the measured eval tau in its metadata) and
  the Hub upload;
- `cli`: `hf-tev train` / `python -m hf_tev.train`; its arguments and parser in `script_args`
  (`ExitScriptArguments` + `ExitTrainingArguments`), the files it reads and the model folders it checks in
  `inputs`.
The loss maths itself is `hf_tev.exit_loss` (plain torch).
"""

from .batch import block_attention_mask, block_labels, sample_anchors, tree_batch_inputs
from .data import ExitDataCollator, check_dataset, check_rows, generate_training_data
from .eval_tau import decoded_block_lengths
from .exit_config import TRAINING_OBJECTIVES, TREE_ANCHORS, ExitTrainingArguments
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
from .rows import CONTEXT_FEATURES, INPUT_IDS, LOSS_MASK, PROMPT_LENGTH, row_tensors
from .trainer import ExitTrainer

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
