"""The feature cache of ExitTrain: batched features equal single-row forwards, the cache is incremental and
refuses another target or layout, and a training step on cached features equals one with the target forward."""

import json

import numpy as np
import pytest
import torch
from helpers import make_drafter, make_target, training_args

import hf_tev.training.features as features_module
from hf_tev.training import (
    CONTEXT_FEATURES,
    CachedFeatureDataset,
    ExitDataCollator,
    ExitTrainer,
    FeatureCache,
    compute_context_features,
)

LAYERS = [0, 2]


@pytest.fixture
def target():
    return make_target("qwen3")


def layers_drafter(target):
    """A drafter that reads target layers `LAYERS`."""
    return make_drafter(target, block_size=4, seed=0, target_layer_ids=LAYERS)


def make_rows(n=6, seed=1):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 20, (n,), generator=generator).tolist()
    return [
        {"input_ids": torch.randint(3, 96, (length,), generator=generator).tolist(), "prompt_length": 2}
        for length in lengths
    ]


def single_row_features(target, drafter, ids):
    with torch.no_grad():
        return drafter.context_features(target(torch.tensor([ids]), output_hidden_states=True).hidden_states)[0]


def test_padded_batch_features_equal_single_row_forwards(target):
    drafter = layers_drafter(target)
    rows = make_rows()
    batched = compute_context_features(target, LAYERS, [row["input_ids"] for row in rows])
    for row, features in zip(rows, batched, strict=True):
        assert features.shape == (len(row["input_ids"]), 2 * 64)
        torch.testing.assert_close(
            features, single_row_features(target, drafter, row["input_ids"]), rtol=1e-5, atol=1e-5
        )


def test_cache_is_incremental_and_survives_reopening(target, tmp_path, monkeypatch):
    drafter = layers_drafter(target)
    rows = make_rows(n=8)
    computed = []
    real = features_module.compute_context_features
    monkeypatch.setattr(
        features_module,
        "compute_context_features",
        lambda t, layers, seqs: computed.extend(seqs) or real(t, layers, seqs),
    )
    cache = FeatureCache(tmp_path / "cache", target, drafter)
    assert cache.update(rows[:5], batch_size=2, show_progress=False) == 5 and len(computed) == 5
    first = {i: cache.features(rows[i]["input_ids"]) for i in range(5)}
    # Reopened from disk (another process, a resumed run): old rows are skipped, new ones appended.
    computed.clear()
    cache = FeatureCache(tmp_path / "cache", target, drafter)
    assert len(cache) == 5 and rows[0]["input_ids"] in cache and rows[6]["input_ids"] not in cache
    assert cache.update(rows + rows[:2], batch_size=3, show_progress=False) == 3
    assert sorted(map(len, computed)) == sorted(len(row["input_ids"]) for row in rows[5:])
    for i, row in enumerate(rows):
        stored = cache.features(row["input_ids"])
        assert stored.dtype == torch.float16 and stored.shape == (len(row["input_ids"]), 128)
        torch.testing.assert_close(
            stored.float(), single_row_features(target, drafter, row["input_ids"]), rtol=2e-3, atol=2e-3
        )
        if i < 5:
            assert torch.equal(stored, first[i])
    index = json.loads((tmp_path / "cache" / "index.json").read_text())
    assert index["num_tokens"] == sum(len(row["input_ids"]) for row in rows) == cache.num_tokens
    assert (tmp_path / "cache" / "features.bin").stat().st_size == cache.num_tokens * 128 * 2
    # Bytes an interrupted update wrote past the index are dropped by the next update.
    with open(tmp_path / "cache" / "features.bin", "ab") as f:
        f.write(b"\1" * 1000)
    extra = make_rows(n=1, seed=9)
    cache = FeatureCache(tmp_path / "cache", target, drafter)
    assert cache.update(extra, show_progress=False) == 1
    torch.testing.assert_close(
        cache.features(extra[0]["input_ids"]).float(),
        single_row_features(target, drafter, extra[0]["input_ids"]),
        rtol=2e-3,
        atol=2e-3,
    )
    assert torch.equal(cache.features(rows[0]["input_ids"]), first[0])
    with pytest.raises(KeyError, match="not in the feature cache"):
        cache.features([5, 6, 7])
    # Two writers of one folder (e.g. a training run and a benchmark): the second appends after the first.
    late, more = FeatureCache(tmp_path / "cache", target, drafter), make_rows(n=4, seed=10)
    assert cache.update(more[:2], show_progress=False) == 2
    assert late.update(more, show_progress=False) == 2 and len(late) == len(rows) + 1 + 4
    fresh = FeatureCache(tmp_path / "cache", target, drafter)
    for row in more + extra + rows[:1]:
        torch.testing.assert_close(
            fresh.features(row["input_ids"]).float(),
            single_row_features(target, drafter, row["input_ids"]),
            rtol=2e-3,
            atol=2e-3,
        )


