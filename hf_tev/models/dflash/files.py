"""The files of a DFlash drafter checkpoint (docs/usage.md#drafters): which safetensors files
`DFlashDraftModel.from_pretrained` loads, from a local folder or the Hub, refusing before transformers sees them
what cannot be loaded strictly (pickle weights, a broken index, non-float tensors, a model's checkpoint where a
drafter's was meant). Hub errors (offline mode, a
gated or missing repo, a missing file) are transformers' own, with what the file was needed for added.
"""

import json
import os

from huggingface_hub import try_to_load_from_cache
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers.utils import cached_file

from .architecture import DRAFTER_ARCHITECTURE, architecture_names
from .vocabulary import VOCABULARY_BUFFER_DTYPES

SAFE_WEIGHTS_NAME, SAFE_INDEX_NAME = "model.safetensors", "model.safetensors.index.json"
PICKLE_WEIGHTS_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def safetensors_files(path, kwargs) -> list[str]:
    """The local paths of a checkpoint's safetensors weight files (downloaded to the cache for a Hub id).

    Refuses, before transformers considers them: a local path that does not exist, a folder without
    `config.json`, pickle weights, and a safetensors index whose shards are not safetensors files.
    """
    path = str(path)
    subfolder = kwargs.get("subfolder") or ""
    if os.path.isfile(path):
        if not path.endswith(".safetensors"):
            raise ValueError(f"{path}: DFlashDraftModel loads safetensors weights only, refusing a pickle file")
        return [path]
    if os.path.isdir(path):
        return _folder_safetensors_files(path, subfolder)
    if _is_local_path(path):
        raise OSError(f"{path}: no such folder (and not a Hub repo id of the form 'owner/name')")
    return _hub_safetensors_files(path, kwargs)


DRAFTER_FIELDS = ("dflash_config", "target_layer_ids", "num_target_layers")  # what only a drafter's config has
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")


def is_drafter_config_dict(config: dict) -> bool:
    """Whether a `config.json` is a DFlash drafter's: it names `DFlashDraftModel`, or has a drafter's fields."""
    return DRAFTER_ARCHITECTURE in architecture_names(config) or any(key in config for key in DRAFTER_FIELDS)


def model_not_drafter(config: dict) -> str | None:
    """What a `config.json` that names a model, not a DFlash drafter, is ("a causal LM (Qwen3ForCausalLM)"); None
    for a drafter's config and for one that names no architecture."""
    names = architecture_names(config)
    if not names or is_drafter_config_dict(config):
        return None
    kind = "a causal LM" if any(name.endswith(CAUSAL_LM_SUFFIXES) for name in names) else "a model"
    return f"{kind} ({', '.join(names)})"


def _check_is_drafter(config_file: str, where: str) -> None:
    """Refuse a checkpoint whose `config.json` is a model's (a target passed as the drafter), naming it."""
    try:
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{where}: config.json ({config_file}) is not valid JSON: {error}") from None
    what = model_not_drafter(config) if isinstance(config, dict) else None
    if what is not None:
        raise ValueError(
            f"{where} is {what}, not a DFlash drafter (its config.json names no {DRAFTER_ARCHITECTURE} and has no "
            "dflash_config): load it as the target (AutoModelForCausalLM.from_pretrained) and pass the drafter made "
            "for it as assistant_model=, or build a fresh one with DFlashDraftModel.from_target(target)"
        )


def _folder_safetensors_files(path: str, subfolder: str) -> list[str]:
    """A local checkpoint folder's safetensors weight files (its `subfolder`), refusing pickle weights."""
    folder = os.path.join(path, subfolder) if subfolder else path
    if not os.path.isdir(folder):
        raise OSError(f"{path} has no subfolder {subfolder!r}")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise OSError(
            f"{folder} has no config.json: not a saved DFlash drafter (save_pretrained writes config.json "
            "next to model.safetensors)"
        )
    _check_is_drafter(os.path.join(folder, "config.json"), folder)
    if os.path.isfile(os.path.join(folder, SAFE_WEIGHTS_NAME)):
        return [os.path.join(folder, SAFE_WEIGHTS_NAME)]
    if os.path.isfile(os.path.join(folder, SAFE_INDEX_NAME)):
        shards = _index_shards(os.path.join(folder, SAFE_INDEX_NAME), folder)
        missing = [shard for shard in shards if not os.path.isfile(os.path.join(folder, shard))]
        if missing:
            raise OSError(f"{folder}: {SAFE_INDEX_NAME} names shards that are not there: {missing}")
        return [os.path.join(folder, shard) for shard in shards]
    pickles = sorted(f for f in os.listdir(folder) if f.endswith(PICKLE_WEIGHTS_SUFFIXES))
    raise ValueError(
        f"{folder} has no model.safetensors; DFlashDraftModel loads safetensors weights only and "
        f"refuses pickle weights{' (found ' + ', '.join(pickles) + ')' if pickles else ''}. "
        "Convert them with safetensors first."
    )


