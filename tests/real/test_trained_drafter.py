"""The DFlash drafter trained for SmolLM2-135M-Instruct (research/smollm2_drafter), as it ships (package data): the
real target's default in the quickstart and the bench. It must be there, load from safetensors alone, and decode
exactly with `TEVConfig()` while its trees are accepted past the root."""

import json

import pytest
import torch

import hf_tev
from hf_tev.packaged import default_drafter

pytestmark = pytest.mark.slow  # the real target (tests/conftest.py `smollm2_folder`)

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def trained_drafter():
    folder = default_drafter(SMOLLM2)
    assert folder is not None, "hf_tev/shipped_drafters/SmolLM2-135M-Instruct-DFlash must ship with the checkout"
    return folder, hf_tev.DFlashDraftModel.from_pretrained(folder).eval()


def test_ships_as_safetensors_with_its_card(trained_drafter):
    folder, drafter = trained_drafter
    assert not list(folder.glob("*.bin")) and not list(folder.glob("*.pt")), "no pickled file ships"
    config = json.loads((folder / "config.json").read_text())
    assert config["block_size"] == 8 and config["dflash_config"]["target_layer_ids"] == [1, 14, 27]
    # its draft vocabulary is stored in its safetensors and restricts its head (issue "A drafter that pays")
    assert config["draft_vocab_size"] == drafter.get_buffer("d2t").numel() == 8192
    card = (folder / "README.md").read_text()
    assert "library_name: hf_tev" in card and SMOLLM2 in card


@pytest.fixture(scope="module")
def word_problem(smollm2):
    """The first GSM8K test question of the bench (a held-out prompt), chat-templated."""
    from hf_tev.bench.methods import PROMPT_SETS

    _, tokenizer = smollm2
    messages = [{"role": "user", "content": PROMPT_SETS["gsm8k"].load(1)[0]}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt").input_ids


def test_its_own_trees_are_exact_and_accepted_deep(smollm2, trained_drafter, word_problem):
    target, _ = smollm2
    _, drafter = trained_drafter
    expected = target.generate(word_problem, do_sample=False, max_new_tokens=40)
    config = hf_tev.TEVConfig(budget=16, lookup=False)  # the drafter's trees alone
    out = target.generate(
        word_problem, assistant_model=drafter, tev_config=config, do_sample=False, max_new_tokens=40,
        return_dict_in_generate=True,
    )  # fmt: skip
    assert out.sequences.tolist() == expected.tolist()
    stats = out.tev_stats
    assert max(stats.accepted_lengths) >= 3, "the trained drafter's trees were never accepted past depth 1"
    assert stats.accepted_by_source.get("drafter", 0) >= 8  # this prompt: tau 1.97 at B = 16 (its Table 2)


def test_the_default_pairing_is_exact(smollm2, chat, trained_drafter):
    target, _ = smollm2
    _, drafter = trained_drafter
    input_ids = chat("Write a Python function to reverse a list.")
    expected = target.generate(input_ids, do_sample=False, max_new_tokens=40)
    out = target.generate(
        input_ids, assistant_model=drafter, tev_config=hf_tev.TEVConfig(), do_sample=False, max_new_tokens=40
    )
    assert out.tolist() == expected.tolist()


def test_sampled_trees_of_the_drafter_are_accepted(smollm2, trained_drafter, word_problem):
    """At T = 1 its trees are accepted too (the law itself is tested with exact enumerations, test_smollm2.py)."""
    target, _ = smollm2
    _, drafter = trained_drafter
    torch.manual_seed(0)
    out = target.generate(
        word_problem, assistant_model=drafter, tev_config=hf_tev.TEVConfig(budget=16, seed=0), do_sample=True,
        temperature=1.0, top_k=0, max_new_tokens=32, return_dict_in_generate=True,
    )  # fmt: skip
    assert out.tev_stats.accepted_by_source.get("drafter", 0) > 0
