"""The report of `hf-tev bench`: pure functions of the `bench.json` document (this module imports no torch).

`markdown_report(document)` gives `bench.md` (tables shaped like the paper's Tables 1, 5 and 3 under headings that
say what they hold, the automatic budget's choices and the hf_tev cycle breakdown, each value with its
lowest and highest prompt's own value), `plot_report` (`plot.py`) draws `bench.png`, `write_outputs` writes all three
files and `write_report` the two rendered ones (`hf-tev bench report DIR/bench.json`); `read_document` reads a
stored `bench.json` and says what it lacks; `check_output_folder` refuses, before a run, a folder it cannot write
or whose earlier results it would replace. Methods are ordered, coloured and named in Table 3 from the registry.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from transformers.utils import logging

from .methods import METHODS, REFERENCE_METHOD, REFERENCE_VERIFIER
from .plot import plot_report
from .summary import (
    BATCH_SCHEMA,
    SCHEMA,
    budget_order,
    has_prompt_values,
    key_order,
    mean,
    prompt_spread,
    record_key,
    record_label,
)

logger = logging.get_logger(__name__)

JSON_NAME, MARKDOWN_NAME, PLOT_NAME = "bench.json", "bench.md", "bench.png"
OUTPUT_NAMES = (JSON_NAME, MARKDOWN_NAME, PLOT_NAME)

READING_GUIDE = (
    f"SR: `{REFERENCE_METHOD}`'s wall time over the method's, each the sum over prompts of the median of its "
    f"repeats (above 1: faster than `{REFERENCE_METHOD}`). τ: tokens per target forward, the mean output block "
    f"with its bonus token (1 for `{REFERENCE_METHOD}`). B: the tree budget, drafted nodes per cycle (auto: the "
    "automatic budget). Avg columns and means are over the prompt sets."
)
SPREAD_GUIDE = (
    "A value is pooled over the prompts of its set (SR, τ and tokens/s: ratios of sums; tree sizes: means over "
    "every prompt's cycles; stage times: medians over every prompt's runs), and an avg column is the mean of the "
    "sets' values. In parentheses beside it: the lowest and the highest prompt's own value (the prompts of every "
    "set pooled for an avg), between which the pooled value always lies. It says how much prompts differ."
)
NO_SPREAD_GUIDE = "This bench.json keeps no per-prompt values (hf_tev records them from 0.1.0 on): no spread is shown."


# --------------------------------------------------------------------------------------------------------
# Cells and tables
# --------------------------------------------------------------------------------------------------------
def markdown_table(header, rows) -> list[str]:
    """A markdown table: the header, its rule and one line per row (cells as strings)."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def _fmt(value, spec=".2f"):
    return "—" if value is None else format(value, spec)


def with_spread(
    value, records, field: str, spec: str = ".2f", scale: float = 1.0, unit: str = "", per: str = "per_prompt"
) -> str:
    """`value` (scaled, formatted) and, in parentheses, the lowest and highest prompt's (`per`: batch's) own value
    of `field` in `records` (`summary.spread`)."""
    if value is None:
        return "—"
    text = format(value * scale, spec) + unit
    spread = prompt_spread(records, field, per)
    if spread is None:
        return text
    low, high = (format(x * scale, spec) for x in spread)
    return f"{text} ({low}–{high}{unit})"


def _percent_spread(value, records, field: str) -> str:
    return with_spread(value, records, field, ".1f", 100, "%")


def shorter_or_longer(reduction) -> str:
    """A reduction `1 - ms / reference_ms` in words: `15.2% shorter`, `3.1% longer`, or `same` (to 0.1%)."""
    if reduction is None:
        return "—"
    percent = format(100 * abs(reduction), ".1f")
    if percent == "0.0":
        return "same"
    return f"{percent}% {'shorter' if reduction > 0 else 'longer'}"


def _rows_of(records, key) -> list[dict]:
    return [r for r in records if record_key(r) == key]


