"""Loading what the bench runs on: the models (`load_bench_models` gives `BenchModels`: the target, its tokenizer, the
drafters and the causal assistant) and the prompts (`load_prompt_texts`, then `tokenize_prompts`).

`check_sources(config)` checks, before anything is loaded, that every folder named exists and holds what its
option needs (a DFlash drafter for `--drafters`, safetensors weights for `--target` unless
`--allow_pickle_target`), and that a Hub id can be fetched (in the local cache when the Hub is offline).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..packaged import (
    KIT_DRAFTERS,
    kit_dir,
    load_kit_model,
    load_kit_tokenizer,
    pretrained_source,
    say_if_its_package_is_missing,
    uses_packaged_model,
)
from .config import DTYPES, BenchConfig
from .methods import METHODS, PROMPT_SETS

SAFETENSORS_NAMES = ("model.safetensors", "model.safetensors.index.json")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass
class BenchModels:
    target: torch.nn.Module
    tokenizer: object
    drafters: dict
    assistant: torch.nn.Module | None = None
    prompt_lookup_num_tokens: int = 10

    def require_assistant(self):
        if self.assistant is None:
            raise ValueError("This method needs --assistant (a small causal LM with the target's tokenizer)")
        return self.assistant

    @property
    def pad_token_id(self) -> int:
        """What pads a batch of prompts: the tokenizer's pad token, else its EOS token."""
        tokenizer = self.tokenizer
        return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


# --------------------------------------------------------------------------------------------------------
# What the options name, checked before anything is loaded
# --------------------------------------------------------------------------------------------------------
def _assistant_name(config: BenchConfig) -> str | None:
    """The assistant the run loads: `--assistant`, else the kit's `assistant-ar` on the kit; None when no method
    needs one."""
    if not any(METHODS[m].uses_assistant for m in config.methods):
        return None
    return config.assistant or ("assistant-ar" if config.target is None else None)


def _is_kit_model(config: BenchConfig, name: str, kit_names) -> bool:
    return config.target is None and name in kit_names


def check_sources(config: BenchConfig) -> None:
    """Raise `ValueError` naming the option and the cause when a model `config` names cannot be what its option
    needs: a folder that does not exist, a drafter folder that holds no DFlash drafter, a target folder without
    safetensors weights (unless `allow_pickle_target`), or, with the Hub offline, a Hub id not in the cache. The
    Hub id of a packaged model whose package is installed passes unconverted (`load_bench_models` converts it)."""
    if config.target is None:  # the kit's target: the kit must be installed (or HF_TEV_KIT set)
        try:
            kit_dir()
        except FileNotFoundError as error:
            raise ValueError(f"--target is not given, so the bench runs on the tiny kit: {error}") from None
    named = []
    # Not `pretrained_source`: it converts a packaged GGUF (tens of seconds) in a check meant to be cheap, and the
    # folder it converts to holds safetensors weights anyway.
    if config.target is not None and not uses_packaged_model(config.target):
        try:
            say_if_its_package_is_missing(config.target)
        except ModuleNotFoundError as error:
            raise ValueError(f"--target: {error}") from None
        named.append(("--target", config.target, True))
    assistant = _assistant_name(config)
    if assistant is not None and not _is_kit_model(config, assistant, ("assistant-ar",)):
        named.append(("--assistant", assistant, True))
    named += [("--drafters", d, False) for d in config.drafters if not _is_kit_model(config, d, KIT_DRAFTERS)]
    for option, name, causal_lm in named:
        if not _check_source(option, name):
            continue  # a Hub id: transformers fetches it (and its errors name it)
        if causal_lm:
            _check_safetensors(option, name, config.allow_pickle_target)
        else:
            _check_drafter_folder(name)


def _check_source(option: str, name: str) -> bool:
    """True when `name` is a local folder; else it must be a Hub id, in the local cache when the Hub is offline."""
    if Path(name).is_dir():
        return True
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    looks_local = os.path.isabs(name) or name.startswith((".", "~")) or Path(name).exists()
    try:
        validate_repo_id(name)
    except HFValidationError:
        looks_local = True
    if looks_local:
        what = "is a file, not a folder" if Path(name).exists() else "does not exist"
        raise ValueError(f"{option}: the folder {name!r} {what}")
    if constants.is_offline_mode() and not isinstance(try_to_load_from_cache(name, "config.json"), str):
        raise ValueError(
            f"{option}: {name!r} is no folder here, and as a Hub id it is not in the local cache while the Hub is "
            "offline (HF_HUB_OFFLINE)"
        )
    return False


def _listing(folder: Path, shown: int = 8) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    return (", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")) or "nothing"


