"""`hf-tev bench --batch-sizes 1,4,8`: tree decoding of batches of prompts against plain batched `generate`.

For every batch size R, each prompt set's prompts (cycled up to a multiple of R) go through `generate` R at a
time, left-padded with their attention mask, for `ar` (the target's plain batched generate) and every hf_tev
method of the bench (methods that cannot take a batch, transformers' assisted / prompt-lookup / native DFlash,
are skipped with a note). Runs are interleaved per batch (all methods on batch 1, `--repeats` times in rotating
order, then batch 2, ...), each from the same seed.

A record per method x drafter x budget x temperature x prompt set x batch size: `tokens_per_s` (new tokens of
every row / the sum over batches of the median batch time) and `ar_tokens_per_s` (plain batched generate at the
same R), `speedup`, `tau` (every row's cycles pooled) and `tau_rows` (each row's own tau, batch by batch), and the
tree pass of the batch: `pass_ms` (one target forward over every unfinished row's tree, per cycle),
`pass_rows` and `pass_nodes` (rows and padded nodes per row in a pass, means), `tree_nodes` (a row's own tree,
drafted nodes), `draft_ms` (the batch's drafter call, per cycle), `verify_ms` (the verifier stage of the batch),
`cycles`. At T = 0, `greedy_exact` says whether every row equals that prompt's own plain greedy generate
run alone, and `matches_batched_ar` whether it equals plain batched generate's row (which may differ from the
prompt alone by rounding in padded batched kernels).
"""

from __future__ import annotations

import os
import statistics
import time
import warnings

import torch

from .methods import METHODS, REFERENCE_METHOD
from .report import BATCH_SCHEMA
from .runner import (
    check_load,
    generation_settings,
    load_models,
    load_prompt_texts,
    machine_info,
    plan_jobs,
    sampling_kwargs,
    tokenize_prompts,
)


def left_padded(prompts: list[torch.Tensor], pad_token_id: int):
    """`(input_ids [R, n], attention_mask [R, n])` of `[1, n_i]` prompts, left-padded as a decoder-only batch."""
    width = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long, device=prompts[0].device)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.shape[1] :] = prompt[0]
        mask[row, width - prompt.shape[1] :] = 1
    return ids, mask


