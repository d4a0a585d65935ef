"""Drafters that are not hf_tev's own: transformers' `MuseGlimmerAssistantModel` (sliding-window layers, a
bidirectional sliding mask) and any drafter its `speculation_type="dflash"` chain drives draft hf_tev's trees, fed as
that chain feeds them; hf_tev's own drafter with sliding-window layers computes what transformers' drafter computes;
Muse Glimmer targets (NoPE full layers beside sliding ones, text prompts through the multimodal wrapper) decode
exactly. Windows are small (4 for the drafters, 8 for the Muse target) and prompts longer, so they matter."""

import pytest
import torch
from helpers import (
    assert_tree_sampling_law,
    flattened,
    make_drafter,
    make_target,
    own_sliding_drafter,
    tiny_text_dims,
    with_oracle,
)
from transformers import (
    MuseGlimmerAssistantConfig,
    MuseGlimmerAssistantModel,
    MuseGlimmerConfig,
    MuseGlimmerForConditionalGeneration,
)

from hf_tev import DFlashDraftModel, TEVConfig
from hf_tev.models.dflash.native import NativeDFlashDrafter, noise_embeddings, tree_drafter
from hf_tev.target_layers import full_length_cache, tree_attention_masks
from hf_tev.tree import build_tree, tree_attention_mask, tree_position_ids

DRAFT_WINDOW = 4
TARGET_WINDOW = 8
VERIFIERS = ("tev", "predraw", "residual")


