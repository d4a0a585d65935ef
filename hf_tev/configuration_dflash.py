"""The old path of `hf_tev.models.dflash.configuration_dflash`: re-exports it (with a FutureWarning)."""

import warnings

from .models.dflash.configuration_dflash import *  # noqa: F403

warnings.warn(
    "hf_tev.configuration_dflash moved to hf_tev.models.dflash.configuration_dflash: import from there",
    FutureWarning,
    stacklevel=2,
)
