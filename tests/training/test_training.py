"""ExitTrainer end to end on tiny random models: the batched forwards against plain ones, training, resume,
evaluation (deterministic, the decoded tau), FLOPs, saving, the Hub upload (recording fake client), 2-process DDP
on CPU, bad input (bad rows: tests/training/test_training_data.py)."""

import json
from pathlib import Path

import pytest
import torch
from helpers import (
    TRAINING_BLOCK_SIZE,
    logged,
    make_target,
    run_two_processes,
    training_args,
    training_drafter,
    training_rows,
)
from huggingface_hub import ModelCard
from safetensors import safe_open

import hf_tev
import hf_tev.training.hub as hub
import hf_tev.training.losses as losses
import hf_tev.training.rollouts as rollouts_module
from hf_tev.exit_loss import exittrain_loss
from hf_tev.models.dflash.modeling_dflash import DFlashDraftModel
from hf_tev.training import (
    ExitDataCollator,
    ExitTrainer,
    ExitTrainingArguments,
    decoded_block_lengths,
    generate_training_data,
)
from hf_tev.training.batch import draft_blocks, sample_anchors, tree_batch_inputs
from hf_tev.training.losses import StepSize
from hf_tev.tree import build_tree


@pytest.fixture
def target():
    return make_target("qwen3")


# ---------------------------------------------------------------------------------------------
# The batched forwards equal plain ones


@pytest.mark.parametrize("softcap", [None, 0.5])
def test_shared_block_forward_equals_one_draft_per_anchor(softcap, target):
    # softcap: a target that soft-caps its final logits (Gemma's final_logit_softcapping, read from the config):
    # training scores the capped logits the drafter drafts with
    target.config.final_logit_softcapping = softcap
    drafter = training_drafter(target)
    input_ids = torch.randint(3, 96, (2, 14), generator=torch.Generator().manual_seed(3))
    anchors = torch.tensor([[2, 5, 11], [0, 7, 9]])
    with torch.no_grad():
        hidden = target(input_ids, output_hidden_states=True).hidden_states
        shared = draft_blocks(drafter, drafter, target, input_ids, drafter.context_features(hidden), anchors)
        for b in range(2):
            for slot, a in enumerate(anchors[b].tolist()):
                # Inference: context = target features of x[0:a], block [x_a, MASK...] at positions a..a+L-1.
                context = (
                    drafter.context_features(target(input_ids[b : b + 1, :a], output_hidden_states=True).hidden_states)
                    if a > 0
                    else torch.zeros(1, 0, 64 * len(drafter.config.target_layer_ids))
                )
                block = torch.full((1, TRAINING_BLOCK_SIZE), drafter.config.mask_token_id)
                block[0, 0] = input_ids[b, a]
                positions = torch.arange(a + TRAINING_BLOCK_SIZE)[None]
                alone = drafter.draft_logits(target, context, block, positions)  # [1, D, V]
                torch.testing.assert_close(shared[b, slot], alone[0], rtol=1e-4, atol=1e-4)
    if softcap:
        assert shared.abs().max() <= softcap


@pytest.mark.parametrize("window", [None, 3])
def test_batched_tree_pass_equals_plain_path_forwards(window, target):
    # With a context window W, the reference is a plain forward of x[:a] + path in which the path rows
    # (root .. node) see only positions >= a - W of the prefix (the prefix rows stay causal).
    torch.manual_seed(0)
    T = 12
    input_ids = torch.randint(3, 96, (2, T))
    owners, anchors = [0, 0, 1], [4, 9, 6]
    trees = [
        build_tree(torch.randn(3, 96).log_softmax(-1), budget, input_ids[b, a])
        for b, a, budget in zip(owners, anchors, [4, 2, 5], strict=True)
    ]
    with torch.no_grad():
        cache = target(input_ids, use_cache=True).cache
        tokens, positions, mask, offsets = tree_batch_inputs(
            trees, owners, anchors, 2, T, torch.float32, context_window=window
        )
        logits = target(tokens, position_ids=positions, attention_mask=mask, cache=cache).logits
        for tree, b, a, offset in zip(trees, owners, anchors, offsets, strict=True):
            for node in range(tree.num_nodes):
                path = tree.tokens[tree.visibility[node]]  # root .. node
                sequence = torch.cat([input_ids[b, :a], path])[None]
                n = sequence.shape[1]
                visible = torch.ones(n, n, dtype=torch.bool).tril()
                if window is not None:
                    visible[a:, : max(a - window, 0)] = False
                plain_mask = torch.zeros(1, 1, n, n).masked_fill(~visible, torch.finfo(torch.float32).min)
                plain = target(sequence, attention_mask=plain_mask, position_ids=torch.arange(n)[None]).logits[0, -1]
                torch.testing.assert_close(logits[b, offset + node], plain, rtol=1e-4, atol=1e-4)
    if window is not None:  # the window changes what the trees see (here: anchors 9 and 6 lose context)
        full = target(
            tokens,
            position_ids=positions,
            cache=target(input_ids, use_cache=True).cache,
            attention_mask=tree_batch_inputs(trees, owners, anchors, 2, T, torch.float32)[2],
        ).logits
        assert not torch.allclose(full, logits, atol=1e-3)


