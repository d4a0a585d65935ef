"""The automatic budget's kept state: a few states per drafter and target, a new temperature's calibration, and the
first call's probe of tree-pass costs."""

import types

import torch
from helpers import greedy, make_drafter, make_target, transformers_log

from hf_tev import TEVConfig
from hf_tev.budget import AcceptanceCalibration
from hf_tev.generation import auto, forward


def sampling(temperature: float):
    """The two generation settings the automatic budget reads (temperature 0: greedy)."""
    return types.SimpleNamespace(do_sample=temperature > 0, temperature=temperature)


def test_thousands_of_temperatures_and_max_budgets_keep_a_few_states():
    target = make_target("qwen3")
    drafter = make_drafter(target)
    first = auto.automatic_budget(target, drafter, TEVConfig(), sampling(0.5))
    for i in range(1, 3001):
        auto.automatic_budget(target, drafter, TEVConfig(), sampling(0.5 + i * 1e-4))
    for max_budget in range(1, 3001):
        auto.automatic_budget(target, drafter, TEVConfig(max_budget=max_budget), sampling(1.0))
    for batch in range(2, 50):
        auto.automatic_budget(target, drafter, TEVConfig(), sampling(1.0), batch)
    assert len(auto._CALIBRATIONS[drafter]) == auto.KEPT_STATES
    assert len(auto._BUDGETS[drafter]) == auto.KEPT_STATES
    assert len(auto._COSTS[target]) == auto.KEPT_STATES
    # a dropped temperature comes back as a new state, kept from then on with its own calibration and cost
    again = auto.automatic_budget(target, drafter, TEVConfig(), sampling(0.5))
    assert again is not first
    assert auto.automatic_budget(target, drafter, TEVConfig(), sampling(0.5)) is again


def test_a_new_temperature_starts_from_the_nearest_learnt_calibration():
    target = make_target("qwen3")
    drafter = make_drafter(target)
    prior = AcceptanceCalibration()
    low = auto.automatic_budget(target, drafter, TEVConfig(), sampling(0.2)).calibration
    high = auto.automatic_budget(target, drafter, TEVConfig(), sampling(1.0)).calibration
    low.update([-0.05] * 20, [False] * 20)  # at 0.2 the confident nodes were turned down
    high.update([-0.05] * 20, [True] * 20)
    learnt = list(low.counts), low(-0.05)
    assert low(-0.05) < prior(-0.05) < high(-0.05)

    new = auto.automatic_budget(target, drafter, TEVConfig(), sampling(0.4)).calibration  # nearest: 0.2
    assert new is not low and new(-0.05) == low(-0.05) and new.counts == low.counts
    new.update([-0.05] * 20, [True] * 20)  # a copy: learning on leaves the other temperature's alone
    assert (low.counts, low(-0.05)) == learnt
    assert auto.automatic_budget(target, drafter, TEVConfig(), sampling(0.9)).calibration(-0.05) == high(-0.05)
    assert auto.automatic_budget(target, drafter, TEVConfig(), sampling(0.0)).calibration.counts == low.counts

    # another drafter, another target or context drafts on: nothing learnt here, the prior
    other_drafter = make_drafter(target, seed=2)
    other_target = make_target("qwen3", seed=3)
    for state in (
        auto.automatic_budget(target, other_drafter, TEVConfig(), sampling(0.4)),
        auto.automatic_budget(other_target, drafter, TEVConfig(), sampling(0.4)),
        auto.automatic_budget(target, drafter, TEVConfig(lookup=True), sampling(0.4)),
    ):
        assert state.calibration(-0.05) == prior(-0.05) and state.calibration.counts == prior.counts


class ScriptedClock:
    """A stage clock whose laps are the scripted cost of the tree passes made since the last lap."""

    def __init__(self):
        self.pending = 0.0

    def lap(self) -> float:
        seconds, self.pending = self.pending, 0.0
        return seconds


