"""hf_tev: lossless tree speculative decoding (DFlash + DDTree trees + Tree Exit Verification) for transformers.

`import hf_tev` routes `model.generate(..., assistant_model=drafter, tev_config=hf_tev.TEVConfig(...))` into
the tree decoder; `hf_tev.disable()` / `hf_tev.enable()` remove and restore that route.
"""

from .configuration_dflash import DFlashConfig
from .generation import TEVConfig, TEVGenerateOutput, TEVStats, disable, enable
from .modeling_dflash import DFlashDraftModel
from .tree import DraftTree, build_tree
from .verify import VERIFIERS, target_flow

__version__ = "0.1.0"

__all__ = [
    "DFlashConfig",
    "DFlashDraftModel",
    "DraftTree",
    "ExitDataCollator",
    "ExitTrainer",
    "ExitTrainingArguments",
    "TEVConfig",
    "TEVGenerateOutput",
    "TEVStats",
    "VERIFIERS",
    "build_tree",
    "disable",
    "enable",
    "generate_training_data",
    "target_flow",
]

# The trainer pulls in transformers.Trainer and accelerate (seconds of import time): load it on first use.
_TRAINING = ("ExitDataCollator", "ExitTrainer", "ExitTrainingArguments", "generate_training_data")


def __getattr__(name):
    if name in _TRAINING:
        from . import training

        return getattr(training, name)
    raise AttributeError(f"module 'hf_tev' has no attribute {name!r}")


enable()