def _sr_tau_table(records, sets, keys, lead) -> list[str]:
    """`lead(key)` cells, then SR and τ per prompt set and their averages (the paper's Tables 1, 2, 4 and 5)."""
    rows = []
    for key in keys:
        mine = _rows_of(records, key)
        by_set = {r["prompt_set"]: r for r in mine}
        cells = [*lead(key)]
        for name in sets:
            found = [by_set[name]] if name in by_set else []
            cells += [with_spread(mean(r[f] for r in found), found, f) for f in ("speedup", "tau")]
        cells += [with_spread(mean(r[f] for r in mine), mine, f) for f in ("speedup", "tau")]
        rows.append(cells)
    header_lead = ["B", "method", "drafter"] if len(lead(keys[0])) == 3 else ["method", "drafter"]
    return markdown_table([*header_lead, *[f"{s} {w}" for s in sets for w in ("SR", "τ")], "avg SR", "avg τ"], rows)


def _end_to_end(at_t, sets, temperature, budget) -> list[str]:
    keys = sorted({record_key(r) for r in at_t if r["budget"] in (None, budget, "auto")}, key=key_order)
    if not keys:
        return []
    shown = f"{budget} (and auto)" if any(k[2] == "auto" for k in keys) and budget != "auto" else budget
    out = ["", f"## Speedup and block length per prompt set at B = {shown}, T = {temperature:g} (the paper's Table 1)"]
    out += [""]
    out += _sr_tau_table(at_t, sets, keys, lambda k: [k[0] if k[2] != "auto" else f"{k[0]} (auto)", k[1] or "—"])
    speeds = []
    for key in keys:
        mine = _rows_of(at_t, key)
        rate = with_spread(mean(r["tokens_per_s"] for r in mine), mine, "tokens_per_s", ".0f")
        speeds.append(f"{record_label(mine[0])} {rate}")
    out += ["", "tokens/s (mean over prompt sets): " + ", ".join(speeds)]
    out += _totals_line([_rows_of(at_t, key) for key in keys])
    if temperature == 0:
        bad = sorted({record_label(r) for r in at_t if r.get("greedy_exact") is False})
        out.append(
            f"**GREEDY MISMATCH** for {bad} (see warnings)."
            if bad
            else f"Greedy output equals {REFERENCE_METHOD}'s for every method."
        )
    return out


def _totals_line(records_by_key: list[list[dict]]) -> list[str]:
    """SR from sums beside SR from medians, over every prompt set: the sums count every run in full (a run that
    was slow for any reason, such as the automatic budget's cost probe, is not hidden), probes included."""
    cells = []
    for mine in records_by_key:
        if mine[0]["method"] == REFERENCE_METHOD or any(r.get("total_time_s") is None for r in mine):
            continue
        by_sums = sum(r["ar_total_time_s"] for r in mine) / sum(r["total_time_s"] for r in mine)
        by_medians = sum(r["ar_time_s"] for r in mine) / sum(r["time_s"] for r in mine)
        probes = sum(r["probe_s"] for r in mine)
        cells.append(f"{record_label(mine[0])} {by_sums:.3f} (medians {by_medians:.3f}; probes {probes:.1f} s)")
    if not cells:
        return []
    return ["", "SR over every set from total times, every run of every prompt and repeat summed, the automatic "
            "budget's cost probes included (beside it, the same from medians): " + ", ".join(cells)]  # fmt: skip


def _auto_budget_table(at_t, auto_keys) -> list[str]:
    rows = []
    for key in auto_keys:
        mine = _rows_of(at_t, key)
        quartiles = " / ".join(f"{q}" for q in mine[0].get("tree_size_quartiles") or [])
        rows.append(
            [
                key[0],
                key[1] or "—",
                with_spread(mean(r.get("tree_size_mean") for r in mine), mine, "tree_size_mean", ".1f"),
                quartiles,
                _percent_spread(mean(r.get("plain_cycle_fraction") for r in mine), mine, "plain_cycle_fraction"),
                with_spread(mean(r.get("predicted_tau") for r in mine), mine, "predicted_tau"),
                with_spread(mean(r["tau"] for r in mine), mine, "tau"),
            ]
        )
    intro = (
        "The automatic budget's choices: tree sizes (drafted nodes per cycle; quartiles over the cycles of the "
        "first prompt set), cycles without a tree, predicted and realised τ (means over prompt sets)"
    )
    header = ["method", "drafter", "mean size", "size p25 / p50 / p75", "plain cycles", "predicted τ", "τ"]
    return ["", intro, "", *markdown_table(header, rows)]


