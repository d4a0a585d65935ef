"""Loading what the bench runs on: the models (`load_models` gives `BenchModels`: the target, its tokenizer, the
drafters and the causal assistant) and the prompts (`load_prompt_texts`, then `tokenize_prompts`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kit import KIT_DRAFTERS, load_kit_model, load_kit_tokenizer
from .config import DTYPES, BenchConfig
from .methods import METHODS, PROMPT_SETS, hub_unreachable_reason
from .records import add_warning


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


def load_models(config: BenchConfig) -> BenchModels:
    dtype, device = DTYPES[config.dtype], config.device
    needs_assistant = any(METHODS[m].uses_assistant for m in config.methods)
    if config.target is None:
        target, tokenizer = load_kit_model("target", dtype, device), load_kit_tokenizer()
        assistant_name = config.assistant or ("assistant-ar" if needs_assistant else None)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        target = AutoModelForCausalLM.from_pretrained(config.target, dtype=dtype, attn_implementation="sdpa")
        target, tokenizer = target.to(device).eval(), AutoTokenizer.from_pretrained(config.target)
        assistant_name = config.assistant
    drafters = {name: _load_drafter(name, config, dtype, device) for name in config.drafters}
    for drafter in drafters.values():
        drafter.check_target(target)
    assistant = None
    if assistant_name is not None and needs_assistant:
        if config.target is None and assistant_name == "assistant-ar":
            assistant = load_kit_model("assistant-ar", dtype, device)
        else:
            from transformers import AutoModelForCausalLM

            assistant = AutoModelForCausalLM.from_pretrained(assistant_name, dtype=dtype).to(device).eval()
    return BenchModels(target, tokenizer, drafters, assistant, config.prompt_lookup_num_tokens)


def _load_drafter(name, config, dtype, device):
    if config.target is None and name in KIT_DRAFTERS:
        return load_kit_model(name, dtype, device)
    from ..modeling_dflash import DFlashDraftModel

    return DFlashDraftModel.from_pretrained(name, dtype=dtype).to(device).eval()


def load_prompt_texts(config: BenchConfig, notes: list[str]) -> dict[str, list[str]]:
    """The prompts of every set, as text. Hub sets are skipped, with a message, when the Hub is not reachable."""
    sets, reason = {}, None
    for name in config.prompt_sets:
        prompt_set = PROMPT_SETS[name]
        if prompt_set.needs_hub:
            reason = reason or hub_unreachable_reason() or ""
            if reason:
                message = (
                    f"prompt set {name!r} needs the Hugging Face Hub (datasets), which is not reachable: "
                    f"{reason}; skipped"
                )
                add_warning(notes, message)
                continue
        sets[name] = prompt_set.load(config.max_prompts)
    if not sets:
        raise RuntimeError(f"No prompt set of {config.prompt_sets} could be loaded: {notes[-1] if notes else ''}")
    return sets


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
