"""One resolution of a call (`hf_tev.generate_call`): every way into `generate` (the route, a bound model, and
transformers' own `custom_generate=tree_speculative_decode` hook without the route) refuses each option of the one
table with the one message, before any model call, and coerces and decides the tree settings once per call."""

import importlib

import pytest
import torch
from helpers import make_drafter, make_target
from transformers import SynthIDTextWatermarkingConfig

import hf_tev
from hf_tev.generate_call import DRAFTER_TWICE, NEEDS_A_DRAFTER, REFUSED_OPTIONS, refusal
from hf_tev.generation import tree_speculative_decode

PROMPT = torch.tensor([[1, 5, 9, 13, 7]])
ENTRIES = ("route", "bind", "hook")

# a refused value of every option of the table (kwargs maker: the target's embeddings are needed for one)
REFUSED_VALUES = {
    "num_beams": lambda target: 2,
    "num_return_sequences": lambda target: 2,
    "constraints": lambda target: [],
    "force_words_ids": lambda target: [[5]],
    "penalty_alpha": lambda target: 0.6,
    "dola_layers": lambda target: "low",
    "guidance_scale": lambda target: 1.5,
    "negative_prompt_ids": lambda target: torch.tensor([[1, 2]]),
    "negative_prompt_attention_mask": lambda target: torch.ones(1, 2, dtype=torch.long),
    "use_mtp": lambda target: True,
    "prompt_lookup_num_tokens": lambda target: 3,
    "assistant_early_exit": lambda target: 1,
    "speculation_type": lambda target: "dflash",
    "assistant_ensemble_weight": lambda target: 0.5,
    "assistant_tokenizer": lambda target: object(),
    "is_assistant": lambda target: True,
    "synced_gpus": lambda target: True,
    "inputs_embeds": lambda target: target.get_input_embeddings()(PROMPT),
    "output_attentions": lambda target: True,
    "output_hidden_states": lambda target: True,
    "cache_implementation": lambda target: "offloaded",
    "watermarking_config": lambda target: SynthIDTextWatermarkingConfig(keys=[1, 2, 3], ngram_len=2),
}
# what an option needs beside it to reach the decoder on transformers' own hook (generate refuses several sequences
# of greedy decoding itself, in its own words; the hook's drafter is `drafter=`: with `assistant_model=` generate
# refuses them for assisted decoding too)
BESIDE = {"num_return_sequences": {"do_sample": True}}
# generate pops `assistant_tokenizer` with the tokenizer before its callable hook (docs/usage.md#entry-points)
NOT_SEEN_BY_THE_HOOK = {"assistant_tokenizer"}


@pytest.fixture(scope="module")
def models():
    target = make_target("qwen3", hidden_size=32, num_layers=2)
    return target, make_drafter(target)


class Entry:
    """One way into `generate` with the drafter and tree settings given as that way takes them."""

    def __init__(self, name, target, drafter):
        self.name, self.target, self.drafter = name, target, drafter

    def __enter__(self):
        if self.name == "bind":
            hf_tev.bind(self.target, self.drafter, {"budget": 4})
        if self.name == "hook":
            hf_tev.disable()
        return self

    def __exit__(self, *exc):
        hf_tev.unbind(self.target)
        hf_tev.enable()

    def generate(self, **kwargs):
        kwargs = {"max_new_tokens": 4, "do_sample": False, **kwargs}
        if self.name == "route":
            kwargs = {"assistant_model": self.drafter, "tev_config": {"budget": 4}, **kwargs}
        elif self.name == "hook":
            kwargs = {"custom_generate": tree_speculative_decode, "drafter": self.drafter, **kwargs}
        return self.target.generate(PROMPT, **kwargs)


def no_model_call(*models):
    def refuse(module, args, kwargs):
        raise AssertionError(f"{type(module).__name__} was called before the option was refused")

    return [model.register_forward_pre_hook(refuse, with_kwargs=True) for model in models]


def test_every_refused_option_has_a_refused_value_here(models):
    assert set(REFUSED_VALUES) == {name for name, _, _ in REFUSED_OPTIONS}
    assert len(REFUSED_OPTIONS) == len(REFUSED_VALUES)  # one row, so one message, per option
    for name, refused, _ in REFUSED_OPTIONS:
        assert refused(REFUSED_VALUES[name](models[0])), name


CASES = [(row, entry) for row in REFUSED_OPTIONS for entry in ENTRIES]


@pytest.mark.parametrize("row, entry", CASES, ids=[f"{row[0]}-{entry}" for row, entry in CASES])
def test_every_entry_refuses_each_option_with_the_one_message(models, row, entry):
    name, _, what = row
    if entry == "hook" and name in NOT_SEEN_BY_THE_HOOK:
        pytest.skip(f"transformers drops `{name}` before its callable hook")
    target, drafter = models
    value = REFUSED_VALUES[name](target)
    hooks = no_model_call(target, drafter)
    try:
        with Entry(entry, target, drafter) as way_in, pytest.raises(ValueError) as error:
            way_in.generate(**{name: value}, **BESIDE.get(name, {}))
    finally:
        for hook in hooks:
            hook.remove()
    assert str(error.value) == str(refusal(name, value, what))


@pytest.mark.parametrize("entry", ENTRIES)
def test_every_entry_says_the_same_when_the_drafter_is_missing_or_given_twice(models, entry):
    target, drafter = models
    with pytest.raises(ValueError) as error:
        if entry == "bind":  # binding no drafter and no context drafts: refused by bind itself
            hf_tev.bind(target, None, {"lookup": False})
        else:
            with Entry(entry, target, drafter) as way_in:
                way_in.generate(assistant_model=None, drafter=None, tev_config={"lookup": False})
    assert str(error.value) == NEEDS_A_DRAFTER
    with Entry(entry, target, drafter) as way_in, pytest.raises(ValueError) as error:
        way_in.generate(drafter=drafter, assistant_model=drafter)
    assert str(error.value) == DRAFTER_TWICE


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_call_coerces_its_tev_config_once_and_decides_it_once(models, entry, monkeypatch):
    target, drafter = models
    config_class = importlib.import_module("hf_tev.config").TEVConfig  # (tests elsewhere reload the module)
    coerce, for_call, counts = config_class.coerce.__func__, config_class.for_call, []

    def counted_coerce(cls, value):
        counts.append("coerce")
        return coerce(cls, value)

    def counted_for_call(self, *args):
        counts.append("for_call")
        return for_call(self, *args)

    with Entry(entry, target, drafter) as way_in:
        monkeypatch.setattr(config_class, "coerce", classmethod(counted_coerce))
        monkeypatch.setattr(config_class, "for_call", counted_for_call)
        kwargs = {"tev_config": {"budget": 3}} if entry == "hook" else {}
        out = way_in.generate(return_dict_in_generate=True, **kwargs)
    assert out.tev_stats.num_cycles > 0  # the tree decoder ran
    assert sorted(counts) == ["coerce", "for_call"]
