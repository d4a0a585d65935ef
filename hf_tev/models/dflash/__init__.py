"""The DFlash drafter (docs/design.md#the-dflash-drafter), in the layout of a transformers model folder:
 - `configuration_dflash`: `DFlashConfig`, the published checkpoints' config layout;
 - `modeling_dflash`: `DFlashDraftModel`, the drafter as a transformers `PreTrainedModel`;
 - `files`: which checkpoint files `DFlashDraftModel.from_pretrained` loads, and what it refuses;
 - `auto`: `AutoModel.from_pretrained(<a drafter>)` builds `DFlashDraftModel` (installed by `import hf_tev`);
 - `native`: drafters transformers' own DFlash chain drives, drafting hf_tev's trees;
 - `architecture`: the drafter's architecture name (a plain module the others read).

Names load on first use, as in `hf_tev` itself: importing this package (as `import hf_tev` does, for `auto`)
imports neither torch nor transformers.
"""

import importlib

__all__ = ["DFlashConfig", "DFlashDraftModel", "NativeDFlashDrafter", "default_target_layer_ids", "tree_drafter"]

# Public name -> the module of this folder that defines it (imported on first access).
_LAZY = {
    "DFlashConfig": "configuration_dflash",
    "default_target_layer_ids": "configuration_dflash",
    "DFlashDraftModel": "modeling_dflash",
    "NativeDFlashDrafter": "native",
    "tree_drafter": "native",
}


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # later accesses skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