def _across_budgets(at_t, sets, temperature) -> list[str]:
    keys = sorted(
        {record_key(r) for r in at_t if r["budget"] is not None}, key=lambda k: (budget_order(k[2]), *key_order(k))
    )
    if not keys:
        return []
    out = ["", f"## Speedup and block length across tree budgets, T = {temperature:g} (the paper's Table 5)", ""]
    out += _sr_tau_table(at_t, sets, keys, lambda k: [str(k[2]), k[0], k[1] or "—"])
    auto = [k for k in keys if k[2] == "auto"]
    return out + (_auto_budget_table(at_t, auto) if auto else [])


def _replayed(method) -> tuple[str | None, str]:
    """(the verifier the replay times for `method`, its name in Table 3)."""
    entry = METHODS.get(method)
    verifier = entry.replay_verifier if entry else None
    return verifier, (entry.replay_label if entry and entry.replay_label else verifier or method)


def _stage_order(key) -> tuple:
    """Per budget and drafter, the reference verifier's row first."""
    return key[2], key[1], _replayed(key[0])[0] != REFERENCE_VERIFIER, *key_order(key)


def _verifier_stage(at_t, sets, temperature) -> list[str]:
    staged = [r for r in at_t if r.get("verifier_stage_ms") is not None]
    if not staged:
        return []
    rows = []
    for key in sorted({record_key(r) for r in staged}, key=_stage_order):
        mine = _rows_of(staged, key)
        by_set = {r["prompt_set"]: r for r in mine}
        cells = [str(key[2]), key[1], _replayed(key[0])[1]]
        for name in sets:
            found = [by_set[name]] if name in by_set else []
            cells.append(with_spread(mean(r["verifier_stage_ms"] for r in found), found, "verifier_stage_ms", ".3f"))
            cells.append(shorter_or_longer(mean(r.get("verifier_stage_reduction") for r in found)))
        cells.append(with_spread(mean(r["verifier_stage_ms"] for r in mine), mine, "verifier_stage_ms", ".3f"))
        cells.append(shorter_or_longer(mean(r.get("verifier_stage_reduction") for r in mine)))
        rows.append(cells)
    title = f"## Verifier stage per cycle on the same trees, T = {temperature:g} (the paper's Table 3)"
    intro = (
        "ms per cycle of each verifier's logits processing, decision and cache commit, the tree forward excluded, "
        f"timed right after its own tree pass over the same tree; vs {REFERENCE_VERIFIER}: how much shorter or "
        f"longer that stage is than {REFERENCE_VERIFIER}'s (DDTree's), as a fraction of {REFERENCE_VERIFIER}'s "
        "time (one ratio of the two medians, so no spread)."
    )
    versus = f"vs {REFERENCE_VERIFIER}"
    per_set = [f"{s} {w}" for s in sets for w in ("ms", versus)]
    header = ["B", "drafter", "verifier", *per_set, "avg ms", f"avg {versus}"]
    return ["", title, "", intro, "", *markdown_table(header, rows)]


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
    keys = sorted(
        {record_key(r) for r in at_t if r.get("cycle_ms") is not None},
        key=lambda k: (budget_order(k[2]), *key_order(k)),
    )
    if not keys:
        return []
    rows = []
    for key in keys:
        mine = _rows_of(at_t, key)
        cells = [str(key[2]), key[0], key[1] or "—"]
        for name, field in STAGE_COLUMNS.items():
            value = mean(r.get(field) for r in mine)
            scale, spec = (100, ".1f") if name == "overhead %" else (1, ".2f")
            cells.append(with_spread(value, mine, field, spec, scale))
        rows.append(cells)
    title = (
        f"## hf_tev cycle breakdown, T = {temperature:g}: ms per cycle of each stage, the decode loop, the time "
        "inside model forwards and hf_tev's own overhead outside them (means over prompt sets)"
    )
    return ["", title, "", *markdown_table(["B", "method", "drafter", *STAGE_COLUMNS], rows)]


def _machine_line(document: dict, prompts_note: str = "") -> str:
    settings, machine = document["settings"], document["machine"]
    loads = " -> ".join("n/a" if x is None else f"{x:.2f}" for x in machine["load_average"])  # None: no getloadavg
    return (
        f"{machine['device_name'] or machine['device']} ({machine['device']}, {machine['dtype']}), "
        f"{machine['cpu_count']} cores, torch threads {machine['torch_threads']}, load average {loads}; torch "
        f"{machine['torch']}, transformers {machine['transformers']}. Prompts per set: "
        f"{settings['max_prompts']} (max{prompts_note}), max_new_tokens {settings['max_new_tokens']}, repeats "
        f"{settings['repeats']}"
    )


