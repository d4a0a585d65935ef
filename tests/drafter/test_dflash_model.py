"""DFlash drafter: published checkpoint layout, the maths of docs/design.md#the-dflash-drafter, cache semantics,
native transformers DFlash generation, and clear errors for what does not fit."""

import json
import math
from collections import Counter

import pytest
import torch
from helpers import (
    EPS,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    THETA,
    VOCAB,
    make_target,
    published_config,
    published_weights,
    write_checkpoint,
)
from safetensors.torch import load_file, save_file

from hf_tev.models.dflash.configuration_dflash import DFlashConfig, default_target_layer_ids
from hf_tev.models.dflash.modeling_dflash import DFlashDraftModel, default_mask_token_id

# ----------------------------------------------------------------------------- a published-style checkpoint


@pytest.fixture
def checkpoint(tmp_path):
    weights = published_weights(num_layers=2, num_features=2)
    return write_checkpoint(tmp_path / "published", published_config(), weights), weights


# ----------------------------------------------------------------- docs/design.md#the-dflash-drafter, written out


def reference_block_rows(w: dict, noise, context_features, positions, num_layers: int):
    """Plain-torch float64 re-computation of the drafter forward for one sequence.

    noise: [L, H]; context_features: [c, k*H]; positions: [c + L]. Returns the final-normed block rows [L, H].
    """
    w = {k: v.double() for k, v in w.items()}
    noise, context_features = noise.double(), context_features.double()
    block_len = noise.shape[0]

    def rmsnorm(x, weight):
        return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS)

    inv_freq = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    angles = positions.double()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [c + L, head_dim]

    def rope(x, cos, sin):  # x: [S, heads, head_dim]
        x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
        return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]

    context = rmsnorm(context_features @ w["fc.weight"].T, w["hidden_norm.weight"])
    h = noise
    for n in range(num_layers):
        p = f"layers.{n}."
        a = rmsnorm(h, w[p + "input_layernorm.weight"])
        kv_in = torch.cat([context, a])  # context rows, then block rows
        q = rmsnorm(
            (a @ w[p + "self_attn.q_proj.weight"].T).view(block_len, HEADS, HEAD_DIM), w[p + "self_attn.q_norm.weight"]
        )
        k = rmsnorm(
            (kv_in @ w[p + "self_attn.k_proj.weight"].T).view(-1, KV_HEADS, HEAD_DIM), w[p + "self_attn.k_norm.weight"]
        )
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(-1, KV_HEADS, HEAD_DIM)
        q, k = rope(q, cos[-block_len:], sin[-block_len:]), rope(k, cos, sin)
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
        probs = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM), -1)  # no mask at all
        attn = torch.einsum("hqk,khd->qhd", probs, v).reshape(block_len, HEADS * HEAD_DIM)
        h = h + attn @ w[p + "self_attn.o_proj.weight"].T
        m = rmsnorm(h, w[p + "post_attention_layernorm.weight"])
        h = (
            h
            + (torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T))
            @ w[p + "mlp.down_proj.weight"].T
        )
    return rmsnorm(h, w["norm.weight"])


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_published_checkpoint_loads_strictly_and_matches_reference(checkpoint, attn_implementation):
    folder, weights = checkpoint
    drafter = DFlashDraftModel.from_pretrained(folder, attn_implementation=attn_implementation)
    assert not drafter.training and drafter.config._attn_implementation == attn_implementation
    assert drafter.dtype == torch.float32
    assert (drafter.config.block_size, drafter.config.mask_token_id, drafter.config.target_layer_ids) == (4, 95, [1, 3])
    assert drafter.config.num_target_layers == 6 and drafter.config.rope_parameters["rope_theta"] == THETA
    assert drafter.target_hidden_indices == [2, 4]

    torch.manual_seed(1)
    batch, ctx_len, block_len, start = 2, 5, 4, 3
    noise = torch.randn(batch, block_len, HIDDEN)
    features = torch.randn(batch, ctx_len, 2 * HIDDEN)
    positions = torch.arange(start, start + ctx_len + block_len)[None].expand(batch, -1)
    with torch.no_grad():
        out = drafter(noise, features, positions).last_hidden_state
    for b in range(batch):
        expected = reference_block_rows(weights, noise[b], features[b], positions[b], num_layers=2)
        torch.testing.assert_close(out[b].double(), expected, atol=2e-5, rtol=2e-5)


