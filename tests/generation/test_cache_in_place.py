"""The target cache is committed in place: a tree pass writes its nodes after the committed tokens in storage that
stays put across cycles (growing only by doubling), the accepted path moves inside it, and the rest is cropped.
A `BufferLayer` holds exactly what transformers' `DynamicLayer` would hold."""

import torch
from helpers import greedy, make_drafter, make_target, with_oracle
from transformers.cache_utils import DynamicLayer

from hf_tev import TEVConfig
from hf_tev.target_layers import BufferLayer


def random_states(rows: int, length: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(rows, 2, length, 4, generator=generator) for _ in range(2))


def test_a_buffer_layer_holds_what_a_dynamic_layer_holds_and_stays_put():
    plain, buffered = DynamicLayer(), BufferLayer()
    pointers = set()
    for step, (new, crop) in enumerate([(5, 0), (3, 1), (1, 0), (6, 4), (2, 0), (9, 3), (1, 0)]):
        keys, values = random_states(2, new, step)
        expected = plain.update(keys, values)
        got = buffered.update(keys, values)
        for a, b in zip(expected, got, strict=True):
            assert torch.equal(a, b)
        pointers.add(buffered.key_buffer.data_ptr())
        if crop:
            plain.crop(-crop)
            buffered.crop(-crop)
        assert buffered.get_seq_length() == plain.get_seq_length()
    assert len(pointers) == 1  # within its headroom, the storage never moves
    length = buffered.get_seq_length()
    buffered.crop(0)  # transformers' crop: a count of positions to remove, 0 removes nothing
    assert buffered.get_seq_length() == length == plain.get_seq_length()
    # a row selection replaces the tensors: the next update takes them into a new buffer, with the same result
    for layer in (plain, buffered):
        layer.batch_select_indices(torch.tensor([1]))
    keys, values = random_states(1, 2, 99)
    for a, b in zip(plain.update(keys, values), buffered.update(keys, values), strict=True):
        assert torch.equal(a, b)


def test_a_decoding_call_keeps_its_cache_storage_across_cycles(monkeypatch):
    target = make_target("qwen3")
    prompt = torch.tensor([[5, 17, 33, 8, 61, 12]])
    expected = greedy(target, prompt, max_new_tokens=300)
    buffers = {}  # layer -> the storage each update wrote into
    update = BufferLayer.update

    def recording_update(self, key_states, value_states, *args, **kwargs):
        out = update(self, key_states, value_states, *args, **kwargs)
        buffers.setdefault(id(self), []).append(self.key_buffer.data_ptr())
        return out

    monkeypatch.setattr(BufferLayer, "update", recording_update)
    drafter = with_oracle(make_drafter(target), expected)
    out = greedy(
        target,
        prompt,
        max_new_tokens=300,
        assistant_model=drafter,
        tev_config=TEVConfig(budget=4),
        return_dict_in_generate=True,
    )
    assert out.sequences.tolist() == expected.tolist()
    assert max(out.tev_stats.accepted_lengths) > 2  # paths were committed, entries moved
    assert len(buffers) == target.config.num_hidden_layers
    for pointers in buffers.values():
        cycles, storages = len(pointers), len(dict.fromkeys(pointers))
        # the prefill's buffer holds 256 positions more; past them it grows once, by as much again
        assert cycles >= 30 and storages == 2, (cycles, storages)


def test_a_batchs_tree_mask_stays_put_across_cycles(monkeypatch):
    """The batch path writes each cycle's tree block and newly committed columns into one mask buffer: over a
    call of many cycles the masks handed to the tree pass share one storage, and every row equals its prompt
    decoded alone."""
    import hf_tev.generation.loop as loop

    target = make_target("qwen3")
    prompts = torch.tensor([[0, 0, 5, 17, 33], [8, 61, 12, 9, 40]])
    mask = (prompts != 0).long()
    expected = greedy(target, prompts, attention_mask=mask, max_new_tokens=60)
    storages = []
    tree_forward = loop.tree_forward

    def recording(model, tokens, cache, masks, positions, hidden_indices):
        storages.append(masks.untyped_storage().data_ptr())
        return tree_forward(model, tokens, cache, masks, positions, hidden_indices)

    monkeypatch.setattr(loop, "tree_forward", recording)
    out = target.generate(
        prompts, attention_mask=mask, max_new_tokens=60, assistant_model=make_drafter(target),
        tev_config=TEVConfig(budget=4, lookup=False), do_sample=False,
    )  # fmt: skip
    assert out.tolist() == expected.tolist()
    assert len(storages) >= 20 and len(set(storages)) <= 2, (len(storages), len(set(storages)))
