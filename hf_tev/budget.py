"""The cost-aware automatic budget: per cycle, the tree size with the most expected tokens per second.

Design: docs/design.md#the-automatic-budget.

Plain Python (no torch, no transformers); `hf_tev.generation` feeds it measured times and verifier outcomes.

- **Nested trees.** The best-first builder adds nodes in non-increasing path log-probability, so its first n
  nodes are the best tree of size n. With Q(v) the drafter's probability of the whole path root..v, the
  drafter's own expected block length of the size-n tree is A(n) = 1 + sum_{i<=n} Q(v_i), concave in n.
- **Calibration** (`AcceptanceCalibration`). The drafter is over- or under-confident: the probability that
  node v is accepted is learnt as a non-decreasing map g(Q) from counts of accepted / drafted nodes per
  bucket of log Q (kept monotone by pooling adjacent violators), so A_cal(n) = 1 + sum g(Q(v_i)) stays
  concave. An accepted node is one on the verifier's accepted path: at T = 0 the target's argmax path, at
  T > 0 a draw whose expectation is the target flow P(v). Counts fade slowly, so the map follows the text.
- **Cost** (`CycleCost`). T(n) = t_draft + t_tree(n + 1) + t_rest(n): the drafter's time, the target's
  tree pass over n + 1 tokens and the rest of the cycle (build, verifier stage, bookkeeping). The shape of
  t_tree over sizes comes from a probe of a few sizes (a CPU pays nearly per token, a GPU almost nothing up to
  a large size), its level follows the cycles' own measurements (the context grows, the machine's load
  changes); t_draft and t_rest (a line in n) are running averages / a running least-squares fit.
- **Choice** (`SizeRule`). While the builder pops nodes, the rule follows A_cal(n) / T(n), and the tree is cut
  to the n where it is largest. The ratio need not be unimodal (a CPU pays most for the first tree token), so
  the builder goes on until no larger tree can win (A_cal concave, T non-decreasing: a bound), at most to the
  cycle's cap. A cycle is compared with plain decoding, 1 / T_plain: when even the best tree does not pay for
  the drafter, the next cycles skip the drafter (their features wait, see `hf_tev.generation.candidates`) for
  1, 2, 4, ... cycles, and drafting is tried again after each pause.
- **Probes.** The calibration learns only from built nodes, so a node it turns down although its own Q says
  it pays is built anyway now and then (after 2, 4, 8, ... such cycles in a row): one bad start cannot switch
  speculation off for good.
- **Exactness.** Everything the rule reads is fixed before the cycle's tree pass (the drafter's output, earlier
  cycles' times and outcomes), never this cycle's target draws, so every verifier stays exact.
"""

from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass, field

PROBE_START = 2  # declined cycles in a row before the first probe (`CostAwareBudget._probe_due`)
# Bucket edges of log Q (natural log), high to low; bucket b holds log Q in (EDGES[b + 1], EDGES[b]].
LOG_Q_EDGES = (0.0, -0.1, -0.25, -0.5, -0.75, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0, -9.0, -math.inf)


def isotonic(values: list[float], weights: list[float], increasing: bool = True) -> list[float]:
    """Weighted least-squares fit of `values` by a monotone sequence (pool adjacent violators)."""
    blocks = []  # [value, weight, size]
    for value, weight in zip(values, weights, strict=True):
        blocks.append([value, weight, 1])
        while len(blocks) > 1 and (blocks[-2][0] > blocks[-1][0]) == increasing and blocks[-2][0] != blocks[-1][0]:
            value_b, weight_b, size_b = blocks.pop()
            value_a, weight_a, size_a = blocks.pop()
            total = weight_a + weight_b
            blocks.append([(value_a * weight_a + value_b * weight_b) / total, total, size_a + size_b])
    return [value for value, _, size in blocks for _ in range(size)]