def test_save_pretrained_round_trip_is_bit_identical(tmp_path):
    weights = published_weights(num_layers=2, num_features=2, dtype=torch.bfloat16)
    source = write_checkpoint(tmp_path / "src", published_config(dtype="bfloat16"), weights)
    drafter = DFlashDraftModel.from_pretrained(source)
    assert drafter.dtype == torch.bfloat16
    drafter.save_pretrained(tmp_path / "saved")

    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == ["config.json", "model.safetensors"]
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert sorted(saved) == sorted(weights)  # exactly the published names: no embeddings, no LM head
    for name, tensor in weights.items():
        assert saved[name].dtype == tensor.dtype and torch.equal(saved[name], tensor), name

    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    original = published_config(dtype="bfloat16")
    assert config["model_type"] == "qwen3" and config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"] == original["dflash_config"]
    assert "target_layer_ids" not in config and "mask_token_id" not in config  # only inside dflash_config
    for key in (
        "block_size",
        "num_target_layers",
        "auto_map",
        "rope_theta",
        "rope_scaling",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "rms_norm_eps",
        "vocab_size",
        "layer_types",
        "use_sliding_window",
        "sliding_window",
    ):
        assert config.get(key) == original[key], key  # a null rope_scaling is left out (4.x reads it as null)
    assert config["dtype"] == "bfloat16" and "rope_scaling" not in config

    reloaded = DFlashDraftModel.from_pretrained(tmp_path / "saved")
    reloaded.save_pretrained(tmp_path / "again")
    saved_bytes = (tmp_path / "saved" / "model.safetensors").read_bytes()
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == saved_bytes
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == config


def test_block_size_inside_dflash_config(tmp_path):
    config = published_config(block_size=6, block_size_in_dflash_config=True)
    folder = write_checkpoint(tmp_path / "src", config, published_weights(2, 2))
    drafter = DFlashDraftModel.from_pretrained(folder)
    assert drafter.config.block_size == 6
    drafter.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["dflash_config"]["block_size"] == 6 and saved["block_size"] == 6


def test_default_target_layer_ids_rule():
    # docs/design.md#the-dflash-drafter, and the published Qwen3-8B-b16 values (5 draft layers, 36 target layers).
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(7, 1) == [3]
    assert default_target_layer_ids(8, 3) == [1, 3, 5]
    assert default_target_layer_ids(10, 4) == [1, 3, 5, 7]  # 1 + i * 6 / 3


@pytest.mark.parametrize("num_layers, expected", [(1, [3]), (3, [1, 2, 4])])
def test_checkpoint_without_target_layer_ids_uses_default_rule(tmp_path, num_layers, expected):
    # 7 target layers: one draft layer reads layer 7 // 2 = 3; three read round(1 + i * 3 / 2) = 1, 2, 4
    # (Python rounds 2.5 half to even, as the publishers' code does).
    config = published_config(num_layers=num_layers, num_target_layers=7, target_layer_ids=None)
    assert DFlashConfig(**config).target_layer_ids == expected
    folder = write_checkpoint(tmp_path / "src", config, published_weights(num_layers, len(expected)))
    drafter = DFlashDraftModel.from_pretrained(folder)
    assert drafter.config.target_layer_ids == expected
    assert drafter.fc.weight.shape == (HIDDEN, len(expected) * HIDDEN)


# ----------------------------------------------------------------------------- running against real targets


def full_hidden_features(target, drafter, ids):
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    return drafter.context_features(out.hidden_states)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_draft_logits_with_cache_equals_full_context(arch):
    target = make_target(arch)
    drafter = DFlashDraftModel.from_target(target, num_layers=2, block_size=5)
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(0))
    features = full_hidden_features(target, drafter, ids)  # [1, 12, 2H]
    mask = drafter.config.mask_token_id
    block = torch.tensor([[ids[0, -1].item(), mask, mask, mask, mask]])  # root = some token, then masks
    n1, n2 = 7, 12  # first call: context rows 0..6; second call: rows 7..11

    cache = drafter.new_cache()
    with torch.no_grad():
        drafter.draft_logits(target, features[:, :n1], block, torch.arange(n1 + 5)[None], cache)
        assert cache.get_seq_length() == n1  # block rows cropped, context kept
        cached = drafter.draft_logits(target, features[:, n1:n2], block, torch.arange(n1, n2 + 5)[None], cache)
        assert cache.get_seq_length() == n2
        full = drafter.draft_logits(target, features[:, :n2], block, torch.arange(n2 + 5)[None])
    assert cached.shape == (1, 4, VOCAB)
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)
    # and it is the target's LM head on the drafter's block rows 1..L-1
    with torch.no_grad():
        rows = drafter(target.get_input_embeddings()(block), features, torch.arange(n2 + 5)[None]).last_hidden_state
    torch.testing.assert_close(full, target.lm_head(rows[:, 1:]))
    # scoring fewer depths gives the same first rows (the block is still drafted whole)
    with torch.no_grad():
        first = drafter.draft_logits(target, features[:, :n2], block, torch.arange(n2 + 5)[None], num_depths=2)
    assert first.shape == (1, 2, VOCAB)
    torch.testing.assert_close(first, full[:, :2])
    for bad in (-1, 5, 2.0, True):
        with pytest.raises(ValueError, match="num_depths"):
            drafter.draft_logits(target, features[:, :n2], block, torch.arange(n2 + 5)[None], num_depths=bad)


