"""Hybrid targets (docs/design.md#hybrid-targets): gated-DeltaNet linear attention next to full attention (Qwen3.5
text, Qwen3.5-MoE text, Qwen3-Next, the Qwen3.5 multimodal wrapper on text prompts), as tiny random models. Every
tree node's output is the layer's on its own path (its conv window from its ancestors, the gated delta rule over
the tree's ancestor mask); the commit keeps the accepted path's recurrent state and conv window. Trees here are
deeper than the conv window (kernel 4), so a deep node's window holds ancestors only, and a shallow one's reaches
back before the root."""

import functools
import json

import pytest
import torch
from helpers import (
    assert_tree_sampling_law,
    flattened,
    make_drafter,
    tiny_text_dims,
    transformers_log,
    with_oracle,
)
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.cache_utils import LinearAttentionLayer

from hf_tev import DFlashDraftModel, TEVConfig
from hf_tev.config import tree_memory_bytes
from hf_tev.generation import checks
from hf_tev.generation.cache import PromptTreeInputs, commit_accepted_path
from hf_tev.generation.checks import warn_tree_memory
from hf_tev.generation.forward import tree_forward
from hf_tev.generation.hybrid import NodeTree, linear_attention_modules, linear_attention_trees, text_position_ids
from hf_tev.target_layers import TreeStateLayer, full_length_cache, tree_state_bytes
from hf_tev.tree import build_tree

FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "qwen3_5")  # qwen3_5: the multimodal wrapper
VERIFIERS = ("tev", "predraw", "residual")
PROMPT_LENGTH = 40
KERNEL = 4  # linear_conv_kernel_dim (the configs' default)


def make_hybrid_target(family: str, vocab_size: int = 96, num_layers: int = 4, seed: int = 0, **linear):
    """A tiny random hybrid target (hidden 32; 3 linear-attention layers : 1 full-attention layer)."""
    torch.manual_seed(seed)
    text = (
        tiny_text_dims(vocab_size, num_layers)
        | dict(
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            tie_word_embeddings=False,
        )
        | linear
    )
    if family in ("qwen3_5_moe_text", "qwen3_next"):
        text |= dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    if family == "qwen3_5_moe_text":
        text.pop("intermediate_size")  # as its config class makes it: experts only, no dense MLP width
    if family == "qwen3_5":
        from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

        text.pop("tie_word_embeddings")
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4)
        config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
        model = Qwen3_5ForConditionalGeneration(config)
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **text))
    with torch.no_grad():  # sharper logits: greedy paths and acceptance mean something
        model.get_output_embeddings().weight.mul_(8.0)
        for module in linear_attention_modules(model):  # states that last (slow decay) and weigh: a wrong one shows
            module.A_log.uniform_(-2.0, 0.0)
            module.out_proj.weight.mul_(4.0)
    model.generation_config.eos_token_id = None  # the laws and lengths below are of free tokens
    model.set_attn_implementation("sdpa")
    return model.eval()


def long_prompt(vocab_size: int, seed: int = 5, length: int = PROMPT_LENGTH) -> torch.LongTensor:
    generator = torch.Generator().manual_seed(seed)
    low = 3 if vocab_size > 8 else 1
    return torch.randint(low, vocab_size, (1, length), generator=generator)


def deep_tree(vocab_size: int = 96, depths: int = 10, budget: int = 24, seed: int = 3):
    torch.manual_seed(seed)
    draft = torch.randn(depths, vocab_size) * 3
    draft[torch.arange(depths), torch.randint(3, vocab_size, (depths,))] += 12  # a deep main path
    return build_tree(torch.log_softmax(draft, -1), budget, torch.tensor(7))


def tree_pass(target, prompt, tree):
    """Prefill `prompt`, then ONE tree pass over `tree` as decoding makes it: `(cache, logits [N, V])`."""
    cache = full_length_cache(target)
    target(prompt, cache=cache)
    inputs = PromptTreeInputs(target, prompt.shape[1] + tree.num_nodes, prompt.device)
    tokens, masks, positions = inputs([tree], prompt.shape[1], [prompt.shape[1]])
    assert isinstance(masks["linear_attention"], NodeTree)
    return cache, tree_forward(target, tokens, cache, masks, positions, None).logits[0]


