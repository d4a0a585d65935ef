"""`bench.png`: τ and SR against the tree budget (`figure`), or tokens/s and τ against the batch size
(`batch_figure`), one column per temperature, from the `bench.json` document alone.

The title names the target, the drafters, the device and the torch threads, and says what the points and bars are.
Points are the report's values (each pooled over its set's prompts), means over the prompt sets; their error bars
run from the lowest to the highest prompt's own value (`summary.prompt_spread`; of a batch bench: over batches for
tokens/s, over rows for τ), which holds the point. The SR and τ axes always show 1 (plain `generate`), drawn as a
dashed line, so a speedup below 1 reads as one. Series at the same budget are set a few points apart so that equal
values stay visible, and the legend sits under the axes, inside the figure.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from .methods import REFERENCE_METHOD
from .summary import BATCH_SCHEMA, method_rank, prompt_spread, record_label, spread

MEASURES = (("tau", "τ (tokens per target forward)"), ("speedup", f"SR (speedup over {REFERENCE_METHOD})"))
RATIO_MEASURES = ("tau", "speedup")  # 1 is plain generate's value: their axes always show it
CAPTION = (
    "points: values pooled over each set's prompts, mean over the prompt sets; bars: lowest to highest prompt; "
    f"dashed: 1 ({REFERENCE_METHOD})"
)
BATCH_CAPTION = "points: mean over the prompt sets; bars: lowest to highest batch (tokens/s) or row (τ); dashed: τ = 1"
BATCH_MEASURES = (("tokens_per_s", "tokens/s"), ("tau", "τ (tokens per target forward)"))
LINE_STYLES, MARKERS = ("-", "--", ":", (0, (5, 1, 1, 1))), ("o", "s", "^", "D", "v", "P")
DODGE_POINTS = 4.0  # horizontal distance between series drawn at the same budget


def plot_report(document: dict, path: Path) -> None:
    """Write the plot of `document` (a bench or a batch bench) to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = batch_figure(document) if document.get("schema") == BATCH_SCHEMA else budget_figure(document)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def title(document: dict) -> str:
    """Target, drafters, device and threads of the run."""
    settings, machine = document["settings"], document["machine"]
    drafters = list(dict.fromkeys(r["drafter"] for r in document["records"] if r.get("drafter")))
    device = f"{machine.get('device_name') or machine['device']} ({machine['device']}, {machine['dtype']})"
    drafter_word = "drafter" if len(drafters) == 1 else "drafters"
    threads = machine["torch_threads"]
    return (
        f"target: {settings.get('target') or 'the tiny kit target'}; {drafter_word}: {', '.join(drafters) or 'none'}\n"
        f"{device}, {threads} torch thread{'' if threads == 1 else 's'}"
    )


def _figure(document: dict, rows_of_legend: int, caption: str):
    """Two rows of axes, one column per temperature, titled (with what the points and bars are); room under them
    for the legend."""
    import matplotlib.pyplot as plt

    columns = len(document["settings"]["temperatures"])
    size = (max(6.5, 5.2 * columns), 7.4 + 0.24 * rows_of_legend)
    figure, axes = plt.subplots(2, columns, figsize=size, squeeze=False, layout="constrained")
    figure.suptitle(f"{title(document)}\n{caption}", fontsize=9)
    return figure, axes


def _dress_axes(ax, ticks: dict, xlabel: str, ylabel: str, heading: str, one: bool = False) -> None:
    """A log2 x axis (linear from 0 to 1 when a tick is at 0) with the `ticks` (position -> label), the labels, a
    light grid, and limits that hold every point drawn (the dodged series are not counted by autoscaling); with
    `one`, a dashed line at y = 1 and a y axis that shows it."""
    if any(position == 0 for position in ticks):
        ax.set_xscale("symlog", base=2, linthresh=1, linscale=0.5)
    else:
        ax.set_xscale("log", base=2)
    ax.relim()
    ax.autoscale_view()
    if one:
        ax.axhline(1.0, color="0.35", linewidth=0.9, linestyle="--", zorder=0)
        low, high = ax.get_ylim()
        pad = 0.05 * max(high - low, 0.1)
        ax.set_ylim(min(low, 1.0 - pad), max(high, 1.0 + pad))
    ax.set_xticks(list(ticks), list(ticks.values()))
    ax.minorticks_off()
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(heading, fontsize=10)
    ax.grid(alpha=0.3)


def _legend(figure, axes) -> None:
    """One legend for the figure, under the axes, every entry once."""
    entries = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            entries.setdefault(label, handle)
    columns = max(1, min(3, len(entries)))
    figure.legend(list(entries.values()), list(entries), loc="outside lower center", ncols=columns, fontsize=8)