def _hub_safetensors_files(path: str, kwargs) -> list[str]:
    """A Hub checkpoint's safetensors weight files, downloaded to the cache (or found there).

    Offline mode, a gated or missing repo, a file the Hub cannot give and a failed connection raise transformers'
    own error (`cached_file`), with what hf_tev needed the file for added. Only a file the Hub (or the cache) says
    is not in the repo is skipped: `model.safetensors` then falls back to the sharded index.
    """
    hub_kwargs = {
        k: kwargs[k]
        for k in ("revision", "token", "cache_dir", "local_files_only", "subfolder", "force_download", "proxies")
        if k in kwargs
    }

    def fetch(name: str, needed_for: str, optional: bool = False) -> str | None:
        try:
            return cached_file(path, name, **hub_kwargs)
        except OSError as error:
            if optional and _known_missing(path, name, hub_kwargs):
                return None
            raise OSError(f"{error}\nDFlashDraftModel.from_pretrained({path!r}) needs {name}: {needed_for}.") from error

    config_file = fetch("config.json", "the drafter's configuration")
    if config_file is None:  # transformers returns None for it alone
        raise OSError(f"{path} has no config.json: not a DFlash drafter checkpoint")
    _check_is_drafter(config_file, path)
    weights = "the drafter's weights (or model.safetensors.index.json for sharded weights)"
    single = fetch(SAFE_WEIGHTS_NAME, weights, optional=True)
    if single is not None:
        return [single]
    index = fetch(SAFE_INDEX_NAME, "the index of the drafter's sharded weights", optional=True)
    if index is None:
        raise ValueError(
            f"{path} has no model.safetensors (or index); DFlashDraftModel loads safetensors weights "
            "only and refuses pickle weights such as pytorch_model.bin"
        )
    files = []
    for shard in _index_shards(index, path):
        local = fetch(shard, f"a shard {SAFE_INDEX_NAME} names", optional=True)
        if local is None:
            raise OSError(f"{path}: {SAFE_INDEX_NAME} names a shard that is not there: {shard}")
        files.append(local)
    return files


def _known_missing(repo_id: str, name: str, hub_kwargs: dict) -> bool:
    """Whether the Hub cache records `name` as absent from the repo (the Hub answered that it does not exist);
    False when nothing is known, e.g. offline before the first download."""
    subfolder = hub_kwargs.get("subfolder") or ""
    cached = try_to_load_from_cache(
        repo_id,
        f"{subfolder}/{name}" if subfolder else name,
        cache_dir=hub_kwargs.get("cache_dir"),
        revision=hub_kwargs.get("revision"),
    )
    return cached is not None and not isinstance(cached, str)  # huggingface_hub's "cached as non-existent" marker


def _index_shards(index_file: str, where: str) -> list[str]:
    """The shard files a safetensors index points at; ValueError naming the file when it is not a JSON index, or
    when any shard is not a safetensors file."""
    try:
        with open(index_file, encoding="utf-8") as f:
            index = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{where}: {SAFE_INDEX_NAME} ({index_file}) is not valid JSON: {error}") from error
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{where}: {SAFE_INDEX_NAME} ({index_file}) has no weight_map of weight names to shard files")
    if "metadata" not in index:  # transformers reads it when it loads the shards
        raise ValueError(
            f"{where}: {SAFE_INDEX_NAME} ({index_file}) has no metadata entry (save_pretrained writes one)"
        )
    shards = sorted(set(weight_map.values()))
    not_safe = [shard for shard in shards if not shard.endswith(".safetensors")]
    if not_safe:
        raise ValueError(
            f"{where}: {SAFE_INDEX_NAME} points at non-safetensors shards {not_safe}; DFlashDraftModel loads "
            "safetensors weights only and refuses pickle weights"
        )
    if not shards:
        raise ValueError(f"{where}: {SAFE_INDEX_NAME} has an empty weight_map")
    return shards


def _is_local_path(path: str) -> bool:
    """Whether `path`, which does not exist, can only have meant a local folder (not a Hub repo id)."""
    if os.path.isabs(path) or path.startswith((".", "~")):
        return True
    try:  # a Hub id is 'name' or 'owner/name'
        validate_repo_id(path)
    except HFValidationError:
        return True
    return False


def check_tensor_dtypes(files: list[str]) -> None:
    """Refuse checkpoint tensors that are not floating point (an int tensor would load as garbage or zeros), but for
    a draft vocabulary's integer buffers (`vocabulary.VOCABULARY_BUFFER_DTYPES`)."""
    from safetensors import safe_open

    wrong = []
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                dtype = f.get_slice(name).get_dtype()
                if not dtype.startswith(("F", "BF")) and VOCABULARY_BUFFER_DTYPES.get(name) != dtype:
                    wrong.append(f"{name} ({dtype})")
    if wrong:
        raise ValueError(
            f"DFlash drafter checkpoint has tensors that are not floating point: {', '.join(sorted(wrong))}; "
            "every DFlash weight is a float (F32 / F16 / BF16), and a draft vocabulary's d2t / t2d are I64 / BOOL"
        )