def test_anchors_are_distinct_supervised_block_starts():
    loss_mask = torch.zeros(3, 10, dtype=torch.bool)
    loss_mask[0, 4:] = True  # candidates 3..8
    loss_mask[1, 8:] = True  # candidates 7, 8: fewer than asked
    anchors, valid = sample_anchors(loss_mask, 4, torch.Generator().manual_seed(0))
    assert valid[0].all() and set(anchors[0].tolist()) <= set(range(3, 9)) and len(set(anchors[0].tolist())) == 4
    assert anchors[1][valid[1]].tolist() == [7, 8] and valid[1].sum() == 2
    assert not valid[2].any()
    again, _ = sample_anchors(loss_mask, 4, torch.Generator().manual_seed(0))
    assert torch.equal(anchors, again)


# ---------------------------------------------------------------------------------------------
# Training


def test_step_trains_the_drafter_only_and_logs_the_parts(target, tmp_path):
    drafter = training_drafter(target)
    target_before = {name: p.clone() for name, p in target.state_dict().items()}
    drafter_before = {name: p.clone() for name, p in drafter.state_dict().items()}
    trainer = ExitTrainer(
        model=drafter,
        target_model=target,
        args=training_args(tmp_path, learning_rate=1e-2),
        train_dataset=training_rows(),
    )
    trainer.train()
    assert all(torch.equal(p, target_before[name]) for name, p in target.state_dict().items())
    assert all(p.grad is None and not p.requires_grad for p in target.parameters())
    changed = [name for name, p in drafter.state_dict().items() if not torch.equal(p, drafter_before[name])]
    assert "fc.weight" in changed and any(name.startswith("layers.0.") for name in changed)
    # The target's embeddings / LM head never became drafter parameters.
    assert not any("embed" in name or "lm_head" in name for name, _ in drafter.named_parameters())
    logged = trainer.state.log_history[0]
    for key in ("loss", "loss_dflash", "loss_tree", "tree_1_plus_c"):
        assert torch.isfinite(torch.tensor(logged[key])), key
    assert 1.0 <= logged["tree_1_plus_c"] <= 1.0 + 6
    assert logged["loss"] == pytest.approx(logged["loss_dflash"] + 0.1 * logged["loss_tree"], rel=1e-5)


@pytest.mark.parametrize("objective", ["exit", "prefix", "dflash"])
def test_loss_goes_down_on_a_fixed_batch(objective, target, tmp_path):
    # Anchors cover every candidate position, so each step sees exactly the same blocks.
    rows = training_rows(n=2, length=8, prompt_length=2)
    args = training_args(
        tmp_path,
        objective=objective,
        anchors_per_sequence=8,
        max_steps=8,
        learning_rate=5e-3,
        lr_scheduler_type="constant",
    )
    trainer = ExitTrainer(model=training_drafter(target), target_model=target, args=args, train_dataset=rows)
    trainer.train()
    history = logged(trainer)
    assert len(history) == 8 and all(torch.isfinite(torch.tensor(history)))
    assert history[-1] < 0.8 * history[0], history
    if objective == "dflash":
        assert not logged(trainer, "loss_tree")
    else:
        tree_history = logged(trainer, "loss_tree")
        assert tree_history[-1] < tree_history[0], tree_history


