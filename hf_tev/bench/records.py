"""What a bench run writes: the `bench.json` document (`bench_document`: settings, `machine_info`, warnings) and
its records, summarised from the runs of `measure`. docs/bench.md#benchjson describes the document and every field
of a record.

One prompt per call (schema `SCHEMA`, fields `RECORD_FIELDS`): `make_records`, from `summarise` of each job's runs.

Batches (`--batch-sizes`, schema `BATCH_SCHEMA`): `batch_records`, a record per method x drafter x budget x
temperature x prompt set x batch size, from `summarise_batches` of each job's batches.
"""

from __future__ import annotations

import hashlib
import math
import os
import platform
import statistics
from dataclasses import fields
from pathlib import Path

import torch
from transformers.utils import logging

from .._version import __version__
from .methods import METHODS, REFERENCE_METHOD, REFERENCE_VERIFIER

logger = logging.get_logger(__name__)

# hf_tev's stage times per cycle: the loop's stages (`TEVStats`), the whole cycle, the time in model forwards and
# what is left of the cycle outside them (hf_tev's own work).
STAGE_FIELDS = (
    "draft_ms",
    "build_ms",
    "forward_ms",
    "verify_ms",
    "cycle_ms",
    "model_ms",
    "overhead_ms",
    "overhead_fraction",
)
# The fields of a record of `SCHEMA`, in order; docs/bench.md#benchjson says what each holds.
RECORD_FIELDS = (
    "method",
    "drafter",
    "budget",
    "temperature",
    "prompt_set",
    "prompts",
    "max_new_tokens",
    "repeats",
    "new_tokens",
    "target_forwards",
    "cycles",
    "tau",
    "tau_counted",
    "coverage",
    "coverage_z",
    "time_s",
    "ar_time_s",
    "speedup",
    "total_time_s",
    "ar_total_time_s",
    "speedup_total",
    "probe_s",
    "tokens_per_s",
    "greedy_exact",
    "tokens_sha1",
    *STAGE_FIELDS,
    "setup_ms",
    "prefill_ms",
    "verifier_stage_ms",
    "verifier_stage_ddtree_ms",
    "verifier_stage_reduction",
    "verifier_stage_cycles",
    "tree_size_mean",
    "tree_size_quartiles",
    "plain_cycle_fraction",
    "predicted_tau",
    "budget_models",
    "per_prompt",
)


# --------------------------------------------------------------------------------------------------------
# The document
# --------------------------------------------------------------------------------------------------------
def add_warning(notes: list[str], message: str) -> None:
    """Log a warning now (transformers' logger of `hf_tev.bench`), and keep the message for the document's
    `warnings`."""
    logger.warning(message)
    notes.append(message)


