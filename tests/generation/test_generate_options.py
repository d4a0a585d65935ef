"""Every `generate` argument of transformers 5.24 under tree decoding, walked from `docs/generate_options.md`.

The table must list every argument (the signature of `generate`, the keyword arguments it reads itself, every
`GenerationConfig` field). Each **works** entry runs against plain `generate` (greedy: the same tokens, scores
and cache length, with a drafter that knows the answer so deep tree paths are accepted; sampling: the same
first draw, and every emitted token's scores equal generate's own processors on the target's logits at that
token's own prefix). Each **refused** entry must raise a `ValueError` naming the option before any model call;
a **partly** entry has both.
"""

import inspect
import re
from pathlib import Path

import pytest
import torch
from helpers import Collect, make_drafter, make_target, with_oracle
from transformers import (
    CompileConfig,
    ContinuousBatchingConfig,
    DynamicCache,
    GenerationConfig,
    GenerationMixin,
    LogitsProcessorList,
    NoRepeatNGramLogitsProcessor,
    StaticCache,
    StoppingCriteria,
    StoppingCriteriaList,
    SynthIDTextWatermarkingConfig,
    WatermarkingConfig,
)
from transformers.generation.configuration_utils import METADATA_FIELDS

from hf_tev import TEVConfig
from hf_tev.generation import tree_speculative_decode

DOC = Path(__file__).resolve().parents[2] / "docs" / "generate_options.md"
PROMPT = torch.tensor([[1, 5, 9, 13, 7]])
N = PROMPT.shape[1]
# What generate reads from its **kwargs itself (besides GenerationConfig fields), hf_tev's own arguments, and the
# table's row for every other model keyword argument.
GENERATE_KWARGS = {"input_ids", "tokenizer", "assistant_tokenizer", "trust_remote_code", "attention_mask"}
GENERATE_KWARGS |= {"position_ids", "cache", "past_key_values", "inputs_embeds", "model_kwargs"}
HF_TEV_KWARGS = {"tev_config", "drafter"}


def documented() -> dict[str, str]:
    return dict(re.findall(r"^\| `(\w+)` \| (works|refused|partly) \|", DOC.read_text(), flags=re.M))


def generate_arguments() -> set[str]:
    params = set(inspect.signature(GenerationMixin.generate).parameters) - {"self", "kwargs"}
    fields = set(vars(GenerationConfig())) - set(METADATA_FIELDS)
    return params | fields | GENERATE_KWARGS | HF_TEV_KWARGS


class Context:
    """The tiny target, and tokens of its plain greedy continuation that options can act on."""

    def __init__(self):
        self.target = make_target("qwen3", hidden_size=32, num_layers=2)
        self.gen = self.target.generate(PROMPT, do_sample=False, max_new_tokens=12)[0, N:].tolist()
        self.eos = self.gen[3]  # a token plain greedy emits early, as an EOS

    def drafter(self, reference=None):
        drafter = make_drafter(self.target)
        return drafter if reference is None else with_oracle(drafter, reference)


@pytest.fixture(scope="module")
def ctx():
    return Context()


class StopAtLength(StoppingCriteria):
    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def allowed_after(batch_id, ids):
    assert batch_id == 0, batch_id  # the row of the user's batch of one, never a tree node index
    return [t for t in range(96) if t % 3 != int(ids[-1]) % 3]