class AcceptanceCalibration:
    """A non-decreasing map g(Q) -> P(node accepted), learnt from the verifier's outcomes.

    Args:
        prior_weight (`float`, defaults to 2.0): pseudo-counts per bucket at g(Q) = Q (trust the drafter until
            the target says otherwise).
        decay (`float`, defaults to 0.995): every update multiplies the counts by it (about the last 200 cycles
            count).
    """

    def __init__(self, prior_weight: float = 2.0, decay: float = 0.995):
        self.prior_weight, self.decay = prior_weight, decay
        buckets = len(LOG_Q_EDGES) - 1
        self.hits = [0.0] * buckets
        self.counts = [0.0] * buckets
        # Prior: the geometric middle of each bucket (the last one, down to -inf, at e^-12).
        self.prior = [
            math.exp((hi + (lo if math.isfinite(lo) else -12.0)) / 2)
            for hi, lo in zip(LOG_Q_EDGES[:-1], LOG_Q_EDGES[1:], strict=True)
        ]
        self._table = list(self.prior)
        self._negated_edges = [-edge for edge in LOG_Q_EDGES[1:-1]]  # ascending, for bisect

    def bucket(self, log_q: float) -> int:
        """The bucket of a path log-probability (log Q <= 0)."""
        return bisect.bisect_left(self._negated_edges, -log_q)

    def __call__(self, log_q: float) -> float:
        """g(Q): the calibrated acceptance probability of a node whose path has log-probability `log_q`."""
        return self._table[self.bucket(log_q)]

    def update(self, log_qs: list[float], accepted: list[bool]) -> None:
        """One cycle's drafted nodes (their path log-probabilities) and whether each was accepted."""
        for bucket in range(len(self.hits)):
            self.hits[bucket] *= self.decay
            self.counts[bucket] *= self.decay
        for log_q, hit in zip(log_qs, accepted, strict=True):
            bucket = self.bucket(log_q)
            self.counts[bucket] += 1.0
            self.hits[bucket] += float(hit)
        self._table = self._monotone_table()

    def _monotone_table(self) -> list[float]:
        """Per-bucket estimates (prior-smoothed), non-increasing from bucket 0 (high Q) to the last."""
        weights = [count + self.prior_weight for count in self.counts]
        rates = [
            (hit + self.prior_weight * prior) / weight
            for hit, prior, weight in zip(self.hits, self.prior, weights, strict=True)
        ]
        return isotonic(rates, weights, increasing=False)


@dataclass(frozen=True)
class ProbePlan:
    """Tree-pass sizes (tokens, ascending) to measure, the largest pass they are to price (`limit`), and whether
    they extend the last probe (1 first as the anchor, then sizes beyond it) rather than replace it, or `refresh`
    one size of a stale probe (1 first as the anchor, then that size)."""

    sizes: list[int]
    limit: int
    extend: bool
    refresh: bool = False


def probe_sizes(first: int, limit: int) -> list[int]:
    """Pass sizes from `first` to `limit` tokens: the powers of two in between, and `limit` itself where it is more
    than a quarter beyond the last of them (a curve probed at 1, 2, 4, ... 2^k prices sizes up to 1.25 * 2^k by
    extending its last segment well enough)."""
    sizes = [1 << i for i in range(limit.bit_length()) if first <= (1 << i) <= limit]
    if limit >= first and (not sizes or limit > 1.25 * sizes[-1]):
        sizes.append(limit)
    return sizes


