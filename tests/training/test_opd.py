"""Draft-OPD (`objective="opd"`, hf_tev/training/rollouts.py and losses.py) on tiny random models: the rollouts'
cycles, the replay teachers against direct target forwards, the loss, training (loss down, rollouts refreshed at the
knob's interval, their tau logged), save / reload / resume, the model card, `hf-tev train --objective opd`, bad
knobs."""

import sys

import pytest
import torch
from helpers import (
    KIT_ROWS,
    TRAINING_BLOCK_SIZE,
    logged,
    make_target,
    run_command,
    run_two_processes,
    small_run_flags,
    train_summary,
    training_args,
    training_drafter,
    training_rows,
)

import hf_tev.training.rollouts as rollouts_module
from hf_tev.models.dflash.modeling_dflash import DFlashDraftModel
from hf_tev.packaged import kit_path
from hf_tev.training import ExitTrainer
from hf_tev.training.losses import accepted_depths, opd_loss, replay_chains, replay_teacher_logits, rollout_batch
from hf_tev.training.rollouts import collect_rollouts, rollout_from_lengths


@pytest.fixture(scope="module")
def target():
    return make_target("qwen3")


def opd_rows():
    return training_rows(n=4, length=12)


def opd_args(tmp_path, **overrides):
    opd = dict(objective="opd", tree_budget=4, anchors_per_sequence=4, opd_rollout_max_new_tokens=10)
    return training_args(tmp_path, **{**opd, **overrides})


# ---------------------------------------------------------------------------------------------


def test_cycles_follow_the_block_lengths():
    # Prompt of 3, 10 new tokens (positions 3..12): the first root is position 3 (the prefill's token); blocks of
    # 2, 1, 4 (depth 3: all accepted) and 2 tokens follow.
    sequence = list(range(13))
    rollout = rollout_from_lengths(sequence, 3, [2, 1, 4, 2], depth=3, max_new_tokens=10)
    assert rollout.anchors == [3, 5, 6, 10] and rollout.accepted == [1, 0, 3, 1]
    # An error was exposed where fewer drafted tokens than the tree could hold were accepted. The last tree, at
    # anchor 10, could only be 3 + 10 - 10 - 2 = 1 deep (the token limit): accepting 1 exposed nothing.
    assert rollout.rejected == [True, True, False, False]
    assert rollout.block_lengths == [2, 1, 4, 2]
    # A sequence cut by EOS inside the last block: its bonus position is past the end, no error exposed.
    cut = rollout_from_lengths(list(range(8)), 3, [2, 3], depth=3, max_new_tokens=10)
    assert cut.rejected == [True, False]


def test_rollouts_are_the_targets_own_greedy_output(target):
    drafter = training_drafter(target).train()  # decoded in eval mode, then given back in training mode
    prompts = [[5, 17, 33], [7, 8]]
    rollouts = collect_rollouts(target, drafter, prompts, 4, 0.0, 12, seeds=[0, 1], pad_token_id=0)
    for prompt, rollout in zip(prompts, rollouts, strict=True):
        plain = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, pad_token_id=0)[0]
        assert rollout.input_ids == plain.tolist() and rollout.prompt_length == len(prompt)
        # The cycles cover the generated tokens: the first root is the prefill's token, each block adds L tokens.
        assert rollout.anchors[0] == len(prompt)
        assert sum(rollout.block_lengths) == len(rollout.input_ids) - len(prompt) - 1
    assert drafter.training  # restored


def test_replay_teachers_are_the_targets_distributions_at_the_replayed_positions(target):
    # Sampled rollouts of an untrained drafter: most cycles reject early, some accept. Every teacher row must be
    # the target's next-token distribution after x[:a] + the replayed chain up to that depth, where the chain is
    # the committed tokens up to the accepted depth and the drafter's own proposals after it.
    drafter = training_drafter(target)
    rollouts = collect_rollouts(target, drafter, [[5, 17, 33], [9, 4]], 6, 1.0, 12, seeds=[3, 4], pad_token_id=0)
    assert any(any(rollout.rejected) for rollout in rollouts)
    input_ids, lengths, anchors, valid, accepted, rejected = rollout_batch(
        rollouts, 32, torch.Generator().manual_seed(0), pad_token_id=0
    )
    B, A = anchors.shape
    D = TRAINING_BLOCK_SIZE - 1
    draft_logits = torch.randn(B, A, D, 96, generator=torch.Generator().manual_seed(1))
    chains = replay_chains(input_ids, anchors, accepted, lengths, draft_logits)
    with torch.no_grad():
        context = target(input_ids, use_cache=True)
        teacher = replay_teacher_logits(target, chains, anchors, valid, context.cache, input_ids.shape[1])
    m = accepted_depths(anchors, accepted, lengths)
    checked_rejected = 0
    for b, s in valid.nonzero().tolist():
        a = int(anchors[b, s])
        for k in range(1, D + 1):  # node k of the chain: committed up to m, the drafter's argmax after it
            if k < D:
                expected = input_ids[b, a + k] if k <= m[b, s] else draft_logits[b, s, k - 1].argmax()
                assert chains[b, s, k] == expected
            prefix = torch.cat([input_ids[b, :a], chains[b, s, :k]])
            with torch.no_grad():
                direct = target(prefix[None]).logits[0, -1]
            torch.testing.assert_close(teacher[b, s, k - 1].softmax(-1), direct.softmax(-1), rtol=1e-4, atol=1e-6)
            checked_rejected += bool(rejected[b, s]) and k > m[b, s]
    assert checked_rejected > 0  # some draft-induced (rejected-stream) positions were checked