# option -> its cases: (kind, kwargs maker) for works (kinds in `test_works_as_plain_generate`), and
# ("refused", kwargs maker, the name the message must carry, None for the option's own name)
CASES = {
    "inputs": [("greedy", lambda c: {}), ("refused", lambda c: {"inputs": PROMPT[0]}, None)],
    "input_ids": [
        ("greedy", lambda c: {"input_ids": PROMPT, "inputs": None}),
        ("refused", lambda c: {"input_ids": PROMPT.float(), "inputs": None}, None),
    ],
    "generation_config": [
        ("greedy", lambda c: {"generation_config": GenerationConfig(do_sample=False, repetition_penalty=1.3)})
    ],
    "logits_processor": [
        ("greedy", lambda c: {"logits_processor": LogitsProcessorList([NoRepeatNGramLogitsProcessor(2)])})
    ],
    "stopping_criteria": [("greedy", lambda c: {"stopping_criteria": StoppingCriteriaList([StopAtLength(N + 7)])})],
    "prefix_allowed_tokens_fn": [("greedy", lambda c: {"prefix_allowed_tokens_fn": allowed_after})],
    "synced_gpus": [("refused", lambda c: {"synced_gpus": True}, "synced_gpus")],
    "assistant_model": [("no_tev_config", lambda c: {})],
    "streamer": [("streamer", lambda c: {})],
    "negative_prompt_ids": [("refused", lambda c: {"negative_prompt_ids": torch.tensor([[1, 2]])}, None)],
    "negative_prompt_attention_mask": [
        ("refused", lambda c: {"negative_prompt_attention_mask": torch.ones(1, 2, dtype=torch.long)}, None)
    ],
    "custom_generate": [("custom_generate", lambda c: {})],
    "drafter": [("custom_generate", lambda c: {})],
    "tokenizer": [("kit", lambda c: {})],
    "stop_strings": [("kit", lambda c: {"stop_strings": True})],
    "token_healing": [("kit", lambda c: {"token_healing": True})],
    "assistant_tokenizer": [("refused", lambda c: {"assistant_tokenizer": object()}, None)],
    "trust_remote_code": [("greedy", lambda c: {"trust_remote_code": True})],
    "attention_mask": [
        (
            "greedy",
            lambda c: {
                "inputs": torch.cat([torch.zeros(1, 2, dtype=torch.long), PROMPT], 1),
                "attention_mask": torch.tensor([[0, 0] + [1] * N]),
            },
        ),
        ("refused", lambda c: {"attention_mask": torch.zeros(1, N, dtype=torch.long)}, None),
        ("refused", lambda c: {"attention_mask": torch.tensor([[1] * (N - 1) + [0]])}, None),
        ("refused", lambda c: {"attention_mask": torch.ones(1, N + 3, dtype=torch.long)}, None),  # generate drops it
    ],
    "position_ids": [
        ("greedy", lambda c: {"position_ids": torch.arange(N)[None]}),
        ("refused", lambda c: {"position_ids": torch.arange(N + 3)[None]}, None),
    ],
    "cache": [
        ("greedy", lambda c: {"cache": DynamicCache(config=c.target.config)}),
        ("greedy", lambda c: {"cache": StaticCache(config=c.target.config, max_cache_len=64)}),
        ("refused", lambda c: {"cache": DynamicCache(config=c.target.config, offloading=True)}, "offloaded"),
    ],
    "past_key_values": [
        ("greedy", lambda c: {"past_key_values": DynamicCache(config=c.target.config)}),
        ("greedy", lambda c: {"past_key_values": StaticCache(config=c.target.config, max_cache_len=64)}),
        ("refused", lambda c: {"past_key_values": DynamicCache(config=c.target.config, offloading=True)}, "offloaded"),
    ],
    "inputs_embeds": [("refused", lambda c: {"inputs_embeds": c.target.get_input_embeddings()(PROMPT)}, None)],
    "model_kwargs": [("refused", lambda c: {"labels": PROMPT}, "labels")],
    "tev_config": [("greedy", lambda c: {"tev_config": {"budget": 6, "verifier": "predraw"}})],
    "max_length": [("greedy", lambda c: {"max_length": N + 7, "max_new_tokens": None})],
    "max_new_tokens": [("greedy", lambda c: {"max_new_tokens": 7})],
    "min_length": [("greedy", lambda c: {"eos_token_id": c.eos, "min_length": N + 8})],
    "min_new_tokens": [("greedy", lambda c: {"eos_token_id": c.eos, "min_new_tokens": 7})],
    "early_stopping": [("greedy", lambda c: {"early_stopping": True})],
    "max_time": [("greedy", lambda c: {"max_time": 0.0})],
    "do_sample": [("sampling", lambda c: {"top_k": 0})],
    "num_beams": [("refused", lambda c: {"num_beams": 2}, None)],
    "num_return_sequences": [("refused", lambda c: {"num_return_sequences": 2, "do_sample": True}, None)],
    "num_beam_groups": [("greedy", lambda c: {"num_beam_groups": 2})],
    "penalty_alpha": [("refused", lambda c: {"penalty_alpha": 0.6, "top_k": 4}, None)],
    "dola_layers": [("refused", lambda c: {"dola_layers": "low"}, None)],
    "use_cache": [("greedy", lambda c: {"use_cache": False})],
    "cache_implementation": [
        ("greedy", lambda c: {"cache_implementation": "dynamic"}),
        ("greedy", lambda c: {"cache_implementation": "static"}),
        ("refused", lambda c: {"cache_implementation": "offloaded"}, None),
        ("refused", lambda c: {"cache_implementation": "paged"}, None),
    ],
    "cache_config": [("greedy", lambda c: {"cache_config": {"nbits": 4}})],
    "max_cache_len": [("greedy", lambda c: {"max_cache_len": 64})],
    "prefill_chunk_size": [("greedy", lambda c: {"prefill_chunk_size": 2})],
    "temperature": [("sampling", lambda c: {"temperature": 0.7, "top_k": 0})],
    "top_k": [("sampling", lambda c: {"top_k": 5})],
    "top_p": [("sampling", lambda c: {"top_p": 0.8, "top_k": 0})],
    "min_p": [("sampling", lambda c: {"min_p": 0.1, "top_k": 0})],
    "top_h": [("sampling", lambda c: {"top_h": 0.5, "top_k": 0})],
    "typical_p": [("sampling", lambda c: {"typical_p": 0.6, "top_k": 0})],
    "epsilon_cutoff": [("sampling", lambda c: {"epsilon_cutoff": 0.02, "top_k": 0})],
    "eta_cutoff": [("sampling", lambda c: {"eta_cutoff": 0.02, "top_k": 0})],
    "repetition_penalty": [("greedy", lambda c: {"repetition_penalty": 1.5})],
    "encoder_repetition_penalty": [("greedy", lambda c: {"encoder_repetition_penalty": 1.5})],
    "length_penalty": [("greedy", lambda c: {"length_penalty": 2.0})],
    "no_repeat_ngram_size": [("greedy", lambda c: {"no_repeat_ngram_size": 2})],
    "encoder_no_repeat_ngram_size": [("greedy", lambda c: {"encoder_no_repeat_ngram_size": 2})],
    "bad_words_ids": [("greedy", lambda c: {"bad_words_ids": [[c.gen[1]], [c.gen[4], c.gen[5]]]})],
    "renormalize_logits": [("greedy", lambda c: {"renormalize_logits": True})],
    "forced_bos_token_id": [("greedy", lambda c: {"forced_bos_token_id": 3})],
    "forced_eos_token_id": [("greedy", lambda c: {"forced_eos_token_id": 3})],
    "remove_invalid_values": [("greedy", lambda c: {"remove_invalid_values": True})],
    "exponential_decay_length_penalty": [
        ("greedy", lambda c: {"exponential_decay_length_penalty": (2, 3.0), "eos_token_id": c.eos})
    ],
    "suppress_tokens": [("greedy", lambda c: {"suppress_tokens": [c.gen[2]]})],
    "begin_suppress_tokens": [("greedy", lambda c: {"begin_suppress_tokens": [c.gen[0]]})],
    "sequence_bias": [("greedy", lambda c: {"sequence_bias": {(c.gen[2],): -20.0}})],
    "guidance_scale": [("refused", lambda c: {"guidance_scale": 1.5}, None)],
    "watermarking_config": [
        ("greedy", lambda c: {"watermarking_config": WatermarkingConfig(bias=4.0, context_width=1)}),
        (
            "refused",
            lambda c: {"watermarking_config": SynthIDTextWatermarkingConfig(keys=[1, 2, 3], ngram_len=2)},
            None,
        ),
    ],
    "output_attentions": [("refused", lambda c: {"output_attentions": True}, None)],
    "output_hidden_states": [("refused", lambda c: {"output_hidden_states": True}, None)],
    "output_scores": [("greedy", lambda c: {"output_scores": True})],
    "output_logits": [("greedy", lambda c: {"output_logits": True})],
    "return_dict_in_generate": [("greedy", lambda c: {"return_dict_in_generate": True})],
    "pad_token_id": [("greedy", lambda c: {"pad_token_id": 3})],
    "bos_token_id": [("greedy", lambda c: {"bos_token_id": 1})],
    "eos_token_id": [("greedy", lambda c: {"eos_token_id": [95, c.eos]})],
    "decoder_start_token_id": [("greedy", lambda c: {"decoder_start_token_id": 3})],
    "is_assistant": [("refused", lambda c: {"is_assistant": True}, None)],
    "num_assistant_tokens": [("greedy", lambda c: {"num_assistant_tokens": 3})],
    "num_assistant_tokens_schedule": [("greedy", lambda c: {"num_assistant_tokens_schedule": "heuristic"})],
    "assistant_confidence_threshold": [("greedy", lambda c: {"assistant_confidence_threshold": 0.2})],
    "prompt_lookup_num_tokens": [("refused", lambda c: {"prompt_lookup_num_tokens": 3}, None)],
    "max_matching_ngram_size": [("greedy", lambda c: {"max_matching_ngram_size": 3})],
    "assistant_early_exit": [("refused", lambda c: {"assistant_early_exit": 1}, None)],
    "assistant_lookbehind": [("greedy", lambda c: {"assistant_lookbehind": 3})],
    "target_lookbehind": [("greedy", lambda c: {"target_lookbehind": 3})],
    "assistant_ensemble_weight": [("refused", lambda c: {"assistant_ensemble_weight": 0.5}, None)],
    "speculation_type": [
        ("transformers_dflash", lambda c: {"speculation_type": "dflash"}),
        ("refused", lambda c: {"speculation_type": "dflash"}, None),
    ],
    "use_mtp": [("refused", lambda c: {"use_mtp": True}, None)],
    "constraints": [("refused", lambda c: {"constraints": []}, None)],
    "force_words_ids": [("refused", lambda c: {"force_words_ids": [[5]]}, None)],
    "diversity_penalty": [("greedy", lambda c: {"diversity_penalty": 0.5})],
    "low_memory": [("greedy", lambda c: {"low_memory": True})],
    "compile_config": [("greedy", lambda c: {"compile_config": CompileConfig()})],
    "disable_compile": [("greedy", lambda c: {"disable_compile": True})],
    "continuous_batching_config": [("greedy", lambda c: {"continuous_batching_config": ContinuousBatchingConfig()})],
}


