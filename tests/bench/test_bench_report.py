"""The report of `hf-tev bench` (bench.md and bench.png) from a bench.json alone: what a reader needs to read it
(budgets in every label, headings that say what a table holds, the spread over prompts beside every value, a plot
that names its run, with error bars and a legend inside the figure), documents it must refuse clearly, budget 0,
and the kept results of earlier runs."""

import copy
import json
from pathlib import Path

import pytest
from helpers import fake_document

from hf_tev import bench
from hf_tev.__main__ import main as hf_tev_main

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def test_report_labels_carry_budgets_headings_say_what_tables_hold_and_values_their_spread():
    markdown = bench.markdown_report(fake_document())
    rates = next(line for line in markdown.splitlines() if line.startswith("tokens/s"))
    # every label of the token rates names its budget: two tev rows are told apart
    assert "tev (drafter-x, B=64) " in rates and "tev (drafter-x, B=auto) " in rates and "prompt_lookup 140" in rates
    headings = [line for line in markdown.splitlines() if line.startswith("## ")]
    assert headings == [
        "## Speedup and block length per prompt set at B = 64 (and auto), T = 0 (the paper's Table 1)",
        "## Speedup and block length across tree budgets, T = 0 (the paper's Table 5)",
        "## hf_tev cycle breakdown, T = 0: ms per cycle of each stage, the decode loop, the time inside model "
        "forwards and hf_tev's own overhead outside them (means over prompt sets)",
    ]
    assert "the lowest and the highest prompt's own value" in markdown and "SR: `ar`'s wall time" in markdown
    # prompt_lookup's SR per prompt is 1.2, 1.4, 1.6 in each set: its value and range, per set and pooled
    row = next(line for line in markdown.splitlines() if line.startswith("| prompt_lookup |"))
    assert row.count("1.40 (1.20–1.60)") == 3 and row.count("2.00 (1.50–2.50)") == 3
    assert "Target: org/target-model." in markdown


def test_a_document_without_per_prompt_values_says_so_and_shows_no_spread():
    markdown = bench.markdown_report(fake_document(per_prompt=False))
    assert "keeps no per-prompt values" in markdown and "–" not in markdown


def _plot_facts(figure):
    """(suptitle, error bar extents, legend inside the figure, x tick labels of the first axes)."""
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    legend = figure.legends[0].get_window_extent(renderer)
    inside = figure.bbox
    bars = [
        container
        for ax in figure.axes
        for container in ax.containers
        if type(container).__name__ == "ErrorbarContainer" and container.has_yerr
    ]
    segments = [seg for c in bars for seg in c.lines[2][0].get_segments()]
    spans = [abs(seg[1][1] - seg[0][1]) for seg in segments]
    fits = inside.x0 <= legend.x0 and legend.x1 <= inside.x1 and inside.y0 <= legend.y0 and legend.y1 <= inside.y1
    ticks = [t.get_text() for t in figure.axes[0].get_xticklabels()]
    return figure._suptitle.get_text(), spans, fits, ticks


def test_plot_names_its_run_has_error_bars_and_a_legend_inside_the_figure():
    import matplotlib.pyplot as plt

    figure = bench.budget_figure(fake_document())
    title, spans, fits, ticks = _plot_facts(figure)
    plt.close(figure)
    for part in ("org/target-model", "drafter-x", "Some CPU 9000", "4 torch threads"):
        assert part in title
    assert any(span > 0 for span in spans)  # the lowest to the highest prompt as error bars
    assert fits
    assert ticks == ["4", "64", "auto", "no B"]


@pytest.mark.parametrize("budgets", [(0,), (0, 4, "auto")])
def test_budget_zero_is_plotted(budgets, tmp_path):
    """Budget 0 (no tree: plain cycles through hf_tev's loop) is a point at 0 of the x axis, not a crash or a
    point dropped from a log axis."""
    import matplotlib.pyplot as plt

    document = fake_document(budgets=budgets)
    bench.plot_report(document, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    figure = bench.budget_figure(document)
    _, _, _, ticks = _plot_facts(figure)
    tev_x = {float(x) for ax in figure.axes[:1] for line in ax.lines for x in line.get_xdata() if line.get_alpha() != 0}
    plt.close(figure)
    assert ticks[0] == "0" and 0.0 in tev_x


def _without(document, path):
    """`document` without the key at `path` (a tuple of keys / indices)."""
    document = copy.deepcopy(document)
    holder = document
    for key in path[:-1]:
        holder = holder[key]
    del holder[path[-1]]
    return document


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: _without(d, ("records",)), "lacks ['records']"),
        (lambda d: {**d, "records": []}, "holds no records"),
        (lambda d: {**d, "records": {"tev": 1}}, "its 'records' is a dict, not a list"),
        (lambda d: _without(d, ("settings", "temperatures")), "its 'settings' lacks ['temperatures']"),
        (lambda d: _without(d, ("machine", "device")), "its 'machine' lacks ['device']"),
        (lambda d: _without(d, ("records", 0, "tau")), "record 0 lacks ['tau']"),
    ],
)
def test_report_of_an_incomplete_document_says_what_it_lacks(change, message, tmp_path, capsys):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(change(fake_document())))
    with pytest.raises(SystemExit) as exit_info:
        hf_tev_main(["bench", "report", str(path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "bench.md").exists()


@pytest.mark.parametrize("folder", ["tiny_kit_cpu", "batch_1thread_schedule"])
def test_the_kept_results_still_render(folder, tmp_path):
    """`hf-tev bench report` reads the kept bench.json files written before 0.1.0 (no per-prompt values)."""
    hf_tev_main(["bench", "report", str(RESULTS / folder / "bench.json"), "--output", str(tmp_path)])
    markdown = (tmp_path / "bench.md").read_text()
    assert markdown.startswith("# hf-tev bench") and "| tev |" in markdown
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_into_a_folder_of_another_run_is_refused_unless_asked(tmp_path, capsys):
    source, other = tmp_path / "a", tmp_path / "b"
    for folder in (source, other):
        folder.mkdir()
        (folder / "bench.json").write_text(json.dumps(fake_document()))
    with pytest.raises(SystemExit) as exit_info:
        hf_tev_main(["bench", "report", str(source / "bench.json"), "--output", str(other)])
    assert exit_info.value.code == 2 and "--overwrite_output_dir" in capsys.readouterr().err
    hf_tev_main(["bench", "report", str(source / "bench.json"), "--output", str(other), "--overwrite_output_dir"])
    hf_tev_main(["bench", "report", str(source / "bench.json")])  # its own folder: re-rendered freely
    hf_tev_main(["bench", "report", str(source)])  # the folder of a run stands for its bench.json
    assert (other / "bench.md").read_text() == (source / "bench.md").read_text()