def _legend_rows(labels) -> int:
    return -(-len(set(labels)) // 3)


def _dodged(ax, index: int, count: int):
    """The data transform of `ax` moved sideways for series `index` of `count`."""
    from matplotlib.transforms import offset_copy

    shift = (index - (count - 1) / 2) * DODGE_POINTS
    return offset_copy(ax.transData, fig=ax.figure, x=shift, y=0, units="points")


def _point(records, field: str) -> tuple[float, float, float]:
    """The mean of `field` over `records` (prompt sets) and how far the lowest and highest prompt's own value lie
    below and above it (0 without per-prompt values)."""
    value = statistics.fmean(r[field] for r in records)
    spread = prompt_spread(records, field)
    if spread is None:
        return value, 0.0, 0.0
    return value, max(0.0, value - spread[0]), max(0.0, spread[1] - value)


def _draw(ax, xs, points, transform, style: dict, **line) -> None:
    """Points with their error bars (and a line through them unless `linestyle` says none); `relim` sees them."""
    ys = [y for y, _, _ in points]
    ax.errorbar(
        xs,
        ys,
        yerr=[[low for _, low, _ in points], [high for _, _, high in points]],
        transform=transform,
        capsize=2.5,
        markersize=4,
        **{**style, **line},
    )
    for x, (y, low, high) in zip(xs, points, strict=True):  # invisible, untransformed: the limits hold the bars
        ax.plot([x, x], [y - low, y + high], alpha=0)


def budget_positions(records) -> tuple[dict, dict]:
    """(budget -> x, x -> tick label): the fixed budgets at their values, `auto` at twice the largest, methods
    without a budget (`None`) at four times it."""
    fixed = sorted({r["budget"] for r in records if r["budget"] not in (None, "auto")})
    top = max([*fixed, 1])
    positions = {b: b for b in fixed}
    if any(r["budget"] == "auto" for r in records):
        positions["auto"] = 2 * top
    if any(r["budget"] is None for r in records):
        positions[None] = 4 * top
    return positions, {x: "no B" if b is None else str(b) for b, x in positions.items()}


def budget_figure(document: dict):
    """τ and SR against the budget, one column per temperature (means over prompt sets, bars from the lowest to the
    highest prompt, a dashed line at 1). The
    automatic budget is a hollow point at `auto`; a method without a budget is a point at `no B` and a thin
    horizontal line across."""
    records, temperatures = document["records"], document["settings"]["temperatures"]
    positions, ticks = budget_positions(records)
    drafters = list(dict.fromkeys(r["drafter"] for r in records if r["drafter"] is not None))
    figure, axes = _figure(document, _legend_rows([record_label(r, budget=False) for r in records]), CAPTION)

    def style(record):  # colour per method, line style and marker per drafter
        at = drafters.index(record["drafter"]) if record["drafter"] else 0
        return dict(
            color=f"C{method_rank(record['method']) % 10}",
            linestyle=LINE_STYLES[at % len(LINE_STYLES)],
            marker=MARKERS[at % len(MARKERS)],
            label=record_label(record, budget=False),
        )

    for column, temperature in enumerate(temperatures):
        at_t = [r for r in records if r["temperature"] == temperature]
        series = list(dict.fromkeys(record_label(r, budget=False) for r in at_t))
        for row, (field, name) in enumerate(MEASURES):
            ax = axes[row][column]
            for index, label in enumerate(series):
                mine = [r for r in at_t if record_label(r, budget=False) == label]
                look, shift = style(mine[0]), _dodged(ax, index, len(series))
                budgets = [b for b in positions if b not in (None, "auto") and any(r["budget"] == b for r in mine)]
                if budgets:
                    points = [_point([r for r in mine if r["budget"] == b], field) for b in budgets]
                    _draw(ax, budgets, points, shift, look, linewidth=1.6)
                for single in ("auto", None):
                    at_b = [r for r in mine if r["budget"] == single]
                    if not at_b:
                        continue
                    point = _point(at_b, field)
                    hollow = dict(linestyle="none", markerfacecolor="white", label=None if budgets else look["label"])
                    _draw(ax, [positions[single]], [point], shift, look, **hollow)
                    if single is None:
                        ax.axhline(point[0], color=look["color"], linewidth=0.8, alpha=0.6)
            heading = f"{name}, T = {temperature:g}"
            _dress_axes(ax, ticks, "tree budget B (drafted nodes)", name, heading, one=field in RATIO_MEASURES)
    _legend(figure, axes)
    return figure


def _batch_point(records, field: str) -> tuple[float, float, float]:
    """The mean of `field` over `records` (prompt sets) and its spread, the lowest to the highest: over batches for
    tokens/s (`per_batch`), over rows for τ (`tau_rows`)."""
    value = statistics.fmean(r[field] for r in records)
    if field == "tau":
        found = spread([v for r in records for v in r.get("tau_rows") or []])
    else:
        found = prompt_spread(records, field, per="per_batch")
    return (value, 0.0, 0.0) if found is None else (value, max(0.0, value - found[0]), max(0.0, found[1] - value))


def batch_figure(document: dict):
    """tokens/s and τ against the batch size, one column per temperature (means over prompt sets; error bars: the
    lowest to the highest batch of tokens/s and row of τ). Colour per method, line style per budget."""
    records, temperatures = document["records"], document["settings"]["temperatures"]
    sizes = sorted({r["batch_size"] for r in records})
    budgets = sorted({str(r["budget"]) for r in records}, key=lambda b: (b != "None", b == "auto", len(b), b))
    figure, axes = _figure(document, _legend_rows([record_label(r) for r in records]), BATCH_CAPTION)
    for column, temperature in enumerate(temperatures):
        at_t = [r for r in records if r["temperature"] == temperature]
        series = list(dict.fromkeys(record_label(r) for r in at_t))
        for row, (field, name) in enumerate(BATCH_MEASURES):
            ax = axes[row][column]
            for index, label in enumerate(series):
                mine = [r for r in at_t if record_label(r) == label and r.get(field) is not None]
                xs = [s for s in sizes if any(r["batch_size"] == s for r in mine)]
                if not xs:
                    continue
                points = [_batch_point([r for r in mine if r["batch_size"] == s], field) for s in xs]
                at = budgets.index(str(mine[0]["budget"]))
                look = dict(
                    label=label,
                    color=f"C{method_rank(mine[0]['method']) % 10}",
                    linestyle=LINE_STYLES[at % len(LINE_STYLES)],
                    marker=MARKERS[at % len(MARKERS)],
                )
                _draw(ax, xs, points, _dodged(ax, index, len(series)), look)
            heading = f"{name}, T = {temperature:g}"
            _dress_axes(ax, {s: str(s) for s in sizes}, "batch size R", name, heading, one=field in RATIO_MEASURES)
    _legend(figure, axes)
    return figure
