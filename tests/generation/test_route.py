"""The `generate` route: lazy imports, reload idempotence, a foreign wrapper, the custom_generate entries."""

import copy
import functools
import importlib
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers import Collect, make_drafter, make_target, transformers_log, with_oracle
from transformers import GenerationMixin, StoppingCriteria

import hf_tev
from hf_tev import TEVConfig
from hf_tev.packaged import kit_path

REPO = Path(__file__).resolve().parents[2]
PROMPT = torch.tensor([[1, 5, 9, 13, 7]])


def run_python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def routes(mixin=GenerationMixin) -> list:
    """Our wrappers in the chain of `generate` (by the marker attribute our wrapper carries)."""
    found, function = [], mixin.generate
    while function is not None:
        if "_hf_tev_active" in getattr(function, "__dict__", {}) and function is mixin.__dict__.get("_hf_tev_route"):
            found.append(function)
        function = getattr(function, "__wrapped__", None)
    return found


def test_core_modules_import_without_transformers_and_the_route_arrives_with_it():
    out = run_python(
        "import sys\n"
        "import hf_tev, hf_tev.tree, hf_tev.verify, hf_tev.exit_loss, hf_tev.config\n"
        "loaded = sorted(m for m in sys.modules if m == 'transformers' or m.startswith('transformers.'))\n"
        "print('loaded', loaded)\n"
        "from transformers import GenerationMixin\n"
        "print('routed', GenerationMixin.generate is GenerationMixin.__dict__['_hf_tev_route'], hf_tev.is_enabled())\n"
    )
    assert "loaded []" in out and "routed True True" in out


def test_transformers_first_then_hf_tev_routes_at_import():
    out = run_python(
        "from transformers import GenerationMixin\n"
        "original = GenerationMixin.generate\n"
        "import hf_tev\n"
        "print(GenerationMixin.generate is not original, GenerationMixin.generate.__wrapped__ is original)\n"
    )
    assert out.strip() == "True True"


def test_reload_does_not_wrap_twice_and_disable_restores_the_original():
    target = make_target("qwen3")
    drafter = make_drafter(target)
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=8)
    route = GenerationMixin.__dict__["_hf_tev_route"]
    original = route.__wrapped__
    old_config = TEVConfig(budget=4)  # made by the class before the reloads
    try:
        for module in ("hf_tev.route", "hf_tev.config", "hf_tev.generation"):
            importlib.reload(importlib.import_module(module))
            importlib.reload(importlib.import_module("hf_tev"))  # runs enable() again
        assert len(routes()) == 1 and GenerationMixin.generate is route
        out = target.generate(PROMPT, do_sample=False, max_new_tokens=8, assistant_model=drafter, tev_config=old_config)
        assert out.tolist() == expected.tolist()
        hf_tev.disable()
        assert GenerationMixin.generate is original and not hf_tev.is_enabled()
    finally:
        hf_tev.enable()
    assert hf_tev.is_enabled() and len(routes()) == 1


def test_disable_with_a_foreign_wrapper_keeps_theirs_and_passes_through():
    target = make_target("qwen3")
    drafter = make_drafter(target)
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=8)
    ours = GenerationMixin.generate
    calls = []

    @functools.wraps(ours)  # also copies our wrapper's attributes: identity, not attributes, must decide
    def foreign(self, *args, **kwargs):
        calls.append(kwargs.get("max_new_tokens"))
        return ours(self, *args, **kwargs)

    GenerationMixin.generate = foreign
    try:
        hf_tev.disable()
        assert GenerationMixin.generate is foreign and not hf_tev.is_enabled()
        assert target.generate(PROMPT, do_sample=False, max_new_tokens=8).tolist() == expected.tolist()
        with pytest.raises(ValueError, match="tev_config"):  # our wrapper passes through: transformers refuses it
            target.generate(PROMPT, do_sample=False, max_new_tokens=8, assistant_model=drafter, tev_config=TEVConfig())
        hf_tev.enable()  # re-activates the wrapper under theirs, no second wrapper
        assert GenerationMixin.generate is foreign and hf_tev.is_enabled() and len(routes()) == 1
        out = target.generate(
            PROMPT, do_sample=False, max_new_tokens=8, assistant_model=drafter, tev_config=TEVConfig(budget=4)
        )
        assert out.tolist() == expected.tolist() and calls[-1] == 8
    finally:
        GenerationMixin.generate = ours
        hf_tev.enable()
    assert hf_tev.is_enabled()