def make_muse_target(vocab_size: int = 96, num_layers: int = 4, seed: int = 0, output_multiplier=None):
    """A tiny random `MuseGlimmerForConditionalGeneration` (text hidden 32; layer 3 full and NoPE, 0-2 sliding with
    window 8; a one-layer vision tower that text prompts never run)."""
    torch.manual_seed(seed)
    text = tiny_text_dims(vocab_size, num_layers) | dict(sliding_window=TARGET_WINDOW)
    if output_multiplier is not None:
        text["output_multiplier"] = output_multiplier
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    config = MuseGlimmerConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=vocab_size + 10,  # outside the text vocabulary: no text token is taken for an image
        video_token_id=vocab_size + 11,
        out_hidden_size=16,
        projector_hidden_size=16,
    )
    model = MuseGlimmerForConditionalGeneration(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    model.set_attn_implementation("sdpa")
    return model.eval()


def make_target_of(kind: str, **kwargs):
    if kind == "muse_glimmer":
        return make_muse_target(**kwargs)
    target = make_target(kind, **kwargs)
    target.generation_config.eos_token_id = None
    return target


def make_native_drafter(target, block_size: int = 6, seed: int = 3, layer_types=None, mask_token_id=None):
    """A random `MuseGlimmerAssistantModel` sized for `target` (two sliding layers of window 4 by default)."""
    text = target.config.get_text_config()
    torch.manual_seed(seed)
    config = MuseGlimmerAssistantConfig(
        hidden_size=text.hidden_size,
        intermediate_size=2 * text.hidden_size,
        num_hidden_layers=2,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads,
        head_dim=text.head_dim,
        sliding_window=DRAFT_WINDOW,
        layer_types=layer_types,
        block_size=block_size,
        mask_token_id=text.vocab_size - 1 if mask_token_id is None else mask_token_id,
        target_layer_ids=[1, text.num_hidden_layers - 2],
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    drafter = MuseGlimmerAssistantModel(config)
    drafter.set_attn_implementation("sdpa")
    return drafter.eval()


def prompt_of(vocab_size: int, length: int = 20, seed: int = 5) -> torch.LongTensor:
    return torch.randint(3, vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))


def record_native_chain(target, drafter, prompt, max_new_tokens=24):
    """transformers' own DFlash chain on `prompt`: its output, and each drafter call's root token, new context
    rows, position ids and candidate logits (the target's LM head on the call's block rows 1..)."""
    calls = []
    weight = target.get_input_embeddings().weight

    def record(module, args, kwargs, output):
        first = kwargs["noise_embeds"][0, 0]  # the root's embedding (no embed_norm: transformers' chain's)
        raw = noise_embeddings(target, torch.arange(weight.shape[0]))
        root = int((raw == first).all(dim=-1).nonzero()[0])
        head = target.get_output_embeddings()
        calls.append(
            dict(
                root=root,
                context=kwargs["context_hidden_states"].clone(),
                positions=kwargs["position_ids"].clone(),
                logits=head(output.last_hidden_state[:, 1:]).clone(),
            )
        )

    handle = drafter.register_forward_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            out = target.generate(
                prompt,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                assistant_model=drafter,
                speculation_type="dflash",
            )
    finally:
        handle.remove()
    return out, calls


def replay(adapter, target, calls):
    """The same calls through hf_tev's interface (`draft_logits`, one `new_cache()`), in order."""
    cache, logits = adapter.new_cache(), []
    block = adapter.config.block_size
    with torch.no_grad():
        for call in calls:
            block_ids = torch.full((1, block), adapter.config.mask_token_id)
            block_ids[0, 0] = call["root"]
            logits.append(adapter.draft_logits(target, call["context"], block_ids, call["positions"], cache=cache))
    return logits


# ------------------------------------------------------------------------------------------------------------------
# the Muse Glimmer target: hf_tev's tree pass covers its NoPE full layers and sliding layers
# ------------------------------------------------------------------------------------------------------------------
def test_muse_glimmer_tree_pass_equals_path_forwards_past_the_window():
    """Every node of a tree deeper than the window (after a 40-token prompt) gets the logits of a plain forward of
    its own path through the multimodal wrapper; without the window the tree pass is wrong (the test has power)."""
    target = make_muse_target()
    prompt = prompt_of(96, length=40)
    past = prompt.shape[1]
    torch.manual_seed(3)
    draft = torch.randn(10, 96) * 3
    draft[torch.arange(10), torch.randint(3, 96, (10,))] += 12  # a deep main path
    tree = build_tree(torch.log_softmax(draft, -1), 24, torch.tensor(7))
    assert tree.max_depth >= TARGET_WINDOW
    mask = tree_attention_mask(tree, past, torch.float32)
    positions = tree_position_ids(tree, past)
    with torch.no_grad():
        cache = full_length_cache(target)
        target(prompt, cache=cache)
        masks = tree_attention_masks(target, tree.depths, mask)
        out = target(tree.tokens[None], position_ids=positions, cache=cache, attention_mask=masks, logits_to_keep=0)
        paths = [tree.visibility[i].nonzero()[:, 0] for i in range(tree.num_nodes)]
        plain = [target(torch.cat([prompt, tree.tokens[path][None]], 1)).logits[0, -1] for path in paths]
        for node in range(tree.num_nodes):
            torch.testing.assert_close(out.logits[0, node], plain[node], atol=1e-4, rtol=1e-4)
        cache.crop(-tree.num_nodes)
        unwindowed = target(tree.tokens[None], position_ids=positions, cache=cache, attention_mask=mask).logits[0]
    assert max((unwindowed[n] - plain[n]).abs().max() for n in range(tree.num_nodes)) > 1e-3


# ------------------------------------------------------------------------------------------------------------------
# transformers' MuseGlimmerAssistantModel: fed as transformers' chain feeds it
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["qwen3", "muse_glimmer"])
def test_native_drafter_blocks_equal_transformers_chain(kind):
    """Every block transformers' chain drafts (its sliding cache cut to the window, past the window) has the
    marginals hf_tev's `draft_logits` gives for the same context; on the Muse target the block embedding skips the
    target's embed_norm as the chain does (with it the marginals differ)."""
    target = make_target_of(kind)
    drafter = make_native_drafter(target)
    prompt = prompt_of(96)
    plain = target.generate(prompt, do_sample=False, max_new_tokens=24)
    out, calls = record_native_chain(target, drafter, prompt)
    assert torch.equal(out, plain)
    assert len(calls) > 3 and max(call["context"].shape[1] for call in calls[1:]) >= 1
    adapter = tree_drafter(drafter)
    assert isinstance(adapter, NativeDFlashDrafter) and tree_drafter(drafter) is adapter  # one per drafter
    for ours, theirs in zip(replay(adapter, target, calls), calls, strict=True):
        torch.testing.assert_close(ours, theirs["logits"], atol=1e-4, rtol=1e-4)
    if kind == "muse_glimmer":  # the normed embedding would draft other marginals: the bypass is tested
        normed = target.get_input_embeddings()
        block_ids = torch.full((1, 6), adapter.config.mask_token_id)
        block_ids[0, 0] = calls[0]["root"]
        assert not torch.allclose(normed(block_ids), noise_embeddings(target, block_ids))