@dataclass
class CycleCost:
    """Measured cost of a cycle as a function of the drafted nodes n (seconds).

    `tree_shape[k]` is the probed relative cost of a target pass over k tokens (k = n + 1, linear between
    probed sizes, and linear beyond the largest); `tree_scale` maps it to seconds and follows every measured
    tree pass. `draft` is a running average of the drafter's time; `rest` is a running least-squares line
    a + b n for build + verifier stage + bookkeeping.
    """

    probe_sizes: list[int] = field(default_factory=list)
    probe_times: list[float] = field(default_factory=list)
    tree_scale: float | None = None
    draft: float | None = None
    smoothing: float = 0.1  # weight of a new measurement in the running averages
    # The probe is taken again when the passes measured since (at least `stale_after` of them) run this many times
    # faster or slower than it said: the machine is not what it was while probing (e.g. a probe under load).
    stale_factor: float = 1.5
    stale_after: int = 16
    passes_since_probe: int = 0
    # The largest pass the probe was asked to cover (sizes beyond it are priced by extending the curve, `tree_shape`),
    # and whether it stopped before it because a pass cost too much for any tree to pay (then no larger size is
    # worth measuring).
    probe_limit: int = 0
    probe_stopped: bool = False
    # Sizes of a stale probe still to measure again, one per call (`probe_plan`): a drift of the machine's load
    # costs each call at most two passes, never the whole curve at once.
    stale_sizes: list[int] = field(default_factory=list)
    _rest_moments: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0, 0.0])  # w, n, n^2, t, n t

    @property
    def probed(self) -> bool:
        return len(self.probe_sizes) >= 1

    @property
    def needs_probe(self) -> bool:
        """Not probed yet, or the probe is stale: the measured passes' scale left [1 / stale_factor, stale_factor].

        A probe taken while the machine was busy prices large passes by that moment's contention; the scale
        corrects only its level, and a budget that then declines every tree observes no pass that could correct
        its shape. A scale that drifted far says the machine changed since: probe again."""
        if not self.probed:
            return True
        scale = self.tree_scale or 1.0
        drifted = not 1 / self.stale_factor <= scale <= self.stale_factor
        return drifted and self.passes_since_probe >= self.stale_after

    def set_probe(self, sizes: list[int], seconds: list[float], limit: int | None = None, stopped=False) -> None:
        """Tree-pass times at a few token counts (ascending sizes); made non-decreasing (a larger pass never
        costs less: what says otherwise is timing noise). `limit`: the largest pass they price (default: the
        largest measured); `stopped`: measuring ended early because a pass cost too much for any tree to pay."""
        self.probe_sizes, self.tree_scale, self.passes_since_probe = list(sizes), 1.0, 0
        self.probe_times = isotonic(list(seconds), [1.0] * len(seconds))
        self.probe_limit, self.probe_stopped = max(sizes) if limit is None else limit, stopped

    def probe_plan(self, limit: int) -> ProbePlan:
        """The passes to measure now so that every pass of at most `limit` tokens is priced from a measurement.
        All of them at first (1, 2, 4, ... up to `limit`). When the probe is stale, one size of it per call, with 1
        first as the anchor (`take_probe` rescales the curve by it): the first such call brings the curve to the
        machine's new level, and each later one corrects the shape at one more size. Only the sizes beyond the
        last probe's limit, anchored at 1 the same way, when the budget may now choose larger trees than it was
        probed for; else none.

        The sizes beyond the limit come first, even while a refresh is owed: the budget is choosing trees the
        curve only extrapolates, and such trees (mispriced) are what drives the scale out of range in the first
        place, so a refresh alone, which never measures past the limit, would keep them mispriced for good."""
        if not self.probed:
            return ProbePlan(probe_sizes(1, limit), limit, extend=False)
        if not self.probe_stopped and limit > self.probe_limit:
            return ProbePlan([1, *probe_sizes(self.probe_limit + 1, limit)], limit, extend=True)
        if self.stale_sizes or self.needs_probe:
            return ProbePlan([1, *self._sizes_to_refresh()[:1]], self.probe_limit, extend=False, refresh=True)
        return ProbePlan([], limit, extend=False)

    def take_probe(self, plan: ProbePlan, sizes: list[int], seconds: list[float]) -> None:
        """The measured passes of `plan` (a pass that cost too much for any tree to pay ends it early, so `sizes`
        may be fewer). An extension's passes were measured at another moment than the probe (another load, a
        longer context), so they are rescaled by the ratio of the two measurements of a one-token pass before
        they join the curve. A refresh rescales the whole curve to its new one-token pass and puts the size it
        measured again in its place."""
        stopped = len(sizes) < len(plan.sizes)
        if plan.refresh:
            self._refresh(sizes, seconds, stopped)
            return
        if not plan.extend:
            self.set_probe(sizes, seconds, plan.limit, stopped)
            return
        ratio = self.probe_times[0] / max(seconds[0], 1e-12)
        times = self.probe_times + [max(t * ratio, self.probe_times[-1]) for t in seconds[1:]]
        self.probe_sizes, self.probe_times = self.probe_sizes + list(sizes[1:]), times
        self.probe_limit, self.probe_stopped = plan.limit, stopped

    def _sizes_to_refresh(self) -> list[int]:
        """The probed sizes past the one-token anchor still to measure again: the rest of a refresh under way, or
        all of them when the probe has just gone stale."""
        return self.stale_sizes or [size for size in self.probe_sizes if size > 1]

    def _refresh(self, sizes: list[int], seconds: list[float], stopped: bool) -> None:
        ratio = seconds[0] / max(self.probe_times[0], 1e-12)
        times = [t * ratio for t in self.probe_times]
        times[0] = seconds[0]
        for size, took in zip(sizes[1:], seconds[1:], strict=True):
            times[self.probe_sizes.index(size)] = took
        # a size that cost too much for any tree to pay (`stopped`) leaves the rest of the refresh to the scale
        self.stale_sizes = [] if stopped else self._sizes_to_refresh()[1:]
        self.probe_times = isotonic(times, [1.0] * len(times))
        self.tree_scale, self.passes_since_probe = 1.0, 0

    def summary(self) -> dict:
        """The model in milliseconds, for `TEVStats`."""
        return {
            "probe_tokens": list(self.probe_sizes),
            "probe_ms": [1e3 * t for t in self.probe_times],
            "tree_scale": self.tree_scale,
            "draft_ms": None if self.draft is None else 1e3 * self.draft,
            "cycle_ms": {n: 1e3 * self.cycle(n) for n in (0, 1, 4, 16, 64)},
            "plain_ms": 1e3 * self.cycle(0, drafted=False),
        }

    def tree_shape(self, tokens: int) -> float:
        """The probed curve at `tokens`: interpolated between probed sizes. Past the largest, extended at the
        steeper of its last segment's slope and its mean slope from the first size: a CPU's curve is a staircase
        (8 and 16 tokens may cost nearly the same), and its last, flat step would price a pass of 100 tokens at
        half what it costs until a probe reaches it."""
        sizes, times = self.probe_sizes, self.probe_times
        if not sizes:
            return float(tokens)  # no probe: a pass costs its tokens (the CPU view)
        if len(sizes) == 1:
            return times[0] * tokens / sizes[0]
        i = min(max(bisect.bisect_left(sizes, tokens), 1), len(sizes) - 1)
        slope = max((times[i] - times[i - 1]) / (sizes[i] - sizes[i - 1]), 0.0)
        if tokens > sizes[-1]:
            slope = max(slope, (times[-1] - times[0]) / (sizes[-1] - sizes[0]))
            return max(times[-1] + slope * (tokens - sizes[-1]), 1e-9)
        return max(times[i - 1] + slope * (tokens - sizes[i - 1]), 1e-9)

    def tree(self, tokens: int) -> float:
        """Predicted seconds of a target pass over `tokens` tree tokens."""
        return (1.0 if self.tree_scale is None else self.tree_scale) * self.tree_shape(tokens)

    def rest(self, nodes: int) -> float:
        weight, s_n, s_nn, s_t, s_nt = self._rest_moments
        if weight <= 0:
            return 0.0
        mean_n, mean_t = s_n / weight, s_t / weight
        variance = s_nn / weight - mean_n * mean_n
        slope = (s_nt / weight - mean_n * mean_t) / variance if variance > 1e-9 else 0.0
        slope = max(slope, 0.0)
        return max(mean_t + slope * (nodes - mean_n), 0.0)

    def cycle(self, nodes: int, drafted: bool = True) -> float:
        """T(n): predicted seconds of a cycle with `nodes` drafted nodes (`drafted=False`: no drafter call)."""
        return (self.draft or 0.0) * drafted + self.tree(nodes + 1) + self.rest(nodes)

    def observe_draft(self, draft_s: float) -> None:
        """The drafter's measured time (known before the tree is built)."""
        a = self.smoothing
        self.draft = draft_s if self.draft is None else (1 - a) * self.draft + a * draft_s

    def observe(self, nodes: int, tree_s: float, rest_s: float) -> None:
        """One cycle's measured tree pass and the rest of the cycle."""
        a = self.smoothing
        self.passes_since_probe += 1
        ratio = tree_s / self.tree_shape(nodes + 1)
        self.tree_scale = ratio if self.tree_scale is None else (1 - a) * self.tree_scale + a * ratio
        moments = self._rest_moments
        for i, value in enumerate((1.0, nodes, nodes * nodes, rest_s, nodes * rest_s)):
            moments[i] = (1 - a) * moments[i] + value