def test_the_table_lists_every_generate_argument_and_the_tests_walk_it():
    table = documented()
    assert set(table) == generate_arguments(), (
        f"missing from the table: {sorted(generate_arguments() - set(table))}; "
        f"not generate arguments: {sorted(set(table) - generate_arguments())}"
    )
    assert set(CASES) == set(table)
    for name, status in table.items():
        kinds = {case[0] == "refused" for case in CASES[name]}
        expected = {"works": {False}, "refused": {True}, "partly": {False, True}}[status]
        assert kinds == expected, (name, status)


def assert_same_scores(ours, theirs):
    assert (ours is None) == (theirs is None)
    if theirs is None:
        return
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        finite = torch.isfinite(b)
        assert torch.equal(finite, torch.isfinite(a))
        torch.testing.assert_close(a[finite], b[finite], atol=1e-4, rtol=1e-4)


def greedy_call(ctx, make, **extra):
    """kwargs for plain generate and a function that runs the same call with a drafter that knows the answer."""
    kwargs = dict(do_sample=False, max_new_tokens=10, return_dict_in_generate=True, output_scores=True)
    kwargs.update(make(ctx))
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    inputs = kwargs.pop("inputs", PROMPT)
    args = () if "input_ids" in kwargs else (inputs,)
    return args, kwargs


