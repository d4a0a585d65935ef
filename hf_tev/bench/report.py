"""The report of `hf-tev bench`: pure functions of the `bench.json` document (this module imports no torch).

`markdown_report(document)` gives `bench.md` (tables shaped like the paper's Tables 1, 5 and 3, and the hf_tev
cycle breakdown), `plot_report(document, path)` draws `bench.png` (tau and SR against budget), `write_outputs`
writes all three files and `write_report` the two rendered ones (`hf-tev bench report DIR/bench.json`).
Methods are ordered, coloured and named in Table 3 from the registry (`METHODS`).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import warnings
from pathlib import Path

from .methods import METHODS, REFERENCE_METHOD, REFERENCE_VERIFIER

SCHEMA = "hf_tev.bench/1"
BATCH_SCHEMA = "hf_tev.bench/batch-1"  # `hf-tev bench --batch-sizes` (`records.batch_records`)
JSON_NAME, MARKDOWN_NAME, PLOT_NAME = "bench.json", "bench.md", "bench.png"


# --------------------------------------------------------------------------------------------------------
# Markdown tables (the paper's Tables 1, 5 and 3) and the plot
# --------------------------------------------------------------------------------------------------------
def _label(record) -> str:
    return record["method"] if record["drafter"] is None else f"{record['method']} ({record['drafter']})"


def _key(record) -> tuple:
    return record["method"], record["drafter"], record["budget"]


def _fmt(value, spec=".2f"):
    return "—" if value is None else format(value, spec)


def _percent(fraction):
    return "—" if fraction is None else f"{100 * fraction:.1f}%"


def _mean(values):
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def _table(header, rows) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def _rank(method) -> int:  # registry order; a method this registry lacks (a stored document) goes last
    return list(METHODS).index(method) if method in METHODS else len(METHODS)


def _budget_order(budget) -> tuple:  # fixed budgets ascending, then "auto"
    return (budget == "auto", 0 if budget in (None, "auto") else budget)


def _order(key) -> tuple:  # methods in registry order, then drafter and budget
    method, drafter, budget = key
    return _rank(method), method, drafter or "", _budget_order(budget)


def _replayed(method) -> tuple[str | None, str]:
    """(the verifier the replay times for `method`, its name in Table 3)."""
    entry = METHODS.get(method)
    verifier = entry.replay_verifier if entry else None
    return verifier, (entry.replay_label if entry and entry.replay_label else verifier or method)


def _per_set(records, key, sets, field_):
    by_set = {r["prompt_set"]: r for r in records if _key(r) == key}
    return [by_set[s][field_] if s in by_set else None for s in sets]


def _sr_tau_table(records, sets, keys, lead) -> list[str]:
    """`lead(key)` cells, then SR and tau per prompt set and their averages (the paper's Tables 1, 2, 4 and 5)."""
    rows = []
    for key in keys:
        srs, taus = _per_set(records, key, sets, "speedup"), _per_set(records, key, sets, "tau")
        pairs = [_fmt(x) for pair in zip(srs, taus, strict=True) for x in pair]
        rows.append([*lead(key), *pairs, _fmt(_mean(srs)), _fmt(_mean(taus))])
    header_lead = ["B", "method", "drafter"] if len(lead(keys[0])) == 3 else ["method", "drafter"]
    return _table([*header_lead, *[f"{s} {w}" for s in sets for w in ("SR", "τ")], "avg SR", "avg τ"], rows)


def _end_to_end(at_t, sets, temperature, budget) -> list[str]:
    keys = sorted({_key(r) for r in at_t if r["budget"] in (None, budget, "auto")}, key=_order)
    shown = f"{budget} and auto" if any(k[2] == "auto" for k in keys) and budget != "auto" else budget
    out = ["", f"## End to end, T = {temperature:g}, B = {shown} (Table 1)", ""]
    out += _sr_tau_table(at_t, sets, keys, lambda k: [k[0] if k[2] != "auto" else f"{k[0]} (auto)", k[1] or "—"])
    speeds = [
        f"{_label(dict(method=k[0], drafter=k[1]))} {_mean(_per_set(at_t, k, sets, 'tokens_per_s')):.0f}" for k in keys
    ]
    out += ["", "tokens/s (mean over prompt sets): " + ", ".join(speeds)]
    if temperature == 0:
        bad = sorted({_label(r) for r in at_t if r["greedy_exact"] is False})
        out.append(
            f"**GREEDY MISMATCH** for {bad} (see warnings)."
            if bad
            else f"Greedy output equals {REFERENCE_METHOD}'s for every method."
        )
    return out


def _across_budgets(at_t, sets, temperature) -> list[str]:
    keys = sorted({_key(r) for r in at_t if r["budget"] is not None}, key=lambda k: (_budget_order(k[2]), *_order(k)))
    if not keys:
        return []
    out = ["", f"## Across budgets, T = {temperature:g} (Table 5)", ""]
    out += _sr_tau_table(at_t, sets, keys, lambda k: [str(k[2]), k[0], k[1] or "—"])
    auto = [k for k in keys if k[2] == "auto"]
    if auto:
        rows = []
        for key in auto:
            mine = [r for r in at_t if _key(r) == key]
            quartiles = " / ".join(f"{q}" for q in mine[0]["tree_size_quartiles"] or [])
            rows.append(
                [
                    key[0],
                    key[1] or "—",
                    _fmt(_mean([r["tree_size_mean"] for r in mine]), ".1f"),
                    quartiles,
                    _percent(_mean([r["plain_cycle_fraction"] for r in mine])),
                    _fmt(_mean([r["predicted_tau"] for r in mine])),
                    _fmt(_mean([r["tau"] for r in mine])),
                ]
            )
        out += [
            "",
            "Automatic budget: chosen tree sizes (drafted nodes per cycle; quartiles of the first prompt set), "
            "cycles without a tree, predicted and realised τ (mean over prompt sets)",
            "",
        ]
        out += _table(
            ["method", "drafter", "mean size", "size p25 / p50 / p75", "plain cycles", "predicted τ", "τ"], rows
        )
    return out


def _verifier_stage(at_t, sets, temperature) -> list[str]:
    staged = [r for r in at_t if r["verifier_stage_ms"] is not None]
    if not staged:
        return []
    rows = []
    # per budget and drafter, the reference verifier's row first
    for key in sorted(
        {_key(r) for r in staged}, key=lambda k: (k[2], k[1], _replayed(k[0])[0] != REFERENCE_VERIFIER, *_order(k))
    ):
        ms = _per_set(staged, key, sets, "verifier_stage_ms")
        reduction = _per_set(staged, key, sets, "verifier_stage_reduction")
        cells = [c for m, red in zip(ms, reduction, strict=True) for c in (_fmt(m, ".3f"), _percent(red))]
        label = _replayed(key[0])[1]
        rows.append([str(key[2]), key[1], label, *cells, _fmt(_mean(ms), ".3f"), _percent(_mean(reduction))])
    title = (
        f"## Verifier stage per cycle on the same trees, T = {temperature:g} (Table 3; ms, decision + cache "
        "commit, tree forward excluded)"
    )
    header = ["B", "drafter", "verifier", *[f"{s} {w}" for s in sets for w in ("ms", "red.")], "avg ms", "avg red."]
    return ["", title, "", *_table(header, rows)]


STAGE_COLUMNS = {
    "draft": "draft_ms",
    "build": "build_ms",
    "tree forward": "forward_ms",
    "verifier stage": "verify_ms",
    "cycle": "cycle_ms",
    "model forwards": "model_ms",
    "overhead": "overhead_ms",
    "overhead %": "overhead_fraction",
}


def _cycle_breakdown(at_t, temperature) -> list[str]:
    keys = sorted({_key(r) for r in at_t if r["cycle_ms"] is not None}, key=lambda k: (_budget_order(k[2]), *_order(k)))
    if not keys:
        return []
    rows = []
    for key in keys:
        mine = [r for r in at_t if _key(r) == key]
        values = {name: _mean([r[field_] for r in mine]) for name, field_ in STAGE_COLUMNS.items()}
        values["overhead %"] *= 100
        rows.append(
            [
                str(key[2]),
                key[0],
                key[1] or "—",
                *(_fmt(v, ".1f" if name == "overhead %" else ".2f") for name, v in values.items()),
            ]
        )
    title = f"## hf_tev cycle breakdown, T = {temperature:g} (ms per cycle, mean over prompt sets)"
    return ["", title, "", *_table(["B", "method", "drafter", *STAGE_COLUMNS], rows)]


def markdown_report(document: dict) -> str:
    if document.get("schema") == BATCH_SCHEMA:
        return batch_markdown(document)
    records, settings, machine = document["records"], document["settings"], document["machine"]
    sets = list(dict.fromkeys(r["prompt_set"] for r in records))
    fixed = [b for b in settings["budgets"] if b != "auto"]
    budget = 64 if 64 in fixed else max(fixed) if fixed else "auto"  # the paper's Table 1 budget
    loads = " -> ".join(f"{x:.2f}" for x in machine["load_average"])
    summary = (
        f"{machine['device_name'] or machine['device']} ({machine['device']}, {machine['dtype']}), "
        f"{machine['cpu_count']} cores, torch threads {machine['torch_threads']}, load average {loads}; torch "
        f"{machine['torch']}, transformers {machine['transformers']}. Prompts per set: "
        f"{settings['max_prompts']} (max), max_new_tokens {settings['max_new_tokens']}, repeats "
        f"{settings['repeats']}."
    )
    out = ["# hf-tev bench", "", summary, ""]
    generation = settings.get("generation")  # absent from documents written before it was recorded
    if generation:
        passed = "; ".join(
            f"T = {t}: `{', '.join(f'{k}={v!r}' for k, v in kwargs.items())}`" for t, kwargs in generation.items()
        )
        out += [f"`generate` settings per temperature: {passed}.", ""]
    out += [f"> **warning:** {note}" for note in document["warnings"]]
    for temperature in settings["temperatures"]:
        at_t = [r for r in records if r["temperature"] == temperature]
        out += _end_to_end(at_t, sets, temperature, budget)
        out += _across_budgets(at_t, sets, temperature)
        out += _verifier_stage(at_t, sets, temperature)
        out += _cycle_breakdown(at_t, temperature)
    return "\n".join(out) + "\n"


def _figure(plt, columns: int):
    """Two rows of axes, one column per temperature, with room at the right for the legend."""
    return plt.subplots(2, columns, figsize=(5 * columns + 2.5, 7), squeeze=False)


def _dress_axes(ax, ticks: list, xlabel: str, ylabel: str, title: str) -> None:
    """A log2 x axis with a tick at every value of `ticks`, the labels and title, and a light grid."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)


def _save_figure(figure, axes, path: Path) -> None:
    """One legend for the whole figure at its right edge (room kept for it), written to `path` and closed."""
    import matplotlib.pyplot as plt

    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="center right", fontsize=8)
    figure.tight_layout(rect=(0, 0, 1 - 2.4 / figure.get_figwidth(), 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_report(document: dict, path: Path) -> None:
    """tau and SR against budget, one column per temperature (mean over prompt sets); methods without a budget
    are horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if document.get("schema") == BATCH_SCHEMA:
        return _plot_batches(document, path, plt)
    records, temperatures = document["records"], document["settings"]["temperatures"]
    budgets = sorted(b for b in document["settings"]["budgets"] if b != "auto")
    drafters = list(dict.fromkeys(r["drafter"] for r in records if r["drafter"] is not None))
    styles = ["-", "--", ":", "-."]

    def style(record):  # colour per method, line style per drafter; methods without a budget are thin lines
        dash = styles[drafters.index(record["drafter"]) % len(styles)] if record["drafter"] else "-"
        return dict(color=f"C{_rank(record['method']) % 10}", linestyle=dash, label=_label(record))

    figure, axes = _figure(plt, len(temperatures))
    for column, temperature in enumerate(temperatures):
        at_t = [r for r in records if r["temperature"] == temperature]
        for row, (key, name) in enumerate((("tau", "τ (block length)"), ("speedup", f"SR vs {REFERENCE_METHOD}"))):
            ax = axes[row][column]
            for label in dict.fromkeys(_label(r) for r in at_t):
                mine = [r for r in at_t if _label(r) == label]
                if mine[0]["budget"] is None:
                    ax.axhline(statistics.fmean(r[key] for r in mine), linewidth=1, alpha=0.8, **style(mine[0]))
                    continue
                auto = [r for r in mine if r["budget"] == "auto"]
                if auto:  # the automatic budget: one level across the fixed budgets, dash-dotted and thick
                    ax.axhline(
                        statistics.fmean(r[key] for r in auto),
                        linewidth=2.4,
                        alpha=0.9,
                        **{**style(auto[0]), "linestyle": "-.", "label": _label(auto[0]) + " auto"},
                    )
                    mine = [r for r in mine if r["budget"] != "auto"]
                xs = [b for b in budgets if any(r["budget"] == b for r in mine)]
                if not xs:
                    continue
                ys = [statistics.fmean(r[key] for r in mine if r["budget"] == b) for b in xs]
                ax.plot(xs, ys, marker="o", linewidth=1.8, **style(mine[0]))
            _dress_axes(ax, budgets, "budget B", name, f"{name}, T = {temperature:g} (mean over prompt sets)")
    _save_figure(figure, axes, path)


# --------------------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------------------
def check_output_folder(output: str | Path) -> Path:
    """Create `output` (with its parents) and check that a file can be written in it, so that a bench fails
    before its run rather than after it. Raises `ValueError` saying why not."""
    folder = Path(output)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise ValueError(f"output folder {str(folder)!r} cannot be written: {error.strerror or error}") from None
    return folder


def read_document(path: str | Path) -> dict:
    """A `bench.json` written by `hf-tev bench`. Raises `ValueError` saying why it cannot be read."""
    try:
        document = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read {str(path)!r}: {error}") from None
    schema = document.get("schema", "") if isinstance(document, dict) else ""
    if not str(schema).startswith(SCHEMA.split("/")[0] + "/"):
        raise ValueError(f"{str(path)!r} is not a bench.json of hf-tev bench (schema {schema!r}, expected {SCHEMA!r})")
    return document


def write_report(document: dict, output: str | Path) -> dict[str, Path]:
    """bench.md and bench.png of `document` in `output` (the plot is skipped, with a warning, without
    matplotlib)."""
    folder = Path(output)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": folder / MARKDOWN_NAME, "plot": folder / PLOT_NAME}
    paths["markdown"].write_text(markdown_report(document))
    try:
        plot_report(document, paths["plot"])
    except ImportError:
        warnings.warn("matplotlib is not installed (pip install 'hf_tev[bench]'): no plot written", stacklevel=2)
        del paths["plot"]
    return paths


def write_outputs(document: dict, output: str | Path) -> dict[str, Path]:
    """bench.json, bench.md and bench.png in `output`. The report is rendered from the JSON text, so that
    `hf-tev bench report` on that file writes the same bench.md."""
    folder = Path(output)
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps(document, indent=1, sort_keys=False) + "\n"
    (folder / JSON_NAME).write_text(text)
    return {"json": folder / JSON_NAME, **write_report(json.loads(text), folder)}


# --------------------------------------------------------------------------------------------------------
# Batches (`hf-tev bench --batch-sizes`)
# --------------------------------------------------------------------------------------------------------
def batch_markdown(document: dict) -> str:
    """bench.md of a batch bench: per temperature and prompt set, one row per method and batch size."""
    settings, machine = document["settings"], document["machine"]
    lines = [
        "# hf-tev bench: batches",
        "",
        f"{machine['device_name']} ({machine['device']}, {machine['dtype']}), {machine['cpu_count']} cores, torch "
        f"threads {machine['torch_threads']}, load average "
        f"{' -> '.join(f'{x:.2f}' for x in machine['load_average'])}; torch {machine['torch']}, transformers "
        f"{machine['transformers']}. Prompts per set: {settings['max_prompts']} (max, cycled to fill a batch), "
        f"max_new_tokens {settings['max_new_tokens']}, repeats {settings['repeats']}, batch sizes "
        f"{settings['batch_sizes']}.",
        "",
        "tok/s: new tokens of every row per second; ar tok/s: plain batched `generate` at the same batch size R; "
        "pass ms: one target forward over every unfinished row's tree, per cycle (rows x padded nodes per row "
        "beside it); draft ms: the batch's drafter call (every row's block), per cycle; exact: every row equals "
        "its prompt's own plain greedy generate alone (= batched ar: equals plain batched generate's row too).",
    ]
    for warning in document["warnings"]:
        lines += ["", f"> {warning}"]
    keys = sorted({(r["temperature"], r["prompt_set"]) for r in document["records"]}, key=str)
    for temperature, set_name in keys:
        lines += [
            "",
            f"## T = {temperature:g}, {set_name}",
            "",
            "| R | method | drafter | budget | tok/s | ar tok/s | speedup | τ | τ per row | pass ms | rows x nodes "
            "| tree nodes | draft ms | verify ms | exact |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in document["records"]:
            if (r["temperature"], r["prompt_set"]) != (temperature, set_name):
                continue
            exact = "—" if "greedy_exact" not in r else ("yes" if r["greedy_exact"] else "NO")
            if "matches_batched_ar" in r:
                exact += " (= batched ar)" if r["matches_batched_ar"] else " (≠ batched ar)"
            tau_rows, budget = r.get("tau_rows"), "—" if r["budget"] is None else r["budget"]
            lines.append(
                f"| {r['batch_size']} | {r['method']} | {r['drafter'] or '—'} | {budget} "
                f"| {r['tokens_per_s']:.1f} | {r['ar_tokens_per_s']:.1f} | {r['speedup']:.2f} "
                f"| {_fmt(r.get('tau'))} | {_rows(tau_rows)} | {_fmt(r.get('pass_ms'), '.1f')} "
                f"| {_fmt(r.get('pass_rows'), '.1f')} x {_fmt(r.get('pass_nodes'), '.1f')} "
                f"| {_fmt(r.get('tree_nodes'), '.1f')} | {_fmt(r.get('draft_ms'), '.1f')} "
                f"| {_fmt(r.get('verify_ms'), '.1f')} | {exact} |"
            )
    return "\n".join(lines) + "\n"


def _rows(values, shown=8):
    if not values:
        return "—"
    text = " ".join(f"{v:.2f}" for v in values[:shown])
    return text + (" …" if len(values) > shown else "")


def _batch_label(record) -> str:
    return _label(record) + ("" if record["budget"] is None else f" B={record['budget']}")


def _plot_batches(document: dict, path: Path, plt) -> None:
    """tokens/s and τ against batch size, one column per temperature (mean over prompt sets)."""
    records, temperatures = document["records"], document["settings"]["temperatures"]
    sizes = sorted({r["batch_size"] for r in records})
    figure, axes = _figure(plt, len(temperatures))
    for column, temperature in enumerate(temperatures):
        at_t = [r for r in records if r["temperature"] == temperature]
        for row, (key, name) in enumerate((("tokens_per_s", "tokens/s"), ("tau", "τ (block length)"))):
            ax = axes[row][column]
            for label in dict.fromkeys(_batch_label(r) for r in at_t):
                mine = [r for r in at_t if _batch_label(r) == label and r.get(key) is not None]
                xs = [s for s in sizes if any(r["batch_size"] == s for r in mine)]
                if xs:
                    ys = [statistics.fmean(r[key] for r in mine if r["batch_size"] == s) for s in xs]
                    ax.plot(xs, ys, marker="o", label=label, color=f"C{_rank(mine[0]['method']) % 10}")
            _dress_axes(ax, sizes, "batch size R", name, f"{name}, T = {temperature:g}")
    _save_figure(figure, axes, path)
