"""The old path of `hf_tev.models.dflash.native`: re-exports it (with a FutureWarning)."""

import warnings

from .models.dflash.native import *  # noqa: F403

warnings.warn(
    "hf_tev.native_drafters moved to hf_tev.models.dflash.native: import from there", FutureWarning, stacklevel=2
)