def test_cache_refuses_another_target_layers_or_dtype(target, tmp_path):
    FeatureCache(tmp_path / "cache", target, LAYERS).update(make_rows(n=2), show_progress=False)
    FeatureCache(tmp_path / "cache", make_target("qwen3"), LAYERS)  # the same weights: accepted
    for other, match in [
        (dict(target=make_target("qwen3", seed=1)), "target_fingerprint"),
        (dict(target=target.to(torch.float64)), "target"),
        (dict(layers=[1, 2]), "layer_ids"),
        (dict(dtype=torch.float32), "dtype"),
        (dict(max_length=8), "max_length"),
    ]:
        settings = dict(target=make_target("qwen3"), layers=LAYERS) | other
        with pytest.raises(ValueError, match=match):
            FeatureCache(tmp_path / "cache", **settings)


def test_max_length_and_bfloat16_storage(target, tmp_path):
    drafter = layers_drafter(target)
    rows = make_rows(n=3)
    cache = FeatureCache(tmp_path / "cache", target, drafter, dtype=torch.bfloat16, max_length=7)
    cache.update(rows, show_progress=False)
    dataset = CachedFeatureDataset(rows, cache)
    for row, item in zip(rows, dataset, strict=True):
        assert item["input_ids"] == row["input_ids"][:7] and item[CONTEXT_FEATURES].shape == (7, 128)
        assert item[CONTEXT_FEATURES].dtype == torch.bfloat16
        torch.testing.assert_close(
            item[CONTEXT_FEATURES].float(),
            single_row_features(target, drafter, row["input_ids"])[:7],
            rtol=1e-2,
            atol=1e-2,
        )


def test_collator_pads_features_and_refuses_mixed_rows():
    rows = [
        {"input_ids": [5, 6, 7], CONTEXT_FEATURES: torch.ones(3, 4, dtype=torch.float16)},
        {"input_ids": [5, 6], CONTEXT_FEATURES: 2 * torch.ones(2, 4, dtype=torch.float16)},
    ]
    batch = ExitDataCollator(max_length=2)(rows)
    assert batch[CONTEXT_FEATURES].dtype == torch.float16 and batch[CONTEXT_FEATURES].shape == (2, 2, 4)
    batch = ExitDataCollator()(rows)
    assert batch[CONTEXT_FEATURES][:, :, 0].tolist() == [[1, 1, 1], [2, 2, 0]]
    with pytest.raises(ValueError, match="every row"):
        ExitDataCollator()([rows[0], {"input_ids": [5, 6]}])
    with pytest.raises(ValueError, match="shape"):
        ExitDataCollator()([{"input_ids": [5, 6, 7], CONTEXT_FEATURES: torch.ones(2, 4)}])


def make_args(tmp_path, **overrides):
    cached_run = dict(per_device_train_batch_size=3, anchors_per_sequence=4, objective="dflash")
    return training_args(tmp_path, **(cached_run | overrides))


@pytest.mark.parametrize("dtype, tolerance", [(torch.float16, 2e-3), (torch.float32, 1e-5)])
def test_step_on_cached_features_equals_step_with_the_target(dtype, tolerance, target, tmp_path, monkeypatch):
    rows = make_rows(n=3)
    cache = FeatureCache(tmp_path / "cache", target, LAYERS, dtype=dtype)
    cache.update(rows, show_progress=False)
    plain = ExitTrainer(model=layers_drafter(target), target_model=target, args=make_args(tmp_path / "a"))
    cached = ExitTrainer(model=layers_drafter(target), target_model=target, args=make_args(tmp_path / "b"))
    loss = plain.compute_loss(plain.model, ExitDataCollator()(rows))
    batch = ExitDataCollator()(CachedFeatureDataset(rows, cache))
    assert batch[CONTEXT_FEATURES].dtype == dtype
    target.forward = lambda *args, **kwargs: pytest.fail("the target ran on a batch with cached features")
    loss_cached = cached.compute_loss(cached.model, batch)
    torch.testing.assert_close(loss_cached, loss, rtol=tolerance, atol=tolerance)


