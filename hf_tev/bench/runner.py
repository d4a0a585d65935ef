"""The bench's runner: `run_bench(config)` plans the jobs, runs them interleaved and returns the JSON document
(schema in `hf_tev/bench/__init__.py`); it writes nothing.

The loop's axes are temperature x prompt set x batch size x prompt (or batch) x repeat x job. Batch size `None`
(no `--batch-sizes`) is the prompt-by-prompt bench: one prompt per `generate` call, with the forward probe's
split of the cycle time and, at T > 0, the same-tree verifier-stage replay. A batch size R sends the prompts
(cycled up to a multiple of R) R at a time, left-padded with their attention mask, for `ar` (the target's plain
batched generate) and every hf_tev method (methods that cannot take a batch, transformers' assisted /
prompt-lookup / native DFlash, are skipped with a note). Within one temperature, prompt set and batch size, the
runs are interleaved per prompt or batch (all jobs on it, `--repeats` times in rotating order, then the next),
each from the same seed. Which method does what comes from `METHODS` (`methods.py`); nothing here tests a
method's name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import BenchConfig, config_sampling, generate_kwargs_by_temperature, sampling_kwargs
from .loading import BenchModels, check_sources, load_bench_models, load_prompt_texts, tokenize_prompts, weights_of
from .measure import ForwardProbe, Job, capture_logits_processor, run_batch, run_once
from .methods import METHODS, REFERENCE_METHOD, REFERENCE_VERIFIER
from .records import (
    batch_records,
    bench_document,
    book_warm_up_probes,
    check_load,
    load_average,
    machine_info,
    make_records,
    probe_seconds,
)
from .replay import same_tree_verifier_stage
from .report import BATCH_SCHEMA, SCHEMA

WARM_UP_TOKENS = 8


def plan_jobs(config: BenchConfig, models: BenchModels) -> dict[tuple, Job]:
    """(method, drafter, budget) of every record -> the job that measures it."""
    plan = {}
    for name in config.methods:
        method = METHODS[name]
        for drafter in config.drafters if method.uses_drafter else [None]:
            for budget in config.budgets if method.uses_budget else [None]:
                effective = None if budget is None else method.effective_budget(models, drafter, budget)
                plan[(name, drafter, budget)] = Job(name, drafter, effective)
    return plan


def plan_replays(plan: dict[tuple, Job]) -> dict[tuple, tuple[str, ...]]:
    """(drafter, budget) -> the verifiers the same-tree replay times there: the reference verifier, then the
    `replay_verifier` of every planned method at that drafter and budget."""
    replays = {}
    for name, drafter, budget in plan:
        verifier = METHODS[name].replay_verifier
        if verifier is not None and budget != "auto":  # the replay times trees of one fixed size
            replays.setdefault((drafter, budget), [REFERENCE_VERIFIER]).append(verifier)
    return {key: tuple(dict.fromkeys(replays[key])) for key in sorted(replays, key=str)}


def batches_of(prompts: list, size: int) -> list[list]:
    """The prompts cycled up to a multiple of `size` (at least one batch), in batches of `size`."""
    count = -(-max(len(prompts), size) // size) * size
    cycled = [prompts[i % len(prompts)] for i in range(count)]
    return [cycled[i : i + size] for i in range(0, count, size)]


def batch_axis(config: BenchConfig) -> list[int | None]:
    """The batch sizes of the run; None: one prompt per call (no `--batch-sizes`)."""
    return config.batch_sizes or [None]


def drop_unbatchable_methods(config: BenchConfig, notes: list[str]) -> None:
    """Keep the methods that can decode a batch: `ar` and hf_tev's (transformers refuses a batch for the others)."""
    skipped = [m for m in config.methods if m != REFERENCE_METHOD and METHODS[m].tev_verifier is None]
    if skipped:
        notes.append(f"methods {skipped} cannot decode a batch (transformers refuses it): skipped")
        config.methods = [m for m in config.methods if m not in skipped]