def check_greedy(ctx, make, tree_call=None):
    args, kwargs = greedy_call(ctx, make)
    plain = ctx.target.generate(*args, **{k: v for k, v in kwargs.items() if k != "tev_config"})
    args, kwargs = greedy_call(ctx, make)  # fresh objects (caches, streamers) for the second call
    drafter = ctx.drafter(plain.sequences)
    tree_call = tree_call or {"assistant_model": drafter, "tev_config": kwargs.pop("tev_config", TEVConfig(budget=6))}
    if callable(tree_call):
        tree_call = tree_call(drafter)
    ours = ctx.target.generate(*args, **kwargs, **tree_call)
    assert ours.tev_stats is not None  # the tree decoder ran
    assert ours.sequences.tolist() == plain.sequences.tolist()
    assert_same_scores(ours.scores, plain.scores)
    assert_same_scores(ours.logits, plain.logits)
    assert (ours.cache is None) == (plain.cache is None)
    if plain.cache is not None:  # every returned token but the last, as plain generate's
        assert ours.cache.get_seq_length() == plain.cache.get_seq_length() == ours.sequences.shape[1] - 1
    return ours


def plain_processors(target, kwargs):
    """generate's own logits processors for these options (what plain sampling applies at every step)."""
    config, _ = target._prepare_generation_config(None, **kwargs)
    target._prepare_special_tokens(config, False, device=PROMPT.device)
    return target._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=N,
        encoder_input_ids=PROMPT,
        prefix_allowed_tokens_fn=None,
        logits_processor=LogitsProcessorList(),
        device=PROMPT.device,
        model_kwargs={},
    )


