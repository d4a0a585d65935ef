"""ExitTrain: training DFlash drafters with `ExitTrainer` (docs/design.md#exittrain, docs/training.md).

- `exit_config`, `exit_trainer`: `ExitTrainingArguments` (every knob) beside `ExitTrainer` (the Trainer hooks);
- `rows`, `data`: one training row (its columns, its check, its prompt); the rows of a run (written by the
  target: `generate_training_data`, checked: `check_rows`, padded: `ExitDataCollator`);
- `draft_vocab`: a drafter's draft vocabulary from the target's token frequencies in the rows;
- `features`: the target features a drafter reads, computed once and memory-mapped (`FeatureCache`);
- `batch`, `losses`: a step's anchors, masks and two shared forwards; the losses built on them (`rows_loss` of
  "exit", "prefix", "dflash"; Draft-OPD's replay and `opd_loss`) and their FLOPs. The maths: `hf_tev.exit_loss`;
- `rollouts`: tree decoding with the frozen target (`collect_rollouts`): the decoded tau of evaluations and the
  Draft-OPD rollouts of a run;
- `checkpoints`: the check of a checkpoint before a run resumes from it, and the seeds of the random draws;
- `hub`: the model card (template `drafter_card.md`) and the Hub upload;
- `cli`, `script_args`, `inputs`: `hf-tev train` / `python -m hf_tev.train`, its arguments and parser, the files it
  reads and the model folders it checks.
"""

from .data import ExitDataCollator, check_rows, generate_training_data
from .draft_vocab import draft_vocab_from_rows
from .exit_config import TRAINING_OBJECTIVES, ExitTrainingArguments
from .exit_trainer import ExitTrainer
from .features import CachedFeatureDataset, FeatureCache, compute_context_features
from .hub import render_model_card
from .losses import opd_loss
from .rollouts import Rollout, collect_rollouts, decoded_block_lengths
from .rows import CONTEXT_FEATURES, INPUT_IDS, LOSS_MASK, PROMPT_LENGTH

__all__ = [
    "CONTEXT_FEATURES",
    "INPUT_IDS",
    "LOSS_MASK",
    "PROMPT_LENGTH",
    "TRAINING_OBJECTIVES",
    "CachedFeatureDataset",
    "ExitDataCollator",
    "ExitTrainer",
    "ExitTrainingArguments",
    "FeatureCache",
    "Rollout",
    "check_rows",
    "collect_rollouts",
    "compute_context_features",
    "decoded_block_lengths",
    "draft_vocab_from_rows",
    "generate_training_data",
    "opd_loss",
    "render_model_card",
]