@dataclass
class Session:
    """What the measurements of one bench run share (`open_session`)."""

    config: BenchConfig
    models: BenchModels
    plan: dict[tuple, Job]
    replays: dict[tuple, tuple[str, ...]]  # none with batch sizes: the replay decodes one prompt at a time
    notes: list[str]
    progress: object  # the tqdm bar
    # One prompt per call only: it splits the cycle time, and its hooks' own cost would land in batch times.
    probe: ForwardProbe | None

    @property
    def jobs(self) -> list[Job]:
        return list(dict.fromkeys(self.plan.values()))

    def measure(self, job: Job, prompts: list, size: int | None, max_new_tokens: int, sampling: dict, seed: int):
        """One timed `generate` of `prompts`: one prompt alone (`size` None, a `Run`) or a batch (a `BatchRun`)."""
        if size is None:
            return run_once(self.models, self.probe, job, prompts[0], max_new_tokens, sampling, seed)
        return run_batch(self.models, job, prompts, max_new_tokens, sampling, seed)

    def close(self) -> None:
        self.progress.close()
        if self.probe is not None:
            self.probe.remove()


def open_session(config: BenchConfig, models: BenchModels, prompt_sets: dict[str, list], notes: list[str]) -> Session:
    """The plan of the run, its progress bar (in prompts generated, each counted once per run it is in, plus the
    prompts the replay decodes) and, one prompt per call, the forward probe."""
    from tqdm.auto import tqdm

    batched = config.batch_sizes is not None
    plan = plan_jobs(config, models)
    replays = {} if batched else plan_replays(plan)
    jobs, prompts = len(set(plan.values())), sum(len(p) for p in prompt_sets.values())
    total = len(config.temperatures) * len(batch_axis(config)) * prompts * jobs * config.repeats
    total += len([t for t in config.temperatures if t > 0]) * prompts * len(replays)
    desc = "hf-tev bench (batches)" if batched else "hf-tev bench"
    progress = tqdm(total=total, desc=desc, disable=not config.progress, dynamic_ncols=True)
    probe = None if batched else ForwardProbe(models, sync=False)
    return Session(config, models, plan, replays, notes, progress, probe)


def warm_up(session: Session, first_set: list) -> dict:
    """A short greedy call of every job (at every batch size) before any timed run: first calls allocate and pick
    kernels, and the automatic budget makes its cost probe (once per batch size). Returns job -> seconds of the
    cost probes it made: a user's first call pays them, so the records' totals do too (`book_warm_up_probes`)."""
    config, probes = session.config, {}
    for job in session.jobs:
        for size in batch_axis(config):
            prompts = [first_set[i % len(first_set)] for i in range(size or 1)]
            # one prompt per call never warms up past max_new_tokens; the batch bench always used 8 tokens (kept)
            tokens = min(WARM_UP_TOKENS, config.max_new_tokens) if size is None else WARM_UP_TOKENS
            run = session.measure(job, prompts, size, tokens, sampling_kwargs(0, False), 0)
            probes[job] = probes.get(job, 0.0) + probe_seconds(run)
    return probes


def run_interleaved(session: Session, prompts: list, units: list[list[int]], size, sampling, label) -> dict:
    """job -> runs[u][r] of unit u (a list of prompt indices: one prompt, or a batch), repeat r. All jobs run on
    a unit, `repeats` times, before the next unit; unit u's runs start from `seed + u`."""
    config, jobs = session.config, session.jobs
    runs = {job: [[] for _ in units] for job in jobs}
    for index, unit in enumerate(units):
        for repeat in range(config.repeats):
            shift = repeat % len(jobs)  # rotate the order so no method always runs first
            for job in jobs[shift:] + jobs[:shift]:
                session.progress.set_postfix_str(f"{label} {job.method}", refresh=False)
                unit_prompts = [prompts[i] for i in unit]
                run = session.measure(job, unit_prompts, size, config.max_new_tokens, sampling, config.seed + index)
                runs[job][index].append(run)
                session.progress.update(len(unit))
    return runs