@pytest.mark.parametrize("tree_anchors", ["full_horizon", "all"])
def test_training_trees_are_scored_like_plain_target_forwards(tree_anchors, target, tmp_path, monkeypatch):
    # The trainer uses the decoder's own builder; the edge probabilities it weighs are the target's
    # distributions after prefix x[:a] + the parent's path, node by node; trees hang only at tree anchors,
    # while the cross-entropy covers every anchor.
    assert losses.build_tree is build_tree
    seen = []

    def recording_loss(*args, **kwargs):
        seen.append((args, kwargs))
        return exittrain_loss(*args, **kwargs)

    # Rows of 12 tokens, 3 of prompt: supervised 3..11. Block size 4 drafts a+1..a+3: anchor 9's horizon
    # leaves the sequence (10, 11 supervised, 12 outside); anchors 3 and 5 have a full horizon.
    anchors, valid = torch.tensor([[3, 9], [5, 0]]), torch.tensor([[True, True], [True, False]])
    monkeypatch.setattr(losses, "exittrain_loss", recording_loss)
    monkeypatch.setattr(losses, "sample_anchors", lambda loss_mask, num_anchors, generator: (anchors, valid))
    drafter = training_drafter(target)
    trainer = ExitTrainer(
        model=drafter,
        target_model=target,
        args=training_args(tmp_path, objective="prefix", alpha=0.01, tree_budget=5, tree_anchors=tree_anchors),
    )
    batch = ExitDataCollator()(training_rows(n=2, length=12))
    loss = trainer.compute_loss(drafter, batch)
    assert torch.isfinite(loss) and len(seen) == 1
    (block_logits, labels, label_mask, trees, tree_blocks, tree_probs, objective), kwargs = seen[0]
    assert objective == "prefix" and kwargs["alpha"] == 0.01
    assert (kwargs["tree_normalization"], kwargs["ce_decay"]) == ("nodes", None)
    assert label_mask.sum() == 3 + 2 + 3  # the CE: every valid anchor's supervised positions
    expected = [(0, 0, 3), (1, 0, 5)] if tree_anchors == "full_horizon" else [(0, 0, 3), (0, 1, 9), (1, 0, 5)]
    assert tree_blocks == [b * 2 + slot for b, slot, _ in expected]  # flat index b * A + slot
    with torch.no_grad():
        for tree, edges, (b, _, a) in zip(trees, tree_probs, expected, strict=True):
            assert tree.num_nodes == 6 and tree.tokens[0] == batch["input_ids"][b, a]
            for node in range(1, tree.num_nodes):
                path = tree.tokens[tree.visibility[tree.parents[node]]]  # root .. parent
                plain = target(torch.cat([batch["input_ids"][b, :a], path])[None]).logits[0, -1].softmax(-1)
                torch.testing.assert_close(edges[node], plain[tree.tokens[node]], rtol=1e-4, atol=1e-6)


def test_tree_knobs_reach_the_loss(target, tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(
        losses, "exittrain_loss", lambda *args, **kwargs: seen.append(kwargs) or exittrain_loss(*args, **kwargs)
    )
    drafter = training_drafter(target)
    args = training_args(
        tmp_path, tree_normalization="weight_sum", ce_decay=True, gamma=3.0, ce_weight=0.5, tree_weight=0.2
    )
    trainer = ExitTrainer(model=drafter, target_model=target, args=args)
    trainer.compute_loss(drafter, ExitDataCollator()(training_rows(n=2, length=12)))
    assert {k: seen[0][k] for k in ("tree_normalization", "ce_decay", "gamma", "ce_weight", "tree_weight")} == {
        "tree_normalization": "weight_sum",
        "ce_decay": True,
        "gamma": 3.0,
        "ce_weight": 0.5,
        "tree_weight": 0.2,
    }


def test_steps_without_a_tree_log_no_nan(target, tmp_path):
    # 4 tokens, 2 of prompt: anchors 1 and 2 have a supervised next token but no full horizon (block size 4).
    rows = training_rows(n=4, length=4, prompt_length=2)
    trainer = ExitTrainer(
        model=training_drafter(target),
        target_model=target,
        args=training_args(tmp_path, max_steps=2),
        train_dataset=rows,
    )
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 2
    for entry in logged:
        assert all(not (isinstance(v, float) and v != v) for v in entry.values()), entry  # no NaN
        assert "loss_dflash" in entry and "loss_tree" not in entry and "tree_1_plus_c" not in entry
        assert entry["loss"] == pytest.approx(entry["loss_dflash"], rel=1e-5)


def test_resume_gives_the_same_next_losses(target, tmp_path):
    rows = training_rows(n=8)
    common = dict(max_steps=4, save_strategy="steps", save_steps=2)
    straight = ExitTrainer(
        model=training_drafter(target),
        target_model=target,
        args=training_args(tmp_path / "a", **common),
        train_dataset=rows,
    )
    straight.train()
    resumed = ExitTrainer(
        model=training_drafter(target, seed=123),
        target_model=target,
        args=training_args(tmp_path / "b", **common),
        train_dataset=rows,
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "out" / "checkpoint-2"))
    for key in ("loss", "loss_tree", "tree_1_plus_c"):
        # Steps 3 and 4 are computed after the resume (steps 1 and 2 come back from the checkpoint's state).
        assert len(logged(resumed, key, after_step=2)) == 2
        torch.testing.assert_close(
            logged(resumed, key, after_step=2), logged(straight, key, after_step=2), rtol=1e-5, atol=1e-6
        )
    checkpoint = tmp_path / "a" / "out" / "checkpoint-2"
    assert not any("target" in f.name for f in checkpoint.iterdir())