def batches_of(prompts: list, size: int) -> list[list]:
    """The prompts cycled up to a multiple of `size` (at least one batch), in batches of `size`."""
    count = -(-max(len(prompts), size) // size) * size
    cycled = [prompts[i % len(prompts)] for i in range(count)]
    return [cycled[i : i + size] for i in range(0, count, size)]


def run_batch(models, method, drafter, budget, prompts, pad_token_id, max_new_tokens, sampling, seed) -> dict:
    """One `generate` call on a batch: seconds, each row's new tokens (host lists, padding kept) and the
    per-row `TEVStats` (None for methods without them)."""
    ids, mask = left_padded(prompts, pad_token_id)
    kwargs = METHODS[method].generate_kwargs(models, drafter, budget)
    sync = models.target.device.type == "cuda"
    torch.manual_seed(seed)
    if sync:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = models.target.generate(
        ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad_token_id, **sampling, **kwargs
    )
    if sync:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    stats = None if isinstance(out, torch.Tensor) else getattr(out, "tev_stats", None)
    if stats is not None and not isinstance(stats, list):  # one prompt: the single-prompt path's TEVStats
        stats = [stats]
    return dict(seconds=seconds, tokens=sequences[:, ids.shape[1] :].tolist(), stats=stats)


def _mean(values):
    return statistics.fmean(values) if values else None


def summarise_batches(runs: list[list[dict]], ar_runs: list[list[dict]], strip_pad: int | None) -> dict:
    """The fields of one job at one batch size (runs[b][r]: batch b, repeat r; repeat 0 gives tokens and tau).
    `strip_pad`: the pad id after rows that stopped early (with --stop-at-eos), else None."""
    time_s = sum(statistics.median(run["seconds"] for run in repeats) for repeats in runs)
    ar_time_s = sum(statistics.median(run["seconds"] for run in repeats) for repeats in ar_runs)
    firsts = [repeats[0] for repeats in runs]
    new_tokens = len([t for tokens in first_rows(runs, strip_pad) for t in tokens])
    ar_tokens = len([t for tokens in first_rows(ar_runs, strip_pad) for t in tokens])
    fields = dict(
        rows=sum(len(run["tokens"]) for run in firsts),
        new_tokens=new_tokens,
        time_s=time_s,
        tokens_per_s=new_tokens / time_s,
        ar_tokens_per_s=ar_tokens / ar_time_s,
        speedup=(new_tokens / time_s) / (ar_tokens / ar_time_s),
    )
    if firsts[0]["stats"] is None:
        return fields
    stats = [row for run in firsts for row in run["stats"]]
    blocks = [length for row in stats for length in row.accepted_lengths]
    timed = [run for repeats in runs for run in repeats]
    # a batch's passes are those of its longest-running row (every pass holds every unfinished row)
    passes = [max(run["stats"], key=lambda row: row.num_cycles) for run in timed]
    cycles = sum(row.num_cycles for row in passes)
    fields.update(
        tau=sum(blocks) / max(1, len(blocks)),
        tau_rows=[round(row.tau, 3) for row in stats],
        cycles=sum(max(row.num_cycles for row in run["stats"]) for run in firsts),
        pass_ms=1e3 * sum(sum(row.forward_times) for row in passes) / max(1, cycles),
        verify_ms=1e3 * sum(sum(row.verify_times) for row in passes) / max(1, cycles),
        draft_ms=1e3 * sum(sum(row.draft_times) for row in passes) / max(1, cycles),  # the batch's drafter call
        # one prompt runs the single-prompt path, which records no batch passes: 1 row of its own tree
        pass_rows=_mean([n for row in passes for n in row.pass_rows or [1] * row.num_cycles]),
        pass_nodes=_mean([n for row in passes for n in row.pass_nodes or [s + 1 for s in row.tree_sizes]]),
        tree_nodes=_mean([n for row in stats for n in row.tree_sizes]),
    )
    return fields


def first_rows(runs: list[list[dict]], strip_pad: int | None) -> list[list[int]]:
    """Every row's new tokens of the first repeat of each batch, without the padding after an early stop."""
    return [_unpadded(tokens, strip_pad) for repeats in runs for tokens in repeats[0]["tokens"]]


def _unpadded(tokens: list[int], pad: int | None) -> list[int]:
    if pad is None:
        return tokens
    end = len(tokens)
    while end and tokens[end - 1] == pad:
        end -= 1
    return tokens[:end]


def run_batch_bench(config) -> dict:
    """Run the batch bench of `config` (`BenchConfig` with `batch_sizes`) and return its JSON document."""
    from tqdm.auto import tqdm

    if config.threads is not None:
        torch.set_num_threads(config.threads)
    notes: list[str] = []
    skipped = [m for m in config.methods if m != REFERENCE_METHOD and METHODS[m].tev_verifier is None]
    if skipped:
        notes.append(f"methods {skipped} cannot decode a batch (transformers refuses it): skipped")
        config.methods = [m for m in config.methods if m not in skipped]
    check_load(notes)
    machine = machine_info(config)
    models = load_models(config)
    tokenizer = models.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompt_sets = tokenize_prompts(load_prompt_texts(config, notes), tokenizer, models.target.device, True)
    plan = plan_jobs(config, models)
    jobs = list(dict.fromkeys(plan.values()))
    ar_job = plan[(REFERENCE_METHOD, None, None)]
    total = len(config.temperatures) * len(config.batch_sizes) * len(jobs) * config.repeats
    total *= sum(len(batches_of(p, 1)) for p in prompt_sets.values())  # about: a batch of R runs ~R prompts' work
    progress = tqdm(total=total, desc="hf-tev bench (batches)", disable=not config.progress, dynamic_ncols=True)
    records = []
    with torch.no_grad():
        first = next(iter(prompt_sets.values()))
        for job in jobs:  # warm-up at every batch size: kernels, and auto's cost probe (once per batch size)
            for size in config.batch_sizes:
                batch = [first[i % len(first)] for i in range(size)]
                run_batch(models, job.method, job.drafter, job.budget, batch, pad, 8, sampling_kwargs(0, False), 0)
        for temperature in config.temperatures:
            sampling = sampling_kwargs(temperature, config.stop_at_eos, config.top_k, config.top_p, config.min_p)
            for set_name, prompts in prompt_sets.items():
                alone_tokens = None
                if temperature == 0:  # each prompt's own plain greedy generate, the exactness reference
                    alone_tokens = [
                        run_batch(models, "ar", None, None, [p], pad, config.max_new_tokens, sampling, 0)["tokens"][0]
                        for p in prompts
                    ]
                for size in config.batch_sizes:
                    batches = batches_of(list(range(len(prompts))), size)
                    runs = {job: [[] for _ in batches] for job in jobs}
                    for index, batch in enumerate(batches):
                        for repeat in range(config.repeats):
                            shift = repeat % len(jobs)
                            for job in jobs[shift:] + jobs[:shift]:
                                progress.set_postfix_str(f"T={temperature:g} {set_name} R={size} {job.method}")
                                runs[job][index].append(
                                    run_batch(
                                        models,
                                        job.method,
                                        job.drafter,
                                        job.budget,
                                        [prompts[i] for i in batch],
                                        pad,
                                        config.max_new_tokens,
                                        sampling,
                                        config.seed + index,
                                    )
                                )
                                progress.update(size)
                    strip = pad if config.stop_at_eos else None
                    for (method, drafter, budget), job in plan.items():
                        record = dict(
                            method=method,
                            drafter=drafter,
                            budget=budget,
                            temperature=temperature,
                            prompt_set=set_name,
                            batch_size=size,
                            batches=len(batches),
                            max_new_tokens=config.max_new_tokens,
                            repeats=config.repeats,
                        )
                        summary = summarise_batches(runs[job], runs[ar_job], strip)
                        if alone_tokens is not None:
                            rows = first_rows(runs[job], strip)
                            alone = [_unpadded(alone_tokens[i], strip) for batch in batches for i in batch]
                            summary.update(
                                greedy_exact=rows == alone, matches_batched_ar=rows == first_rows(runs[ar_job], strip)
                            )
                            if not summary["greedy_exact"]:
                                message = (
                                    f"GREEDY MISMATCH: {method} (drafter {drafter}, B={budget}) at R={size} on "
                                    f"{set_name}: a row differs from its prompt's own plain greedy generate"
                                )
                                warnings.warn(message, stacklevel=2)
                                notes.append(message)
                        record.update(summary)
                        records.append(record)
    progress.close()
    check_load(notes)
    machine["load_average"].append(os.getloadavg()[0])
    settings = {name: getattr(config, name) for name in vars(config)}
    settings["generation"] = generation_settings(config, models.target)
    return dict(schema=BATCH_SCHEMA, settings=settings, machine=machine, warnings=notes, records=records)
