"""The cost-aware automatic budget (docs/design.md#the-automatic-budget): calibration, cost model and the size
choice, alone."""

import functools
import math
import random
import threading

import pytest
import torch

from hf_tev.budget import AcceptanceCalibration, CostAwareBudget, CycleCost, ProbePlan, isotonic
from hf_tev.lookup import LookupStats, build_merged_tree
from hf_tev.tree import TREE_BUILDERS, build_tree


def identity_calibration() -> AcceptanceCalibration:
    """g(Q) = the bucket's prior (about Q), no data."""
    return AcceptanceCalibration()


def brute_force_size(log_qs, calibration, cost, max_budget) -> int:
    """argmax_n A_cal(n) / T(n) over n = 0..max_budget (first maximum)."""
    best, best_n, length = 1.0 / cost.cycle(0), 0, 1.0
    for n, log_q in enumerate(log_qs[:max_budget], start=1):
        length += calibration(log_q)
        rate = length / cost.cycle(n)
        if rate > best:
            best, best_n = rate, n
    return best_n


def choose(budget: CostAwareBudget, log_qs, drafted: bool = True) -> int:
    """One cycle's size as a builder gets it: nodes offered until the rule stops the build, then `size()`."""
    rule = budget.size_rule(drafted)
    for n, log_q in enumerate(log_qs, start=1):
        if not rule(n, log_q):
            break
    return rule.size()


def test_isotonic_fits_are_monotone_and_keep_sorted_input():
    assert isotonic([1.0, 2.0, 3.0], [1, 1, 1]) == [1.0, 2.0, 3.0]
    assert isotonic([1.0, 3.0, 2.0, 4.0, 1.0], [1] * 5) == [1.0, 2.5, 2.5, 2.5, 2.5]
    assert isotonic([3.0, 1.0], [1.0, 3.0]) == [1.5, 1.5]  # weighted mean
    assert isotonic([1.0, 2.0], [1, 1], increasing=False) == [1.5, 1.5]


@pytest.mark.parametrize("shape", ["cpu", "gpu", "cpu_first_token"])
def test_size_rule_finds_the_best_tree_size_on_a_synthetic_cost_curve(shape):
    rng = random.Random(0)
    for trial in range(20):
        # a drafter's tree: path log-probs in the builder's order (non-increasing)
        log_qs = sorted((math.log(rng.uniform(1e-4, 1.0)) * rng.uniform(0.2, 3) for _ in range(128)), reverse=True)
        cost = CycleCost()
        if shape == "cpu":  # a pass costs nearly per token
            sizes = [1, 2, 4, 8, 16, 32, 64, 129]
            cost.set_probe(sizes, [5e-3 + 2.5e-4 * k for k in sizes])
        elif shape == "gpu":  # flat up to a large size, then linear
            sizes = [1, 2, 4, 8, 16, 32, 64, 129]
            cost.set_probe(sizes, [10e-3 + (0.0 if k <= 64 else 1e-4 * (k - 64)) for k in sizes])
        else:  # a CPU where a plain step (1 token, no mask) is much cheaper than the smallest tree pass:
            # T(n) is not convex, A_cal / T not unimodal (the first node can lower it, the tenth raise it)
            sizes = [1, 2, 4, 8, 16, 32, 64, 129]
            cost.set_probe(sizes, [5e-3 + (0.0 if k == 1 else 3e-3 + 1e-4 * k) for k in sizes])
        cost.observe_draft(2e-3)
        budget = CostAwareBudget(128, identity_calibration(), cost)
        budget.limit = 128  # the whole range (the cap grows to it when trees keep reaching it: see below)
        tree_size = choose(budget, log_qs)
        assert tree_size == brute_force_size(log_qs, budget.calibration, cost, 128), trial
        if shape == "gpu" and tree_size:
            assert tree_size >= 63  # the pass is flat up to 64 tokens: every node there is free


def test_the_size_rule_looks_past_a_first_node_that_does_not_pay():
    # Measured on CPUs: a plain step (one token, no mask) is much cheaper than the smallest tree pass, after which
    # each node costs little. Then the first node lowers A_cal / T below plain decoding and ten nodes raise it well
    # above: stopping at the first decrease (right for a convex T) would decode plainly for ever.
    cost = CycleCost()
    sizes = [1, 2, 4, 8, 16, 32]
    cost.set_probe(sizes, [5e-3 if k == 1 else 8e-3 + 1e-4 * k for k in sizes])
    cost.observe_draft(2e-3)
    budget = CostAwareBudget(32, identity_calibration(), cost)
    log_qs = [math.log(0.45)] * 12 + [math.log(0.04)] * 20  # twelve fair nodes, then poor ones
    gain = budget.calibration(log_qs[0])
    assert (1 + gain) / cost.cycle(1) < 1 / cost.cycle(0)  # the first node alone does not pay
    size = choose(budget, log_qs)
    assert size == brute_force_size(log_qs, budget.calibration, cost, budget.cap()) == 12
    assert budget._state["rate"] > 1.5 / cost.cycle(0)


