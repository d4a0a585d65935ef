"""hf_tev: lossless tree speculative decoding (DFlash + DDTree trees + Tree Exit Verification) for transformers.

`import hf_tev` routes `model.generate(..., assistant_model=drafter, tev_config=hf_tev.TEVConfig(...))` into
the tree decoder (`hf_tev.route`); `hf_tev.disable()` / `hf_tev.enable()` remove and restore that route.

Names load on first use: importing `hf_tev` (or its algorithm core `hf_tev.tree`, `hf_tev.verify`,
`hf_tev.exit_loss`) does not import transformers; the route is installed when transformers is loaded.
"""

import importlib
import logging

from ._version import __version__
from .auto_class import AUTO_FACTORY
from .import_hooks import after_import
from .route import disable, enable, is_enabled

# hf_tev's loggers (`transformers.utils.logging.get_logger(__name__)`) answer to transformers' library logger: its
# verbosity (`transformers.logging.set_verbosity_error()`, TRANSFORMERS_VERBOSITY) and its handler.
logging.getLogger(__name__).parent = logging.getLogger("transformers")

__all__ = [
    "DFlashConfig",
    "DFlashDraftModel",
    "DraftTree",
    "CachedFeatureDataset",
    "ExitDataCollator",
    "ExitTrainer",
    "ExitTrainingArguments",
    "FeatureCache",
    "TEVConfig",
    "TEVGenerateOutput",
    "TEVStats",
    "TREE_BUILDERS",
    "VERIFIERS",
    "__version__",
    "build_tree",
    "disable",
    "enable",
    "generate_training_data",
    "is_enabled",
    "target_flow",
    "tree_speculative_decode",
]

# Public name -> the module that defines it (imported on first access).
_LAZY = {
    "DFlashConfig": "configuration_dflash",
    "DFlashDraftModel": "modeling_dflash",
    "DraftTree": "tree",
    "TREE_BUILDERS": "tree",
    "build_tree": "tree",
    "VERIFIERS": "verify",
    "target_flow": "verify",
    "TEVConfig": "config",
    "TEVStats": "config",
    "TEVGenerateOutput": "generation",
    "tree_speculative_decode": "generation",
    "ExitDataCollator": "training",
    "ExitTrainer": "training",
    "ExitTrainingArguments": "training",
    "generate_training_data": "training",
    "FeatureCache": "training",
    "CachedFeatureDataset": "training",
}


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # later accesses skip this function
        return value
    raise AttributeError(f"module 'hf_tev' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


enable()
after_import(AUTO_FACTORY, f"{__name__}.auto_class", "install")  # AutoModel loads saved drafters