def test_custom_generate_callable_entry_with_streamer_and_stop_strings():
    from hf_tev.generation import tree_speculative_decode
    from hf_tev.packaged import load_kit_model, load_kit_tokenizer

    target, tokenizer = load_kit_model("target"), load_kit_tokenizer()
    drafter = load_kit_model("drafter-dflash-l135")
    prompt = tokenizer("def fibonacci(n):\n", return_tensors="pt").input_ids
    expected = target.generate(prompt, do_sample=False, max_new_tokens=24)
    streamer = Collect()
    out = target.generate(
        prompt,
        do_sample=False,
        max_new_tokens=24,
        custom_generate=tree_speculative_decode,
        drafter=drafter,
        tev_config=TEVConfig(budget=8),
        streamer=streamer,
    )
    assert out.tolist() == expected.tolist()
    assert streamer.tokens == expected[0].tolist() and streamer.ended  # the prompt, then every new token
    # stop strings need the tokenizer, which the callable route passes on
    text = tokenizer.decode(expected[0, prompt.shape[1] :])
    stop = text.strip().split()[1]
    kwargs = dict(do_sample=False, max_new_tokens=24, stop_strings=[stop], tokenizer=tokenizer)
    plain = target.generate(prompt, **kwargs)
    assert plain.shape[1] < expected.shape[1]
    for call in (
        dict(custom_generate=tree_speculative_decode, drafter=drafter),
        dict(assistant_model=drafter, tev_config=TEVConfig(budget=8)),
    ):
        assert target.generate(prompt, **kwargs, **call).tolist() == plain.tolist()


@pytest.fixture
def route_disabled():
    """transformers' own callable route: `custom_generate=tree_speculative_decode` without hf_tev's route."""
    hf_tev.disable()
    try:
        yield
    finally:
        hf_tev.enable()


def test_the_patch_free_callable_route_honours_the_drafter_the_streamer_and_the_configs_tev_config(route_disabled):
    """transformers drops `assistant_model` and `streamer` for a callable `custom_generate`: the decoder takes them
    from the generate call (decoding with the drafter, streaming every token), and the generation config's
    `tev_config`, as the route does."""
    from transformers import GenerationConfig

    from hf_tev.generation import tree_speculative_decode

    target = make_target("qwen3")
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=12)
    drafter = with_oracle(make_drafter(target), expected)  # accepted often: the drafter's use shows in tau
    assert not hf_tev.is_enabled()
    streamer = Collect()
    out = target.generate(
        PROMPT, do_sample=False, max_new_tokens=12, custom_generate=tree_speculative_decode, assistant_model=drafter,
        tev_config=TEVConfig(budget=6, lookup=False), streamer=streamer, return_dict_in_generate=True,
    )  # fmt: skip
    assert out.sequences.tolist() == expected.tolist() and out.tev_stats.tau > 1.5
    assert streamer.tokens == expected[0].tolist() and streamer.ended  # the prompt (generate's), then every token
    config = GenerationConfig(do_sample=False, max_new_tokens=12, tev_config={"budget": 2, "lookup": False})
    out = target.generate(
        PROMPT, generation_config=config, custom_generate=tree_speculative_decode, assistant_model=drafter,
        return_dict_in_generate=True,
    )  # fmt: skip
    assert out.sequences.tolist() == expected.tolist() and max(out.tev_stats.tree_sizes) <= 2 + 1