def test_context_features_from_selective_hidden_states():
    target = make_target("qwen3", num_layers=8)
    drafter = DFlashDraftModel.from_target(target, num_layers=2)
    assert drafter.config.target_layer_ids == [1, 5] and drafter.target_hidden_indices == [2, 6]
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        selective = target(ids, output_hidden_states=drafter.target_hidden_indices).hidden_states
        full = target(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(drafter.context_features(selective), drafter.context_features(full))
    expected = torch.cat([full[i + 1] for i in drafter.config.target_layer_ids], -1)
    torch.testing.assert_close(drafter.context_features(full), expected)


def test_multi_block_4d_and_padding_2d_masks(qwen3_target):
    """Training layout: two blocks in one forward with a block-structured 4D mask equal two separate forwards;
    a 2D padding mask hides context rows exactly like leaving them out."""
    drafter = DFlashDraftModel.from_target(qwen3_target, num_layers=1, block_size=4)
    torch.manual_seed(3)
    features = torch.randn(1, 10, 64)  # one target layer of hidden size 64
    noise = torch.randn(1, 8, 64)
    # block A drafts after context rows 0..3 (positions 4..7); block B after rows 0..6 (positions 7..10)
    positions = torch.cat([torch.arange(10), torch.arange(4, 8), torch.arange(7, 11)])[None]
    visible = torch.zeros(8, 18, dtype=torch.bool)
    visible[:4, :4] = True
    visible[:4, 10:14] = True
    visible[4:, :7] = True
    visible[4:, 14:18] = True
    mask = torch.zeros(1, 1, 8, 18).masked_fill(~visible, torch.finfo(torch.float32).min)
    with torch.no_grad():
        both = drafter(noise, features, positions, attention_mask=mask).last_hidden_state
        block_a = drafter(noise[:, :4], features[:, :4], torch.arange(8)[None]).last_hidden_state
        block_b = drafter(noise[:, 4:], features[:, :7], torch.arange(11)[None]).last_hidden_state
        bool_mask = drafter(noise, features, positions, attention_mask=visible[None, None]).last_hidden_state
    torch.testing.assert_close(both[:, :4], block_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(both[:, 4:], block_b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bool_mask, both)

    padding = torch.ones(1, 14, dtype=torch.long)
    padding[:, :3] = 0  # hide the first three context rows
    with torch.no_grad():
        padded = drafter(noise[:, :4], features, torch.arange(14)[None], attention_mask=padding).last_hidden_state
        dropped = drafter(noise[:, :4], features[:, 3:], torch.arange(3, 14)[None]).last_hidden_state
    torch.testing.assert_close(padded, dropped, atol=1e-5, rtol=1e-5)


def steer_towards(drafter, target, tokens):
    """Make a random drafter propose tokens the target generates, so that the native path accepts drafts too.

    With its residual branches scaled down, a block row's final state is close to norm(embedding of its input),
    so a mask token whose embedding scores a frequently generated token makes the drafter propose that token.
    """
    with torch.no_grad():
        for layer in drafter.layers:
            layer.self_attn.o_proj.weight.mul_(0.02)
            layer.mlp.down_proj.weight.mul_(0.02)
        proposal = target.lm_head(drafter.norm(target.get_input_embeddings().weight)).argmax(-1)  # per mask id
    wanted = next(y for y, _ in Counter(tokens.tolist()).most_common() if (proposal == y).any())
    drafter.config.mask_token_id = int((proposal == wanted).nonzero()[0])


@pytest.mark.parametrize("arch, left_pad", [("qwen3", 0), ("qwen3", 2), ("llama", 0)])
def test_native_transformers_dflash_generate(arch, left_pad):
    """transformers' own speculation_type="dflash" path runs our drafter, returns the target's greedy output,
    and every drafter call it makes (with its DFlashCache, after rejected and after accepted drafts) equals a
    cache-free forward over all context rows so far."""
    target = make_target(arch)
    drafter = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    prompt = torch.tensor([[0] * left_pad + [1, 5, 7, 9, 11, 3]])
    attention_mask = (prompt != 0).long() if left_pad else None
    with torch.no_grad():
        ref = target.generate(prompt, attention_mask=attention_mask, max_new_tokens=32, do_sample=False)
    steer_towards(drafter, target, ref[0, prompt.shape[1] :])
    calls = []

    def record(module, args, kwargs, output):
        calls.append(
            {k: kwargs[k].clone() for k in ("noise_embeds", "context_hidden_states", "position_ids")}
            | {"attention_mask": kwargs["attention_mask"], "out": output.last_hidden_state.clone()}
        )

    handle = drafter.register_forward_hook(record, with_kwargs=True)
    with torch.no_grad():
        out = target.generate(
            prompt,
            attention_mask=attention_mask,
            max_new_tokens=32,
            do_sample=False,
            assistant_model=drafter,
            speculation_type="dflash",
        )
    handle.remove()
    assert torch.equal(out, ref)

    new_rows = [call["context_hidden_states"].shape[1] for call in calls]
    assert len(calls) > 3 and max(new_rows[1:]) > 1  # some drafts were accepted
    context, context_positions = [], []
    for call, rows in zip(calls, new_rows, strict=True):
        context.append(call["context_hidden_states"])
        context_positions.append(call["position_ids"][:, :rows])
        all_context, all_positions = torch.cat(context, 1), torch.cat(context_positions, 1)
        if left_pad:  # padded prompts reach the drafter's 2D-mask path
            assert call["attention_mask"] is not None and call["attention_mask"].dim() == 2
        else:  # context rows arrive once each, in order
            assert torch.equal(all_positions[0], torch.arange(all_positions.shape[1]))
        with torch.no_grad():
            replay = drafter(
                call["noise_embeds"],
                all_context,
                torch.cat([all_positions, call["position_ids"][:, rows:]], 1),
                attention_mask=call["attention_mask"],
            ).last_hidden_state
        torch.testing.assert_close(replay, call["out"], atol=1e-5, rtol=1e-5)


def test_from_target_sizes_and_mask_rule(tmp_path, qwen3_target, llama_target):
    from transformers import LlamaConfig, LlamaForCausalLM

    drafter = DFlashDraftModel.from_target(qwen3_target, num_layers=2, block_size=8)
    tc = qwen3_target.config
    cfg = drafter.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (
        tc.hidden_size,
        tc.num_attention_heads,
        tc.num_key_value_heads,
        tc.head_dim,
        tc.vocab_size,
    )
    assert cfg.rope_parameters == tc.rope_parameters and cfg.rms_norm_eps == tc.rms_norm_eps
    assert (cfg.num_target_layers, cfg.target_layer_ids, cfg.block_size) == (4, default_target_layer_ids(4, 2), 8)
    assert cfg.mask_token_id == 0  # the target's pad id (0) differs from its eos (2)
    assert not any("embed" in n or "lm_head" in n for n, _ in drafter.named_parameters())
    assert DFlashDraftModel.from_target(llama_target, mask_token_id=7).config.mask_token_id == 7
    # any set of target layers, read in the given order; fc takes one hidden-size slice per layer
    wide = DFlashDraftModel.from_target(qwen3_target, num_layers=1, target_layer_ids=[0, 1, 3])
    assert wide.config.target_layer_ids == [0, 1, 3] and wide.fc.in_features == 3 * tc.hidden_size
    assert wide.target_hidden_indices == [1, 2, 4]
    for bad in ([], [4], [-1]):
        with pytest.raises(ValueError, match="target_layer_ids"):
            DFlashDraftModel.from_target(qwen3_target, target_layer_ids=bad)

    # a Llama-3.1-style "llama3" rope is copied, computed like the target's, and survives a save round trip
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            eos_token_id=2,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    ).eval()
    drafter = DFlashDraftModel.from_target(llama)
    assert torch.equal(drafter.rotary_emb.inv_freq, llama.model.rotary_emb.inv_freq)
    assert drafter.config.mask_token_id == 63  # no pad token: the last vocabulary id
    drafter.save_pretrained(tmp_path / "llama3")
    reloaded = DFlashDraftModel.from_pretrained(tmp_path / "llama3")
    assert reloaded.config.rope_parameters == llama.config.rope_parameters
    assert torch.equal(reloaded.rotary_emb.inv_freq, llama.model.rotary_emb.inv_freq)

    class Cfg:  # pad == eos, or no pad at all: the last vocabulary id
        vocab_size, eos_token_id, pad_token_id = 100, [2, 5], 5

    assert default_mask_token_id(Cfg) == 99
    Cfg.pad_token_id = None
    assert default_mask_token_id(Cfg) == 99


def test_bf16_target_draft_logits():
    target = make_target("qwen3", dtype=torch.bfloat16)
    drafter = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    assert drafter.dtype == torch.bfloat16
    features = full_hidden_features(target, drafter, torch.tensor([[1, 4, 9, 16, 25]]))
    mask = drafter.config.mask_token_id
    cache = drafter.new_cache()
    with torch.no_grad():
        logits = drafter.draft_logits(
            target, features, torch.tensor([[3, mask, mask, mask]]), torch.arange(9)[None], cache
        )
    assert logits.shape == (1, 3, VOCAB) and logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    assert cache.get_seq_length() == 5


# ----------------------------------------------------------------------------- clear errors


def test_refuses_pickle_only_folder(tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(published_config()))
    torch.save(published_weights(2, 2), folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"safetensors.*pytorch_model\.bin"):
        DFlashDraftModel.from_pretrained(folder)


def cached_repo(cache, name, files_writer, absent=()):
    """A Hub repo `org/<name>` in the Hub cache folder `cache`, its snapshot written by `files_writer`; the files
    in `absent` are recorded as not in the repo, as the cache records what the Hub answered."""
    repo = cache / f"models--org--{name}"
    files_writer(repo / "snapshots" / ("a" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    for file in absent:
        (repo / ".no_exist" / ("a" * 40)).mkdir(parents=True, exist_ok=True)
        (repo / ".no_exist" / ("a" * 40) / file).touch()


def test_hub_id_loads_from_cache_and_refuses_pickle_only_repo(tmp_path):
    """Hub ids go through the same safetensors-only rule (an offline fake Hub cache stands in for the Hub)."""

    def pickled(folder):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(published_config()))
        torch.save(published_weights(2, 2), folder / "pytorch_model.bin")

    cache = tmp_path / "hub"
    cached_repo(cache, "good", lambda folder: write_checkpoint(folder, published_config(), published_weights(2, 2)))
    no_safetensors = ("model.safetensors", "model.safetensors.index.json")
    cached_repo(cache, "pickled", pickled, absent=no_safetensors)
    hub = dict(cache_dir=cache, local_files_only=True)
    assert DFlashDraftModel.from_pretrained("org/good", **hub).config.target_layer_ids == [1, 3]
    with pytest.raises(ValueError, match=r"org/pickled has no model\.safetensors.*refuses pickle"):
        DFlashDraftModel.from_pretrained("org/pickled", **hub)

    def index_to_bin(folder):
        write_checkpoint(folder, published_config(), published_weights(2, 2))
        _index_to_bin(folder)

    cached_repo(cache, "binshards", index_to_bin, absent=["model.safetensors"])
    with pytest.raises(ValueError, match=r"org/binshards: model\.safetensors\.index\.json points at non-safetensors"):
        DFlashDraftModel.from_pretrained("org/binshards", **hub)

    def sharded(folder):
        write_checkpoint(folder, published_config(), published_weights(2, 2))
        _shard(folder)

    cached_repo(cache, "sharded", sharded, absent=["model.safetensors"])
    assert DFlashDraftModel.from_pretrained("org/sharded", **hub).config.target_layer_ids == [1, 3]


def test_hub_errors_are_transformers_own_with_what_was_needed(tmp_path, monkeypatch):
    """Offline mode, a gated repo, a missing repo: transformers' words, then the file DFlashDraftModel needed."""
    import httpx2
    import transformers.utils.hub
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # HF_HUB_OFFLINE=1 (the constant is read at import)
    cache = tmp_path / "hub"
    cache.mkdir()
    with pytest.raises(OSError, match=r"(?s)offline mode.*from_pretrained\('z-lab/Qwen3-4B-DFlash-b16'\) needs config"):
        DFlashDraftModel.from_pretrained("z-lab/Qwen3-4B-DFlash-b16", cache_dir=cache)

    def config_only(folder):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(published_config()))

    cached_repo(cache, "weights-not-cached", config_only)  # offline, the weights cannot be fetched: not "no weights"
    with pytest.raises(OSError, match=r"(?s)offline mode.*needs model\.safetensors: the drafter's weights"):
        DFlashDraftModel.from_pretrained("org/weights-not-cached", cache_dir=cache)

    request = httpx2.Request("GET", "https://huggingface.co/org/private/resolve/main/config.json")
    for error, said in [
        (
            GatedRepoError(
                "Access to model org/private is restricted.", response=httpx2.Response(401, request=request)
            ),
            r"(?s)gated repo.*org/private is restricted.*needs config\.json",
        ),
        (
            RepositoryNotFoundError("Repository Not Found", response=httpx2.Response(404, request=request)),
            r"(?s)org/private is not a local folder and is not a valid model identifier.*needs config\.json",
        ),
    ]:

        def hub_answers(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(transformers.utils.hub, "hf_hub_download", hub_answers)
        with pytest.raises(OSError, match=said):
            DFlashDraftModel.from_pretrained("org/private", cache_dir=cache)


def test_refuses_missing_unexpected_and_misshaped_weights(tmp_path):
    weights = published_weights(2, 2)
    missing = {k: v for k, v in weights.items() if k != "hidden_norm.weight"}
    with pytest.raises(ValueError, match=r"missing weights.*hidden_norm\.weight"):
        DFlashDraftModel.from_pretrained(write_checkpoint(tmp_path / "missing", published_config(), missing))

    extra = dict(weights, **{"embed_tokens.weight": torch.zeros(VOCAB, HIDDEN)})
    with pytest.raises(ValueError, match=r"unexpected weights.*embed_tokens\.weight"):
        DFlashDraftModel.from_pretrained(write_checkpoint(tmp_path / "extra", published_config(), extra))

    # three target layers in the config, but fc was trained for two
    config = published_config(target_layer_ids=(1, 2, 3))
    with pytest.raises(ValueError, match=r"fc\.weight"):
        DFlashDraftModel.from_pretrained(write_checkpoint(tmp_path / "shape", config, weights))


@pytest.mark.parametrize(
    "change, named",
    [
        ({"use_sliding_window": True, "sliding_window": None, "layer_types": ["sliding_attention"] * 2}, "window"),
        (
            {"dflash_config": {"target_layer_ids": [1, 3], "mask_token_id": 95, "projector_type": "mlp"}},
            "dflash_config.projector_type",
        ),
        (
            {"dflash_config": {"target_layer_ids": [1, 3], "mask_token_id": 95, "final_logit_softcapping": 20.0}},
            "final_logit_softcapping",
        ),
        ({"output_multiplier": 0.5}, "output_multiplier"),
        ({"is_causal": True}, "is_causal"),
        ({"dflash_config": {"target_layer_ids": [1, 9], "mask_token_id": 95}}, "num_target_layers"),
    ],
)
def test_refuses_unsupported_config_values(tmp_path, change, named):
    config = published_config() | change
    folder = write_checkpoint(tmp_path / "variant", config, published_weights(2, 2))
    with pytest.raises(ValueError, match=named):
        DFlashDraftModel.from_pretrained(folder)


def test_accepts_neutral_variant_fields(tmp_path):
    config = published_config() | {"is_causal": False}
    config["dflash_config"] |= {"output_multiplier": 1.0, "final_logit_softcapping": None}
    drafter = DFlashDraftModel.from_pretrained(write_checkpoint(tmp_path / "neutral", config, published_weights(2, 2)))
    assert drafter.config.target_layer_ids == [1, 3]


def test_check_target_names_the_mismatch(tmp_path, checkpoint):
    folder, _ = checkpoint
    drafter = DFlashDraftModel.from_pretrained(folder)  # hidden 32, vocab 96, 6 target layers
    with pytest.raises(ValueError, match=r"hidden size: drafter 32, target 64"):
        drafter.check_target(make_target("qwen3", hidden_size=64, num_layers=6))
    with pytest.raises(ValueError, match=r"vocabulary: drafter 96, target LM head 128"):
        drafter.check_target(make_target("qwen3", hidden_size=32, vocab_size=128, num_layers=6))
    with pytest.raises(ValueError, match=r"built for 6 target layers, target has 4"):
        drafter.check_target(make_target("qwen3", hidden_size=32, num_layers=4))
    drafter.check_target(make_target("qwen3", hidden_size=32, num_layers=6))  # fits
    drafter.config.mask_token_id = 500
    with pytest.raises(ValueError, match=r"mask_token_id 500 outside"):
        drafter.check_target(make_target("qwen3", hidden_size=32, num_layers=6))


def test_forward_input_errors(qwen3_target):
    drafter = DFlashDraftModel.from_target(qwen3_target, block_size=4)
    noise, features = torch.zeros(1, 4, 64), torch.zeros(1, 3, 64)
    with pytest.raises(ValueError, match="position_ids cover 6 rows"):
        drafter(noise, features, torch.arange(6)[None])
    with pytest.raises(ValueError, match="2D attention_mask has 5 columns"):
        drafter(noise, features, torch.arange(7)[None], attention_mask=torch.ones(1, 5))
    with pytest.raises(TypeError, match="unexpected arguments"):
        drafter(noise, features, torch.arange(7)[None], output_router_logits=True)


@pytest.mark.parametrize("drafter_dtype", [torch.float32, torch.bfloat16])
def test_drafter_runs_in_its_own_dtype_and_returns_the_callers(drafter_dtype):
    """Features and block embeddings are cast at the boundary; the block rows come back in the dtype of
    `noise_embeds` (the target's LM head reads them), in draft_logits and in transformers' native DFlash path."""
    target = make_target("qwen3", dtype=torch.bfloat16 if drafter_dtype == torch.float32 else torch.float32)
    drafter = DFlashDraftModel.from_target(make_target("qwen3"), num_layers=1, block_size=4).to(drafter_dtype)
    features = full_hidden_features(target, drafter, torch.tensor([[1, 4, 9, 16, 25]]))
    mask = drafter.config.mask_token_id
    with torch.no_grad():
        rows = drafter(
            target.get_input_embeddings()(torch.tensor([[3, mask, mask, mask]])), features, torch.arange(9)[None]
        )
        logits = drafter.draft_logits(target, features, torch.tensor([[3, mask, mask, mask]]), torch.arange(9)[None])
    assert rows.last_hidden_state.dtype == target.dtype and logits.dtype == target.dtype
    assert torch.isfinite(logits).all() and drafter.fc.weight.dtype == drafter_dtype
    prompt = torch.tensor([[1, 5, 9, 13, 7]])
    out = target.generate(prompt, do_sample=False, max_new_tokens=6, assistant_model=drafter, speculation_type="dflash")
    assert out.shape == (1, 11)


def test_from_target_names_the_argument(qwen3_target):
    for kwargs, named in [
        ({"num_layers": 0}, r"from_target\(num_layers=0\)"),
        ({"num_layers": 1.5}, r"from_target\(num_layers=1\.5\)"),
        ({"block_size": 1}, r"from_target\(block_size=1\)"),
        ({"mask_token_id": 500}, r"from_target\(mask_token_id=500\)"),
        ({"target_layer_ids": []}, r"from_target\(target_layer_ids=\[\]\)"),
        ({"target_layer_ids": [4]}, r"from_target\(target_layer_ids=\[4\]\)"),
    ]:
        with pytest.raises(ValueError, match=named):
            DFlashDraftModel.from_target(qwen3_target, **kwargs)


def _index_to_bin(folder):
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save(weights, folder / "pytorch_model-00001-of-00001.bin")
    index = {"metadata": {}, "weight_map": dict.fromkeys(weights, "pytorch_model-00001-of-00001.bin")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _int_fc(folder):
    weights = load_file(folder / "model.safetensors")
    weights["fc.weight"] = weights["fc.weight"].to(torch.int32)
    save_file(weights, str(folder / "model.safetensors"))


def _index_missing_shard(folder):
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": dict.fromkeys(weights, "model-00001-of-00002.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize(
    "damage, error, named",
    [
        (_index_to_bin, ValueError, r"index\.json points at non-safetensors shards \['pytorch_model-00001"),
        (_int_fc, ValueError, r"not floating point: fc\.weight \(I32\)"),
        (lambda folder: (folder / "config.json").unlink(), OSError, r"has no config\.json"),
        (_index_missing_shard, OSError, r"shards that are not there: \['model-00001-of-00002"),
        (None, OSError, r"no such folder"),
    ],
)
def test_loading_problems_get_their_own_message(checkpoint, tmp_path, damage, error, named):
    folder, _ = checkpoint
    if damage is None:
        folder = tmp_path / "not" / "there"
    else:
        damage(folder)
    with pytest.raises(error, match=named):
        DFlashDraftModel.from_pretrained(folder)


def _shard(folder):
    """Replace `model.safetensors` by two shards and their index."""
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(folder / shard), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_sharded_safetensors_checkpoint_loads(checkpoint):
    folder, weights = checkpoint
    _shard(folder)
    drafter = DFlashDraftModel.from_pretrained(folder)
    assert torch.equal(drafter.fc.weight, weights["fc.weight"])


@pytest.mark.parametrize(
    "index, said",
    [
        ('{"weight_map": {"fc.weight": ', r"is not valid JSON: Expecting value: line 1 column 30"),
        ('["model-00001-of-00002.safetensors"]', r"has no weight_map of weight names to shard files"),
        ('{"weight_map": {"fc.weight": "model-00001-of-00002.safetensors"}}', r"has no metadata entry"),
    ],
)
def test_a_broken_index_is_named_with_its_error(checkpoint, index, said):
    folder, _ = checkpoint
    _shard(folder)
    (folder / "model.safetensors.index.json").write_text(index)
    with pytest.raises(
        ValueError, match=rf"model\.safetensors\.index\.json \({folder}/model\.safetensors\.index\.json\) {said}"
    ):
        DFlashDraftModel.from_pretrained(folder)


def test_generate_without_hf_tev_says_how_to_use_a_drafter(qwen3_target):
    """A `generate` hf_tev does not route (hf_tev disabled, no speculation_type) reaches transformers' classic
    assisted generation, which cannot run a DFlash drafter: the error says what to do, before any model call;
    transformers' own DFlash chain still runs it."""
    import hf_tev

    drafter = DFlashDraftModel.from_target(qwen3_target, num_layers=1, block_size=4)
    assert not hasattr(drafter, "generation_config")  # the Trainer asks with hasattr
    calls = []
    handle = qwen3_target.register_forward_pre_hook(lambda *args: calls.append(1))
    prompt = torch.tensor([[1, 5, 7, 9]])
    hf_tev.disable()
    try:
        with pytest.raises(AttributeError, match=r"hf_tev\.enable\(\).*speculation_type=\"dflash\""):
            qwen3_target.generate(prompt, assistant_model=drafter, max_new_tokens=4, do_sample=False)
        assert calls == []
        handle.remove()
        out = qwen3_target.generate(
            prompt, assistant_model=drafter, speculation_type="dflash", max_new_tokens=4, do_sample=False
        )
        assert torch.equal(out, qwen3_target.generate(prompt, max_new_tokens=4, do_sample=False))
    finally:
        hf_tev.enable()
        handle.remove()


@pytest.mark.parametrize("rope", [None, {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}])
def test_saved_config_reloads_without_a_deprecation_warning(tmp_path, rope):
    """A saved drafter's config.json is read back (by DFlashDraftModel, and by the plain `PreTrainedConfig` that
    `Trainer` reads when it resumes) with no deprecation warning, and with a default rope with nothing said."""
    import logging
    import warnings

    from transformers import PreTrainedConfig, Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging

    common = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4)
    target = Qwen3ForCausalLM(Qwen3Config(**common, num_key_value_heads=2, head_dim=8))
    if rope is not None:
        target = Qwen3ForCausalLM(Qwen3Config(**common, num_key_value_heads=2, head_dim=8, rope_parameters=rope))
    DFlashDraftModel.from_target(target, block_size=4).save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["rope_theta"] == 10000.0 and saved.get("rope_scaling") == (
        None if rope is None else {"rope_type": "linear", "factor": 2.0}
    )  # what transformers 4.x (the publishers' code) reads

    records = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = records.append
    library_logger = hf_logging.get_logger()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    library_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            PreTrainedConfig.from_json_file(str(tmp_path / "saved" / "config.json"))
            reloaded = DFlashDraftModel.from_pretrained(tmp_path / "saved")
    finally:
        library_logger.removeHandler(handler)
        hf_logging.set_verbosity(verbosity)
    said = [str(w.message) for w in caught] + [r.getMessage() for r in records]
    assert not [text for text in said if "deprecat" in text.lower()], said
    if rope is None:  # the usual case (the published Qwen3 drafters): nothing at all is said
        assert not said, said
    # A scaled rope keeps `rope_scaling` for transformers 4.x, which the plain `PreTrainedConfig` mentions once.
    assert reloaded.config.rope_parameters == target.config.rope_parameters


def test_no_drafter_named_is_refused_before_the_hub_is_asked():
    """`from_pretrained(None)` (what `default_drafter` gives where no drafter ships) names the cause, not a Hub
    repo called 'None'."""
    with pytest.raises(ValueError, match=r"from_pretrained\(None\): no drafter was named.*default_drafter"):
        DFlashDraftModel.from_pretrained(None)