def test_datasets_dataset_and_loss_mask_column_work(target, tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = training_rows(n=4)
    dataset = datasets.Dataset.from_list(
        [{"input_ids": r["input_ids"], "loss_mask": [0] * 5 + [1] * 11, "text": "x"} for r in rows]
    )
    trainer = ExitTrainer(
        model=training_drafter(target),
        target_model=target,
        args=training_args(tmp_path, max_steps=1),
        train_dataset=dataset,
        eval_dataset=dataset,
    )
    trainer.train()
    metrics = trainer.evaluate()
    assert {"eval_loss", "eval_loss_dflash", "eval_loss_tree", "eval_tree_1_plus_c", "eval_tau"} <= set(metrics)
    assert metrics["eval_tau"] >= 1.0 and metrics["eval_tau_cycles"] > 0


# ---------------------------------------------------------------------------------------------
# Evaluation: deterministic, and the decoded tau is real tree decoding

EVAL_KEYS = ("eval_loss", "eval_loss_dflash", "eval_loss_tree", "eval_tree_1_plus_c", "eval_tau", "eval_tau_cycles")


def test_evaluation_is_deterministic_and_reports_the_decoded_tau(target, tmp_path):
    rows = training_rows(n=6, length=16)
    args = training_args(tmp_path, eval_tau_prompts=3, eval_tau_max_new_tokens=12, per_device_eval_batch_size=2)
    trainer = ExitTrainer(
        model=training_drafter(target), target_model=target, args=args, train_dataset=rows, eval_dataset=rows
    )
    first, second = trainer.evaluate(), trainer.evaluate()
    assert {key: first[key] for key in EVAL_KEYS} == {key: second[key] for key in EVAL_KEYS}
    trainer.train()  # new weights, a new step: still the same anchors, so two evaluations agree again
    third, fourth = trainer.evaluate(), trainer.evaluate()
    assert {key: third[key] for key in EVAL_KEYS} == {key: fourth[key] for key in EVAL_KEYS}
    assert third["eval_loss"] != first["eval_loss"]

    # eval_tau is the mean accepted block length of target.generate with the drafter and TEVConfig(budget=...),
    # greedy, over the first eval_tau_prompts rows' prompts (tokens before the first supervised one).
    lengths = []
    for row in rows[:3]:
        prompt = torch.tensor([row["input_ids"][: row["prompt_length"]]])
        output = target.generate(
            prompt,
            assistant_model=trainer.model,
            tev_config=hf_tev.TEVConfig(budget=args.tree_budget, lookup=False),  # the drafter's own trees
            max_new_tokens=12,
            do_sample=False,
            return_dict_in_generate=True,
        )
        lengths += output.tev_stats.accepted_lengths
    assert fourth["eval_tau"] == pytest.approx(sum(lengths) / len(lengths)) and fourth["eval_tau_cycles"] == len(
        lengths
    )


def test_a_fresh_drafter_reads_tau_one_whatever_the_context_drafts_default():
    """The decoded tau of evaluations, cards and the Draft-OPD rollouts is the drafter's own: context drafts (on by
    default for greedy decoding) would give an untrained drafter on the kit's code prompts a tau of about 4."""
    from hf_tev.packaged import load_kit_model, load_kit_tokenizer
    from hf_tev.training.rollouts import collect_rollouts

    target, tokenizer = load_kit_model("target"), load_kit_tokenizer()
    drafter = DFlashDraftModel.from_target(target, block_size=8)  # random weights: it proposes nothing useful
    text = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def "
    prompts = [tokenizer(text).input_ids]
    lengths = decoded_block_lengths(target, drafter, prompts, budget=16, max_new_tokens=40)
    assert sum(lengths) / len(lengths) < 1.1, lengths
    rollout = collect_rollouts(target, drafter, prompts, 16, 0.0, 40, [0], tokenizer.pad_token_id)[0]
    assert sum(rollout.accepted) / len(rollout.accepted) < 0.1, rollout.accepted
    # the same call with context drafts (TEVConfig's greedy default) is far above it: the test can tell them apart
    ids = torch.tensor(prompts)
    out = target.generate(
        ids, assistant_model=drafter, tev_config=hf_tev.TEVConfig(budget=16), max_new_tokens=40,
        do_sample=False, return_dict_in_generate=True,
    )  # fmt: skip
    assert out.tev_stats.tau > 1.5


def test_sampled_eval_tau_is_seeded_and_leaves_the_global_rng_alone(target):
    drafter = training_drafter(target)
    prompts = [[5, 17, 33], [40, 41, 42, 43]]
    settings = dict(budget=4, temperature=1.0, max_new_tokens=10, seed=3)
    state = torch.random.get_rng_state()
    first = decoded_block_lengths(target, drafter, prompts, **settings)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert decoded_block_lengths(target, drafter, prompts, **settings) == first
    # Prompt i is seeded seed + i, also when the prompts are split across processes (first_index, index_step).
    alone = decoded_block_lengths(target, drafter, prompts[:1], **settings)
    second = decoded_block_lengths(target, drafter, prompts[1:], **settings, first_index=1, index_step=2)
    assert alone + second == first
    assert decoded_block_lengths(target, drafter, prompts, **{**settings, "seed": 4}) != first  # the seed matters


def test_eval_prompts_are_decoded_instead_of_the_rows_prompts(target, tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(
        rollouts_module,
        "decoded_block_lengths",
        lambda target, drafter, prompts, **kwargs: seen.append((prompts, kwargs)) or [2, 1],
    )
    rows = training_rows(n=4, length=12)
    args = training_args(
        tmp_path, eval_tau_prompts=2, eval_tau_budget=9, eval_tau_temperature=0.5, eval_tau_max_new_tokens=7
    )
    trainer = ExitTrainer(
        model=training_drafter(target),
        target_model=target,
        args=args,
        train_dataset=rows,
        eval_dataset=rows,
        eval_prompts=[[9, 9, 9], [8, 8], [7]],
    )
    metrics = trainer.evaluate()
    assert metrics["eval_tau"] == 1.5 and metrics["eval_tau_cycles"] == 2
    prompts, kwargs = seen[0]
    assert prompts == [[9, 9, 9], [8, 8]]
    assert {k: kwargs[k] for k in ("budget", "temperature", "max_new_tokens", "seed")} == {
        "budget": 9,
        "temperature": 0.5,
        "max_new_tokens": 7,
        "seed": 0,
    }
    args.eval_tau_prompts = 0
    assert "eval_tau" not in trainer.evaluate() and len(seen) == 1


def test_total_flos_is_counted(target, tmp_path):
    rows = training_rows(n=4, length=16)
    args = training_args(tmp_path, objective="dflash", tree_weight=0.0, max_steps=2)
    trainer = ExitTrainer(model=training_drafter(target), target_model=target, args=args, train_dataset=rows)
    trainer.train()
    # Per step: B = 2 rows of T = 16 tokens, A = 3 anchors, block L = 4, a target context forward, no trees.
    per_step = trainer.flop_counter.flos(StepSize(2, 16, 3, TRAINING_BLOCK_SIZE, False, 0))
    drafter_params = sum(p.numel() for p in trainer.model.parameters())
    assert per_step >= 6 * drafter_params * 2 * 3 * TRAINING_BLOCK_SIZE
    assert trainer.state.total_flos == 2 * per_step > 0


def test_collator_pads_masks_and_truncates():
    collate = ExitDataCollator(pad_token_id=0, max_length=6)
    batch = collate(
        [
            {"input_ids": [5, 6, 7, 8, 9, 10, 11, 12], "prompt_length": 2},
            {"input_ids": [5, 6, 7], "loss_mask": [1, 0, 1]},
            {"input_ids": torch.tensor([9, 9, 9, 9])},
        ]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10], [5, 6, 7, 0, 0, 0], [9, 9, 9, 9, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1] * 6, [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]]
    assert batch["loss_mask"].int().tolist() == [[0, 0, 1, 1, 1, 1], [1, 0, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]]
    with pytest.raises(ValueError, match="input_ids"):
        collate([{"text": "hello"}])
    with pytest.raises(ValueError, match="loss_mask"):
        collate([{"input_ids": [1, 2, 3], "loss_mask": [1, 1]}])


def test_generate_training_data_uses_the_targets_own_responses(target):
    prompts = [[5, 17, 33], [40, 41], [7, 8, 9, 10]]
    rows = generate_training_data(target, prompts, max_new_tokens=6, batch_size=2, show_progress=False, do_sample=False)
    assert len(rows) == 3
    for prompt, row in zip(prompts, rows, strict=True):
        alone = target.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)[0].tolist()
        assert row["prompt_length"] == len(prompt)
        assert row["input_ids"] == alone[: len(row["input_ids"])]
        # Responses stop at the first EOS (kept), otherwise run to max_new_tokens.
        response = row["input_ids"][len(prompt) :]
        assert len(response) == 6 or response[-1] == target.generation_config.eos_token_id
    # With an EOS the target emits inside a response, that response ends right after it.
    stop = rows[0]["input_ids"][3 + 2]
    cut = generate_training_data(
        target, prompts[:1], max_new_tokens=6, show_progress=False, do_sample=False, eos_token_id=stop
    )
    response = rows[0]["input_ids"][3:]
    assert cut[0]["input_ids"] == rows[0]["input_ids"][: 3 + response.index(stop) + 1]