def test_opd_loss_streams_by_hand():
    generator = torch.Generator().manual_seed(0)
    draft, teacher = torch.randn(2, 3, 5, generator=generator), torch.randn(2, 3, 5, generator=generator)
    accepted, rejected, valid = torch.tensor([1, 3]), torch.tensor([True, False]), torch.tensor([True, True])
    parts = opd_loss(draft, teacher, accepted, rejected, valid, accept_weight=1.0, reject_weight=3.0, decay=0.5)
    q, p = draft.log_softmax(-1), teacher.log_softmax(-1)
    fkl = lambda i, k: (p[i, k].exp() * (p[i, k] - q[i, k])).sum()  # noqa: E731
    rkl = lambda i, k: (q[i, k].exp() * (q[i, k] - p[i, k])).sum()  # noqa: E731
    accept = (fkl(0, 0) + fkl(1, 0) + fkl(1, 1) + fkl(1, 2)) / 4  # cycle 0 accepted depth 1, cycle 1 all three
    reject = (rkl(0, 1) + 0.5 * rkl(0, 2)) / 1.5  # cycle 0 rejected at depths 2, 3 (decay 0.5^(k-2))
    torch.testing.assert_close(parts.accept, accept)
    torch.testing.assert_close(parts.reject, reject)
    torch.testing.assert_close(parts.loss, (accept + 3 * reject) / 4)
    only_accept = opd_loss(draft, teacher, accepted, torch.tensor([False, False]), valid)
    assert torch.isnan(only_accept.reject) and torch.allclose(only_accept.loss, accept)


def test_loss_goes_down_on_fixed_rollouts_and_tau_is_logged(target, tmp_path):
    # One refresh for the whole run (the same two rollouts at every step), every cycle replayed, OPD alone.
    args = opd_args(
        tmp_path,
        max_steps=8,
        opd_refresh_steps=100,
        opd_rollouts=2,
        anchors_per_sequence=64,
        ce_weight=0.0,
        learning_rate=5e-3,
        lr_scheduler_type="constant",
    )
    trainer = ExitTrainer(model=training_drafter(target), target_model=target, args=args, train_dataset=opd_rows())
    trainer.train()
    history = logged(trainer, "loss_opd")
    assert len(history) == 8 and history[-1] < 0.8 * history[0], history
    assert logged(trainer, "loss") == pytest.approx(history, rel=1e-5)  # ce_weight 0: the OPD loss alone
    lengths = [length for r in trainer.rollout_pool.rollouts for length in r.block_lengths]
    assert logged(trainer, "opd_rollout_tau") == pytest.approx([sum(lengths) / len(lengths)] * 8)
    assert not logged(trainer, "loss_dflash")


def test_rollouts_are_refreshed_at_the_knobs_interval_with_the_current_drafter(target, tmp_path, monkeypatch):
    calls = []

    def recording(target_model, drafter, prompts, **kwargs):
        calls.append((trainer.state.global_step, drafter.fc.weight.detach().clone(), len(prompts), kwargs))
        return collect_rollouts(target_model, drafter, prompts, **kwargs)

    monkeypatch.setattr(rollouts_module, "collect_rollouts", recording)
    args = opd_args(tmp_path, max_steps=5, opd_refresh_steps=2, learning_rate=1e-2, opd_rollout_temperature=0.0)
    trainer = ExitTrainer(model=training_drafter(target), target_model=target, args=args, train_dataset=opd_rows())
    trainer.train()
    assert [step for step, *_ in calls] == [0, 2, 4]
    assert all(count == 2 * 2 for _, _, count, _ in calls)  # batch 2 x refresh 2: each rollout trained on once
    assert not torch.equal(calls[0][1], calls[1][1])  # the second refresh rolled out the updated drafter
    assert calls[0][3]["budget"] == 4 and calls[0][3]["temperature"] == 0.0 and calls[0][3]["max_new_tokens"] == 10
    entry = trainer.state.log_history[0]
    for key in ("loss", "loss_dflash", "loss_opd", "opd_rollout_tau"):
        assert torch.isfinite(torch.tensor(entry[key])), key
    assert entry["loss"] == pytest.approx(entry["loss_dflash"] + entry["loss_opd"], rel=1e-5)
    assert entry["opd_rollout_tau"] >= 1.0