def test_the_first_auto_call_says_it_measures_the_tree_pass_costs_once():
    target = make_target("qwen3")
    drafter = make_drafter(target)
    prompt = torch.tensor([[1, 5, 9, 13, 7, 3]])
    with transformers_log() as messages:
        greedy(target, prompt, assistant_model=drafter, tev_config=TEVConfig(), max_new_tokens=4)
        first = list(messages)
        greedy(target, prompt, assistant_model=drafter, tev_config=TEVConfig(), max_new_tokens=4)
    said = [m for m in first if "measures the target's tree-pass costs once" in m]
    assert len(said) == 1, first
    assert not [m for m in messages[len(first) :] if "tree-pass costs" in m]  # the second call: measured already


def test_the_first_auto_call_probes_only_sizes_a_tree_could_repay(monkeypatch):
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=8)  # a cycle emits at most 8 tokens
    prompts = torch.tensor([[1, 5, 9, 13, 7, 3], [1, 40, 41, 3, 17, 88]] * 4)  # a batch of 8
    clock, passes, real = ScriptedClock(), [], forward.tree_forward

    def priced_forward(model, tokens, *args):  # a pass costs its tokens (a CPU), 1 ms each
        passes.append(tuple(tokens.shape))
        clock.pending += 1e-3 * tokens.numel()
        return real(model, tokens, *args)

    monkeypatch.setattr(forward, "tree_forward", priced_forward)
    monkeypatch.setattr(forward, "StageClock", lambda device: clock)
    expected = greedy(target, prompts, max_new_tokens=6)
    out = greedy(
        target,
        prompts,
        max_new_tokens=6,
        assistant_model=drafter,
        tev_config=TEVConfig(max_budget=512),
        return_dict_in_generate=True,
    )
    assert out.sequences.tolist() == expected.tolist()
    # Only sizes the budget could choose: its first cap is 16 nodes, a pass of 17 tokens, priced from 16 (a larger
    # max_budget is probed when the cap grows); and a pass of 16 tokens per row costs exactly the 2 x 8 one-token
    # passes a tree could repay, so nothing larger would have been measured either.
    assert out.tev_stats[0].budget_model["probe_tokens"] == [1, 2, 4, 8, 16]
    assert max(passes) == (8, 16)


def test_a_stale_probe_is_taken_again_at_the_next_call(monkeypatch):
    target = make_target("qwen3")
    drafter = make_drafter(target)  # untrained: mostly plain cycles, each a measured pass
    prompt = torch.tensor([[1, 5, 9, 13, 7, 3]])
    clock, price, real = ScriptedClock(), {"per_token": 0.5}, forward.tree_forward

    passes = []

    def priced_forward(model, tokens, *args):  # only the probe's passes are priced by the script
        passes.append(tokens.numel())
        clock.pending += price["per_token"] * tokens.numel()
        return real(model, tokens, *args)

    monkeypatch.setattr(forward, "tree_forward", priced_forward)
    monkeypatch.setattr(forward, "StageClock", lambda device: clock)
    expected = greedy(target, prompt, max_new_tokens=40)

    def call():
        out = greedy(
            target,
            prompt,
            max_new_tokens=40,
            assistant_model=drafter,
            tev_config=TEVConfig(),
            return_dict_in_generate=True,
        )
        assert out.sequences.tolist() == expected.tolist()
        return out.tev_stats.budget_model

    busy = call()  # probed "under load": half a second per token, far slower than the passes that follow
    assert busy["probe_ms"][0] == 500.0 and busy["tree_scale"] < 0.1
    price["per_token"] = 1e-3
    (budget,) = auto._BUDGETS[drafter].states.values()
    budget.paused = 8  # the drafter does not pay (it is untrained): while it is paused no tree is priced
    assert call()["probe_ms"][0] == 500.0  # so the stale probe is not taken again
    auto.forget_budgets()  # a budget whose drafter is not paused (as after the pause)
    passes.clear()
    quiet = call()  # the passes drifted far from the probe: this call probes again, one size and the anchor
    assert quiet["probe_ms"][0] == 1.0
    assert sorted(set(passes))[:2] == [1, 2] and passes.count(16) == 0  # not the whole curve: 4, 8 and 16 wait
