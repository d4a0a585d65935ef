"""`AutoModel.from_pretrained(<a DFlash drafter>)` builds an `hf_tev.DFlashDraftModel`.

A drafter's `config.json` keeps the published layout, `model_type: "qwen3"` (the publishers' loader and
transformers 4.x read it), so transformers reads it as a `Qwen3Config` and, left alone, `AutoModel` builds a
`Qwen3Model` that misses the drafter's weights. transformers picks an auto class's model class in one function
(`auto_factory._get_model_class`, by config class); hf_tev wraps it so that a Qwen3 config whose `architectures`
names `DFlashDraftModel` (that exact name, in a list or as the one string) gets hf_tev's drafter from `AutoModel`
(hf_tev's own code, never a checkpoint's `auto_map` code, even with `trust_remote_code=True`), and a clear error
from every other auto class (a drafter has no LM head and cannot run alone). Every other config goes to
transformers' own choice, untouched.

Registering a tuple `(Qwen3Model, DFlashDraftModel)` for `Qwen3Config`, transformers' public way to let
`architectures` choose, is not usable: transformers' choice among a tuple fails on every config without
`architectures` (`AutoModel.from_config(Qwen3Config())` would raise), as it does for Funnel's tuple today.
The wrapper goes in when `transformers.models.auto.auto_factory` loads, or at `import hf_tev` when it is loaded
already, and again each time the module is executed anew (`importlib.reload`), whichever was imported first
(`hf_tev.import_hooks`). A transformers without `_get_model_class` gets a one-time warning naming what is lost.
"""

import functools

from .architecture import DRAFTER_ARCHITECTURE, architecture_names

AUTO_FACTORY = "transformers.models.auto.auto_factory"


def install(auto_factory) -> None:
    """Wrap `auto_factory._get_model_class` (once per execution of the module: `hf_tev.import_hooks` runs this
    again after a reload). A transformers without that function is left alone, with a warning (once) that names
    what no longer works."""
    choose = getattr(auto_factory, "_get_model_class", None)
    if choose is None:
        from transformers.utils import logging

        logging.get_logger(__name__).warning_once(
            f"hf_tev: {AUTO_FACTORY} has no `_get_model_class` in this transformers version, so AutoModel cannot "
            "load DFlash drafters: AutoModel.from_pretrained(<a drafter>) builds a plain Qwen3Model without the "
            "drafter's weights, and the other auto classes no longer refuse drafters. Load drafters with "
            "hf_tev.DFlashDraftModel.from_pretrained(...)."
        )
        return
    if getattr(choose, "_hf_tev_drafters", False):
        return

    @functools.wraps(choose)
    def get_model_class(config, model_mapping):
        if not is_drafter_config(config):
            return choose(config, model_mapping)
        return drafter_class(config, model_mapping)

    get_model_class._hf_tev_drafters = True
    auto_factory._get_model_class = get_model_class


def is_drafter_config(config) -> bool:
    """Whether `config` is a published-layout DFlash drafter's: a Qwen3 config whose `architectures` (a list of
    names, or one name as a string) holds exactly the name `DFlashDraftModel`."""
    return getattr(config, "model_type", None) == "qwen3" and DRAFTER_ARCHITECTURE in architecture_names(config)


def drafter_class(config, model_mapping):
    """`DFlashDraftModel` for `AutoModel`'s mapping; a ValueError for any other auto class."""
    from transformers import MODEL_MAPPING

    if model_mapping is MODEL_MAPPING:
        from .modeling_dflash import DFlashDraftModel  # on first use: `import hf_tev` loads this module, not torch

        return DFlashDraftModel
    name = getattr(config, "name_or_path", "") or "this config"
    raise ValueError(
        f"{name} is a DFlash drafter (architectures {architecture_names(config)}): it has no LM head of its own "
        "and cannot run alone. Load it with hf_tev.DFlashDraftModel.from_pretrained(...) (or AutoModel) and pass it "
        "to the target's generate as assistant_model="
    )
