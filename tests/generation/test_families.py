"""Every target family the released drafters pair with, as tiny random models: Qwen3, Qwen3-MoE, Llama 3.1 (llama3
rope scaling, block 10), Gemma 3 text and Gemma 4 (text, and the unified multimodal wrapper) with sliding-window
layers. Prompts are longer than the window (40 tokens, window 8) so the window matters in every tree pass."""

import pytest
import torch
from helpers import (
    assert_tree_sampling_law,
    flattened,
    make_drafter,
    published_config,
    published_weights,
    tiny_text_dims,
    with_oracle,
    write_checkpoint,
)
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.models.gemma4 import Gemma4ForCausalLM, Gemma4TextConfig
from transformers.models.gemma4_unified import Gemma4UnifiedConfig, Gemma4UnifiedForConditionalGeneration

from hf_tev import DFlashDraftModel, TEVConfig
from hf_tev.generation.cache import commit_accepted_path
from hf_tev.target_layers import full_length_cache, tree_attention_masks
from hf_tev.tree import build_tree, tree_attention_mask, tree_position_ids

WINDOW = 8
PROMPT_LENGTH = 40
FAMILIES = ("qwen3", "qwen3_moe", "llama31", "gemma3", "gemma4", "gemma4_unified")
SLIDING_FAMILIES = ("gemma3", "gemma4", "gemma4_unified", "qwen3_sliding", "mistral")
MORE_WINDOWS = ("qwen3_sliding", "mistral")  # other sliding-window layouts: tree pass and greedy only
BLOCK_SIZE = {"llama31": 10}  # the released Llama-3.1 drafters draft blocks of 10; the others 16 (8 here: cheaper)
VERIFIERS = ("tev", "predraw", "residual")