# ---------------------------------------------------------------------------------------------------------
# The tree pass: every node's logits are the target's on its own path; the kept path continues as a cache
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_tree_pass_equals_path_forwards_deeper_than_the_conv_window(family):
    target = make_hybrid_target(family)
    assert len(linear_attention_modules(target)) == 3
    prompt = long_prompt(96)
    past = prompt.shape[1]
    tree = deep_tree()
    assert tree.max_depth > KERNEL + 1 and len(set(tree.depths.tolist())) < tree.num_nodes  # deep, and branching
    paths = [tree.visibility[i].nonzero()[:, 0] for i in range(tree.num_nodes)]
    with torch.no_grad():
        cache, logits = tree_pass(target, prompt, tree)
        assert all(type(layer) is TreeStateLayer for layer in cache.layers if not hasattr(layer, "keys"))
        plain = [target(torch.cat([prompt, tree.tokens[path][None]], 1)).logits[0, -1] for path in paths]
        for node in range(tree.num_nodes):
            torch.testing.assert_close(logits[node], plain[node], atol=1e-4, rtol=1e-4)
        # the test has power: one running state over the nodes in index order (the tree mask on the attention
        # layers only) is wrong
        fresh = full_length_cache(target)
        target(prompt, cache=fresh)
        inputs = PromptTreeInputs(target, past + tree.num_nodes, prompt.device)
        tokens, masks, positions = inputs([tree], past, [past])
        one_state = target(tokens, cache=fresh, position_ids=positions, attention_mask=masks["full_attention"])
        assert max((one_state.logits[0, n] - plain[n]).abs().max() for n in range(tree.num_nodes)) > 1e-2
        # keep the deepest path (not a prefix of the node order) and continue with two tokens: the committed
        # recurrent state is the last node's, the conv window the path's last inputs (and the prompt's before it)
        node = max(range(tree.num_nodes), key=lambda i: (len(paths[i]), i))
        path = paths[node]
        assert path.tolist() != list(range(len(path))) and len(path) > KERNEL
        commit_accepted_path(cache, past, path, path_is_prefix=False)
        committed = torch.cat([prompt, tree.tokens[path][None]], 1)
        assert cache.get_seq_length() == committed.shape[1]
        nxt = torch.tensor([[11, 12]])
        step = target(nxt, cache=cache, position_ids=torch.arange(2)[None] + committed.shape[1]).logits[0]
        torch.testing.assert_close(step, target(torch.cat([committed, nxt], 1)).logits[0, -2:], atol=1e-4, rtol=1e-4)


def test_the_kept_path_can_be_cropped_back_to_any_of_its_tokens():
    """A stop inside an accepted block crops the cache back: the linear-attention state is then the one after the
    last token kept (the path's own states are kept until the next pass)."""
    target = make_hybrid_target("qwen3_5_text")
    prompt = long_prompt(96)
    past = prompt.shape[1]
    tree = deep_tree()
    path = tree.visibility[tree.num_nodes - 1].nonzero()[:, 0]
    with torch.no_grad():
        for keep in (1, 2, len(path) - 1):
            cache, _ = tree_pass(target, prompt, tree)
            commit_accepted_path(cache, past, path, path_is_prefix=False)
            cache.crop(keep - len(path))
            committed = torch.cat([prompt, tree.tokens[path[:keep]][None]], 1)
            step = target(torch.tensor([[11]]), cache=cache, position_ids=torch.tensor([[committed.shape[1]]]))
            fresh = target(torch.cat([committed, torch.tensor([[11]])], 1)).logits[0, -1]
            torch.testing.assert_close(step.logits[0, -1], fresh, atol=1e-4, rtol=1e-4)
        cache, _ = tree_pass(target, prompt, tree)
        commit_accepted_path(cache, past, path, path_is_prefix=False)
        with pytest.raises(RuntimeError, match="keeps the per-token states of the last"):
            cache.crop(-(len(path) + 1))