class CostAwareBudget:
    """Chooses each cycle's tree size (docs/design.md#the-automatic-budget). `hf_tev.generation` keeps one per
    models and settings across decoding calls, so its pauses, probes and cap go on where the last call stopped;
    its calibration and cost model may be shared with other budgets.

    Args:
        max_budget (`int`): the largest tree (drafted nodes).
        calibration (`AcceptanceCalibration`), cost (`CycleCost`): the learnt state.
        max_pause (`int`, defaults to 32): the longest run of cycles without the drafter after a cycle where
            no tree paid for it.
    """

    def __init__(self, max_budget: int, calibration: AcceptanceCalibration, cost: CycleCost, max_pause: int = 32):
        self.max_budget, self.calibration, self.cost, self.max_pause = max_budget, calibration, cost, max_pause
        self.pause, self.paused = 0, 0  # length of the current pause, cycles left in it
        self.predicted = 1.0  # A_cal of the last chosen tree
        self.limit = min(max_budget, 16)  # this cycle's cap, see `cap`
        self.recent: list[int] = []  # sizes chosen in the last drafted cycles
        self.declined, self.probe_interval = 0, PROBE_START  # see `_probe_due`
        self._choices = threading.local()  # see `_state`

    @property
    def _state(self) -> dict:
        """This cycle's size choice, `{"length": A_cal, "rate": tokens per second}`: `SizeRule.size` and
        `common_size` write it, `chose` reads it. Kept per thread: calls in several threads may share a budget,
        and one call's choice must not become another's."""
        return self._choices.state

    @_state.setter
    def _state(self, value: dict) -> None:
        self._choices.state = value

    def start_call(self) -> None:
        """A new decoding call, i.e. a new text: the probes start over (`_probe_due`), since a calibration that
        turned every tree down on the last text may be wrong for this one (a text that repeats itself suits
        context drafts where the last did not). The pause of a drafter that did not pay and the cap go on."""
        self.declined, self.probe_interval = 0, PROBE_START

    def probe_plan(self) -> ProbePlan:
        """The tree passes to measure at the start of a call (`CycleCost.probe_plan`): only sizes this budget
        could choose (up to its cap + 1 tokens), and nothing while the drafter is paused (its cycles are plain
        steps; a stale probe waits until the drafter is tried again). A first probe is always taken."""
        if self.cost.probed and self.paused > 0:
            return ProbePlan([], self.cap() + 1, extend=False)
        return self.cost.probe_plan(self.cap() + 1)

    def cap(self) -> int:
        """The most nodes this cycle's tree may take. The builder's cost grows with its cap (a top-k of that
        width per depth, the LM head rows of that many depths), so it follows the sizes recently chosen: twice
        the largest of the last 16, doubled whenever a tree reached it (the rule wanted more), within
        [8, max_budget]. A cap only ever cuts a tree the rule would have grown further: any tree stays exact."""
        return self.limit

    def should_draft(self) -> bool:
        """Whether this cycle runs the drafter (False during a pause: the cycle is a plain decoding step)."""
        if self.paused > 0:
            self.paused -= 1
            return False
        return True

    def size_rule(self, drafted: bool = True, explore: bool = True) -> SizeRule:
        """A fresh `SizeRule` for this cycle's tree builder (`drafted=False`: this cycle's candidates cost no
        drafter call, e.g. context drafts alone). With `explore`, a tree the calibration turns down may be built
        anyway as a probe (`_probe_due`)."""
        return SizeRule(self, drafted, explore)

    def _probe_due(self, pays_by_own_q: bool) -> bool:
        """Whether a cycle where the calibration turned every tree down builds one anyway, as a probe.

        The calibration learns only from nodes that are built: after a few unlucky cycles it can turn down
        every node, and then it never sees another outcome, so one bad start would switch speculation off for
        good (and for later calls, which share the calibration). When the first node's own probability Q says it
        pays (uncalibrated: `1 + Q` tokens per `T(1)` beat plain decoding) but the calibration turns every tree
        down, the best tree of at least one node is built after `probe_interval` such cycles in a row; the
        interval doubles with every probe (up to `max_pause`) and starts over once the rule builds trees by
        itself. A node that even its own Q says does not pay (a useless drafter) is never probed."""
        if not pays_by_own_q:
            return False
        self.declined += 1
        if self.declined < self.probe_interval:
            return False
        self.declined, self.probe_interval = 0, min(2 * self.probe_interval, self.max_pause)
        return True

    def _settle(self, best: tuple, best_tree: tuple | None, first_pays: bool) -> tuple:
        """The tree a scan chose, `(nodes, A_cal, rate)`: its best (`best`), or as a probe its best of at least
        one node (`best_tree`; None when nothing was offered) where the best is no tree (`_probe_due`). A tree
        chosen on merit starts the probes over."""
        if best_tree is None:
            return best
        if best[0] > 0:
            self.declined, self.probe_interval = 0, PROBE_START
            return best
        return best_tree if self._probe_due(first_pays) else best

    def best_rate(self, path_logprobs: list[float], drafted: bool) -> float:
        """The expected tokens per second of the best tree of these nodes (root first, in the builder's order),
        as `SizeRule` would cut it (never a probe)."""
        kept = getattr(self, "_state", None)  # the rule of this cycle's tree stays the one `chose` reads
        rule = self.size_rule(drafted, explore=False)
        for nodes, log_q in enumerate(path_logprobs[1:], start=1):
            if not rule(nodes, log_q):
                break
        rule.size()
        rate, self._state = self._state["rate"], kept
        return rate

    def chose(self, nodes: int, drafted: bool = True, alternative_rate: float = 0.0) -> float:
        """After the build and `SizeRule.size` (or `common_size`): the tree has `nodes` drafted nodes. Decides the
        pause before the next drafted cycle (only a cycle that ran the drafter can tell whether the drafter pays:
        against plain decoding, or against `alternative_rate`, the best cycle without the drafter, e.g. context
        drafts alone) and returns the predicted block length A_cal(nodes)."""
        self.predicted = self._state["length"] if nodes else 1.0
        if not drafted:
            return self.predicted
        self.recent = (self.recent + [nodes])[-16:]
        if nodes >= self.limit:
            self.limit = min(self.max_budget, 2 * self.limit)
        else:
            self.limit = min(self.max_budget, max(8, 2 * max(self.recent), self.limit // 2))
        plain_rate = max(1.0 / self.cost.cycle(0, drafted=False), alternative_rate)
        if self._state["rate"] < plain_rate:  # no tree pays for the drafter: go without it for a while
            self.pause = min(max(1, 2 * self.pause), self.max_pause)
            self.paused = self.pause
        else:
            self.pause = 0
        return self.predicted

    def observe(self, path_logprobs: list[float] | None, path: list[int], tree_s: float, rest_s: float) -> None:
        """One cycle's outcome: every node's path log-probability (`DraftTree.path_logprobs`, root first; None
        or just the root when nothing was drafted), the accepted path's node indices (root first), and the
        measured times of the tree pass and the rest of the cycle (the drafter's: `cost.observe_draft`)."""
        nodes = 0 if path_logprobs is None else len(path_logprobs) - 1
        if nodes:
            on_path = set(path)
            self.calibration.update(path_logprobs[1:], [node in on_path for node in range(1, nodes + 1)])
        self.cost.observe(nodes, tree_s, rest_s)

    # A batch of prompts (docs/design.md#batches): one size for every row's tree, this budget's cost being the batch's.
    def common_size(self, rows_log_q: list[list[float]], drafted: bool = True) -> tuple[int, list[float]]:
        """One tree size n for every row of a batch, and each row's predicted block length A_cal,r(n).

        `rows_log_q[r]` are row r's drafted nodes' path log-probabilities in the builder's order (its tree at the
        cap; best-first trees are nested, so its tree of n nodes is its first n). n maximises the batch's
        expected tokens per second `sum_r A_cal,r(n) / T(n)`, with `T` this budget's cost model, which for a
        batch is the cycle of every row at n nodes each (every n up to the cap is scanned). Probes as in
        `SizeRule`. `chose` then reads this choice as the per-row mean."""
        gains = [[self.calibration(log_q) for log_q in row] for row in rows_log_q]
        rows = max(1, len(gains))
        length, best = float(rows), (0, float(rows), rows / self.cost.cycle(0, drafted))
        best_tree = None  # the best of at least one node per row (what a probe builds, see `_probe_due`)
        for n in range(1, min(self.limit, max((len(g) for g in gains), default=0)) + 1):
            length += sum(g[n - 1] for g in gains if len(g) >= n)
            rate = length / self.cost.cycle(n, drafted)
            if rate > best[2]:
                best = (n, length, rate)
            if best_tree is None or rate > best_tree[2]:
                best_tree = (n, length, rate)
        first = rows + sum(math.exp(row[0]) for row in rows_log_q if row)  # the first nodes, by their own Q
        size, length, rate = self._settle(best, best_tree, first / self.cost.cycle(1, drafted) > best[2])
        self._state = {"length": length / rows, "rate": rate / rows}
        return size, [1.0 + sum(g[:size]) for g in gains]

    def observe_batch(self, rows: list[tuple[list[float] | None, list[int]]], nodes: int, tree_s: float, rest_s: float):
        """`observe` for a batch cycle: every row's (path log-probabilities, accepted path) teaches the
        calibration; the batch pass of `nodes` drafted nodes per row and the rest of the cycle, the cost."""
        for path_logprobs, path in rows:
            if path_logprobs is not None and len(path_logprobs) > 1:
                on_path = set(path)
                self.calibration.update(path_logprobs[1:], [node in on_path for node in range(1, len(path_logprobs))])
        self.cost.observe(nodes, tree_s, rest_s)


class SizeRule:
    """One cycle's size choice (`CostAwareBudget.size_rule`): the tree builder asks it before each node, then
    `size()` is the number of drafted nodes with the most expected tokens per second, A_cal(n) / T(n), over every
    n the builder offered (the caller keeps the tree's first `size()` nodes: `DraftTree.truncated`).

    The whole range is scanned because the ratio need not be unimodal: a CPU pays more for the step from a plain
    step to a tree (the first tree token brings the tree mask and the verifier) than for each node after it, so
    the first node can lower the ratio and the eighth raise it above plain decoding. The builder stops early only
    where no larger tree can win any more: the next nodes add at most this node's calibrated gain each (A_cal is
    concave) and cost at least T(n) (T never decreases), up to the cycle's cap.
    """

    def __init__(self, budget: CostAwareBudget, drafted: bool, explore: bool):
        self.budget, self.drafted, self.explore = budget, drafted, explore
        self.plain_rate = 1.0 / budget.cost.cycle(0, drafted)  # this cycle without drafted nodes
        self.length = 1.0  # A_cal of the nodes offered so far
        self.best = (0, 1.0, self.plain_rate)  # (nodes, A_cal, rate) of the best tree so far
        self.best_tree = None  # the same over trees of at least one node (what a probe builds)
        self.first_pays = False  # whether the first node pays by its own, uncalibrated Q (see `_probe_due`)

    def __call__(self, nodes: int, log_q: float) -> bool:
        """Whether the builder adds node `nodes` (1, 2, ...), whose path log-probability is `log_q`."""
        budget = self.budget
        if nodes > budget.limit or log_q == -math.inf:  # a node the drafter gives probability 0 never pays
            return False
        gain = budget.calibration(log_q)
        self.length += gain
        cycle = budget.cost.cycle(nodes, self.drafted)
        rate = self.length / cycle
        if nodes == 1:
            self.first_pays = (1.0 + math.exp(log_q)) / cycle > self.plain_rate
        if rate > self.best[2]:
            self.best = (nodes, self.length, rate)
        if self.best_tree is None or rate > self.best_tree[2]:
            self.best_tree = (nodes, self.length, rate)
        bound = (self.length + gain * (budget.limit - nodes)) / cycle  # of any tree of more nodes
        return nodes in (self.best[0], self.best_tree[0]) or bound > self.best[2]

    def size(self) -> int:
        """The chosen number of drafted nodes (recorded for `CostAwareBudget.chose`)."""
        budget = self.budget
        nodes, length, rate = budget._settle(self.best, self.best_tree, self.first_pays) if self.explore else self.best
        budget._state = {"length": length, "rate": rate}
        return nodes