def test_the_builder_stops_where_the_rule_says_and_keeps_the_best_prefix():
    logprobs = torch.log_softmax(torch.randn(5, 12, generator=torch.Generator().manual_seed(0)) * 2, -1)
    full = build_tree(logprobs, 40, 3)
    assert full.path_logprobs[0] == 0.0 and full.path_logprobs == sorted(full.path_logprobs, reverse=True)
    for name, builder in TREE_BUILDERS.items():
        whole = builder(logprobs, 40, 3, size_rule=lambda n, log_q: True)
        for stop in (1, 4, 9):
            asked = []

            def rule(n, log_q, stop=stop, asked=asked):
                asked.append(n)
                return n <= stop

            cut = builder(logprobs, 40, 3, size_rule=rule)
            size = min(stop, whole.num_nodes - 1)
            assert cut.num_nodes == size + 1, name
            assert torch.equal(cut.tokens, whole.tokens[: size + 1]) and torch.equal(
                cut.parents, whole.parents[: size + 1]
            )
            assert cut.path_logprobs == whole.path_logprobs[: size + 1]
            assert asked == list(range(1, len(asked) + 1))
            # the path log-probs are the sums of the drafter's log-probs along each path
            for node in range(1, cut.num_nodes):
                path = cut.visibility[node].nonzero().squeeze(1)[1:]
                expected = sum(float(logprobs[int(cut.depths[v]) - 1, int(cut.tokens[v])]) for v in path)
                assert cut.path_logprobs[node] == pytest.approx(expected, abs=1e-5)