def markdown_report(document: dict) -> str:
    if document.get("schema") == BATCH_SCHEMA:
        return batch_markdown(document)
    records, settings = document["records"], document["settings"]
    sets = list(dict.fromkeys(r["prompt_set"] for r in records))
    fixed = [b for b in settings["budgets"] if b != "auto"]
    budget = 64 if 64 in fixed else max(fixed) if fixed else "auto"  # the paper's Table 1 budget
    target = settings.get("target") or "the tiny kit's target"
    out = ["# hf-tev bench", "", f"Target: {target}. " + _machine_line(document) + ".", ""]
    out += [READING_GUIDE + " " + (SPREAD_GUIDE if has_prompt_values(document) else NO_SPREAD_GUIDE), ""]
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


# --------------------------------------------------------------------------------------------------------
# Batches (`hf-tev bench --batch-sizes`)
# --------------------------------------------------------------------------------------------------------
BATCH_HEADER = (
    "R",
    "method",
    "drafter",
    "budget",
    "tok/s",
    "ar tok/s",
    "speedup",
    "τ",
    "τ per row",
    "pass ms",
    "rows x nodes",
    "tree nodes",
    "draft ms",
    "verify ms",
    "exact",
)


def _batch_row(r: dict) -> list[str]:
    exact = "—" if "greedy_exact" not in r else ("yes" if r["greedy_exact"] else "NO")
    if "matches_batched_ar" in r:
        exact += " (= batched ar)" if r["matches_batched_ar"] else " (≠ batched ar)"
    return [
        str(r["batch_size"]),
        r["method"],
        r["drafter"] or "—",
        "—" if r["budget"] is None else str(r["budget"]),
        with_spread(r["tokens_per_s"], [r], "tokens_per_s", ".1f", per="per_batch"),
        with_spread(r["ar_tokens_per_s"], [r], "ar_tokens_per_s", ".1f", per="per_batch"),
        with_spread(r["speedup"], [r], "speedup", per="per_batch"),
        _fmt(r.get("tau")),
        _rows(r.get("tau_rows")),
        _fmt(r.get("pass_ms"), ".1f"),
        f"{_fmt(r.get('pass_rows'), '.1f')} x {_fmt(r.get('pass_nodes'), '.1f')}",
        _fmt(r.get("tree_nodes"), ".1f"),
        _fmt(r.get("draft_ms"), ".1f"),
        _fmt(r.get("verify_ms"), ".1f"),
        exact,
    ]


def batch_markdown(document: dict) -> str:
    """bench.md of a batch bench: per temperature and prompt set, one row per method and batch size."""
    settings = document["settings"]
    lines = [
        "# hf-tev bench: batches",
        "",
        _machine_line(document, ", cycled to fill a batch") + f", batch sizes {settings['batch_sizes']}.",
        "",
        "tok/s: new tokens of every row per second; ar tok/s: plain batched `generate` at the same batch size R; "
        "pass ms: one target forward over every unfinished row's tree, per cycle (rows x padded nodes per row "
        "beside it); draft ms: the batch's drafter call (every row's block), per cycle; exact: every row equals "
        "its prompt's own plain greedy generate alone (= batched ar: equals plain batched generate's row too)."
        + (
            " In parentheses: the lowest and the highest batch's own value (the value is pooled over the batches)."
            if has_prompt_values(document, "per_batch")
            else ""
        ),
    ]
    for warning in document["warnings"]:
        lines += ["", f"> {warning}"]
    keys = sorted({(r["temperature"], r["prompt_set"]) for r in document["records"]}, key=str)
    for temperature, set_name in keys:
        rows = [
            _batch_row(r) for r in document["records"] if (r["temperature"], r["prompt_set"]) == (temperature, set_name)
        ]
        lines += ["", f"## T = {temperature:g}, {set_name}", "", *markdown_table(BATCH_HEADER, rows)]
    return "\n".join(lines) + "\n"


def _rows(values, shown=8):
    if not values:
        return "—"
    text = " ".join(f"{v:.2f}" for v in values[:shown])
    return text + (" …" if len(values) > shown else "")


