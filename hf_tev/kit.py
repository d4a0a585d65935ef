"""The old path of the tiny kit's loaders, now in `hf_tev.packaged`: re-exports them (with a FutureWarning)."""

import warnings

from .packaged import (  # noqa: F401
    KIT_DRAFTERS,
    KIT_MODELS,
    PROMPT_SETS,
    kit_dir,
    kit_path,
    load_kit_model,
    load_kit_prompts,
    load_kit_tokenizer,
)

warnings.warn("hf_tev.kit moved to hf_tev.packaged: import from there", FutureWarning, stacklevel=2)