# ---------------------------------------------------------------------------------------------------------
# generate: greedy equality (every verifier), top-k 1, the sampling law, continuation, deep acceptances
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_plain_generate(family):
    target = make_hybrid_target(family)
    prompt = long_prompt(96)
    expected = target.generate(prompt, do_sample=False, max_new_tokens=24)
    taus = []
    for budget in (6, 32):
        drafter = with_oracle(make_drafter(target), expected)
        out = target.generate(
            prompt, do_sample=False, max_new_tokens=24, assistant_model=drafter, tev_config=TEVConfig(budget=budget),
            return_dict_in_generate=True,
        )  # fmt: skip
        assert out.sequences.tolist() == expected.tolist(), budget
        assert out.cache.get_seq_length() == out.sequences.shape[1] - 1
        assert all(layer.window is None for layer in out.cache.layers if isinstance(layer, TreeStateLayer))
        taus.append(out.tev_stats.tau)
        for verifier in VERIFIERS:  # top-k 1: each sampling verifier must give the greedy tokens
            out = target.generate(
                prompt, do_sample=True, top_k=1, max_new_tokens=24, assistant_model=drafter,
                tev_config=TEVConfig(budget=budget, verifier=verifier, seed=0),
            )  # fmt: skip
            assert out.tolist() == expected.tolist(), (budget, verifier)
    assert max(taus) > KERNEL, "no path longer than the conv window was accepted"


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
def test_sampling_law_matches_target(family):
    """The law of the last two of 4 sampled tokens (the first tree after the prefill can emit both) against the
    target's exact law, per verifier; the pooled counts must reject a wrong law."""
    vocab = 4
    target = make_hybrid_target(family, vocab_size=vocab, seed=4)
    prompt = long_prompt(vocab)
    assert_tree_sampling_law(target, prompt, flattened(make_drafter(target)), VERIFIERS)


def test_the_returned_cache_continues_exactly_also_after_a_stop_inside_a_block():
    target = make_hybrid_target("qwen3_5_text")
    prompt = long_prompt(96)
    uninterrupted = target.generate(prompt, do_sample=False, max_new_tokens=30)
    drafter = with_oracle(make_drafter(target), uninterrupted)
    kwargs = dict(do_sample=False, assistant_model=drafter, tev_config=TEVConfig(budget=16))
    first = target.generate(prompt, max_new_tokens=12, return_dict_in_generate=True, **kwargs)
    more = target.generate(first.sequences, cache=first.cache, max_new_tokens=18, **kwargs)
    assert more.tolist() == uninterrupted.tolist()
    # a stop (EOS) inside an accepted block: the cache is cropped back along the block to the stop
    eos = int(uninterrupted[0, PROMPT_LENGTH + 9])
    first_eos = next(i for i in range(PROMPT_LENGTH, 70) if int(uninterrupted[0, i]) == eos)
    stopped = target.generate(prompt, max_new_tokens=30, eos_token_id=eos, return_dict_in_generate=True, **kwargs)
    assert stopped.sequences.shape[1] == first_eos + 1
    assert any(length > 1 for length in stopped.tev_stats.accepted_lengths)
    plain = target.generate(stopped.sequences, cache=stopped.cache, do_sample=False, max_new_tokens=6)
    assert plain.tolist() == target.generate(stopped.sequences, do_sample=False, max_new_tokens=6).tolist()
    # a plain generate cache (transformers' own linear-attention layers) continues with tree decoding
    start = target.generate(prompt, do_sample=False, max_new_tokens=3, return_dict_in_generate=True)
    assert any(type(layer) is LinearAttentionLayer for layer in start.cache.layers)
    more = target.generate(start.sequences, cache=start.cache, max_new_tokens=27, **kwargs)
    assert more.tolist() == uninterrupted.tolist()


