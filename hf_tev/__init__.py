"""hf_tev: lossless tree speculative decoding (DFlash + DDTree trees + Tree Exit Verification) for transformers.

`import hf_tev` routes `model.generate(..., assistant_model=drafter, tev_config=hf_tev.TEVConfig(...))` into
the tree decoder; `hf_tev.disable()` / `hf_tev.enable()` remove and restore that route.
"""

from .configuration_dflash import DFlashConfig
from .generation import TEVConfig, TEVGenerateOutput, TEVStats, disable, enable
from .modeling_dflash import DFlashDraftModel

__version__ = "0.1.0"

__all__ = [
    "DFlashConfig",
    "DFlashDraftModel",
    "TEVConfig",
    "TEVGenerateOutput",
    "TEVStats",
    "disable",
    "enable",
]

enable()