def make_family_target(family: str, vocab_size: int = 96, num_layers: int = 4, seed: int = 0, window: int = WINDOW):
    """A tiny random target of `family` (hidden 32, heads 4 / KV 2), sliding window 8 where the family has one."""
    torch.manual_seed(seed)
    common = tiny_text_dims(vocab_size, num_layers)
    # 3 sliding : 1 full (Gemma 4's pattern is 5:1 with the last layer full)
    pattern = ["sliding_attention"] * (num_layers - 1) + ["full_attention"]
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, tie_word_embeddings=False))
    elif family == "qwen3_sliding":  # Qwen3's own sliding layers (use_sliding_window, from max_window_layers on)
        config = Qwen3Config(
            **common, use_sliding_window=True, sliding_window=window, max_window_layers=1, tie_word_embeddings=False
        )
        model = Qwen3ForCausalLM(config)
    elif family == "mistral":  # every layer slides, no layer_types: the model takes one mask
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=window, tie_word_embeddings=False))
    elif family == "qwen3_moe":  # Qwen3-Coder-30B-A3B's family: routed experts in every layer
        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(
                **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, tie_word_embeddings=False
            )
        )
    elif family == "llama31":  # Llama-3.1's rope: llama3 frequency scaling
        rope = dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        )
        model = LlamaForCausalLM(LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=False))
    elif family == "gemma3":
        config = Gemma3TextConfig(**common, sliding_window=window, layer_types=pattern, final_logit_softcapping=30.0)
        model = Gemma3ForCausalLM(config)
    elif family == "gemma4":
        # per-layer head_dim (full-attention layers 16), per-layer input embeddings, KV sharing (the last two
        # layers reuse the first two's K/V), soft-capping
        config = Gemma4TextConfig(
            **common,
            sliding_window=window,
            layer_types=["sliding_attention", "full_attention"] * (num_layers // 2),
            final_logit_softcapping=30.0,
            global_head_dim=16,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=vocab_size,
            num_kv_shared_layers=num_layers // 2 if num_layers >= 4 else 0,
        )
        model = Gemma4ForCausalLM(config)
    elif family == "gemma4_unified":  # gemma-4-12B-it's class; text-only prompts
        text = dict(common, sliding_window=window, layer_types=pattern, final_logit_softcapping=30.0)
        model = Gemma4UnifiedForConditionalGeneration(
            Gemma4UnifiedConfig(text_config=text, vision_config=None, audio_config=None)
        )
    else:
        raise ValueError(family)
    with torch.no_grad():  # sharper logits: greedy paths and acceptance mean something
        model.get_output_embeddings().weight.mul_(8.0)

    model.generation_config.eos_token_id = None  # the laws and lengths below are of free tokens
    model.set_attn_implementation("sdpa")
    return model.eval()


def make_family_drafter(target, family: str, seed: int = 1):
    return make_drafter(target, block_size=BLOCK_SIZE.get(family, 8), seed=seed)


def long_prompt(vocab_size: int, seed: int = 5, length: int = PROMPT_LENGTH) -> torch.LongTensor:
    generator = torch.Generator().manual_seed(seed)
    # never the pad id 0 (generate would mask it); past all special ids except in the laws' tiny vocabularies
    low = 3 if vocab_size > 8 else 1
    return torch.randint(low, vocab_size, (1, length), generator=generator)


# ---------------------------------------------------------------------------------------------------------
# The tree pass itself: every node's logits are the target's on its own path, and the kept path is a cache
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES + MORE_WINDOWS)
def test_tree_pass_equals_path_forwards_past_the_window(family):
    target = make_family_target(family)
    prompt = long_prompt(96)
    past = prompt.shape[1]
    torch.manual_seed(3)
    # 10 depths: paths longer than the window, so a deep node's window drops its own oldest ancestors too
    draft = torch.randn(10, 96) * 3
    draft[torch.arange(10), torch.randint(3, 96, (10,))] += 12  # one likely token per depth: a deep main path
    tree = build_tree(torch.log_softmax(draft, -1), 24, torch.tensor(7))
    assert tree.max_depth >= WINDOW
    mask = tree_attention_mask(tree, past, torch.float32)
    with torch.no_grad():
        cache = full_length_cache(target)
        target(prompt, cache=cache)
        out = target(
            tree.tokens[None],
            position_ids=tree_position_ids(tree, past),
            cache=cache,
            attention_mask=tree_attention_masks(target, tree.depths, mask),
            logits_to_keep=0,
        )
        paths = [tree.visibility[i].nonzero()[:, 0] for i in range(tree.num_nodes)]
        plain = [target(torch.cat([prompt, tree.tokens[path][None]], 1)).logits[0, -1] for path in paths]
        for node in range(tree.num_nodes):
            torch.testing.assert_close(out.logits[0, node], plain[node], atol=1e-4, rtol=1e-4)
        if family in SLIDING_FAMILIES:  # the window is what makes it exact: the plain tree mask is wrong here
            cache.crop(-tree.num_nodes)
            unwindowed = target(
                tree.tokens[None], position_ids=tree_position_ids(tree, past), cache=cache, attention_mask=mask
            ).logits[0]
            assert max((unwindowed[n] - plain[n]).abs().max() for n in range(tree.num_nodes)) > 1e-2
            cache.crop(-tree.num_nodes)
            target(tree.tokens[None], position_ids=tree_position_ids(tree, past), cache=cache,
                   attention_mask=tree_attention_masks(target, tree.depths, mask))  # fmt: skip
        # keep the deepest path (not a prefix of the node order) and continue with one token
        node = max(range(tree.num_nodes), key=lambda i: (len(paths[i]), i))
        path = paths[node]
        assert path.tolist() != list(range(len(path)))
        commit_accepted_path(cache, past, path, path_is_prefix=False)
        committed = torch.cat([prompt, tree.tokens[path][None]], 1)
        nxt = torch.tensor([[11]])
        step = target(nxt, cache=cache, position_ids=torch.tensor([[committed.shape[1]]])).logits[0, -1]
        fresh = target(torch.cat([committed, nxt], 1)).logits[0, -1]
        torch.testing.assert_close(step, fresh, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------
# generate: greedy equality and the sampling law, every verifier
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES + MORE_WINDOWS)
def test_greedy_equals_plain_generate(family):
    target = make_family_target(family)
    prompt = long_prompt(96)
    expected = target.generate(prompt, do_sample=False, max_new_tokens=24)
    taus = []
    for budget in (6, 32):
        for verifier in VERIFIERS:
            drafter = with_oracle(make_family_drafter(target, family), expected)
            out = target.generate(
                prompt,
                do_sample=False,
                max_new_tokens=24,
                assistant_model=drafter,
                tev_config=TEVConfig(budget=budget, verifier=verifier),
                return_dict_in_generate=True,
            )
            assert out.sequences.tolist() == expected.tolist(), (budget, verifier)
            taus.append(out.tev_stats.tau)
            # the returned cache continues the sequence like plain decoding (sliding layers at full length)
            assert out.cache.get_seq_length() == out.sequences.shape[1] - 1
    assert max(taus) > 3, "the acceptance path was never exercised"


# (family, verifiers): Qwen3's tev / predraw laws are tested in test_generation.py; residual is tested here
SAMPLING_CASES = [("qwen3", ("residual",))] + [(family, VERIFIERS) for family in FAMILIES[1:]]