@pytest.mark.parametrize("kind", ["qwen3", "muse_glimmer"])
def test_chain_source_first_block_is_transformers_proposal(kind):
    """`TEVConfig(tree="chain")`: hf_tev's first drafted block is the block transformers' chain proposes."""
    target = make_target_of(kind)
    drafter = make_native_drafter(target)
    prompt = prompt_of(96)
    _, calls = record_native_chain(target, drafter, prompt, max_new_tokens=8)
    adapter = tree_drafter(drafter)
    drafted, real = [], adapter.draft_logits

    def recording(*args, **kwargs):
        logits = real(*args, **kwargs)
        drafted.append(logits)
        return logits

    adapter.draft_logits = recording
    out = target.generate(
        prompt,
        do_sample=False,
        max_new_tokens=8,
        assistant_model=drafter,
        tev_config=TEVConfig(tree="chain", budget=5),
        return_dict_in_generate=True,
    )
    assert out.tev_stats.tree_sizes[0] == 5
    assert drafted[0].argmax(-1).tolist() == calls[0]["logits"].argmax(-1).tolist()
    torch.testing.assert_close(drafted[0], calls[0]["logits"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["qwen3", "muse_glimmer"])
def test_native_drafter_greedy_equals_plain_generate(kind):
    target = make_target_of(kind)
    prompt = prompt_of(96, length=40)
    expected = target.generate(prompt, do_sample=False, max_new_tokens=24)
    taus = []
    for verifier in VERIFIERS:
        for budget in (6, 32):
            drafter = make_native_drafter(target)
            with_oracle(tree_drafter(drafter), expected)  # the adapter generate picks up for this drafter
            out = target.generate(
                prompt,
                do_sample=False,
                max_new_tokens=24,
                assistant_model=drafter,
                tev_config=TEVConfig(budget=budget, verifier=verifier),
                return_dict_in_generate=True,
            )
            assert out.sequences.tolist() == expected.tolist(), (verifier, budget)
            taus.append(out.tev_stats.tau)
    assert max(taus) > 3, "the acceptance path was never exercised"
    # and the drafter as it is (no oracle) decodes the same tokens with the default settings
    plain_drafter = make_native_drafter(target, seed=7)
    out = target.generate(
        prompt, do_sample=False, max_new_tokens=24, assistant_model=plain_drafter, tev_config=TEVConfig()
    )
    assert out.tolist() == expected.tolist()


def test_muse_glimmer_target_with_native_drafter_keeps_the_sampling_law():
    """The law of the last two of 4 sampled tokens after a 40-token prompt (past both windows), per verifier,
    against the Muse target's exact law; the pooled counts reject a wrong law (temperature 0.6)."""
    vocab = 4
    target = make_muse_target(vocab_size=vocab, num_layers=2, seed=4, output_multiplier=1.0)
    prompt = torch.randint(1, vocab, (1, 40), generator=torch.Generator().manual_seed(5))
    drafter = make_native_drafter(target, block_size=4, mask_token_id=3)
    flattened(tree_drafter(drafter))
    assert_tree_sampling_law(target, prompt, drafter, VERIFIERS)


# ------------------------------------------------------------------------------------------------------------------
# routing and refusals
# ------------------------------------------------------------------------------------------------------------------
def test_routing_native_drafters_go_to_transformers_unless_tev_config_is_given():
    target = make_target_of("qwen3")
    drafter = make_native_drafter(target)
    prompt = prompt_of(96)
    expected = target.generate(prompt, do_sample=False, max_new_tokens=10)
    # speculation_type="dflash" without tev_config: transformers' own chain, untouched (no tev_stats)
    native = target.generate(
        prompt,
        do_sample=False,
        max_new_tokens=10,
        assistant_model=drafter,
        speculation_type="dflash",
        return_dict_in_generate=True,
    )
    assert native.sequences.tolist() == expected.tolist() and not hasattr(native, "tev_stats")
    # tev_config: hf_tev's trees
    ours = target.generate(
        prompt,
        do_sample=False,
        max_new_tokens=10,
        assistant_model=drafter,
        tev_config=TEVConfig(),
        return_dict_in_generate=True,
    )
    assert ours.sequences.tolist() == expected.tolist() and ours.tev_stats.num_cycles > 0
    with pytest.raises(ValueError, match="speculation_type"):
        target.generate(
            prompt, max_new_tokens=4, assistant_model=drafter, speculation_type="dflash", tev_config=TEVConfig()
        )


def test_what_is_no_drafter_is_refused_naming_what_it_lacks():
    target = make_target_of("qwen3")
    with pytest.raises(TypeError, match=r"Qwen3ForCausalLM has no config\.target_layer_ids.*mask_token_id"):
        target.generate(prompt_of(96), max_new_tokens=4, assistant_model=make_target("qwen3"), tev_config=TEVConfig())
    drafter = make_native_drafter(target)
    drafter.forward = lambda noise_embeds, context_hidden_states: None  # no position_ids / attention_mask / cache
    with pytest.raises(TypeError, match=r"has no forward\(noise_embeds="):
        target.generate(prompt_of(96), max_new_tokens=4, assistant_model=drafter, tev_config=TEVConfig())

    class DraftsOnly(torch.nn.Module):  # has `draft_logits`, and nothing else a drafter has
        def draft_logits(self, *args, **kwargs):
            raise AssertionError("never called: refused first")

    lacks = r"DraftsOnly\) has `draft_logits` but is not a DFlash drafter: it lacks check_target, target_hidden_ind"
    with pytest.raises(TypeError, match=lacks):
        target.generate(prompt_of(96), max_new_tokens=4, assistant_model=DraftsOnly(), tev_config=TEVConfig())


def test_a_native_drafter_that_does_not_fit_the_target_is_named():
    target = make_target_of("qwen3")
    other = make_target("qwen3", hidden_size=32)
    drafter = make_native_drafter(other)  # hidden 32, target_layer_ids [1, 2]
    drafter.config.target_layer_ids = [1, 7]
    drafter.config.mask_token_id = 500
    with pytest.raises(ValueError, match=r"hidden size: drafter 32, target 64.*mask_token_id 500.*\[1, 7\]"):
        target.generate(prompt_of(96), max_new_tokens=4, assistant_model=drafter, tev_config=TEVConfig())


def test_a_batch_refuses_sliding_drafters_and_decodes_each_row_with_a_full_attention_native_drafter():
    target = make_target_of("qwen3")
    prompts = torch.tensor([[0, 0, 5, 7, 9, 11, 13], [3, 4, 8, 16, 22, 30, 41]])
    mask = (prompts != 0).long()
    with pytest.raises(ValueError, match="sliding-window layers \\(window 4\\)"):
        target.generate(
            prompts, attention_mask=mask, max_new_tokens=4, assistant_model=make_native_drafter(target), tev_config={}
        )
    own = DFlashDraftModel.from_target(target, num_layers=1, block_size=4, sliding_window=DRAFT_WINDOW)
    with pytest.raises(ValueError, match="sliding-window layers \\(window 4\\)"):
        target.generate(prompts, attention_mask=mask, max_new_tokens=4, assistant_model=own, tev_config={})
    full = make_native_drafter(target, layer_types=["full_attention"] * 2)
    out = target.generate(
        prompts, attention_mask=mask, do_sample=False, max_new_tokens=12, assistant_model=full, tev_config={}
    )
    for row, alone in enumerate((prompts[:1, 2:], prompts[1:])):
        expected = target.generate(alone, do_sample=False, max_new_tokens=12)
        assert out[row, -12:].tolist() == expected[0, -12:].tolist()


# ------------------------------------------------------------------------------------------------------------------
# hf_tev's own drafter with sliding-window layers: transformers' drafter's computation, saved and decoded
# ------------------------------------------------------------------------------------------------------------------
def as_muse_assistant(drafter):
    """transformers' `MuseGlimmerAssistantModel` with `drafter`'s weights (the same architecture under other
    names: `encoder.fc` / `encoder.output_norm_enc` are `fc` / `hidden_norm`)."""
    c = drafter.config
    config = MuseGlimmerAssistantConfig(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters=dict(c.rope_parameters),
        sliding_window=c.sliding_window,
        layer_types=list(c.layer_types),
        block_size=c.block_size,
        mask_token_id=c.mask_token_id,
        target_layer_ids=list(c.target_layer_ids),
        max_position_embeddings=c.max_position_embeddings,
    )
    muse = MuseGlimmerAssistantModel(config)
    renamed = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
    muse.load_state_dict({renamed.get(k, k): v for k, v in drafter.state_dict().items()}, strict=True)
    muse.set_attn_implementation("sdpa")
    return muse.eval()


@pytest.mark.parametrize(
    "layer_types",
    [("sliding_attention", "sliding_attention"), ("sliding_attention", "full_attention")],
    ids=["all_sliding", "sliding_and_full"],
)
def test_own_sliding_drafter_computes_what_transformers_drafter_computes(layer_types):
    """hf_tev's drafter with sliding-window layers drafts, in transformers' chain and in hf_tev's `draft_logits`,
    the marginals transformers' MuseGlimmerAssistantModel with the same weights drafts; the window matters (the
    same weights without it draft other marginals)."""
    target = make_target_of("qwen3")
    drafter = own_sliding_drafter(target, layer_types)
    muse = as_muse_assistant(drafter)
    prompt = prompt_of(96)
    out, calls = record_native_chain(target, muse, prompt)
    ours_out, ours_calls = record_native_chain(target, drafter, prompt)  # transformers' chain drives ours too
    assert torch.equal(out, ours_out) and torch.equal(out, target.generate(prompt, do_sample=False, max_new_tokens=24))
    for ours, theirs in zip(ours_calls, calls, strict=True):
        torch.testing.assert_close(ours["logits"], theirs["logits"], atol=1e-4, rtol=1e-4)
    replayed = replay(drafter, target, calls)  # hf_tev's own draft_logits and new_cache (full-length layers)
    for ours, theirs in zip(replayed, calls, strict=True):
        torch.testing.assert_close(ours, theirs["logits"], atol=1e-4, rtol=1e-4)
    unwindowed = DFlashDraftModel.from_target(
        target, num_layers=len(layer_types), block_size=6, target_layer_ids=drafter.config.target_layer_ids
    )
    unwindowed.load_state_dict(drafter.state_dict())
    different = replay(unwindowed, target, calls)
    assert any(not torch.allclose(a, b["logits"], atol=1e-3) for a, b in zip(different, calls, strict=True))


def test_own_sliding_drafter_multi_block_mask_equals_separate_forwards():
    """The training layout (several blocks in one forward with a 4D mask): each block's rows equal its own
    forward, the window taken by position (the blocks' rows sit after every context row)."""
    target = make_target_of("qwen3")
    drafter = own_sliding_drafter(target, block_size=4)
    torch.manual_seed(3)
    features = torch.randn(1, 10, 128)
    noise = torch.randn(1, 8, 64)
    positions = torch.cat([torch.arange(10), torch.arange(4, 8), torch.arange(7, 11)])[None]
    visible = torch.zeros(8, 18, dtype=torch.bool)
    visible[:4, :4], visible[:4, 10:14], visible[4:, :7], visible[4:, 14:18] = True, True, True, True
    mask = torch.zeros(1, 1, 8, 18).masked_fill(~visible, torch.finfo(torch.float32).min)
    with torch.no_grad():
        both = drafter(noise, features, positions, attention_mask=mask).last_hidden_state
        block_a = drafter(noise[:, :4], features[:, :4], torch.arange(8)[None]).last_hidden_state
        block_b = drafter(noise[:, 4:], features[:, :7], torch.arange(11)[None]).last_hidden_state
    torch.testing.assert_close(both[:, :4], block_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(both[:, 4:], block_b, atol=1e-5, rtol=1e-5)


def test_own_sliding_drafter_saves_loads_and_decodes_exactly(tmp_path):
    import json

    target = make_target_of("qwen3")
    drafter = own_sliding_drafter(target, ("sliding_attention", "full_attention"))
    drafter.save_pretrained(tmp_path / "sliding")
    saved = json.loads((tmp_path / "sliding" / "config.json").read_text())
    assert saved["layer_types"] == ["sliding_attention", "full_attention"] and saved["sliding_window"] == DRAFT_WINDOW
    assert saved["use_sliding_window"] is True
    loaded = DFlashDraftModel.from_pretrained(tmp_path / "sliding")
    assert loaded.config.layer_types == drafter.config.layer_types and loaded.config.sliding_window == DRAFT_WINDOW
    prompt = prompt_of(96, length=40)
    expected = target.generate(prompt, do_sample=False, max_new_tokens=24)
    features = torch.randn(1, 30, 128, generator=torch.Generator().manual_seed(0))
    block = torch.full((1, 6), drafter.config.mask_token_id)
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.draft_logits(target, features, block, torch.arange(36)[None]),
            drafter.draft_logits(target, features, block, torch.arange(36)[None]),
        )
    for verifier in VERIFIERS:
        out = target.generate(
            prompt,
            do_sample=False,
            max_new_tokens=24,
            assistant_model=with_oracle(own_sliding_drafter(target), expected),
            tev_config=TEVConfig(budget=16, verifier=verifier),
            return_dict_in_generate=True,
        )
        assert out.sequences.tolist() == expected.tolist(), verifier
        assert out.tev_stats.tau > 2
    out = target.generate(prompt, do_sample=False, max_new_tokens=24, assistant_model=loaded)  # the default route
    assert out.tolist() == expected.tolist()


def test_muse_glimmer_target_decodes_with_hf_tev_drafters_of_both_kinds():
    """A Muse Glimmer target with hf_tev's own drafter (full and sliding layers): greedy equals plain generate."""
    target = make_muse_target()
    prompt = prompt_of(96, length=40)
    expected = target.generate(prompt, do_sample=False, max_new_tokens=24)
    for drafter in (make_drafter(target, block_size=6), own_sliding_drafter(target)):
        out = target.generate(
            prompt,
            do_sample=False,
            max_new_tokens=24,
            assistant_model=with_oracle(drafter, expected),
            tev_config=TEVConfig(budget=16),
            return_dict_in_generate=True,
        )
        assert out.sequences.tolist() == expected.tolist()
        assert out.tev_stats.tau > 2


def test_from_target_names_bad_window_arguments():
    target = make_target_of("qwen3")
    with pytest.raises(ValueError, match=r"from_target\(sliding_window=0\)"):
        DFlashDraftModel.from_target(target, num_layers=2, sliding_window=0)
    with pytest.raises(ValueError, match=r"from_target\(layer_types=\['sliding_attention'\]\)"):
        DFlashDraftModel.from_target(target, num_layers=2, layer_types=["sliding_attention"], sliding_window=4)
    with pytest.raises(ValueError, match="pass sliding_window"):
        DFlashDraftModel.from_target(target, num_layers=1, layer_types=["sliding_attention"])
    drafter = DFlashDraftModel.from_target(target, num_layers=2, sliding_window=4)  # every layer slides
    assert drafter.config.layer_types == ["sliding_attention"] * 2
