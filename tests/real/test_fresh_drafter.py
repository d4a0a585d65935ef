"""A fresh drafter starts near ln V (uniform guessing), not far above it, on the tied-embedding targets: the kit's
and SmolLM2. Before `from_target` bounded the first logits, SmolLM2's fresh drafter started at cross-entropy ~59-69
(ln V = 10.8) and the kit's at 13.3 (ln V = 8.3): every logit was huge, because the mask token's row is a real
token's and the target scores the block rows with its tied embeddings."""

import math

import pytest
import torch

from hf_tev import DFlashDraftModel

pytestmark = pytest.mark.slow  # the real target (tests/conftest.py `smollm2_folder`)


def first_loss(target, prompt_ids: torch.Tensor, block_size: int = 8, seed: int = 0) -> float:
    """The teacher-forced cross-entropy of a fresh drafter's block on the target's own greedy continuation."""
    torch.manual_seed(seed)
    drafter = DFlashDraftModel.from_target(target, num_layers=1, block_size=block_size)
    n = prompt_ids.shape[1]
    with torch.no_grad():
        ids = target.generate(prompt_ids, max_new_tokens=block_size, do_sample=False, min_new_tokens=block_size)
        features = drafter.context_features(target(ids, output_hidden_states=True).hidden_states)
        block = torch.full((1, block_size), drafter.config.mask_token_id)
        block[0, 0] = ids[0, n]
        logits = drafter.draft_logits(target, features[:, :n], block, torch.arange(n + block_size)[None])
    labels = ids[0, n + 1 : n + block_size]
    return torch.nn.functional.cross_entropy(logits[0].float(), labels).item()


def test_a_fresh_drafter_starts_near_ln_v_on_the_kit():
    from hf_tev.packaged import load_kit_model, load_kit_tokenizer

    target = load_kit_model("target")
    loss = first_loss(target, load_kit_tokenizer()("def add(a, b):\n    return", return_tensors="pt").input_ids)
    assert loss < math.log(target.config.vocab_size) + 1.0, loss


def test_a_fresh_drafter_starts_near_ln_v_on_smollm2(smollm2, chat):
    target, _ = smollm2
    loss = first_loss(target, chat("Write a Python function that reverses a string."))
    assert loss < math.log(target.config.vocab_size) + 1.0, loss