PATCH_FREE_REFUSALS = {
    "stop_strings": (dict(stop_strings=["x"]), r"`stop_strings` cannot be matched on transformers' callable .*"
                     r"drops `tokenizer=`.*stopping_criteria=\[StopStringCriteria"),
    "token_healing": (dict(token_healing=True), r"`token_healing` needs the tokenizer, which transformers' callable"),
    "synced_gpus": (dict(synced_gpus=True), r"`synced_gpus=True` asks for multi-GPU lockstep decoding"),
    "negative_prompt_ids": (dict(negative_prompt_ids=PROMPT), r"`negative_prompt_ids=<Tensor>` asks for classifier"),
    "drafter twice": (dict(drafter="the drafter"), r"Pass the DFlash drafter once: `assistant_model=` or `drafter=`"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(PATCH_FREE_REFUSALS))
def test_the_patch_free_callable_route_refuses_what_it_cannot_honour_by_name(case, route_disabled, monkeypatch):
    """What the callable route loses for good (the tokenizer, so stop strings and token healing) or what the route
    refuses too is refused by name, before any model call, where it was dropped or failed without a word."""
    from transformers import AutoTokenizer

    from hf_tev.generation import tree_speculative_decode

    target = make_target("qwen3")
    drafter = make_drafter(target)
    extra, message = PATCH_FREE_REFUSALS[case]
    extra = {key: drafter if value == "the drafter" else value for key, value in extra.items()}
    tokenizer = AutoTokenizer.from_pretrained(kit_path("target"))  # given, and dropped by transformers all the same
    monkeypatch.setattr(type(target), "forward", lambda *a, **k: pytest.fail("the model was called"))
    with pytest.raises(ValueError, match=message):
        target.generate(
            PROMPT, max_new_tokens=4, custom_generate=tree_speculative_decode, assistant_model=drafter,
            tokenizer=tokenizer, **extra,
        )  # fmt: skip


def test_custom_generate_folder_from_a_local_path(monkeypatch):
    target = make_target("llama")
    drafter = make_drafter(target)
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=12)
    streamer = Collect()
    out = target.generate(
        PROMPT,
        do_sample=False,
        max_new_tokens=12,
        custom_generate=str(REPO),
        trust_remote_code=True,
        assistant_model=drafter,
        tev_config={"budget": 6},
        streamer=streamer,
        return_dict_in_generate=True,
    )
    assert out.sequences.tolist() == expected.tolist() and out.tev_stats.num_cycles > 0
    assert streamer.tokens == expected[0].tolist()


def test_a_dflash_drafter_alone_goes_to_tree_decoding_and_dflash_speculation_to_transformers():
    target = make_target("qwen3")
    drafter = make_drafter(target)
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=10)
    out = target.generate(
        PROMPT, do_sample=False, max_new_tokens=10, assistant_model=drafter, return_dict_in_generate=True
    )
    assert out.sequences.tolist() == expected.tolist() and out.tev_stats.num_cycles > 0  # TEVConfig() defaults
    native = target.generate(
        PROMPT,
        do_sample=False,
        max_new_tokens=10,
        assistant_model=drafter,
        speculation_type="dflash",
        return_dict_in_generate=True,
    )
    assert native.sequences.tolist() == expected.tolist() and not hasattr(native, "tev_stats")
    with pytest.raises(ValueError, match="speculation_type"):
        target.generate(PROMPT, max_new_tokens=4, assistant_model=drafter, speculation_type="dflash", tev_config={})
    assistant = make_target("qwen3", num_layers=1)  # a classic assistant still goes to assisted generation
    assert target.generate(PROMPT, do_sample=False, max_new_tokens=10, assistant_model=assistant).tolist() == (
        expected.tolist()
    )


@pytest.mark.parametrize("form", ["object", "dict"])
def test_tev_config_in_a_generation_config_round_trip(tmp_path, form):
    from transformers import AutoModelForCausalLM, GenerationConfig

    target = make_target("qwen3")
    drafter = make_drafter(target)
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=12)
    tev = TEVConfig(budget=3, verifier="predraw") if form == "object" else {"budget": 3, "verifier": "predraw"}
    fresh = GenerationConfig(do_sample=False, max_new_tokens=12, tev_config=tev)
    fresh.save_pretrained(tmp_path / "fresh")
    loaded = GenerationConfig.from_pretrained(tmp_path / "fresh")
    current = importlib.import_module("hf_tev.config").TEVConfig  # (a test above reloads the module)
    assert loaded.tev_config == current(budget=3, verifier="predraw")  # a TEVConfig, from either form
    out = target.generate(PROMPT, generation_config=loaded, assistant_model=drafter, return_dict_in_generate=True)
    assert out.sequences.tolist() == expected.tolist() and max(out.tev_stats.tree_sizes) <= 3
    # the model's own generation config (derived from its config: transformers would drop an unknown field)
    assert target.generation_config._from_model_config
    TEVConfig(budget=2).attach_to(target.generation_config)
    target.save_pretrained(tmp_path / "model")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", attn_implementation="sdpa")
    assert reloaded.generation_config.tev_config == current(budget=2)  # read back as a TEVConfig
    out = reloaded.generate(
        PROMPT, do_sample=False, max_new_tokens=12, assistant_model=drafter, return_dict_in_generate=True
    )
    assert out.sequences.tolist() == expected.tolist() and max(out.tev_stats.tree_sizes) <= 2
    # a call's tev_config wins over the generation config's; without a drafter the field is inert
    out = reloaded.generate(
        PROMPT,
        do_sample=False,
        max_new_tokens=12,
        assistant_model=drafter,
        tev_config={"budget": 0},
        return_dict_in_generate=True,
    )
    assert set(out.tev_stats.tree_sizes) == {0}
    assert reloaded.generate(PROMPT, do_sample=False, max_new_tokens=12).tolist() == expected.tolist()