def replay_verifier_stage(session: Session, prompts: list, sampling: dict, label: str) -> dict:
    """(drafter, budget) -> for each prompt, verifier -> seconds per cycle of its same-tree replay (prompt i from
    seed + i)."""
    if not session.replays:
        return {}
    config, models = session.config, session.models
    processors = capture_logits_processor(models.target, prompts[0], sampling)
    stage = {}
    for (drafter, budget), verifiers in session.replays.items():
        session.progress.set_postfix_str(f"{label} verifier stage B={budget}")
        stage[(drafter, budget)] = []
        for index, prompt in enumerate(prompts):
            times = same_tree_verifier_stage(
                models.target,
                models.drafters[drafter],
                [prompt],
                budget,
                processors,
                config.max_new_tokens,
                verifiers=verifiers,
                seed=config.seed + index,
            )
            stage[(drafter, budget)].append(times)
            session.progress.update(1)
    return stage


def alone_greedy_tokens(session: Session, prompts: list, sampling: dict) -> list[list[int]]:
    """Each prompt's own plain greedy generate, alone: the exactness reference of the rows of a batch."""
    ar = session.plan[(REFERENCE_METHOD, None, None)]
    return [session.measure(ar, [p], 1, session.config.max_new_tokens, sampling, 0).tokens[0] for p in prompts]


def measure_prompt_set(session: Session, temperature: float, set_name: str, prompts: list) -> list[dict]:
    """The records of one temperature and prompt set, at every batch size."""
    config, notes, records = session.config, session.notes, []
    sampling = config_sampling(config, temperature)
    batched = config.batch_sizes is not None
    alone = alone_greedy_tokens(session, prompts, sampling) if batched and temperature == 0 else None
    for size in batch_axis(config):
        label = f"T={temperature:g} {set_name}" + ("" if size is None else f" R={size}")
        units = batches_of(list(range(len(prompts))), size or 1)
        runs = run_interleaved(session, prompts, units, size, sampling, label)
        if size is None:
            stage = replay_verifier_stage(session, prompts, sampling, label) if temperature > 0 else {}
            records += make_records(config, session.plan, runs, stage, temperature, set_name, len(prompts), notes)
        else:
            strip_pad = session.models.pad_token_id if config.stop_at_eos else None
            records += batch_records(config, session.plan, runs, units, alone, temperature, set_name, strip_pad, notes)
    return records


def run_bench(config: BenchConfig, models: BenchModels | None = None) -> dict:
    """Run the bench and return the JSON document (see `hf_tev.bench`'s docstring); nothing is written. The models
    `config` names are checked (`check_sources`) before anything runs."""
    if models is None:
        check_sources(config)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    notes: list[str] = []
    batched = config.batch_sizes is not None
    if batched:
        drop_unbatchable_methods(config, notes)
    check_load(notes)
    machine = machine_info(config)
    texts = load_prompt_texts(config)
    models = models or load_bench_models(config)
    weights = weights_of(models)
    prompt_sets = tokenize_prompts(texts, models.tokenizer, models.target.device, config.chat_template)
    session = open_session(config, models, prompt_sets, notes)
    generation = generate_kwargs_by_temperature(config, models.target)
    records = []
    try:
        with torch.no_grad():
            warm_up_probes = warm_up(session, next(iter(prompt_sets.values())))
            for temperature in config.temperatures:
                for set_name, prompts in prompt_sets.items():
                    records += measure_prompt_set(session, temperature, set_name, prompts)
            book_warm_up_probes(records, session.plan, warm_up_probes)
    finally:
        session.close()
    check_load(notes)
    machine["load_average"].append(load_average())
    schema = BATCH_SCHEMA if batched else SCHEMA
    return bench_document(schema, config, generation, machine, notes, records, weights)
