"""What the scripts of this study share: the target, the training stages and their recipes, where each stage's
drafter ships, and how tau is pooled over prompts. The scripts import it from their own folder (`from study import
...`); it loads nothing."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"
STAGES = ("init", "dflash", "exit")  # the shared initialisation, then the two arms of Table 2 from it
RECIPES = HERE / "recipes"  # recipes/<stage>.yaml: each stage's `hf-tev train` settings, paths from the repo root
# Where each stage's final drafter ships (`write_cards.py` copies it there from `runs/<stage>/`, which stays local).
SHIPPED = {
    "exit": HERE / "drafter-exittrain",
    "dflash": HERE / "drafter-dflash",
}


def recipe(stage: str) -> Path:
    """The `hf-tev train` recipe of a stage."""
    return RECIPES / f"{stage}.yaml"


def pooled_tau(records) -> float:
    """tau pooled over Table 2's per-prompt records: the tokens of all cycles (their accepted lengths) over the
    cycles."""
    return sum(r["tokens"] for r in records) / sum(r["cycles"] for r in records)


def measured_tau(records, drafter: str) -> dict[tuple[int, float], float]:
    """Pooled tau of `drafter` with TEV in Table 2's records, by (budget, temperature): what its card states."""
    records = [r for r in records if r.get("verifier", "tev") == "tev"]  # not a Table 4 arm's other verifiers
    cells = sorted({(r["budget"], r["temperature"]) for r in records if r["drafter"] == drafter})
    return {
        cell: round(
            pooled_tau([r for r in records if (r["drafter"], r["budget"], r["temperature"]) == (drafter, *cell)]), 3
        )
        for cell in cells
    }
