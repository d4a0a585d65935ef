"""hf_tev: lossless tree speculative decoding (DFlash + DDTree trees + Tree Exit Verification) for transformers.

`import hf_tev` routes `model.generate(..., assistant_model=drafter, tev_config=hf_tev.TEVConfig(...))` into
the tree decoder (`hf_tev.route`); `hf_tev.disable()` / `hf_tev.enable()` remove and restore that route. It also
lets `AutoModel` load saved drafters (`hf_tev.models.dflash.auto`) and reads a generation config's `tev_config`
back as a `TEVConfig` (`hf_tev.config.TEVConfigField`).

With `HF_TEV_NO_PATCH=1` (or true / yes / on) in the environment before the import, hf_tev changes nothing in
transformers: no route, no `AutoModel` entry, no generation-config field. Tree decoding is then bound to one
model at a time, `hf_tev.bind(target, drafter)` (`hf_tev.binding`), or asked for with `hf_tev.enable()`.

Names load on first use: importing `hf_tev` (or its algorithm core `hf_tev.tree`, `hf_tev.verify`,
`hf_tev.exit_loss`) does not import transformers; the route is installed when transformers is loaded.
"""

import importlib
import os

from ._version import __version__
from .binding import bind, is_bound, unbind
from .import_hooks import after_import
from .logs import configure_logging
from .models.dflash.auto import AUTO_FACTORY
from .route import disable, enable, is_enabled

# The environment variable that makes `import hf_tev` change nothing in transformers (see above).
NO_PATCH_VARIABLE = "HF_TEV_NO_PATCH"
GENERATION_CONFIG_MODULE = "transformers.generation.configuration_utils"  # hf_tev.config loads with it (torch)

# hf_tev's log lines print as `[hf_tev] ...`, at transformers' verbosity (`hf_tev.logs`).
configure_logging()

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
    "bind",
    "build_tree",
    "disable",
    "enable",
    "generate_training_data",
    "is_bound",
    "is_enabled",
    "target_flow",
    "tree_speculative_decode",
    "unbind",
]

# Public name -> the module that defines it (imported on first access).
_LAZY = {
    "DFlashConfig": "models.dflash.configuration_dflash",
    "DFlashDraftModel": "models.dflash.modeling_dflash",
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


def patches_wanted() -> bool:
    """Whether `import hf_tev` may change transformers: not when `HF_TEV_NO_PATCH` is 1, true, yes or on."""
    return os.environ.get(NO_PATCH_VARIABLE, "").strip().lower() not in ("1", "true", "yes", "on")


if patches_wanted():
    enable()
    after_import(AUTO_FACTORY, f"{__name__}.models.dflash.auto", "install")  # AutoModel loads saved drafters
    after_import(GENERATION_CONFIG_MODULE, f"{__name__}.config", "install_generation_config_field")
