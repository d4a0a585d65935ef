"""The old path of `hf_tev.models.dflash.modeling_dflash`: re-exports it (with a FutureWarning)."""

import warnings

from .models.dflash.modeling_dflash import *  # noqa: F403

warnings.warn(
    "hf_tev.modeling_dflash moved to hf_tev.models.dflash.modeling_dflash: import from there",
    FutureWarning,
    stacklevel=2,
)
