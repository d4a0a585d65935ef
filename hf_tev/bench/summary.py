"""What the report (`report.py`) and the plot (`plot.py`) read from the records of a `bench.json`: how a record is
named and ordered, and the spread over prompts of a measure (`prompt_spread`, from the records' `per_prompt`).
Pure functions of the document (no torch)."""

from __future__ import annotations

import statistics

from .methods import METHODS

SCHEMA = "hf_tev.bench/1"
BATCH_SCHEMA = "hf_tev.bench/batch-1"  # `hf-tev bench --batch-sizes` (`records.batch_records`)


def record_key(record) -> tuple:
    """(method, drafter, budget): one row of the report, across temperatures and prompt sets."""
    return record["method"], record["drafter"], record["budget"]


def record_label(record, budget: bool = True) -> str:
    """`tev (drafter-x, B=16)`: the method, its drafter and (with `budget`) its budget, as far as it has them."""
    parts = [p for p in (record["drafter"], budget and record["budget"] is not None and f"B={record['budget']}") if p]
    return record["method"] + (f" ({', '.join(parts)})" if parts else "")


def method_rank(method) -> int:
    """Registry order; a method this registry lacks (a stored document) goes last."""
    return list(METHODS).index(method) if method in METHODS else len(METHODS)


def budget_order(budget) -> tuple:
    """Fixed budgets ascending, then `auto`."""
    return (budget == "auto", 0 if budget in (None, "auto") else budget)


def key_order(key) -> tuple:
    """Methods in registry order, then drafter and budget."""
    method, drafter, budget = key
    return method_rank(method), method, drafter or "", budget_order(budget)


def mean(values):
    """The mean of the values that are not None (None when there are none)."""
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def prompt_values(records, field: str, per: str = "per_prompt") -> list[float]:
    """Every prompt's own value of `field` in `records`, pooled (from their `per_prompt`; `per="per_batch"`: every
    batch's, of a batch bench). Empty for documents written without them."""
    return [v for r in records for v in ((r.get(per) or {}).get(field) or []) if v is not None]


def spread(values) -> tuple[float, float] | None:
    """The lowest and the highest of `values`; None with fewer than two.

    A record's value is pooled over its prompts (a ratio of sums such as SR and τ, a mean over every prompt's
    cycles, a median over every prompt's runs), which lies between the lowest and the highest prompt's own value,
    so the report's `value (low–high)` always holds its value; an interquartile range need not."""
    if len(values) < 2:
        return None
    return min(values), max(values)


def prompt_spread(records, field: str, per: str = "per_prompt") -> tuple[float, float] | None:
    """The lowest and highest of every prompt's (or batch's) own value of `field` in `records`."""
    return spread(prompt_values(records, field, per))


def has_prompt_values(document: dict, per: str = "per_prompt") -> bool:
    """Whether the records keep per-prompt (or per-batch) values (documents written before them do not)."""
    return any(r.get(per) for r in document["records"])