def test_training_on_a_cached_dataset(target, tmp_path):
    rows = make_rows(n=6)
    cache = FeatureCache(tmp_path / "cache", target, LAYERS)
    cache.update(rows, show_progress=False)
    drafter = layers_drafter(target)
    before = {name: p.clone() for name, p in drafter.state_dict().items()}
    trainer = ExitTrainer(
        model=drafter,
        target_model=target,
        args=make_args(tmp_path, learning_rate=1e-2),
        train_dataset=CachedFeatureDataset(rows, cache),
    )
    trainer.train()
    assert all(np.isfinite(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry)
    assert not torch.equal(drafter.state_dict()["fc.weight"], before["fc.weight"])
    # The tree objectives run the target (its K/V score the trees) and still train on a cached dataset.
    tree_trainer = ExitTrainer(
        model=layers_drafter(target),
        target_model=target,
        args=make_args(tmp_path / "tree", objective="exit", tree_budget=4, max_steps=1),
        train_dataset=CachedFeatureDataset(rows, cache),
    )
    tree_trainer.train()
    assert "loss_tree" in tree_trainer.state.log_history[0]
    # A cache of other layers is refused before training.
    other = FeatureCache(tmp_path / "other", target, [1])
    with pytest.raises(ValueError, match="target layers"):
        ExitTrainer(
            model=layers_drafter(target),
            target_model=target,
            args=make_args(tmp_path / "c"),
            train_dataset=CachedFeatureDataset(rows, other),
        )


# ---------------------------------------------------------------------------------------------
# Another target, missing rows, bad rows and a damaged cache: refused before any feature is read


def changed_deep_weights(seed=0):
    """The qwen3 test target with the entries past the first 256 of layer 2's `down_proj` changed (its first rows
    and every other weight as they were)."""
    changed = make_target("qwen3", seed=seed)
    with torch.no_grad():
        changed.model.layers[2].mlp.down_proj.weight[10:] += 0.5
    return changed


def test_the_fingerprint_covers_every_entry_of_every_weight(target, tmp_path):
    rows = make_rows(n=2)
    FeatureCache(tmp_path / "cache", target, LAYERS).update(rows, show_progress=False)
    with pytest.raises(ValueError, match="target_fingerprint"):
        FeatureCache(tmp_path / "cache", changed_deep_weights(), LAYERS)
    last = make_target("qwen3")
    with torch.no_grad():
        last.lm_head.weight[-1, -1] += 1e-3  # one entry, the very last of the last weight
    assert features_module.target_fingerprint(last) != features_module.target_fingerprint(target)
    assert features_module.target_fingerprint(make_target("qwen3")) == features_module.target_fingerprint(target)


def test_the_trainer_refuses_features_of_another_target(target, tmp_path):
    rows = make_rows(n=3)
    target.name_or_path = "cache-target"
    cache = FeatureCache(tmp_path / "cache", target, LAYERS)
    cache.update(rows, show_progress=False)
    other = changed_deep_weights()
    other.name_or_path = "other-target"
    with pytest.raises(ValueError, match=r"feature cache .*'cache-target'.* the trainer's target 'other-target'"):
        ExitTrainer(
            model=layers_drafter(other),
            target_model=other,
            args=make_args(tmp_path / "a"),
            train_dataset=CachedFeatureDataset(rows, cache),
        )
    with pytest.raises(ValueError, match=r"eval_dataset .*feature cache"):
        ExitTrainer(
            model=layers_drafter(other),
            target_model=other,
            args=make_args(tmp_path / "b"),
            train_dataset=rows,
            eval_dataset=CachedFeatureDataset(rows, cache),
        )
    # The same weights in another object (loaded again, from another path) are the same target.
    ExitTrainer(
        model=layers_drafter(target),
        target_model=make_target("qwen3"),
        args=make_args(tmp_path / "c"),
        train_dataset=CachedFeatureDataset(rows, cache),
    )


def test_every_cached_row_is_checked_before_training(target, tmp_path):
    rows = make_rows(n=6)
    cache = FeatureCache(tmp_path / "cache", target, LAYERS)
    cache.update(rows[:5], show_progress=False)
    with pytest.raises(ValueError, match=r"train_dataset row 5 \(\d+ tokens\) is not in the feature cache .*update"):
        ExitTrainer(
            model=layers_drafter(target),
            target_model=target,
            args=make_args(tmp_path),
            train_dataset=CachedFeatureDataset(rows, cache),
        )


def test_update_refuses_a_row_without_tokens_or_outside_the_vocabulary(target, tmp_path):
    cache = FeatureCache(tmp_path / "cache", target, LAYERS)
    rows = make_rows(n=3)
    with pytest.raises(ValueError, match=r"row 2 has no tokens"):
        cache.update([*rows[:2], {"input_ids": []}], show_progress=False)
    with pytest.raises(ValueError, match=r"row 1: token id 96 at position 2 .* outside the target's vocabulary"):
        cache.update([rows[0], [5, 6, 96]], show_progress=False)
    with pytest.raises(ValueError, match=r"row 0: 'input_ids' is text"):
        cache.update([{"input_ids": "def f(): pass"}], show_progress=False)
    assert len(cache) == 0 and not (tmp_path / "cache" / "index.json").exists()  # nothing was computed


def test_a_damaged_cache_is_refused_when_opened(target, tmp_path):
    rows = make_rows(n=3)
    folder = tmp_path / "cache"
    FeatureCache(folder, target, LAYERS).update(rows, show_progress=False)
    index = (folder / "index.json").read_text()
    data = (folder / "features.bin").read_bytes()

    (folder / "features.bin").write_bytes(data[: len(data) // 2])  # cut off (a full disk, a partial copy)
    with pytest.raises(ValueError, match=rf"features.bin has {len(data) // 2} bytes, its index.json names {len(data)}"):
        FeatureCache(folder, target, LAYERS)
    (folder / "features.bin").unlink()
    with pytest.raises(ValueError, match=r"features.bin is missing"):
        FeatureCache(folder, target, LAYERS)
    (folder / "features.bin").write_bytes(data)

    (folder / "index.json").write_text(index[: len(index) // 2])
    with pytest.raises(ValueError, match=r"index.json is not valid JSON \(line 1 column \d+"):
        FeatureCache(folder, target, LAYERS)
    (folder / "index.json").write_bytes(b"\xff\xfe" + index.encode())
    with pytest.raises(ValueError, match=r"index.json is not valid JSON"):
        FeatureCache(folder, target, LAYERS)
    for broken in ({**json.loads(index), "rows": "x"}, {**json.loads(index), "num_tokens": 1}, [1, 2]):
        (folder / "index.json").write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=r"index.json is not a feature cache index"):
            FeatureCache(folder, target, LAYERS)
    (folder / "index.json").write_text(index)
    cache = FeatureCache(folder, target, LAYERS)
    assert len(cache) == 3 and cache.features(rows[0]["input_ids"]).shape[0] == len(rows[0]["input_ids"])


def test_an_update_waits_while_another_process_holds_the_folders_lock(target, tmp_path, monkeypatch):
    import subprocess
    import sys
    import threading

    drafter = layers_drafter(target)
    cache = FeatureCache(tmp_path / "cache", target, drafter)
    (tmp_path / "cache").mkdir(exist_ok=True)
    started = threading.Event()
    real = FeatureCache._append
    monkeypatch.setattr(FeatureCache, "_append", lambda self, *a: started.set() or real(self, *a))
    holder = subprocess.Popen(  # another process in the middle of its own update of the folder
        [sys.executable, "-c", "import sys; from filelock import FileLock\n"
         f"lock = FileLock({str(tmp_path / 'cache' / features_module.LOCK_NAME)!r}); lock.acquire()\n"
         "print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        added = []
        update = threading.Thread(target=lambda: added.append(cache.update(make_rows(n=2), show_progress=False)))
        update.start()
        assert not started.wait(timeout=1.0)  # still waiting for the other process
    finally:
        holder.stdin.close()  # the other process finishes, which releases its lock
        holder.wait(timeout=60)
    update.join(timeout=120)
    assert started.is_set() and added == [2]