# --------------------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------------------
def check_output_folder(output: str | Path, overwrite: bool = True, replaced=OUTPUT_NAMES) -> Path:
    """Create `output` (with its parents) and check that a file can be written in it, so that a bench fails
    before its run rather than after it. Unless `overwrite`, a folder already holding any of the files named in
    `replaced` (an earlier run's) is refused. Raises `ValueError` saying why."""
    folder = Path(output)
    there = [] if overwrite else [name for name in replaced if (folder / name).exists()]
    if there:
        raise ValueError(
            f"--output {str(folder)!r} already holds {', '.join(there)} of an earlier run: pass "
            "--overwrite_output_dir to replace them, or choose another --output"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise ValueError(f"output folder {str(folder)!r} cannot be written: {error.strerror or error}") from None
    return folder


# What the report reads from a document; a stored document without one of them cannot be rendered.
DOCUMENT_KEYS = ("settings", "machine", "warnings", "records")
SETTINGS_KEYS = ("temperatures", "budgets", "max_prompts", "max_new_tokens", "repeats")
MACHINE_KEYS = ("device", "device_name", "dtype", "cpu_count", "torch_threads", "load_average", "torch", "transformers")
RECORD_KEYS = ("method", "drafter", "budget", "temperature", "prompt_set", "speedup", "tokens_per_s")
KEYS_OF_SCHEMA = {SCHEMA: ("tau",), BATCH_SCHEMA: ("batch_size", "ar_tokens_per_s")}


def _check_document(document: dict, where: str) -> None:
    """Raise `ValueError` naming what `document` lacks of what the report reads."""
    missing = [key for key in DOCUMENT_KEYS if key not in document]
    if missing:
        raise ValueError(f"{where} lacks {missing}: a bench.json of hf-tev bench holds {list(DOCUMENT_KEYS)}")
    records = document["records"]
    if not isinstance(records, list):
        raise ValueError(f"{where}: its 'records' is a {type(records).__name__}, not a list of records")
    if not records:
        raise ValueError(f"{where} holds no records (its 'records' is empty): there is nothing to report")
    settings = SETTINGS_KEYS + (("batch_sizes",) if document["schema"] == BATCH_SCHEMA else ())
    for part, keys in (("settings", settings), ("machine", MACHINE_KEYS)):
        lacking = [key for key in keys if key not in (document[part] or {})]
        if lacking:
            raise ValueError(f"{where}: its {part!r} lacks {lacking}")
    wanted = RECORD_KEYS + KEYS_OF_SCHEMA.get(document["schema"], ())
    for index, record in enumerate(records):
        lacking = [key for key in wanted if key not in record] if isinstance(record, dict) else list(wanted)
        if lacking:
            raise ValueError(f"{where}: record {index} lacks {lacking}")


def read_document(path: str | Path) -> dict:
    """A `bench.json` written by `hf-tev bench`. Raises `ValueError` saying why it cannot be read or rendered."""
    try:
        document = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read {str(path)!r}: {error}") from None
    schema = document.get("schema", "") if isinstance(document, dict) else ""
    if not str(schema).startswith(SCHEMA.split("/")[0] + "/"):
        raise ValueError(f"{str(path)!r} is not a bench.json of hf-tev bench (schema {schema!r}, expected {SCHEMA!r})")
    _check_document(document, repr(str(path)))
    return document


def write_report(document: dict, output: str | Path) -> dict[str, Path]:
    """bench.md and bench.png of `document` in `output` (the plot is skipped, with a logged warning, without
    matplotlib)."""
    folder = Path(output)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": folder / MARKDOWN_NAME, "plot": folder / PLOT_NAME}
    paths["markdown"].write_text(markdown_report(document))
    try:
        plot_report(document, paths["plot"])
    except ImportError:
        logger.warning("matplotlib is not installed (pip install matplotlib): no plot written")
        del paths["plot"]
    return paths


def write_outputs(document: dict, output: str | Path) -> dict[str, Path]:
    """bench.json, bench.md and bench.png in `output`. The report is rendered from the JSON text, so that
    `hf-tev bench report` on that file writes the same bench.md."""
    folder = Path(output)
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps(document, indent=1, sort_keys=False) + "\n"
    partial = folder / (JSON_NAME + ".partial")  # written whole, then renamed: never half a document
    partial.write_text(text)
    os.replace(partial, folder / JSON_NAME)
    return {"json": folder / JSON_NAME, **write_report(json.loads(text), folder)}
