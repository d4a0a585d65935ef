"""Reports a reader can trust: every value lies inside the interval printed beside it (checked on every kept run
that has per-prompt values), reductions say shorter or longer instead of a signed percentage, the plot's SR and τ
axes show 1 with the bars said for what they are, and a machine without a load average still gets a report."""

import os
import re
from pathlib import Path

import pytest
from helpers import fake_document

from hf_tev import bench
from hf_tev.bench.records import check_load, load_average
from hf_tev.bench.report import shorter_or_longer

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
KEPT_WITH_SPREAD = sorted(
    path.parent.name
    for path in RESULTS.glob("*/bench.json")
    if '"per_prompt"' in path.read_text() or '"per_batch"' in path.read_text()
)
CELL = re.compile(r"(-?\d+(?:\.\d+)?)(%?) \((-?\d+(?:\.\d+)?)–(-?\d+(?:\.\d+)?)%?\)")


def cells_outside_their_interval(markdown: str) -> list[str]:
    outside = []
    for match in CELL.finditer(markdown):
        value, low, high = (float(match.group(i)) for i in (1, 3, 4))
        if not low <= value <= high:  # all three printed with the same precision, so rounding keeps the order
            outside.append(match.group(0))
    return outside


def test_kept_runs_with_spread_exist():
    assert len(KEPT_WITH_SPREAD) >= 2, KEPT_WITH_SPREAD


@pytest.mark.parametrize("folder", KEPT_WITH_SPREAD)
def test_every_value_of_a_kept_run_lies_inside_its_interval(folder):
    document = bench.read_document(RESULTS / folder / "bench.json")
    markdown = bench.markdown_report(document)  # a batch bench's too
    assert len(CELL.findall(markdown)) > 20  # the check reads the cells it means to
    assert cells_outside_their_interval(markdown) == []
    assert "lowest and the highest" in markdown
    for line in markdown.splitlines():  # reductions are worded, never a signed percentage
        assert not re.search(r"\| -\d+(\.\d+)?% ", line), line


def test_the_interval_check_can_fail():
    assert cells_outside_their_interval("| 19.30 (20.10–23.52) | 1.5 (1.2–1.6) | 12.0% (11.0–13.0%) |") == [
        "19.30 (20.10–23.52)"
    ]


def test_a_pooled_value_outside_the_interquartile_range_lies_inside_the_printed_interval():
    document = fake_document()
    row = next(r for r in document["records"] if r["method"] == "prompt_lookup" and r["prompt_set"] == "humaneval")
    row["per_prompt"]["speedup"] = [1.0, 1.01, 1.02, 1.03, 3.0]  # one slow-to-fast outlier
    row["speedup"] = 1.3  # a ratio of sums, pulled by the outlier: outside the IQR (1.01-1.03)
    markdown = bench.markdown_report(document)
    assert "1.30 (1.00–3.00)" in markdown and cells_outside_their_interval(markdown) == []


@pytest.mark.parametrize(
    "reduction, words", [(0.152, "15.2% shorter"), (-0.031, "3.1% longer"), (0.0004, "same"), (None, "—")]
)
def test_reductions_are_worded_so_the_sign_is_clear(reduction, words):
    assert shorter_or_longer(reduction) == words


def test_the_plots_ratio_axes_show_one_and_the_title_says_what_the_bars_are():
    import matplotlib.pyplot as plt

    document = fake_document()
    for record in document["records"]:  # every method well above 1: autoscaling alone would leave 1 out
        record["speedup"] = 3.0 + record["speedup"]
        record["tau"] = 3.0 + record["tau"]
        record["per_prompt"] = {name: [3.0 + v for v in values] for name, values in record["per_prompt"].items()}
    figure = bench.budget_figure(document)
    try:
        figure.canvas.draw()
        limits = [ax.get_ylim() for ax in figure.axes]
        dashed = [line for ax in figure.axes for line in ax.lines if line.get_linestyle() == "--"]
        title = figure._suptitle.get_text()
    finally:
        plt.close(figure)
    assert limits and all(low < 1.0 < high for low, high in limits)
    assert len(dashed) >= len(figure.axes)  # the line at 1 on every SR and τ axes
    assert "bars: lowest to highest prompt" in title


def test_a_machine_without_a_load_average_gets_a_report(monkeypatch):
    monkeypatch.delattr(os, "getloadavg")
    assert load_average() is None
    notes = []
    check_load(notes)
    assert notes == []
    document = fake_document()
    document["machine"]["load_average"] = [None, None]
    assert "load average n/a -> n/a" in bench.markdown_report(document)