def test_stop_strings_from_the_model_generation_config_and_tokenizer_options_without_one():
    from hf_tev.packaged import load_kit_model, load_kit_tokenizer

    target, tokenizer = load_kit_model("target"), load_kit_tokenizer()
    drafter = load_kit_model("drafter-dflash-l135")
    prompt = tokenizer("def fibonacci(n):\n", return_tensors="pt").input_ids
    text = tokenizer.decode(target.generate(prompt, do_sample=False, max_new_tokens=24)[0, prompt.shape[1] :])
    stop = [text.strip().split()[1]]
    target.generation_config.stop_strings = stop  # generate refills unset fields from here
    plain = target.generate(prompt, do_sample=False, max_new_tokens=24, tokenizer=tokenizer)
    out = target.generate(
        prompt,
        do_sample=False,
        max_new_tokens=24,
        tokenizer=tokenizer,
        assistant_model=drafter,
        tev_config={"budget": 4},
    )
    assert out.tolist() == plain.tolist() and plain.shape[1] < prompt.shape[1] + 24
    assert target.generation_config.stop_strings == stop  # never changed
    with pytest.raises(ValueError, match="stop_strings"):
        target.generate(prompt, max_new_tokens=4, assistant_model=drafter)
    target.generation_config.stop_strings = None
    with pytest.raises(ValueError, match="token_healing"):
        target.generate(prompt, max_new_tokens=4, assistant_model=drafter, token_healing=True)


def kit_stop_case():
    """The kit target, drafter and tokenizer, a prompt, and a stop string inside its greedy continuation."""
    from hf_tev.packaged import load_kit_model, load_kit_tokenizer

    target, tokenizer = load_kit_model("target"), load_kit_tokenizer()
    prompt = tokenizer("def fibonacci(n):\n", return_tensors="pt").input_ids
    text = tokenizer.decode(target.generate(prompt, do_sample=False, max_new_tokens=24)[0, prompt.shape[1] :])
    return target, load_kit_model("drafter-dflash-l135"), tokenizer, prompt, [text.strip().split()[1]]


class HoldFirstCall(StoppingCriteria):
    """A stopping criterion that, on its first call, says so (`inside`) and waits until `release` is set."""

    def __init__(self):
        self.inside, self.release = threading.Event(), threading.Event()

    def __call__(self, input_ids, scores, **kwargs):
        if not self.inside.is_set():
            self.inside.set()
            assert self.release.wait(timeout=120)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@pytest.mark.parametrize("passed_config", [False, True])
def test_a_tree_decoding_call_leaves_the_models_stop_strings_to_other_threads(passed_config):
    from transformers import GenerationConfig

    target, drafter, tokenizer, prompt, stop = kit_stop_case()
    target.generation_config.stop_strings = stop
    common = dict(do_sample=False, max_new_tokens=24, tokenizer=tokenizer)
    if passed_config:  # generate fills the passed config's unset stop strings from the model's
        common = dict(generation_config=GenerationConfig(do_sample=False, max_new_tokens=24), tokenizer=tokenizer)
    plain = target.generate(prompt, **common)
    assert plain.shape[1] < prompt.shape[1] + 24  # the model's stop strings stop it
    hold, results = HoldFirstCall(), {}

    def first():  # tree decoding, held inside its decoding loop
        results["first"] = target.generate(
            prompt, **common, assistant_model=drafter, tev_config={"budget": 4}, stopping_criteria=[hold]
        )

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert hold.inside.wait(timeout=120)
        assert target.generation_config.stop_strings == stop
        during = [  # other calls while the first one decodes: plain, then tree decoding
            target.generate(prompt, **common),
            target.generate(prompt, **common, assistant_model=drafter, tev_config={"budget": 4}),
        ]
    finally:
        hold.release.set()
        thread.join(timeout=120)
    assert [out.tolist() for out in during] == [plain.tolist()] * 2
    assert results["first"].tolist() == plain.tolist()


