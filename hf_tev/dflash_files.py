"""The old path of `hf_tev.models.dflash.files`: re-exports it (with a FutureWarning)."""

import warnings

from .models.dflash.files import *  # noqa: F403
from .models.dflash.files import architecture_names as config_architectures  # noqa: F401 (its old name)

warnings.warn("hf_tev.dflash_files moved to hf_tev.models.dflash.files: import from there", FutureWarning, stacklevel=2)