def test_context_drafts_accept_deep_paths_exactly():
    """A prompt that repeats, decoded with context drafts (and with them alone): multi-token paths longer than
    the conv window are accepted and committed, the output is plain greedy's."""
    target = make_hybrid_target("qwen3_next")
    start = long_prompt(96, seed=8, length=8)
    loop = target.generate(start, do_sample=False, max_new_tokens=40)
    prompt = torch.cat([loop, loop[:, 8:]], 1)  # the target's own continuation, twice
    expected = target.generate(prompt, do_sample=False, max_new_tokens=40)
    for drafter in (make_drafter(target), None):  # context drafts merged into the drafter's trees, and alone
        out = target.generate(
            prompt, do_sample=False, max_new_tokens=40, assistant_model=drafter,
            tev_config=TEVConfig(budget=16, lookup=True), return_dict_in_generate=True,
        )  # fmt: skip
        assert out.sequences.tolist() == expected.tolist()
        assert sum(length > KERNEL + 1 for length in out.tev_stats.accepted_lengths) >= 2


def test_auto_budget_probes_and_decodes_exactly():
    target = make_hybrid_target("qwen3_5_moe_text")
    prompt = long_prompt(96)
    expected = target.generate(prompt, do_sample=False, max_new_tokens=20)
    drafter = with_oracle(make_drafter(target), expected)
    out = target.generate(
        prompt, do_sample=False, max_new_tokens=20, assistant_model=drafter, tev_config=TEVConfig(budget="auto"),
        return_dict_in_generate=True,
    )  # fmt: skip
    assert out.sequences.tolist() == expected.tolist()
    sizes = out.tev_stats.budget_model["probe_tokens"]
    assert len(sizes) > 1  # the probe's tree passes (chains) ran and were cropped off the cache
    assert out.cache.get_seq_length() == out.sequences.shape[1] - 1


# ---------------------------------------------------------------------------------------------------------
# Batches: each row decodes as it would alone, rows with their own states leave when they stop
# ---------------------------------------------------------------------------------------------------------
def test_a_batch_decodes_each_row_as_alone():
    target = make_hybrid_target("qwen3_5_text")
    prompts = [
        long_prompt(96, seed=5, length=20),
        long_prompt(96, seed=6, length=13),
        long_prompt(96, seed=7, length=9),
    ]
    width = 20
    batch = torch.zeros(len(prompts), width, dtype=torch.long)
    attention_mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        batch[row, -prompt.shape[1] :], attention_mask[row, -prompt.shape[1] :] = prompt[0], 1
    alone = [target.generate(p, do_sample=False, max_new_tokens=16)[0, p.shape[1] :] for p in prompts]
    eos = int(alone[1][5])  # row 1 stops early (and leaves the batch's caches)
    drafter = make_drafter(target)
    for config in (TEVConfig(budget=8), TEVConfig(budget=8, lookup=True)):
        out = target.generate(
            batch, attention_mask=attention_mask, do_sample=False, max_new_tokens=16, assistant_model=drafter,
            tev_config=config, eos_token_id=eos, pad_token_id=0,
        )  # fmt: skip
        for row, tokens in enumerate(alone):
            stop = next((i for i, t in enumerate(tokens.tolist()) if t == eos), len(tokens) - 1)
            assert out[row, width : width + stop + 1].tolist() == tokens[: stop + 1].tolist(), row


# ---------------------------------------------------------------------------------------------------------
# The tree path is taken only inside a tree pass; what stays refused
# ---------------------------------------------------------------------------------------------------------
def test_layer_wrappers_exist_only_during_tree_passes_and_leave_plain_calls_alone():
    target = make_hybrid_target("qwen3_5_text")
    modules = linear_attention_modules(target)
    prompt = long_prompt(96, length=12)
    sentinel = modules[0].forward  # an instance forward set before (as accelerate's hooks set one) is kept
    modules[0].forward = sentinel
    tree = deep_tree()
    inputs = PromptTreeInputs(target, 64, prompt.device)
    _, masks, _ = inputs([tree], 12, [12])
    with torch.no_grad():
        before = target(prompt).logits
        with linear_attention_trees(target, masks), linear_attention_trees(target, masks):  # two passes at once
            assert all("forward" in module.__dict__ for module in modules)
            inside = target(prompt).logits  # another caller's plain forward meanwhile: the module's own path
        torch.testing.assert_close(inside, before, atol=0, rtol=0)
    assert modules[0].__dict__["forward"] is sentinel
    assert all("forward" not in module.__dict__ for module in modules[1:])
    with linear_attention_trees(target, {"full_attention": None}):  # no NodeTree: nothing is wrapped
        assert all("forward" not in module.__dict__ for module in modules[1:])