# ---------------------------------------------------------------------------------------------
# Saving and the Hub


class RecordingHfApi:
    """Stands in for huggingface_hub.HfApi: records calls and the files of every uploaded folder."""

    calls = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs

    def create_repo(self, repo_id, **kwargs):
        RecordingHfApi.calls.append(("create_repo", repo_id, kwargs))
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def upload_folder(self, repo_id, folder_path, **kwargs):
        files = sorted(str(p.relative_to(folder_path)) for p in Path(folder_path).rglob("*") if p.is_file())
        RecordingHfApi.calls.append(("upload_folder", repo_id, {"folder_path": folder_path, "files": files, **kwargs}))
        return "commit-url"


def test_push_to_hub_uploads_published_layout_and_card(target, tmp_path, monkeypatch):
    RecordingHfApi.calls = []
    monkeypatch.setattr(hub, "HfApi", RecordingHfApi)
    drafter = training_drafter(target)
    args = training_args(
        tmp_path, max_steps=2, save_strategy="steps", save_steps=1, eval_tau_prompts=2, eval_tau_max_new_tokens=8
    )
    trainer = ExitTrainer(
        model=drafter, target_model=target, args=args, train_dataset=training_rows(n=4), eval_dataset=training_rows(n=2)
    )
    trainer.train()
    eval_tau = trainer.evaluate()["eval_tau"]
    result = trainer.push_to_hub(
        "me/tiny-exittrain",
        target_model_id="me/tiny-target",
        dataset_description="Four random sequences.",
        measured_tau={64: 3.25},
        tau_temperature=0.0,
        license="mit",
        datasets=["me/prompts"],
    )
    assert result == "commit-url"
    (create, repo_id, create_kwargs), (upload, upload_repo, upload_kwargs) = RecordingHfApi.calls
    assert (create, repo_id, upload, upload_repo) == (
        "create_repo",
        "me/tiny-exittrain",
        "upload_folder",
        "me/tiny-exittrain",
    )
    assert create_kwargs["exist_ok"] is True
    assert {"config.json", "model.safetensors", "README.md"} <= set(upload_kwargs["files"])
    assert (
        "checkpoint-*" in upload_kwargs["ignore_patterns"] and "training_args.bin" in upload_kwargs["ignore_patterns"]
    )

    folder = Path(upload_kwargs["folder_path"])
    with safe_open(folder / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
    assert {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.mlp.down_proj.weight",
    } <= names
    assert not any("embed" in name or "lm_head" in name for name in names)  # no target weights
    config = json.loads((folder / "config.json").read_text())
    assert config["block_size"] == TRAINING_BLOCK_SIZE and config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["mask_token_id"] == drafter.config.mask_token_id

    card = (folder / "README.md").read_text()
    assert "$" not in card.replace("$ ", "")  # every placeholder filled
    for text in (
        "me/tiny-exittrain",
        "**exit**",
        "| `tree_budget` | 6 |",
        "| `ce_weight` | 1.0 |",
        "| `tree_weight` | 0.1 |",
        "| `alpha` | 0.0001 |",
        "| `tree_normalization` | nodes |",
        "| `tree_anchors` | full_horizon |",
        "| `tree_context_window` | None |",
        "| `anchors_per_sequence` | 3 |",
        "| optimizer steps | 2 |",
        "plain mean over the supervised block positions",
        "divided by their number of drafted nodes",
        "Four random sequences.",
        "| budget 64 | 0.0 | 3.250 |",
        'DFlashDraftModel.from_pretrained("me/tiny-exittrain")',
        "tev_config=hf_tev.TEVConfig()",
        "assistant_model=drafter",
    ):
        assert text in card, text
    for name in ExitTrainingArguments.knob_names:  # every knob the objective uses is recorded, and only those
        assert (f"| `{name}` |" in card) is not (name == "gamma" or name.startswith("opd_")), name
    metadata = ModelCard.load(folder / "README.md").data
    assert metadata.base_model == "me/tiny-target" and metadata.library_name == "hf_tev"
    assert metadata.license == "mit" and metadata.datasets == ["me/prompts"]
    assert {"speculative-decoding", "dflash", "tev", "exittrain", "exit"} <= set(metadata.tags)
    # The tau the trainer decoded, with its budget and temperature, as a model-index result and a table row.
    (result,) = metadata.eval_results
    assert (result.metric_type, result.metric_value, result.task_type) == ("tau", round(eval_tau, 4), "text-generation")
    cycles = result.metric_args["cycles"]
    assert cycles > 0 and result.metric_args == {
        "budget": 6,
        "temperature": 0.0,
        "max_new_tokens": 8,
        "cycles": cycles,
        "step": 2,
    }
    assert result.metric_config == "budget=6,temperature=0" and metadata.model_name == "tiny-exittrain"
    row = "| budget 6, eval_dataset prompts, tree decoding by the trainer with the drafter's trees alone"
    row += f" (8 new tokens per prompt, {cycles} cycles,"
    assert f"{row} step 2) | 0.0 | {eval_tau:.3f} |" in card

    loaded = DFlashDraftModel.from_pretrained(folder)
    for name, value in drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value)


