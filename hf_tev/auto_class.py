"""The old path of `hf_tev.models.dflash.auto`: re-exports it (with a FutureWarning)."""

import warnings

from .models.dflash.auto import *  # noqa: F403

warnings.warn("hf_tev.auto_class moved to hf_tev.models.dflash.auto: import from there", FutureWarning, stacklevel=2)
