"""The DFlash drafter's architecture name, and the names a config gives in `architectures`.

A plain module (no transformers, no torch) below every other module of the drafter: `hf_tev.models.dflash.auto`
(which `import hf_tev` loads) and `hf_tev.models.dflash.files` both read it, so neither imports the other.
"""

DRAFTER_ARCHITECTURE = "DFlashDraftModel"


def architecture_names(config) -> list[str]:
    """The names in a config's `architectures` (a config object's attribute, or a `config.json` dict's key): a list
    (or tuple) of names, or one name given as a string."""
    architectures = (
        config.get("architectures") if isinstance(config, dict) else getattr(config, "architectures", None)
    ) or ()
    if isinstance(architectures, str):
        return [architectures]
    return [name for name in architectures if isinstance(name, str)]