@pytest.mark.parametrize("family,verifiers", SAMPLING_CASES, ids=[case[0] for case in SAMPLING_CASES])
def test_sampling_law_matches_target(family, verifiers):
    """The law of the last two of 4 sampled tokens (the first tree after the prefill can emit both) against the
    target's exact law, per verifier, after a 40-token prompt; the pooled counts must reject a wrong law."""
    vocab = 4
    # (a tree pass without the window changes this law too little to be seen in 120 draws: the window's own power
    # is in test_tree_pass_equals_path_forwards_past_the_window and the greedy tests)
    target = make_family_target(family, vocab_size=vocab, num_layers=2, seed=4)
    if family == "qwen3_moe":  # its tiny random law is nearly flat: sharpen it so temperature changes it
        with torch.no_grad():
            target.get_output_embeddings().weight.mul_(2.0)
    prompt = long_prompt(vocab, length=PROMPT_LENGTH)
    assert_tree_sampling_law(target, prompt, flattened(make_family_drafter(target, family)), verifiers)


# ---------------------------------------------------------------------------------------------------------
# The released drafters' layouts: each family's export loads strictly and decodes (tree and native chain path)
# ---------------------------------------------------------------------------------------------------------
# Field values of each release that differ from the Qwen3-8B export (docs/design.md#the-dflash-drafter),
# dimensions tiny. Every release is a Qwen3-style `DFlashDraftModel` (`model_type: "qwen3"`), whatever the
# target family.
RELEASED_LAYOUTS = {
    # z-lab/Qwen3-{4B,8B}-DFlash-b16, husj576/TEV-qwen3-{4B,8B}: block_size at the top level
    "qwen3": {},
    # z-lab/Qwen3-Coder-30B-A3B-DFlash: a dense drafter for the MoE target
    "qwen3_moe": {"rope_theta": 10000000.0},
    # z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat, husj576/TEV-llama31-8B: block 10, llama3 rope, EOS list
    "llama31": {
        "block_size": 10,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_type": "llama3",
        },
        "eos_token_id": [2, 3],
    },
    # z-lab/gemma4-12B-it-DFlash (and the Gemma 3 export): Gemma's activation, block_size inside dflash_config,
    # the target's final soft-capping copied
    "gemma": {
        "hidden_act": "gelu_pytorch_tanh",
        "rope_theta": 1000000.0,
        "final_logit_softcapping": 30.0,
        "block_size": None,
        "dflash_config": {"block_size": 16},
    },
}


def released_checkpoint(folder, layout: str):
    config = published_config(num_layers=1, num_target_layers=4, target_layer_ids=(1,), mask_token_id=95, block_size=16)
    for key, value in RELEASED_LAYOUTS[layout].items():
        if value is None:
            config.pop(key)
        elif key == "dflash_config":
            config[key] |= value
        else:
            config[key] = value
    return write_checkpoint(folder / layout, config, published_weights(num_layers=1, num_features=1))


@pytest.mark.parametrize("family", FAMILIES)
def test_released_layout_loads_strictly_and_decodes(family, tmp_path):
    layout = "gemma" if family.startswith("gemma") else family
    drafter = DFlashDraftModel.from_pretrained(released_checkpoint(tmp_path, layout))
    assert drafter.config.block_size == (10 if family == "llama31" else 16)
    target = make_family_target(family)
    drafter.check_target(target)
    prompt = long_prompt(96)
    expected = target.generate(prompt, do_sample=False, max_new_tokens=12)
    out = target.generate(
        prompt, do_sample=False, max_new_tokens=12, assistant_model=drafter, tev_config=TEVConfig(budget=8)
    )
    assert out.tolist() == expected.tolist()
    # transformers' own DFlash chain path on the same drafter
    native = target.generate(
        prompt, do_sample=False, max_new_tokens=12, assistant_model=drafter, speculation_type="dflash"
    )
    assert native.tolist() == expected.tolist()


def test_gemma_softcapping_is_applied_to_draft_marginals_and_checked():
    target = make_family_target("gemma4")
    drafter = make_family_drafter(target, "gemma4")
    assert drafter.config.final_logit_softcapping == 30.0
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(1, 5, 32, generator=generator)
    block = torch.tensor([[7] + [drafter.config.mask_token_id] * 7])
    with torch.no_grad():
        capped = drafter.draft_logits(target, features, block, torch.arange(13)[None])
    assert capped.abs().max() < 30.0 and capped.abs().max() > 1.0
    # the block is embedded as the target embeds its input: Gemma scales its embeddings by sqrt(hidden)
    seen = []
    handle = drafter.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    with torch.no_grad():
        drafter.draft_logits(target, features, block, torch.arange(13)[None])
    handle.remove()
    raw = target.get_input_embeddings().weight[block]
    torch.testing.assert_close(seen[0], raw * 32**0.5)
    drafter.config.final_logit_softcapping = 20.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        drafter.check_target(target)


