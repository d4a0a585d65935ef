"""The dataset columns of ExitTrain's training rows and batches (see `ExitDataCollator`), in one place for the
modules that read or write them (`data`, `data_generation`, `features`)."""

INPUT_IDS = "input_ids"
LOSS_MASK = "loss_mask"
PROMPT_LENGTH = "prompt_length"
CONTEXT_FEATURES = "context_features"
# Batch only: 1 on real tokens, 0 on padding.
ATTENTION_MASK = "attention_mask"