def test_other_recurrent_layers_are_refused_naming_why():
    from transformers import Lfm2Config, Lfm2ForCausalLM

    config = Lfm2Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "full_attention"],
    )  # fmt: skip
    target = Lfm2ForCausalLM(config).eval()
    with pytest.raises(ValueError, match=r"\['conv'\] layers keep one running state.*only for the gated-DeltaNet"):
        target.generate(long_prompt(96, length=10), max_new_tokens=4, tev_config=TEVConfig(lookup=True))


def test_the_memory_warning_counts_the_nodes_linear_attention_pieces(monkeypatch):
    target = make_hybrid_target("qwen3_5_text")
    per_node = tree_state_bytes(target)
    # 3 layers of: a conv input (2 * 2 * 8 + 4 * 8 channels) and a key, corrected value and decay per value head
    assert per_node == 3 * (64 * 4 + 4 * (4 * (8 + 8 + 1) + 1))
    generation_config = target.generation_config
    generation_config.max_length = 64
    config = TEVConfig(budget=400, lookup=True)
    without = tree_memory_bytes(401, 96, 64, 4)
    monkeypatch.setattr(checks, "TREE_MEMORY_WARNING_BYTES", without + 401 * per_node // 2)
    with transformers_log() as messages:
        warn_tree_memory(target, None, generation_config, config)
    assert any(f"{per_node / 2**20:.1f} MiB of linear-attention states per node" in m for m in messages), messages
    monkeypatch.setattr(checks, "TREE_MEMORY_WARNING_BYTES", without + 401 * per_node + 1)
    with transformers_log() as messages:
        warn_tree_memory(target, None, generation_config, config)
    assert not messages


def test_the_drafter_from_target_saves_and_loads(tmp_path):
    target = make_hybrid_target("qwen3_5")
    drafter = make_drafter(target)
    drafter.save_pretrained(tmp_path / "drafter")
    loaded = DFlashDraftModel.from_pretrained(tmp_path / "drafter")
    loaded.check_target(target)
    prompt = long_prompt(96)
    expected = target.generate(prompt, do_sample=False, max_new_tokens=10)
    out = target.generate(prompt, do_sample=False, max_new_tokens=10, assistant_model=loaded, tev_config=TEVConfig())
    assert out.tolist() == expected.tolist()


def test_a_qwen3_5_moe_target_gets_a_fresh_drafter_and_trains_one_from_its_saved_folder(tmp_path):
    """Qwen3.5-MoE's config has no dense `intermediate_size`: a fresh drafter's MLP is as wide as the experts a token
    runs through (2 of 32, plus the shared 32), from `from_target` and from `hf-tev train --target <folder>`."""
    from helpers import small_run_flags

    from hf_tev.training import cli

    target = make_hybrid_target("qwen3_5_moe_text")
    assert not hasattr(target.config, "intermediate_size")
    assert DFlashDraftModel.from_target(target).config.intermediate_size == 2 * 32 + 32
    target.save_pretrained(tmp_path / "target")
    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(3, 96, (24,), generator=generator).tolist(), "prompt_length": 8}] * 4
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    argv = ["--target", str(tmp_path / "target"), "--train_data", str(tmp_path / "rows.jsonl")]
    argv += ["--output_dir", str(tmp_path / "out"), *small_run_flags(max_steps=1, eval_tau_prompts=None)]
    trainer = cli.run(*cli.parse_args(argv))
    assert trainer.state.global_step == 1 and (tmp_path / "out" / "model.safetensors").is_file()
    assert DFlashDraftModel.from_pretrained(tmp_path / "out").config.intermediate_size == 96