def machine_info(config) -> dict:
    """The document's `machine`: cores, threads, load, device, dtype and library versions."""
    import sys

    import transformers

    if config.device.startswith("cuda"):
        device_name = torch.cuda.get_device_name(config.device)
    else:
        cpuinfo = Path("/proc/cpuinfo")
        lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
        names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
        device_name = names[0] if names else platform.processor()
    return dict(
        cpu_count=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        load_average=[load_average()],
        device=config.device,
        device_name=device_name or platform.machine(),
        dtype=config.dtype,
        torch=torch.__version__,
        transformers=transformers.__version__,
        hf_tev=__version__,
        python=sys.version.split()[0],
        platform=platform.platform(),
        # glibc malloc tuning changes CPU timings of large per-cycle buffers (docs/bench.md): record it.
        malloc_env={k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
    )


def load_average() -> float | None:
    """The 1-minute load average, or None where the OS has none (`os.getloadavg` is Unix-only)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def check_load(notes: list[str]) -> None:
    """A warning when the machine is busier than its cores: timings taken now are not its own."""
    load, cores = load_average(), os.cpu_count() or 1
    if load is not None and load > cores:
        add_warning(
            notes,
            f"machine is loaded: 1-min load average {load:.2f} > {cores} cores; timings (SR, stage times) mean little",
        )


def bench_document(
    schema: str, config, generation: dict, machine: dict, notes: list[str], records, weights: dict | None = None
) -> dict:
    """The JSON document: `settings` are the fields of `config` and the `generate` settings per temperature;
    `weights` which weights ran (`loading.weights_of`: each model's resolved folder and fingerprint)."""
    settings = {f.name: getattr(config, f.name) for f in fields(config)}
    settings["generation"] = generation
    return dict(schema=schema, settings=settings, machine=machine, weights=weights, warnings=notes, records=records)


# --------------------------------------------------------------------------------------------------------
# Shared by both kinds of record
# --------------------------------------------------------------------------------------------------------
def z_statistic(differences: list[float]) -> float | None:
    """mean / (std / sqrt(n)) of per-cycle differences; 0 when all are 0 (T = 0), None with fewer than 2."""
    n = len(differences)
    if n < 2:
        return None
    mean = statistics.fmean(differences)
    std = statistics.stdev(differences)
    if std == 0:
        return 0.0 if mean == 0 else math.copysign(math.inf, mean)
    return mean / (std / math.sqrt(n))


def _median_ms(values):
    return 1e3 * statistics.median(values) if values else None


def _mean(values):
    return statistics.fmean(values) if values else None


def median_seconds(runs_per_unit) -> float:
    """The sum over prompts (or batches) of the median wall time of their repeats."""
    return sum(statistics.median(run.seconds for run in runs) for runs in runs_per_unit)


def probe_seconds(run) -> float:
    """The automatic budget's cost probe inside one run (0 for other methods, and where none was due)."""
    stats = run.stats[0] if isinstance(run.stats, list) else run.stats  # a batch's rows share one probe
    return getattr(stats, "probe_time", 0.0) or 0.0


def total_fields(runs_per_unit, ar_runs) -> dict:
    """Every run's wall time summed (no median: a slow run, such as one that probed costs, counts in full) beside
    the reference's, and the cost probes' part of it."""
    total = sum(run.seconds for runs in runs_per_unit for run in runs)
    ar_total = sum(run.seconds for runs in ar_runs for run in runs)
    probe = sum(probe_seconds(run) for runs in runs_per_unit for run in runs)
    return dict(total_time_s=total, ar_total_time_s=ar_total, speedup_total=ar_total / total, probe_s=probe)


def book_warm_up_probes(records: list[dict], plan, warm_up_probe_s: dict) -> None:
    """Add each job's warm-up cost probe (`runner.warm_up`; a user's first call pays it) to the totals of the
    job's records in `records`, once: the bench books it to the first temperature and prompt set it measures."""
    for key, job in plan.items():
        seconds = warm_up_probe_s.get(job, 0.0)
        first = next((r for r in records if (r["method"], r["drafter"], r["budget"]) == key), None)
        if seconds and first is not None and first.get("total_time_s") is not None:
            first["probe_s"] += seconds
            first["total_time_s"] += seconds
            first["speedup_total"] = first["ar_total_time_s"] / first["total_time_s"]


def what_was_run(config, key: tuple, temperature: float, set_name: str, **prompts) -> dict:
    """The fields that say what a record measured: method, drafter and budget (`key`), temperature, prompt set,
    how its prompts went through `generate` (`prompts`), tokens per run and repeats."""
    method, drafter, budget = key
    return dict(
        method=method,
        drafter=drafter,
        budget=budget,
        temperature=temperature,
        prompt_set=set_name,
        **prompts,
        max_new_tokens=config.max_new_tokens,
        repeats=config.repeats,
    )


def greedy_mismatch_message(method, drafter, budget, where: str) -> str:
    return f"GREEDY MISMATCH: {method} (drafter {drafter}, B={budget}) {where}"


# --------------------------------------------------------------------------------------------------------
# One prompt per call
# --------------------------------------------------------------------------------------------------------
def summarise(job, runs_per_prompt: list[list], ar_runs: list[list]) -> dict:
    """The measured fields of one job at one temperature and prompt set (runs_per_prompt[p][r]: prompt p, repeat
    r; repeat 0 gives tokens and tau)."""
    firsts = [runs[0] for runs in runs_per_prompt]
    time_s, ar_time_s = median_seconds(runs_per_prompt), median_seconds(ar_runs)
    new_tokens = sum(run.sequence.shape[1] for run in firsts)
    digest = hashlib.sha1()
    for run in firsts:
        digest.update(run.sequence.numpy().tobytes())
    counted = sum(run.sequence.shape[1] - 1 for run in firsts) / max(1, sum(run.target_forwards - 1 for run in firsts))
    fields_ = dict(
        new_tokens=new_tokens,
        target_forwards=sum(run.target_forwards for run in firsts),
        tau_counted=counted,
        tau=counted,
        time_s=time_s,
        ar_time_s=ar_time_s,
        speedup=ar_time_s / time_s,
        **total_fields(runs_per_prompt, ar_runs),
        tokens_per_s=new_tokens / time_s,
        tokens_sha1=digest.hexdigest(),
    )
    if METHODS[job.method].tev_verifier is not None:
        fields_.update(tree_fields(firsts, [run for runs in runs_per_prompt for run in runs]))
    return fields_


def tree_fields(firsts: list, every: list) -> dict:
    """What the `TEVStats` of an hf_tev method add: tau, coverage and the chosen tree sizes from the first repeat
    of each prompt (`firsts`), stage times per cycle from every repeat (`every`)."""
    blocks = [length for run in firsts for length in run.stats.accepted_lengths]
    coverages = [c for run in firsts for c in run.stats.coverages]
    timed = [run for run in every if run.stats.num_cycles]

    def per_cycle_ms(seconds_of):  # median over runs of the run's mean per cycle
        return _median_ms([seconds_of(run) / run.stats.num_cycles for run in timed])

    return dict(
        cycles=len(blocks),
        tau=sum(blocks) / max(1, len(blocks)),
        coverage=statistics.fmean(coverages) if coverages else None,
        coverage_z=z_statistic([b - c for b, c in zip(blocks, coverages, strict=True)]),
        draft_ms=per_cycle_ms(lambda run: sum(run.stats.draft_times)),
        build_ms=per_cycle_ms(lambda run: sum(run.stats.build_times)),
        forward_ms=per_cycle_ms(lambda run: sum(run.stats.forward_times)),
        verify_ms=per_cycle_ms(lambda run: sum(run.stats.verify_times)),
        cycle_ms=per_cycle_ms(lambda run: run.loop_s),
        model_ms=per_cycle_ms(lambda run: run.loop_model_s),
        overhead_ms=per_cycle_ms(lambda run: run.loop_s - run.loop_model_s),
        overhead_fraction=statistics.median((run.loop_s - run.loop_model_s) / run.loop_s for run in timed)
        if timed
        else None,
        setup_ms=_median_ms([run.setup_s for run in timed]),
        prefill_ms=_median_ms([run.stats.prefill_time for run in timed]),
        **tree_size_fields(firsts),
    )


def tree_size_fields(runs: list) -> dict:
    """The chosen tree sizes (drafted nodes per cycle) of the runs: mean, quartiles, the fraction of cycles
    without a tree, and the block length the automatic budget predicted (None for fixed budgets)."""
    sizes = sorted(size for run in runs for size in run.stats.tree_sizes)
    predicted = [p for run in runs for p in run.stats.predicted_lengths]
    if not sizes:
        return {}
    quartiles = [sizes[min(len(sizes) - 1, int(q * len(sizes)))] for q in (0.25, 0.5, 0.75)]
    return dict(
        tree_size_mean=statistics.fmean(sizes),
        tree_size_quartiles=quartiles,
        plain_cycle_fraction=sum(size == 0 for size in sizes) / len(sizes),
        predicted_tau=statistics.fmean(predicted) if predicted else None,
    )


def budget_models(runs_per_prompt: list[list]) -> list[dict] | None:
    """The automatic budget's cost model at the end of each prompt's first run (`TEVStats.budget_model`: probed
    pass times, scale, drafter and cycle times), in prompt order; None where no run had an automatic budget. It
    is state shared by every call on the same target (docs/auto_budget.md), so it says what each call priced its
    trees by."""
    models = [getattr(runs[0].stats, "budget_model", None) for runs in runs_per_prompt]
    return models if any(model is not None for model in models) else None


def greedy_mismatch(runs_per_prompt, ar_runs) -> str | None:
    """None when every prompt's tokens equal ar's, else where they first differ."""
    for index, (runs, reference) in enumerate(zip(runs_per_prompt, ar_runs, strict=True)):
        got, want = runs[0].sequence[0], reference[0].sequence[0]
        if not torch.equal(got, want):
            common = min(got.numel(), want.numel())
            differ = (got[:common] != want[:common]).nonzero()
            position = int(differ[0, 0]) if differ.numel() else common
            return f"prompt {index}: first difference at new token {position} (lengths {got.numel()} vs {want.numel()})"
    return None


def verifier_stage_fields(method: str, times: dict | None) -> dict:
    """The verifier-stage fields of `method` from the same-tree replay's verifier -> seconds per cycle."""
    verifier = METHODS[method].replay_verifier
    if not times or verifier is None:
        return {}
    reference_ms = _median_ms(times[REFERENCE_VERIFIER])
    stage = dict(
        verifier_stage_ms=_median_ms(times[verifier]),
        verifier_stage_ddtree_ms=reference_ms,
        verifier_stage_cycles=len(times[REFERENCE_VERIFIER]),
    )
    if verifier != REFERENCE_VERIFIER:
        stage["verifier_stage_reduction"] = 1 - stage["verifier_stage_ms"] / reference_ms
    return stage


# The per-prompt values a record keeps (`per_prompt`): the measures its report gives a spread over prompts for.
PER_PROMPT_FIELDS = (
    "time_s",
    "ar_time_s",
    "speedup",
    "new_tokens",
    "tokens_per_s",
    "tau",
    "coverage",
    *STAGE_FIELDS,
    "tree_size_mean",
    "plain_cycle_fraction",
    "predicted_tau",
    "verifier_stage_ms",
    "verifier_stage_ddtree_ms",
    "verifier_stage_reduction",
)


def per_prompt_values(job, runs_per_prompt: list[list], ar_runs: list[list], stage: list | None) -> dict:
    """`per_prompt`: field -> its value for each prompt alone (in prompt order), for the `PER_PROMPT_FIELDS`
    that apply to the job. `stage[p]` is prompt p's same-tree replay (verifier -> seconds per cycle), or None."""
    alone = [summarise(job, [runs], [ar]) for runs, ar in zip(runs_per_prompt, ar_runs, strict=True)]
    if stage:
        for fields_, times in zip(alone, stage, strict=True):
            fields_.update(verifier_stage_fields(job.method, times))
    return {name: [f[name] for f in alone] for name in PER_PROMPT_FIELDS if alone[0].get(name) is not None}


def pooled_stage(stage: list | None) -> dict | None:
    """The replay's verifier -> seconds per cycle of every prompt together, from one replay per prompt."""
    if not stage:
        return None
    return {name: [t for times in stage for t in times[name]] for name in stage[0]}


def make_records(config, plan, runs, stage, temperature, set_name, num_prompts, notes) -> list[dict]:
    """The records of one temperature and prompt set; `stage[(drafter, budget)][p]` is prompt p's same-tree
    replay, verifier -> seconds per cycle."""
    ar_runs = runs[plan[(REFERENCE_METHOD, None, None)]]
    summaries, records = {}, []
    for (method, drafter, budget), job in plan.items():
        if job not in summaries:
            summaries[job] = summarise(job, runs[job], ar_runs)
        replay = stage.get((drafter, budget))
        record = dict.fromkeys(RECORD_FIELDS)
        record.update(what_was_run(config, (method, drafter, budget), temperature, set_name, prompts=num_prompts))
        record.update(summaries[job])
        if temperature == 0:
            mismatch = greedy_mismatch(runs[job], ar_runs)
            record["greedy_exact"] = mismatch is None
            if mismatch:
                where = f"on {set_name} differs from {REFERENCE_METHOD} at T=0: {mismatch}"
                add_warning(notes, greedy_mismatch_message(method, drafter, budget, where))
        record.update(verifier_stage_fields(method, pooled_stage(replay)))
        record["budget_models"] = budget_models(runs[job])
        record["per_prompt"] = per_prompt_values(
            job, runs[job], ar_runs, replay if record["verifier_stage_ms"] else None
        )
        records.append(record)
    return records


# --------------------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------------------
def summarise_batches(runs: list[list], ar_runs: list[list], strip_pad: int | None) -> dict:
    """The fields of one job at one batch size (runs[b][r]: batch b, repeat r; repeat 0 gives tokens and tau).
    `strip_pad`: the pad id after rows that stopped early (with --stop-at-eos), else None."""
    time_s, ar_time_s = median_seconds(runs), median_seconds(ar_runs)
    firsts = [repeats[0] for repeats in runs]
    new_tokens = len([t for tokens in first_rows(runs, strip_pad) for t in tokens])
    ar_tokens = len([t for tokens in first_rows(ar_runs, strip_pad) for t in tokens])
    fields_ = dict(
        rows=sum(len(run.tokens) for run in firsts),
        new_tokens=new_tokens,
        time_s=time_s,
        tokens_per_s=new_tokens / time_s,
        ar_tokens_per_s=ar_tokens / ar_time_s,
        speedup=(new_tokens / time_s) / (ar_tokens / ar_time_s),
    )
    if firsts[0].stats is not None:
        fields_.update(batch_tree_fields(firsts, [run for repeats in runs for run in repeats]))
    return fields_


PER_BATCH_FIELDS = ("time_s", "tokens_per_s", "ar_tokens_per_s", "speedup")


def per_batch_values(runs: list[list], ar_runs: list[list], strip_pad: int | None) -> dict:
    """`per_batch`: field -> its value for each batch alone (in batch order), for the `PER_BATCH_FIELDS`."""
    alone = [summarise_batches([mine], [ar], strip_pad) for mine, ar in zip(runs, ar_runs, strict=True)]
    return {name: [fields_[name] for fields_ in alone] for name in PER_BATCH_FIELDS}


def batch_tree_fields(firsts: list, every: list) -> dict:
    """What the rows' `TEVStats` add: tau and tree sizes from the first repeat of each batch (`firsts`), the
    batch's tree pass per cycle from every repeat (`every`)."""
    stats = [row for run in firsts for row in run.stats]
    blocks = [length for row in stats for length in row.accepted_lengths]
    # a batch's passes are those of its longest-running row (every pass holds every unfinished row)
    passes = [max(run.stats, key=lambda row: row.num_cycles) for run in every]
    cycles = sum(row.num_cycles for row in passes)
    return dict(
        tau=sum(blocks) / max(1, len(blocks)),
        tau_rows=[round(row.tau, 3) for row in stats],
        cycles=sum(max(row.num_cycles for row in run.stats) for run in firsts),
        pass_ms=1e3 * sum(sum(row.forward_times) for row in passes) / max(1, cycles),
        verify_ms=1e3 * sum(sum(row.verify_times) for row in passes) / max(1, cycles),
        draft_ms=1e3 * sum(sum(row.draft_times) for row in passes) / max(1, cycles),  # the batch's drafter call
        # one prompt runs the single-prompt path, which records no batch passes: 1 row of its own tree
        pass_rows=_mean([n for row in passes for n in row.pass_rows or [1] * row.num_cycles]),
        pass_nodes=_mean([n for row in passes for n in row.pass_nodes or [s + 1 for s in row.tree_sizes]]),
        tree_nodes=_mean([n for row in stats for n in row.tree_sizes]),
    )


def first_rows(runs: list[list], strip_pad: int | None) -> list[list[int]]:
    """Every row's new tokens of the first repeat of each batch, without the padding after an early stop."""
    return [unpadded(tokens, strip_pad) for repeats in runs for tokens in repeats[0].tokens]


def unpadded(tokens: list[int], pad: int | None) -> list[int]:
    """`tokens` without the trailing `pad` ids (all of them kept when `pad` is None)."""
    if pad is None:
        return tokens
    end = len(tokens)
    while end and tokens[end - 1] == pad:
        end -= 1
    return tokens[:end]


def batch_records(config, plan, runs, batches, alone, temperature, set_name, strip_pad, notes) -> list[dict]:
    """The records of one temperature, prompt set and batch size: `batches` are lists of prompt indices, and
    `alone[i]` prompt i's own plain greedy tokens (at T = 0; None otherwise)."""
    ar_runs = runs[plan[(REFERENCE_METHOD, None, None)]]
    size, records = len(batches[0]), []
    for (method, drafter, budget), job in plan.items():
        key = (method, drafter, budget)
        record = what_was_run(config, key, temperature, set_name, batch_size=size, batches=len(batches))
        record.update(summarise_batches(runs[job], ar_runs, strip_pad))
        record["per_batch"] = per_batch_values(runs[job], ar_runs, strip_pad)
        if alone is not None:
            rows = first_rows(runs[job], strip_pad)
            expected = [unpadded(alone[i], strip_pad) for batch in batches for i in batch]
            record.update(greedy_exact=rows == expected, matches_batched_ar=rows == first_rows(ar_runs, strip_pad))
            if not record["greedy_exact"]:
                where = f"at R={size} on {set_name}: a row differs from its prompt's own plain greedy generate"
                add_warning(notes, greedy_mismatch_message(method, drafter, budget, where))
        records.append(record)
    return records