def check_sampling(ctx, make):
    kwargs = dict(do_sample=True, max_new_tokens=12, return_dict_in_generate=True, output_scores=True)
    kwargs.update(make(ctx), output_logits=True)
    drafter = ctx.drafter()
    torch.manual_seed(0)
    plain = ctx.target.generate(PROMPT, **kwargs)
    torch.manual_seed(0)
    ours = ctx.target.generate(PROMPT, **kwargs, assistant_model=drafter, tev_config=TEVConfig(budget=6))
    # the first token: the same processed prefill scores and the same draw as plain sampling
    assert ours.sequences[0, N] == plain.sequences[0, N]
    assert_same_scores(ours.scores[:1], plain.scores[:1])
    # every token: generate's processors on the target's raw logits at the token's own prefix
    processors = plain_processors(ctx.target, kwargs)
    expected = [processors(ours.sequences[:, : N + i], raw) for i, raw in enumerate(ours.logits)]
    assert_same_scores(ours.scores, tuple(expected))
    assert ours.tev_stats.num_cycles > 0


def check_kit(make):
    """Options that need the tokenizer, on the kit's real target and tokenizer."""
    from hf_tev.packaged import load_kit_model, load_kit_tokenizer

    target, tokenizer = load_kit_model("target"), load_kit_tokenizer()
    options = make(None)
    prompt = tokenizer("from typing import Li", return_tensors="pt").input_ids  # healing changes its last token
    kwargs = dict(do_sample=False, max_new_tokens=16, tokenizer=tokenizer)
    if options.get("stop_strings"):
        text = tokenizer.decode(target.generate(prompt, **kwargs)[0, prompt.shape[1] :])
        kwargs["stop_strings"] = [text.strip().split()[1]]
    if options.get("token_healing"):
        kwargs["token_healing"] = True
    plain = target.generate(prompt, **kwargs)
    drafter = with_oracle(load_kit_model("drafter-dflash-l135"), plain)
    ours = target.generate(prompt, **kwargs, assistant_model=drafter, tev_config=TEVConfig(budget=6))
    assert ours.tolist() == plain.tolist()
    if "stop_strings" in kwargs:
        assert plain.shape[1] < prompt.shape[1] + 16
    if "token_healing" in kwargs:
        assert not plain[0, : prompt.shape[1]].equal(prompt[0])  # the prompt was healed, by both


def no_model_call(*models):
    def refuse(module, args, kwargs):
        raise AssertionError(f"{type(module).__name__} was called before the option was refused")

    return [model.register_forward_pre_hook(refuse, with_kwargs=True) for model in models]


WORKS = [(name, i) for name, cases in CASES.items() for i, case in enumerate(cases) if case[0] != "refused"]
REFUSED = [(name, i) for name, cases in CASES.items() for i, case in enumerate(cases) if case[0] == "refused"]


@pytest.mark.parametrize("name, index", WORKS, ids=[f"{n}-{i}" for n, i in WORKS])
def test_works_as_plain_generate(ctx, name, index):
    kind, make = CASES[name][index][:2]
    if kind == "greedy":
        check_greedy(ctx, make)
    elif kind == "sampling":
        check_sampling(ctx, make)
    elif kind == "kit":
        check_kit(make)
    elif kind == "no_tev_config":  # a DFlash drafter alone is tree decoding with TEVConfig()
        out = check_greedy(ctx, make, tree_call=lambda drafter: {"assistant_model": drafter})
        assert out.tev_stats.num_cycles > 0
    elif kind == "custom_generate":
        check_greedy(
            ctx, make, tree_call=lambda drafter: {"custom_generate": tree_speculative_decode, "drafter": drafter}
        )
    elif kind == "streamer":
        streamers = []
        out = check_greedy(ctx, lambda c: {"streamer": streamers.append(Collect()) or streamers[-1]})
        assert streamers[-1].tokens == out.sequences[0].tolist() and streamers[-1].ended
    elif kind == "transformers_dflash":  # not hf_tev: transformers' own chain path, the same greedy output
        args, kwargs = greedy_call(ctx, make)
        plain = ctx.target.generate(*args, **{k: v for k, v in kwargs.items() if k != "speculation_type"})
        ours = ctx.target.generate(*args, **kwargs, assistant_model=ctx.drafter())
        assert not hasattr(ours, "tev_stats") and ours.sequences.tolist() == plain.sequences.tolist()
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize("name, index", REFUSED, ids=[f"{n}-{i}" for n, i in REFUSED])
def test_refused_with_the_option_named(ctx, name, index):
    _, make, named = CASES[name][index]
    kwargs = dict(do_sample=False, max_new_tokens=4, tev_config=TEVConfig(budget=4))
    kwargs.update(make(ctx))
    drafter = ctx.drafter()
    hooks = no_model_call(ctx.target, drafter)
    inputs = kwargs.pop("inputs", PROMPT)
    try:
        with pytest.raises(ValueError, match=re.escape(named or name)):
            ctx.target.generate(inputs, **kwargs, assistant_model=drafter)
    finally:
        for hook in hooks:
            hook.remove()