def test_push_to_hub_offline_fails_before_writing_anything(target, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # the constant is read at import
    trainer = ExitTrainer(model=training_drafter(target), target_model=target, args=training_args(tmp_path))
    out = Path(trainer.args.output_dir)
    before = sorted(out.rglob("*")) if out.exists() else []
    with pytest.raises(Exception, match="(?i)offline"):
        trainer.push_to_hub("me/offline-drafter", target_model_id="me/tiny-target")
    assert (sorted(out.rglob("*")) if out.exists() else []) == before


def test_defaults_follow_the_released_code_and_knobs_are_the_exittrain_fields(tmp_path):
    args = ExitTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    assert (
        args.objective,
        args.anchors_per_sequence,
        args.tree_anchors,
        args.tree_normalization,
        args.ce_decay,
        args.tree_context_window,
        args.tree_budget,
        args.ce_weight,
        args.tree_weight,
        args.alpha,
    ) == ("exit", 32, "full_horizon", "nodes", None, None, 32, 1.0, 0.1, 1e-4)
    from dataclasses import fields

    from transformers import TrainingArguments

    own = {f.name for f in fields(ExitTrainingArguments)} - {f.name for f in fields(TrainingArguments)}
    knobs, evaluation = set(ExitTrainingArguments.knob_names), set(ExitTrainingArguments.eval_names)
    assert knobs | evaluation == own and not knobs & evaluation  # learning_rate, remove_unused_columns: inherited
    assert (args.eval_tau_prompts, args.eval_tau_budget, args.eval_tau_temperature) == (8, None, 0.0)


# ---------------------------------------------------------------------------------------------
# Two processes (DDP over gloo on CPU)

DDP_SCRIPT = """
import json, sys, torch
from helpers import make_target
from hf_tev.models.dflash.modeling_dflash import DFlashDraftModel
from hf_tev.training import ExitTrainer, ExitTrainingArguments

out = sys.argv[1]
target = make_target("qwen3")
torch.manual_seed(0)
drafter = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
generator = torch.Generator().manual_seed(1)
rows = [{"input_ids": torch.randint(3, 96, (12,), generator=generator).tolist(), "prompt_length": 2}
        for _ in range(8)]
args = ExitTrainingArguments(output_dir=out, use_cpu=True, ddp_backend="gloo", max_steps=2,
                             per_device_train_batch_size=2, tree_budget=4, anchors_per_sequence=2,
                             report_to=[], disable_tqdm=True, save_strategy="no", logging_steps=1)
trainer = ExitTrainer(model=drafter, target_model=target, args=args, train_dataset=rows)
trainer.train()
checksum = sum(p.double().sum().item() for p in drafter.parameters())
with open(f"{out}/rank{args.process_index}.json", "w") as f:
    json.dump({"world_size": args.world_size, "wrapped": type(trainer.model_wrapped).__name__,
               "checksum": checksum}, f)
trainer.save_model()
"""


@pytest.mark.slow
def test_two_process_ddp_on_cpu(tmp_path):
    ranks, out = run_two_processes(DDP_SCRIPT, tmp_path)
    assert all(r["world_size"] == 2 and r["wrapped"] == "DistributedDataParallel" for r in ranks)
    assert ranks[0]["checksum"] == pytest.approx(ranks[1]["checksum"], rel=1e-6)  # replicas stayed in sync
    loaded = DFlashDraftModel.from_pretrained(out)
    assert sum(p.double().sum().item() for p in loaded.parameters()) == pytest.approx(ranks[0]["checksum"], rel=1e-6)


# ---------------------------------------------------------------------------------------------
# Bad input


def test_clear_errors_for_bad_input(target, tmp_path):
    drafter = training_drafter(target)
    with pytest.raises(ValueError, match="tree_budget"):
        training_args(tmp_path, tree_budget=0)
    for knob, value in (("eval_tau_prompts", -1), ("eval_tau_budget", "auto"), ("eval_tau_max_new_tokens", 0)):
        with pytest.raises(ValueError, match=knob):
            training_args(tmp_path, **{knob: value})
    with pytest.raises(ValueError, match="objective"):
        training_args(tmp_path, objective="medusa")
    with pytest.raises(ValueError, match="remove_unused_columns"):
        training_args(tmp_path, remove_unused_columns=True)
    with pytest.raises(ValueError, match="alpha"):
        training_args(tmp_path, alpha=0.0)
    for knob, value in (
        ("tree_normalization", "mean"),
        ("tree_anchors", "some"),
        ("tree_context_window", 0),
        ("ce_decay", "yes"),
        ("anchors_per_sequence", 0),
    ):
        with pytest.raises(ValueError, match=knob):
            training_args(tmp_path, **{knob: value})
    with pytest.raises(ValueError, match="input_ids"):
        ExitTrainer(model=drafter, target_model=target, args=training_args(tmp_path), train_dataset=[{"text": "hi"}])
    other_target = make_target("qwen3", hidden_size=32)
    with pytest.raises(ValueError, match="does not fit"):
        ExitTrainer(
            model=drafter, target_model=other_target, args=training_args(tmp_path), train_dataset=training_rows()
        )
    other_vocab = make_target("qwen3", vocab_size=80)
    with pytest.raises(ValueError, match="vocab"):
        ExitTrainer(
            model=drafter, target_model=other_vocab, args=training_args(tmp_path), train_dataset=training_rows()
        )
    with pytest.raises(TypeError, match="DFlashDraftModel"):
        ExitTrainer(model=target, target_model=target, args=training_args(tmp_path), train_dataset=training_rows())