def assert_same_tree(a, b):
    for name in ("tokens", "depths", "parents", "visibility", "internal_nodes", "parent_rows"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.max_depth == b.max_depth and a.path_logprobs == b.path_logprobs
    # host lists; the root's token may be unknown there (-1)
    assert a.lists._replace(tokens=a.lists.tokens[1:]) == b.lists._replace(tokens=b.lists.tokens[1:])


def test_a_truncated_tree_is_the_tree_its_source_builds_at_that_budget():
    # the automatic budget builds to the cap and keeps the best first n nodes: they must be exactly the tree the
    # source builds with budget n (best-first trees are nested), with every derived structure rebuilt
    logprobs = torch.log_softmax(torch.randn(6, 10, generator=torch.Generator().manual_seed(1)) * 2, -1)
    continuations = [([4, 2, 7, 1], 3), ([4, 5], 2), ([9, 9, 9], 1)]

    def keep_all(n, log_q):
        return True

    sources = {name: functools.partial(builder, size_rule=keep_all) for name, builder in TREE_BUILDERS.items()}
    sources["merged"] = lambda lp, budget, root: build_merged_tree(lp, budget, root, continuations, LookupStats())
    for name, source in sources.items():
        whole = source(logprobs, 40, 3)
        for size in (0, 1, 2, 5, 11, whole.num_nodes - 1):
            cut = whole.truncated(size + 1)
            assert_same_tree(cut, source(logprobs, size, 3))
            if name == "merged":
                assert cut.node_info.depths == [int(d) for d in cut.depths]
                assert len(cut.node_info.sources) == len(cut.node_info.matches) == size + 1
    assert whole.truncated(10**6) is whole
    with pytest.raises(ValueError, match="num_nodes"):
        whole.truncated(0)


def test_the_cap_follows_the_chosen_sizes():
    cost = CycleCost()
    cost.set_probe([1, 256], [1e-2, 1e-2])  # free nodes: the rule wants every node the cap allows
    cost.observe_draft(1e-3)
    budget = CostAwareBudget(100, identity_calibration(), cost)
    caps = []
    for _ in range(5):
        caps.append(budget.cap())
        size = choose(budget, [-0.01] * 199)
        assert size == budget.cap()
        budget.chose(size)
    assert caps == [16, 32, 64, 100, 100]  # doubled while trees reach it, never past max_budget
    for _ in range(20):  # then the trees stay small: the cap comes down to twice the largest recent one
        choose(budget, [-0.01] * 3)
        budget.chose(3)
    assert budget.cap() == 8


def test_calibration_learns_the_targets_acceptance_and_stays_monotone():
    calibration = AcceptanceCalibration(decay=1.0)
    assert calibration(-0.05) > calibration(-1.0) > calibration(-5.0) > calibration(-20.0) > 0
    rng = random.Random(1)
    for _ in range(300):  # an over-confident drafter: a node is accepted with probability Q / 3
        log_qs = [math.log(rng.uniform(0.01, 1.0)) for _ in range(16)]
        calibration.update(log_qs, [rng.random() < math.exp(q) / 3 for q in log_qs])
    table = calibration._table
    assert table == sorted(table, reverse=True)
    assert calibration(math.log(0.9)) == pytest.approx(0.9 / 3, abs=0.06)
    assert calibration(math.log(0.3)) == pytest.approx(0.3 / 3, abs=0.05)


def test_a_useless_drafter_falls_back_to_plain_decoding_with_growing_pauses():
    cost = CycleCost()
    cost.set_probe([1, 2, 4, 8, 16], [5e-3 * (1 + 0.1 * k) for k in (1, 2, 4, 8, 16)])
    cost.observe_draft(3e-3)
    calibration = AcceptanceCalibration(decay=1.0)
    budget = CostAwareBudget(16, calibration, cost, max_pause=8)
    pauses = []
    for _ in range(6):
        assert budget.should_draft()
        assert choose(budget, [math.log(1e-4)]) == 0  # nothing the drafter proposes is worth a node
        budget.chose(0)
        budget.observe([0.0], [0], tree_s=5e-3, rest_s=1e-4)
        skipped = 0
        while not budget.should_draft():
            skipped += 1
        pauses.append(skipped)
        budget.paused = 0  # the loop above consumed the pause; the next cycle drafts
    assert pauses == [1, 2, 4, 8, 8, 8]
    # a drafter that proposes what the target accepts ends the pauses
    assert choose(budget, [math.log(0.95), math.log(0.9)]) == 2
    budget.chose(2)
    assert budget.pause == 0 and budget.should_draft()


def test_cost_model_follows_measured_cycles():
    cost = CycleCost()
    cost.set_probe([1, 4, 16], [4e-3, 6e-3, 3e-3])  # noise: made non-decreasing
    assert cost.probe_times == sorted(cost.probe_times)
    for _ in range(100):  # the machine got twice as slow
        cost.observe(3, tree_s=2 * cost.tree_shape(4), rest_s=1e-3 + 1e-5 * 3)
        cost.observe(15, tree_s=2 * cost.tree_shape(16), rest_s=1e-3 + 1e-5 * 15)
    assert cost.tree(4) == pytest.approx(2 * cost.tree_shape(4), rel=1e-3)
    assert cost.rest(9) == pytest.approx(1e-3 + 9e-5, rel=1e-3)


def test_the_drafter_pauses_when_a_tree_without_it_is_better():
    cost = CycleCost()
    cost.set_probe([1, 2, 4, 8, 16], [5e-3 * (1 + 0.05 * k) for k in (1, 2, 4, 8, 16)])
    cost.observe_draft(4e-3)  # an expensive drafter
    budget = CostAwareBudget(16, AcceptanceCalibration(decay=1.0), cost)
    drafter_paths = [0.0, math.log(0.95), math.log(0.9)]  # what the drafter proposes: it pays against plain
    lookup_paths = [0.0, math.log(0.99), math.log(0.98), math.log(0.97)]  # what the context proposes, for free
    nodes = choose(budget, drafter_paths[1:])
    alternative = budget.best_rate(lookup_paths, drafted=False)
    assert alternative > budget._state["rate"]  # best_rate left this cycle's rule in place
    budget.chose(nodes, drafted=True, alternative_rate=alternative)
    assert not budget.should_draft()  # the next cycle goes without the drafter (context drafts alone)
    # the same drafter without a better alternative keeps drafting
    budget = CostAwareBudget(16, AcceptanceCalibration(decay=1.0), cost)
    nodes = choose(budget, drafter_paths[1:])
    budget.chose(nodes, drafted=True)
    assert budget.should_draft()


def locked_budget() -> tuple[CostAwareBudget, float]:
    """A budget whose calibration turned down a node of Q = 0.6 (which pays on its own: 1.6 tokens for 1.23
    plain cycles) after 40 rejections in a row, and that node's log Q."""
    cost = CycleCost()
    cost.set_probe([1, 2, 4, 8, 16], [5e-3 * (1 + 0.3 * k) for k in (1, 2, 4, 8, 16)])
    calibration = AcceptanceCalibration(decay=1.0)
    log_q = math.log(0.6)
    calibration.update([log_q] * 40, [False] * 40)
    return CostAwareBudget(16, calibration, cost, max_pause=8), log_q


def test_a_calibration_that_turned_everything_down_is_probed_again_and_recovers():
    # A bad start: the first node (Q = 0.6, which pays on its own: 1.6 tokens for 1.23 plain cycles) was
    # rejected 40 times, so the calibration now says it does not pay and, learning only from built nodes, would
    # never see another outcome. Probes build it after 2, then 4, 8, ... declined cycles in a row.
    budget, log_q = locked_budget()
    built = [choose(budget, [log_q], drafted=False) for _ in range(24)]
    probes = [cycle for cycle, node in enumerate(built) if node]
    assert probes == [1, 5, 13, 21]  # after 2, 4, 8, 8 declined cycles (the interval doubles up to max_pause)
    # best_rate (the what-if of a cycle without the drafter) neither probes nor counts
    declined = budget.declined
    budget.best_rate([0.0, log_q], drafted=False)
    assert budget.declined == declined
    # what the probes saw (the node accepted) restores the calibration: the rule builds it on merit, probes reset
    for _ in range(40):
        budget.observe([0.0, log_q], [0, 1], tree_s=6.5e-3, rest_s=0.0)
    assert choose(budget, [log_q], drafted=False) == 1
    assert (budget.declined, budget.probe_interval) == (0, 2)
    # a node that does not pay even by its own Q is never probed
    assert not any(choose(budget, [math.log(0.05)], drafted=False) for _ in range(40))


def test_a_new_call_starts_the_probes_over_and_keeps_the_pause():
    # The budget outlives a call (`automatic_budget`); a new call is a new text, so a locked calibration is
    # probed again after 2 declined cycles, while a pause (a drafter that did not pay) goes on.
    budget, log_q = locked_budget()
    built = [choose(budget, [log_q], drafted=False) for _ in range(14)]
    assert budget.probe_interval == 8 and [c for c, node in enumerate(built) if node] == [1, 5, 13]
    budget.paused = 3
    budget.start_call()
    assert (budget.declined, budget.probe_interval, budget.paused) == (0, 2, 3)
    assert [choose(budget, [log_q], drafted=False) for _ in range(2)] == [0, 1]


def test_a_batch_probes_a_locked_calibration_too():
    # `common_size` (one tree size for a batch's rows) has the same lock-in risk and the same probes
    budget, log_q = locked_budget()
    sizes = [budget.common_size([[log_q, log_q - 1], [log_q]], drafted=False)[0] for _ in range(24)]
    assert [cycle for cycle, size in enumerate(sizes) if size] == [1, 5, 13, 21]
    assert set(sizes) == {0, 1}
    useless = [budget.common_size([[math.log(0.05)], [math.log(0.05)]], drafted=False)[0] for _ in range(40)]
    assert not any(useless)
    # once the calibration says the nodes pay, the batch builds on merit and the probes start over
    for _ in range(40):
        budget.observe_batch([([0.0, log_q], [0, 1])] * 2, nodes=1, tree_s=6.5e-3, rest_s=0.0)
    assert budget.common_size([[log_q], [log_q]], drafted=False)[0] == 1
    assert (budget.declined, budget.probe_interval) == (0, 2)


def test_a_node_the_drafter_gives_probability_zero_is_never_drafted():
    # depths the drafter could not score reach the builders as rows of -inf (hf_tev.generation.candidates): the
    # rule turns their nodes down, even where the calibration's lowest bucket would pay for them
    cost = CycleCost()
    cost.set_probe([1, 2, 4, 8, 16], [1.0, 1.0, 1.0, 1.0, 1.0])  # flat: any node that may be accepted pays
    budget = CostAwareBudget(16, identity_calibration(), cost)
    logprobs = torch.log_softmax(torch.randn(4, 12, generator=torch.Generator().manual_seed(2)) * 2, -1)
    logprobs[2:] = -math.inf  # depths 3 and 4 not scored
    for name, builder in TREE_BUILDERS.items():
        tree = builder(logprobs, 16, 3, size_rule=budget.size_rule())
        assert tree.num_nodes > 1 and tree.max_depth <= 2, name
        assert all(math.isfinite(score) for score in tree.path_logprobs), name
    rule = budget.size_rule()
    assert rule(1, -0.1) and not rule(2, -math.inf)


def test_calls_in_two_threads_sharing_a_budget_each_get_their_own_choice():
    # thread A chooses its tree, then thread B chooses another on the same budget before A reads its choice back
    cost = CycleCost()
    cost.set_probe([1, 2, 4, 8, 16], [1.0, 1.0, 1.0, 1.0, 1.0])
    budget, calibration = CostAwareBudget(16, identity_calibration(), cost), identity_calibration()
    a_log_qs, b_log_qs, b_predicted = [-0.01, -3.0], [-0.01] * 12, []
    a_nodes = choose(budget, a_log_qs)
    thread = threading.Thread(target=lambda: b_predicted.append(budget.chose(choose(budget, b_log_qs))))
    thread.start()
    thread.join(timeout=60)
    assert b_predicted[0] == pytest.approx(1 + 12 * calibration(-0.01))
    assert a_nodes > 0 and budget.chose(a_nodes) == pytest.approx(1 + sum(map(calibration, a_log_qs[:a_nodes])))


def test_a_probe_the_machine_no_longer_matches_is_taken_again():
    cost = CycleCost()
    assert cost.needs_probe  # never probed
    cost.set_probe([1, 2, 4], [10e-3, 20e-3, 40e-3])  # probed while the machine was busy: 10 ms per token
    assert not cost.needs_probe
    for _ in range(cost.stale_after - 1):  # then quiet: a plain pass takes 4 ms
        cost.observe(0, 4e-3, 0.0)
    assert cost.tree_scale < 1 / cost.stale_factor and not cost.needs_probe  # too few passes to say yet
    cost.observe(0, 4e-3, 0.0)
    assert cost.needs_probe
    cost.set_probe([1, 2, 4], [4e-3, 8e-3, 16e-3])  # the new probe starts over
    assert cost.tree_scale == 1.0 and cost.passes_since_probe == 0 and not cost.needs_probe
    rng = random.Random(0)
    for _ in range(200):  # passes that scatter around what the probe said never ask for another
        nodes = rng.choice([0, 1, 3])
        cost.observe(nodes, cost.tree_shape(nodes + 1) * rng.uniform(0.75, 1.3), 1e-4)
    assert not cost.needs_probe
    for _ in range(cost.stale_after):  # slower for good (another process took a core): probe again
        cost.observe(0, 2.5 * cost.tree_shape(1), 1e-4)
    assert cost.needs_probe


def test_the_probe_measures_only_sizes_the_budget_could_choose():
    cost = CycleCost()
    budget = CostAwareBudget(max_budget=128, calibration=AcceptanceCalibration(), cost=cost)
    assert budget.cap() == 16
    plan = budget.probe_plan()
    assert plan == ProbePlan([1, 2, 4, 8, 16], 17, extend=False)  # a pass of 17 tokens is priced from 16's segment
    cost.take_probe(plan, plan.sizes, [5e-3 * (1 + 0.1 * k) for k in plan.sizes])
    assert budget.probe_plan().sizes == []  # covered: nothing to measure at the next call

    budget.limit = 64  # trees reached the cap: it doubled twice, the curve lacks sizes it can now choose
    plan = budget.probe_plan()
    assert plan == ProbePlan([1, 32, 64], 65, extend=True)  # only the new sizes, anchored at one token
    # measured under twice the load: rescaled by the one-token pass, so the curve stays one curve
    cost.take_probe(plan, plan.sizes, [2 * 5e-3 * (1 + 0.1 * k) for k in plan.sizes])
    assert cost.probe_sizes == [1, 2, 4, 8, 16, 32, 64]
    assert cost.tree_shape(64) == pytest.approx(5e-3 * (1 + 0.1 * 64))
    assert budget.probe_plan().sizes == []


def test_a_stale_probe_is_extended_first_when_the_budget_outgrew_it():
    """A budget whose trees outgrew the probe makes the scale drift (they are priced by extrapolation); the sizes
    past the probe are measured before the refresh, which never measures past the probed sizes and would leave the
    large trees mispriced call after call."""
    cost = CycleCost()
    budget = CostAwareBudget(max_budget=128, calibration=AcceptanceCalibration(), cost=cost)
    plan = budget.probe_plan()
    cost.take_probe(plan, plan.sizes, [5e-3 * (1 + 0.1 * k) for k in plan.sizes])
    for _ in range(cost.stale_after):  # large trees, underpriced: their passes run slower than the curve said
        cost.observe(63, 2.5 * cost.tree_shape(64), 1e-4)
    budget.limit = 64
    assert cost.needs_probe
    plan = budget.probe_plan()
    assert plan == ProbePlan([1, 32, 64], 65, extend=True)
    cost.take_probe(plan, plan.sizes, [5e-3 * (1 + 0.1 * k) for k in plan.sizes])
    assert cost.probe_sizes == [1, 2, 4, 8, 16, 32, 64]
    assert budget.probe_plan() == ProbePlan([1, 2], 65, extend=False, refresh=True)  # then the refresh, as before


def test_passes_past_the_probe_are_priced_no_flatter_than_the_probed_curve():
    """A CPU's curve is a staircase (SmolLM2 at 1 thread, in plain steps: 8 tokens 2.02, 16 tokens 2.11, 105 tokens
    5.85): its last, flat step must not price a pass of 105 tokens at about 3 steps. A GPU's flat curve stays flat."""
    cpu = CycleCost()
    cpu.set_probe([1, 2, 4, 8, 16], [1.00, 1.06, 1.55, 2.02, 2.11], limit=17)
    assert cpu.tree_shape(105) / cpu.tree_shape(1) >= 5.0
    assert cpu.tree_shape(12) == pytest.approx((2.02 + 2.11) / 2)  # inside the probe: interpolated as before
    assert cpu.tree_shape(17) == pytest.approx(2.11 + 1.11 / 15)
    gpu = CycleCost()
    gpu.set_probe([1, 2, 4, 8, 16], [1.00, 1.00, 1.01, 1.02, 1.05], limit=17)
    assert gpu.tree_shape(65) / gpu.tree_shape(1) <= 1.3


def test_the_probe_stops_where_no_tree_can_pay_and_is_not_extended_past_it():
    cost = CycleCost()
    plan = cost.probe_plan(17)
    cost.take_probe(plan, [1, 2, 4], [1e-3, 2e-3, 40e-3])  # ended at 4 tokens: 40x a one-token pass
    assert cost.probe_stopped and cost.probe_plan(65).sizes == []


def test_a_stale_probe_is_not_taken_again_while_the_drafter_is_paused():
    cost = CycleCost()
    budget = CostAwareBudget(max_budget=64, calibration=AcceptanceCalibration(), cost=cost)
    plan = budget.probe_plan()
    cost.take_probe(plan, plan.sizes, [10e-3 * k for k in plan.sizes])  # probed under load
    for _ in range(cost.stale_after):
        cost.observe(0, 3e-3, 0.0)  # then the machine got quiet: the probe is stale
    assert cost.needs_probe
    budget.paused = 4  # the drafter does not pay now: its cycles are plain steps, no tree is priced
    assert budget.probe_plan().sizes == []
    budget.paused = 0  # tried again: the stale probe is taken again, one size (and the anchor) per call
    assert budget.probe_plan() == ProbePlan([1, 2], 17, extend=False, refresh=True)


def test_a_stale_probe_is_measured_again_one_size_per_call():
    """A drift of the machine's load costs a call at most two passes: the first call rescales the curve to its new
    one-token pass, and each later one measures one more size of it again, until the whole curve is new."""
    cost = CycleCost()
    budget = CostAwareBudget(max_budget=64, calibration=AcceptanceCalibration(), cost=cost)
    plan = budget.probe_plan()
    cost.take_probe(plan, plan.sizes, [10e-3 * (1 + 0.5 * k) for k in plan.sizes])  # probed under load
    for _ in range(cost.stale_after):
        cost.observe(0, 2e-3, 0.0)  # then quiet, and the shape changed too: 1 ms per token past the first
    assert cost.needs_probe
    quiet = [1e-3 * (1 + k) for k in (1, 2, 4, 8, 16)]
    plans = []
    while (plan := budget.probe_plan()).sizes:
        plans.append(plan.sizes)
        cost.take_probe(plan, plan.sizes, [1e-3 * (1 + k) for k in plan.sizes])
        assert cost.tree_scale == 1.0 and not cost.needs_probe  # the level is right from the first call on
    assert plans == [[1, 2], [1, 4], [1, 8], [1, 16]]
    assert cost.probe_sizes == [1, 2, 4, 8, 16] and cost.probe_times == pytest.approx(quiet)