# ---------------------------------------------------------------------------------------------------------
# Caches that lost tokens (hybrid targets, and what stays refused: tests/generation/test_hybrid.py)
# ---------------------------------------------------------------------------------------------------------
def test_a_plain_cache_with_filled_sliding_layers_is_refused():
    target = make_family_target("gemma3")
    prompt = long_prompt(96)
    plain = target.generate(prompt, do_sample=False, max_new_tokens=3, return_dict_in_generate=True)
    with pytest.raises(ValueError, match="sliding-window layer that dropped"):
        target.generate(
            plain.sequences, cache=plain.cache, max_new_tokens=3, assistant_model=make_family_drafter(target, "gemma3"),
            tev_config=TEVConfig(budget=4),
        )  # fmt: skip
    # a cache returned by tree decoding continues exactly
    drafter = make_family_drafter(target, "gemma3")
    first = target.generate(
        prompt, do_sample=False, max_new_tokens=5, assistant_model=drafter, tev_config=TEVConfig(budget=8),
        return_dict_in_generate=True,
    )  # fmt: skip
    more = target.generate(
        first.sequences, cache=first.cache, do_sample=False, max_new_tokens=10, assistant_model=drafter,
        tev_config=TEVConfig(budget=8),
    )  # fmt: skip
    assert more.tolist() == target.generate(prompt, do_sample=False, max_new_tokens=15).tolist()
    # a plain cache whose sliding layers dropped nothing yet (a context shorter than the window) continues too
    short = prompt[:, : WINDOW - 4]
    plain = target.generate(short, do_sample=False, max_new_tokens=2, return_dict_in_generate=True)
    more = target.generate(
        plain.sequences, cache=plain.cache, do_sample=False, max_new_tokens=10, assistant_model=drafter,
        tev_config=TEVConfig(budget=8),
    )  # fmt: skip
    assert more.tolist() == target.generate(short, do_sample=False, max_new_tokens=12).tolist()


def test_left_padded_prompt_past_the_window_matches_plain_generate():
    target = make_family_target("gemma3")
    prompt = torch.cat([torch.zeros(1, 3, dtype=torch.long), long_prompt(96)], dim=1)
    attention_mask = (prompt != 0).long()
    expected = target.generate(prompt, attention_mask=attention_mask, do_sample=False, max_new_tokens=16)
    drafter = with_oracle(make_family_drafter(target, "gemma3"), expected)
    out = target.generate(
        prompt, attention_mask=attention_mask, do_sample=False, max_new_tokens=16, assistant_model=drafter,
        tev_config=TEVConfig(budget=16), return_dict_in_generate=True,
    )  # fmt: skip
    assert out.sequences.tolist() == expected.tolist()
    assert out.tev_stats.tau > 2


@pytest.mark.parametrize("family", ["gemma3", "gemma4_unified"])
def test_gemma_drafter_from_target_saves_and_loads(family, tmp_path):
    target = make_family_target(family)
    drafter = make_family_drafter(target, family)
    config = drafter.config
    assert config.hidden_act == "gelu_pytorch_tanh" and config.head_dim == 8  # Gemma's activation; the base head_dim
    assert config.rope_parameters["rope_theta"] == 1000000.0  # the full-attention layers' rope
    drafter.save_pretrained(tmp_path / "drafter")
    loaded = DFlashDraftModel.from_pretrained(tmp_path / "drafter")
    assert loaded.config.final_logit_softcapping == 30.0
    loaded.check_target(target)
    features = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(0))
    block = torch.tensor([[7] + [config.mask_token_id] * 7])
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.draft_logits(target, features, block, torch.arange(13)[None]),
            drafter.draft_logits(target, features, block, torch.arange(13)[None]),
        )


@pytest.mark.parametrize("family", ["qwen3_moe", "llama31", "gemma3"])
def test_a_batch_decodes_each_row_as_alone_or_refuses_sliding_windows(family):
    # full-attention families batch like Qwen3; a sliding-window target is refused by name before any pass
    target = make_family_target(family)
    prompts = [long_prompt(96, seed=5, length=20), long_prompt(96, seed=6, length=13)]
    batch = torch.zeros(2, 20, dtype=torch.long)
    attention_mask = torch.zeros(2, 20, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        batch[row, -prompt.shape[1] :], attention_mask[row, -prompt.shape[1] :] = prompt[0], 1
    drafter = make_family_drafter(target, family)
    kwargs = dict(do_sample=False, max_new_tokens=12, assistant_model=drafter, tev_config=TEVConfig(budget=8))
    if family == "gemma3":
        with pytest.raises(ValueError, match="sliding-window"):
            target.generate(batch, attention_mask=attention_mask, **kwargs)
        return
    out = target.generate(batch, attention_mask=attention_mask, **kwargs)
    for row, prompt in enumerate(prompts):
        alone = target.generate(prompt, do_sample=False, max_new_tokens=12)[0, prompt.shape[1] :]
        assert out[row, 20:].tolist() == alone.tolist(), row