def _check_drafter_folder(name: str) -> None:
    """A drafter folder holds a DFlash drafter's config.json: `dflash_config`, or a `DFlash*` architecture."""
    folder = Path(name)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(
            f"--drafters: {name!r} is not a DFlash drafter: it has no config.json (it holds {_listing(folder)})"
        )
    try:
        config = json.loads(config_path.read_text())
    except ValueError as error:
        raise ValueError(f"--drafters: {config_path} is not valid JSON: {error}") from None
    architectures = config.get("architectures") or []
    if "dflash_config" in config or any("dflash" in str(a).lower() for a in architectures):
        return
    model = ", ".join(map(str, architectures)) or "no architectures"
    raise ValueError(
        f"--drafters: {name!r} is not a DFlash drafter: its config.json describes a {model} "
        f"(model_type {config.get('model_type')!r}) with no dflash_config; it holds {_listing(folder)}. "
        "A DFlash drafter's config.json has a dflash_config and architectures ['DFlashDraftModel']"
    )


def _check_safetensors(option: str, name: str, allow_pickle: bool) -> None:
    """A model folder holds safetensors weights, unless pickle weights are allowed."""
    folder = Path(name)
    if allow_pickle or any((folder / n).is_file() for n in SAFETENSORS_NAMES):
        return
    pickles = sorted(p.name for p in folder.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
    found = f"it holds pickle weights ({', '.join(pickles)})" if pickles else f"it holds {_listing(folder)}"
    raise ValueError(
        f"{option}: the folder {name!r} has no model.safetensors; {found}. hf-tev bench loads models from "
        "safetensors only: pass --allow_pickle_target to load pickle weights (transformers' weights_only loading)"
    )


# --------------------------------------------------------------------------------------------------------
# The models
# --------------------------------------------------------------------------------------------------------
def _load_causal_lm(option: str, name: str, config: BenchConfig, **kwargs):
    """`AutoModelForCausalLM.from_pretrained`, safetensors only unless `allow_pickle_target`."""
    from transformers import AutoModelForCausalLM

    safe = None if config.allow_pickle_target else True
    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=DTYPES[config.dtype], use_safetensors=safe, **kwargs)
    except OSError as error:
        if safe and "safetensors" in str(error):
            raise ValueError(
                f"{option}: {name!r} has no safetensors weights; hf-tev bench loads models from safetensors only: "
                "pass --allow_pickle_target to load pickle weights (transformers' weights_only loading)"
            ) from error
        raise
    return model.to(config.device).eval()


def load_bench_models(config: BenchConfig) -> BenchModels:
    check_sources(config)
    dtype, device = DTYPES[config.dtype], config.device
    if config.target is None:
        target, tokenizer = load_kit_model("target", dtype, device), load_kit_tokenizer()
    else:
        from transformers import AutoTokenizer

        source = pretrained_source(config.target)
        target = _load_causal_lm("--target", source, config, attn_implementation="sdpa")
        tokenizer = AutoTokenizer.from_pretrained(source)
    drafters = {name: _load_drafter(name, config, dtype, device) for name in config.drafters}
    for drafter in drafters.values():
        drafter.check_target(target)
    assistant, assistant_name = None, _assistant_name(config)
    if assistant_name is not None:
        if _is_kit_model(config, assistant_name, ("assistant-ar",)):
            assistant = load_kit_model("assistant-ar", dtype, device)
        else:
            assistant = _load_causal_lm("--assistant", assistant_name, config)
    return BenchModels(target, tokenizer, drafters, assistant, config.prompt_lookup_num_tokens)


def weights_of(models: BenchModels) -> dict:
    """Which weights the run loaded, for the document's `weights`: per model, the folder it was read from (resolved
    to an absolute path; a Hub id as it was given) and `target_fingerprint` of the loaded parameters."""
    from ..training.features import target_fingerprint

    def record(model) -> dict:
        source = str(getattr(model, "name_or_path", "") or "")
        path = str(Path(source).resolve()) if source and Path(source).is_dir() else source
        return {"path": path, "fingerprint": target_fingerprint(model)}

    return {
        "target": record(models.target),
        "drafters": {name: record(drafter) for name, drafter in models.drafters.items()},
    }


def _load_drafter(name, config, dtype, device):
    if config.target is None and name in KIT_DRAFTERS:
        return load_kit_model(name, dtype, device)
    from ..models.dflash.modeling_dflash import DFlashDraftModel

    return DFlashDraftModel.from_pretrained(name, dtype=dtype).to(device).eval()


def load_prompt_texts(config: BenchConfig) -> dict[str, list[str]]:
    """The prompts of every set, as text."""
    return {name: PROMPT_SETS[name].load(config.max_prompts) for name in config.prompt_sets}


def tokenize_prompts(texts: dict[str, list[str]], tokenizer, device, chat_template: bool) -> dict[str, list]:
    """`[1, n]` input ids per prompt; the tokenizer's chat template wraps each prompt when it has one."""
    sets = {}
    for name, prompts in texts.items():
        if chat_template and getattr(tokenizer, "chat_template", None):
            prompts = [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
                )
                for text in prompts
            ]
        sets[name] = [tokenizer(text, return_tensors="pt").input_ids.to(device) for text in prompts if text]
    return sets