def test_save_reload_and_resume_give_the_same_next_losses(target, tmp_path):
    rows = opd_rows()
    # Refresh every 3 steps, checkpoint at 2: the resumed run trains step 3 on the saved rollouts, then rolls out.
    common = dict(max_steps=4, save_strategy="steps", save_steps=2, opd_refresh_steps=3)
    straight = ExitTrainer(
        model=training_drafter(target),
        target_model=target,
        args=opd_args(tmp_path / "a", **common),
        train_dataset=rows,
    )
    straight.train()
    checkpoint = tmp_path / "a" / "out" / "checkpoint-2"
    assert (checkpoint / "opd_rollouts_0.json").is_file()
    resumed = ExitTrainer(
        model=training_drafter(target, seed=123),
        target_model=target,
        args=opd_args(tmp_path / "b", **common),
        train_dataset=rows,
    )
    resumed.train(resume_from_checkpoint=str(checkpoint))
    for key in ("loss", "loss_opd", "opd_rollout_tau"):
        assert len(logged(resumed, key, after_step=2)) == 2
        torch.testing.assert_close(logged(resumed, key, after_step=2), logged(straight, key, after_step=2))
    straight.save_model(str(tmp_path / "saved"))
    reloaded = DFlashDraftModel.from_pretrained(tmp_path / "saved")
    for name, value in straight.model.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], value)
    card = straight.create_model_card()
    assert "Draft-OPD" in card and "| `opd_refresh_steps` | 3 |" in card and "`tree_weight` |" not in card


def test_bad_opd_knobs_are_refused(tmp_path):
    for bad in (
        dict(opd_refresh_steps=0),
        dict(opd_reject_decay=0.0),
        dict(opd_weight=-1.0),
        dict(opd_accept_weight=0.0, opd_reject_weight=0.0),
        dict(opd_rollouts=0),
        dict(opd_rollout_budget=0),
        dict(opd_rollout_temperature=-0.5),
        dict(opd_rollout_max_new_tokens=0),
        dict(ce_weight=0.0, opd_weight=0.0),
    ):
        with pytest.raises(ValueError, match="opd|loss"):
            opd_args(tmp_path, **bad)


@pytest.mark.slow
def test_hf_tev_train_objective_opd(tmp_path):
    out = tmp_path / "drafter"
    command = [sys.executable, "-m", "hf_tev.train", "--target", str(kit_path("target"))]
    command += ["--drafter", str(kit_path("drafter-dflash")), "--train_data", str(KIT_ROWS), "--max_train_rows", "4"]
    command += ["--objective", "opd", "--opd_refresh_steps", "1", "--opd_rollout_max_new_tokens", "8"]
    command += ["--output_dir", str(out), "--logging_steps", "1"]
    command += small_run_flags(block_size=None, eval_tau_prompts=0)
    result = run_command(command, tmp_path)
    assert train_summary(result)["steps"] == 2
    assert "opd_rollout_tau" in result.stdout and "loss_opd" in result.stdout  # the logged metrics
    assert "Draft-OPD" in (out / "README.md").read_text()


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
args = ExitTrainingArguments(output_dir=out, use_cpu=True, ddp_backend="gloo", max_steps=2, objective="opd",
                             per_device_train_batch_size=2, tree_budget=4, anchors_per_sequence=2,
                             opd_refresh_steps=1, opd_rollout_max_new_tokens=6, report_to=[], disable_tqdm=True,
                             save_strategy="no", logging_steps=1)
trainer = ExitTrainer(model=drafter, target_model=target, args=args, train_dataset=rows)
trainer.train()
checksum = sum(p.double().sum().item() for p in drafter.parameters())
with open(f"{out}/rank{args.process_index}.json", "w") as f:
    json.dump({"wrapped": type(trainer.model_wrapped).__name__, "checksum": checksum,
               "prompts": [r.input_ids[: r.prompt_length] for r in trainer.rollout_pool.rollouts],
               "tau": [e["opd_rollout_tau"] for e in trainer.state.log_history if "opd_rollout_tau" in e]}, f)
"""


@pytest.mark.slow
def test_two_process_ddp_rollouts_differ_and_replicas_stay_in_sync(tmp_path):
    ranks, _ = run_two_processes(DDP_SCRIPT, tmp_path)
    assert all(r["wrapped"] == "DistributedDataParallel" for r in ranks)
    assert ranks[0]["checksum"] == pytest.approx(ranks[1]["checksum"], rel=1e-6)  # replicas stayed in sync
    assert ranks[0]["prompts"] != ranks[1]["prompts"]  # each process rolled out its own prompts
    assert ranks[0]["tau"] == pytest.approx(ranks[1]["tau"])  # the logged tau is averaged across processes
