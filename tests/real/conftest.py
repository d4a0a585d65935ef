"""The real pretrained target, SmolLM2-135M-Instruct (`smollm2_folder`, tests/conftest.py): loaded once, shared by
every test here, never changed by one."""

import pytest
import torch


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
