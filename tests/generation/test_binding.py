"""The way in without global changes: `HF_TEV_NO_PATCH=1` makes `import hf_tev` change nothing in transformers, and
`hf_tev.bind(model, drafter)` gives one model tree decoding, taking and refusing options as the route does."""

import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import Collect, make_drafter, make_target

import hf_tev
from hf_tev import TEVConfig

REPO = Path(__file__).resolve().parents[2]
PROMPT = torch.tensor([[1, 5, 9, 13, 7]])

# Run with HF_TEV_NO_PATCH=1: nothing of transformers changed, then one bound kit target against plain generate.
NO_PATCH_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    torch.set_num_threads(1)
    import hf_tev
    from transformers import GenerationConfig, GenerationMixin, pipeline
    from transformers.generation import configuration_utils
    from transformers.models.auto import auto_factory
    from hf_tev.packaged import load_kit_model, load_kit_tokenizer

    # 1. nothing global: no route, no auto-class wrapper, no generation-config field, no import hook
    chain, function = [], GenerationMixin.generate
    while function is not None:
        chain.append(function)
        function = getattr(function, "__wrapped__", None)
    assert not any("_hf_tev_active" in vars(f) for f in chain) and "_hf_tev_route" not in vars(GenerationMixin)
    assert not hf_tev.is_enabled()
    assert not getattr(auto_factory._get_model_class, "_hf_tev_drafters", False)
    assert "tev_config" not in vars(configuration_utils.GenerationConfig)
    assert not any(type(f).__module__.startswith("hf_tev") for f in sys.meta_path)

    # 2. one bound model: the route's options and refusals
    target, other, tokenizer = load_kit_model("target"), load_kit_model("target"), load_kit_tokenizer()
    drafter = load_kit_model("drafter-dflash-l135")
    calls = []
    drafter.register_forward_hook(lambda *args: calls.append(1))
    prompt = tokenizer("def fibonacci(n):\\n", return_tensors="pt").input_ids
    greedy = dict(do_sample=False, max_new_tokens=24)
    plain = target.generate(prompt, **greedy)
    assert hf_tev.bind(target, drafter, hf_tev.TEVConfig(budget=8)) is target and hf_tev.is_bound(target)
    assert "generate" not in vars(other) and not hf_tev.is_bound(other)  # another model of the class: untouched
    out = target.generate(prompt, **greedy, return_dict_in_generate=True)
    assert out.sequences.tolist() == plain.tolist() and out.tev_stats.num_cycles > 0 and calls
    assert max(out.tev_stats.tree_sizes) <= 8  # the bound config
    out = target.generate(prompt, **greedy, tev_config={"budget": 0}, return_dict_in_generate=True)
    assert set(out.tev_stats.tree_sizes) == {0}  # a call's own tev_config wins

    class Collect:
        def __init__(self):
            self.tokens, self.ended = [], False
        def put(self, value):
            self.tokens += value.reshape(-1).tolist()
        def end(self):
            self.ended = True

    streamer = Collect()
    assert target.generate(prompt, **greedy, streamer=streamer).tolist() == plain.tolist()
    assert streamer.tokens == plain[0].tolist() and streamer.ended

    stop = tokenizer.decode(plain[0, prompt.shape[1]:]).strip().split()[1]
    stopped = other.generate(prompt, **greedy, stop_strings=[stop], tokenizer=tokenizer)
    assert stopped.shape[1] < plain.shape[1]
    assert target.generate(prompt, **greedy, stop_strings=[stop], tokenizer=tokenizer).tolist() == stopped.tolist()

    unhealed = tokenizer("from typing import Li", return_tensors="pt").input_ids
    healed = other.generate(unhealed, **greedy, token_healing=True, tokenizer=tokenizer)
    assert not healed[0, : unhealed.shape[1]].equal(unhealed[0])  # the prompt was healed
    assert target.generate(unhealed, **greedy, token_healing=True, tokenizer=tokenizer).tolist() == healed.tolist()

    config = GenerationConfig(do_sample=False, max_new_tokens=24)
    assert target.generate(prompt, config).tolist() == plain.tolist()  # positional, as generate reads it

    for option, value in [("num_beams", 2), ("speculation_type", "dflash"), ("inputs_embeds", torch.ones(1, 2, 8))]:
        calls.clear()
        try:
            target.generate(prompt, **greedy, **{option: value})
        except ValueError as error:
            assert option in str(error), (option, error)
        else:
            raise AssertionError(f"{option} was not refused")
        assert not calls, option  # refused before any model call

    calls.clear()
    pipe = pipeline("text-generation", model=target, tokenizer=tokenizer)
    text = pipe("def fibonacci(n):\\n", **greedy)[0]["generated_text"]
    assert text == tokenizer.decode(plain[0], skip_special_tokens=True) and calls  # the pipeline decoded with trees

    calls.clear()
    assert hf_tev.unbind(target) is target and not hf_tev.is_bound(target)
    assert target.generate(prompt, **greedy).tolist() == plain.tolist() and not calls
    print("no-patch checks passed")
    """
)


def test_no_patch_changes_nothing_in_transformers_and_a_bound_model_takes_the_routes_options():
    env = {**os.environ, "HF_TEV_NO_PATCH": "1"}
    result = subprocess.run(
        [sys.executable, "-c", NO_PATCH_SCRIPT], capture_output=True, text=True, cwd=REPO, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "no-patch checks passed" in result.stdout


def test_the_no_patch_variable_is_read_as_transformers_reads_flags(monkeypatch):
    for value, wanted in [("", True), ("0", True), ("false", True), ("1", False), ("TRUE", False), (" yes ", False)]:
        monkeypatch.setenv(hf_tev.NO_PATCH_VARIABLE, value)
        assert hf_tev.patches_wanted() is wanted, value
    monkeypatch.delenv(hf_tev.NO_PATCH_VARIABLE)
    assert hf_tev.patches_wanted()


def test_bind_beside_the_route_defaults_overrides_copies_and_saving(tmp_path):
    target = make_target("qwen3")
    drafter = make_drafter(target)
    plain = target.generate(PROMPT, do_sample=False, max_new_tokens=10)
    keys = set(target.state_dict())
    hf_tev.bind(target, drafter)  # TEVConfig() by default, under the route `import hf_tev` installed
    streamer = Collect()
    out = target.generate(PROMPT, do_sample=False, max_new_tokens=10, streamer=streamer, return_dict_in_generate=True)
    assert out.sequences.tolist() == plain.tolist() and out.tev_stats.num_cycles > 0
    assert streamer.tokens == plain[0].tolist()
    # the drafter is the binding's, not the target's: not in its weights, not saved with it
    assert set(target.state_dict()) == keys and drafter not in list(target.modules())
    target.save_pretrained(tmp_path / "target")
    assert "generate" not in (tmp_path / "target" / "config.json").read_text()
    # a deep copy is bound to itself (its own weights, its own copy of the drafter)
    twin = copy.deepcopy(target)
    assert hf_tev.is_bound(twin) and twin.generate.__self__ is twin
    assert twin.generate(PROMPT, do_sample=False, max_new_tokens=10).tolist() == plain.tolist()
    with pytest.raises(ValueError, match="custom_generate"):
        target.generate(PROMPT, max_new_tokens=4, custom_generate=lambda *a, **k: None)
    hf_tev.unbind(target)
    assert not hf_tev.is_bound(target) and "generate" not in vars(target)
    out = target.generate(PROMPT, do_sample=False, max_new_tokens=10, return_dict_in_generate=True)
    assert not hasattr(out, "tev_stats")  # plain generate again


def test_bind_needs_a_drafter_or_context_drafts_and_a_generate():
    target = make_target("qwen3")
    with pytest.raises(ValueError, match="DFlash drafter"):
        hf_tev.bind(target)
    with pytest.raises(TypeError, match="generate"):
        hf_tev.bind(torch.nn.Linear(2, 2), make_drafter(target))
    hf_tev.bind(target, tev_config=TEVConfig(lookup=True, budget=4))  # tree lookup decoding, no drafter
    out = target.generate(PROMPT, do_sample=False, max_new_tokens=10, return_dict_in_generate=True)
    assert out.sequences.tolist() == hf_tev.unbind(target).generate(PROMPT, do_sample=False, max_new_tokens=10).tolist()
    assert out.tev_stats.num_cycles > 0