def test_an_image_prompt_is_refused_naming_the_image_input_passed(monkeypatch):
    """The multimodal wrapper's image input is refused by the names the caller passed (`pixel_values`,
    `image_grid_thw`), not by `mm_encoder_outputs`, generate's encoding of it; the route refuses it before generate
    runs the vision encoder."""
    import hf_tev
    from hf_tev.generation import tree_speculative_decode

    target = make_hybrid_target("qwen3_5")
    target.config.image_token_id = 90  # inside the tiny vocabulary
    drafter = make_drafter(target)
    vision = target.config.vision_config
    grid = torch.tensor([[1, 4, 4]])  # 16 patches, 4 image tokens after the 2 x 2 merge
    image = dict(pixel_values=torch.randn(16, vision.in_channels * vision.temporal_patch_size * vision.patch_size**2))
    image["image_grid_thw"] = grid
    prompt = torch.tensor([[5, 6, 90, 90, 90, 90, 7, 8]])
    assert target.generate(prompt, **image, max_new_tokens=3, do_sample=False).shape == (1, 11)  # plain works
    names = r"this call passes image input \(`pixel_values`, `image_grid_thw`"
    encode = target.model.get_image_features

    @functools.wraps(encode)  # its signature, which generate and the route read
    def never(*args, **kwargs):
        pytest.fail("the image was encoded")

    monkeypatch.setattr(target.model, "get_image_features", never)
    with pytest.raises(ValueError, match=names + r"\): decode it with plain generate"):
        target.generate(prompt, **image, max_new_tokens=3, assistant_model=drafter)
    monkeypatch.setattr(target.model, "get_image_features", encode)
    hf_tev.disable()  # transformers' own callable route: generate encodes the image before the decoder
    try:
        with pytest.raises(ValueError, match=names + r"; generate encoded it as `mm_encoder_outputs`\)"):
            target.generate(prompt, **image, max_new_tokens=3, custom_generate=tree_speculative_decode, drafter=drafter)
    finally:
        hf_tev.enable()


def test_multimodal_rope_positions_of_a_text_prompt_become_its_text_positions():
    text = torch.arange(6)[None]
    kwargs = text_position_ids({"position_ids": text[None].expand(4, 1, 6), "attention_mask": None})
    assert kwargs["position_ids"].tolist() == text.tolist()
    image = text[None].repeat(4, 1, 1)
    image[1:, 0, 2:] = 2  # an image's grid positions on the rope axes
    with pytest.raises(ValueError, match="multimodal rope positions .* text prompts"):
        text_position_ids({"position_ids": image})


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
def test_the_patch_free_callable_takes_drafter_where_transformers_refuses_assistant_model(family):
    """Without the route (transformers' own `custom_generate` hook), transformers refuses `assistant_model=` on a
    stateful (hybrid) target before the decoder runs; `drafter=` decodes, and docs/usage.md says to pass it."""
    from pathlib import Path

    import hf_tev
    from hf_tev.generation import tree_speculative_decode

    target = make_hybrid_target(family)
    drafter, prompt = make_drafter(target), long_prompt(96)
    expected = target.generate(prompt, do_sample=False, max_new_tokens=8)
    kwargs = dict(do_sample=False, max_new_tokens=8, custom_generate=tree_speculative_decode)
    hf_tev.disable()
    try:
        with pytest.raises(ValueError, match="assisted generation is not supported with stateful models"):
            target.generate(prompt, assistant_model=drafter, **kwargs)
        assert target.generate(prompt, drafter=drafter, **kwargs).tolist() == expected.tolist()
        # the folder form of the hook (custom_generate/ of this repository, as on the Hub) runs before that check
        repository = str(Path(__file__).resolve().parents[2])
        folder_form = dict(kwargs, custom_generate=repository, trust_remote_code=True)
        assert target.generate(prompt, assistant_model=drafter, **folder_form).tolist() == expected.tolist()
    finally:
        hf_tev.enable()
    assert target.generate(prompt, assistant_model=drafter, **kwargs).tolist() == expected.tolist()  # the route
    usage = " ".join((Path(__file__).resolve().parents[2] / "docs" / "usage.md").read_text().split())
    assert "On a hybrid target (Qwen3.5, Qwen3.5-MoE, Qwen3-Next" in usage and "pass the drafter as `drafter=`" in usage