@pytest.mark.parametrize("model_has_them", [True, False])
def test_stop_strings_and_token_healing_with_a_passed_generation_config_leave_both_configs_alone(model_has_them):
    from transformers import GenerationConfig

    target, drafter, tokenizer, prompt, stop = kit_stop_case()
    passed = GenerationConfig(do_sample=False, max_new_tokens=24, stop_strings=None if model_has_them else stop)
    if model_has_them:
        target.generation_config.stop_strings = stop
    before = (copy.deepcopy(passed.to_dict()), copy.deepcopy(target.generation_config.to_dict()))
    plain = target.generate(prompt, generation_config=passed, tokenizer=tokenizer)
    assert plain.shape[1] < prompt.shape[1] + 24
    with transformers_log() as messages:
        out = target.generate(
            prompt, generation_config=passed, tokenizer=tokenizer, assistant_model=drafter, tev_config={"budget": 4}
        )
    assert out.tolist() == plain.tolist()
    assert not [m for m in messages if "deprecated" in m]  # no keyword arguments added next to the config
    assert (passed.to_dict(), target.generation_config.to_dict()) == before
    assert type(passed) is GenerationConfig
    # token healing from a passed config: healed by the route, the config untouched
    healing = GenerationConfig(do_sample=False, max_new_tokens=8, token_healing=True)
    expected = target.generate(prompt, generation_config=healing, tokenizer=tokenizer)
    with transformers_log() as messages:
        out = target.generate(
            prompt, generation_config=healing, tokenizer=tokenizer, assistant_model=drafter, tev_config={"budget": 4}
        )
    assert out.tolist() == expected.tolist() and healing.token_healing is True
    assert not [m for m in messages if "deprecated" in m]


def test_generation_config_and_assistant_model_passed_by_position_are_seen_by_the_route():
    from transformers import GenerationConfig

    target = make_target("qwen3")
    drafter = make_drafter(target)
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=12)
    config = GenerationConfig(do_sample=False, max_new_tokens=12, tev_config={"budget": 2})
    # the config's tev_config reaches the decoder (a DFlash drafter alone routes the call)
    out = target.generate(PROMPT, config, assistant_model=drafter, return_dict_in_generate=True)
    assert out.sequences.tolist() == expected.tolist() and max(out.tev_stats.tree_sizes) == 2
    # generate(inputs, generation_config, logits_processor, stopping_criteria, prefix_allowed_tokens_fn,
    #          synced_gpus, assistant_model, ...)
    out = target.generate(PROMPT, config, None, None, None, None, drafter, return_dict_in_generate=True)
    assert out.sequences.tolist() == expected.tolist() and max(out.tev_stats.tree_sizes) == 2
    # options the route refuses are found in a positional config too
    with pytest.raises(ValueError, match="cache_implementation"):
        target.generate(PROMPT, GenerationConfig(max_new_tokens=4, cache_implementation="offloaded"), tev_config={})
    with pytest.raises(TypeError, match="multiple values for argument 'generation_config'"):
        target.generate(PROMPT, config, generation_config=config, assistant_model=drafter)


def test_a_transformers_module_executed_again_gets_the_route_and_the_auto_class_entry_again():
    out = run_python(
        "import importlib\n"
        "import hf_tev\n"
        "import transformers.generation.utils as utils\n"
        "import transformers.models.auto.auto_factory as factory\n"
        "utils, factory = importlib.reload(utils), importlib.reload(factory)\n"
        "mixin = utils.GenerationMixin\n"
        "print(mixin.generate is mixin.__dict__.get('_hf_tev_route'), factory._get_model_class._hf_tev_drafters)\n"
    )
    assert out.strip() == "True True"
