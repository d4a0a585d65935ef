"""One timed `generate` call of the bench: what it runs (`Job`), how it is timed (`ForwardProbe`, `run_once` for
one prompt, `run_batch` for a left-padded batch) and what it gives (`Run`, `BatchRun`, which `records` reads).

Every call starts from `torch.manual_seed(seed)` and, on CUDA, is synchronised at both ends, so its wall time is
its own work.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .loading import BenchModels
from .methods import METHODS


@dataclass(frozen=True)
class Job:
    """One distinct `generate` configuration. Budgets that give the same run (a chain longer than the drafter's
    block, methods without a budget) share a job."""

    method: str
    drafter: str | None = None
    budget: int | None = None


@dataclass
class Run:
    """One prompt's `generate` call (`run_once`)."""

    seconds: float
    sequence: torch.Tensor  # [1, new_tokens] generated ids, on CPU
    target_forwards: int
    stats: object = None  # TEVStats of hf_tev methods
    loop_s: float = 0.0  # prefill end to return
    loop_model_s: float = 0.0  # time inside model forwards during the loop
    setup_s: float = 0.0  # generate's preparation before the prefill forward


@dataclass
class BatchRun:
    """One batch's `generate` call (`run_batch`)."""

    seconds: float
    tokens: list[list[int]]  # each row's new tokens, padding after an early stop kept
    stats: list | None = None  # each row's TEVStats (hf_tev methods)


class ForwardProbe:
    """Forward hooks on the models of a run: counts target forwards and times model compute.

    Compute time is the wall time of outermost calls of the hooked modules (target, drafters, assistant, and the
    target's embedding and LM-head modules, which the drafter calls directly); nested calls count once. Each call
    is kept as `(end, seconds)`, so a run can split it at its prefill stage's end (`model_seconds_after`). With
    `sync` (accelerators) every call boundary synchronises, so it is on only for the runs whose time is split.
    """

    def __init__(self, models: BenchModels, sync: bool):
        self.sync = sync
        self.handles = []
        target = models.target
        hooked = [target.get_input_embeddings(), target.get_output_embeddings(), *models.drafters.values()]
        if models.assistant is not None:
            hooked.append(models.assistant)
        for module in [target, *hooked]:
            is_target = module is target
            self.handles.append(module.register_forward_pre_hook(lambda m, a, t=is_target: self._enter(t)))
            self.handles.append(module.register_forward_hook(lambda m, a, o, t=is_target: self._exit(t)))
        self.reset()

    def reset(self):
        self.depth, self.target_forwards = 0, 0
        self.first_forward_start = None
        self.calls: list[tuple[float, float]] = []  # (end, seconds) of every outermost call

    def _now(self):
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _enter(self, is_target):
        if self.depth == 0:
            self.start = self._now()
            if is_target and self.first_forward_start is None:
                self.first_forward_start = self.start
        self.depth += 1

    def _exit(self, is_target):
        self.depth -= 1
        if is_target:
            self.target_forwards += 1
        if self.depth == 0:
            end = self._now()
            self.calls.append((end, end - self.start))

    def model_seconds_after(self, moment: float) -> float:
        """Compute time of the outermost calls that ended after `moment` (`time.perf_counter` seconds)."""
        return sum(seconds for end, seconds in self.calls if end > moment)

    def remove(self):
        for handle in self.handles:
            handle.remove()


def timed_generate(target, input_ids, seed: int, **kwargs) -> tuple[object, float, float]:
    """`target.generate(input_ids, **kwargs)` from `torch.manual_seed(seed)`: (its output, start, end), in
    `time.perf_counter` seconds."""
    sync = target.device.type == "cuda"
    torch.manual_seed(seed)
    if sync:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = target.generate(input_ids, **kwargs)
    if sync:
        torch.cuda.synchronize()
    return out, start, time.perf_counter()


def sequences_of(out) -> torch.Tensor:
    """The token ids of a `generate` output, plain or a dict output."""
    return out if isinstance(out, torch.Tensor) else out.sequences


def run_once(models: BenchModels, probe: ForwardProbe, job: Job, input_ids, max_new_tokens, sampling, seed) -> Run:
    method = METHODS[job.method]
    kwargs = method.generate_kwargs(models, job.drafter, job.budget)
    probe.reset()
    # per-forward syncs only where model time is split out
    probe.sync = models.target.device.type == "cuda" and method.tev_verifier is not None
    out, start, end = timed_generate(
        models.target,
        input_ids,
        seed,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        **sampling,
        **kwargs,
    )
    run = Run(end - start, sequences_of(out)[:, input_ids.shape[1] :].cpu(), probe.target_forwards)
    if method.tev_verifier is not None:
        run.stats = out.tev_stats
        run.setup_s = probe.first_forward_start - start
        # The prefill stage (`stats.prefill_time`) is the prefill forward and, with the automatic budget, any
        # tree-pass cost probe; both end before the loop, whose first forward ends well after it starts (the
        # stage clock starts just before the first forward, so `loop_start` is at most that gap late).
        loop_start = probe.first_forward_start + run.stats.prefill_time
        run.loop_s = end - loop_start
        run.loop_model_s = probe.model_seconds_after(loop_start)
    return run


def left_padded(prompts: list[torch.Tensor], pad_token_id: int):
    """`(input_ids [R, n], attention_mask [R, n])` of `[1, n_i]` prompts, left-padded as a decoder-only batch."""
    width = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long, device=prompts[0].device)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.shape[1] :] = prompt[0]
        mask[row, width - prompt.shape[1] :] = 1
    return ids, mask


def run_batch(models: BenchModels, job: Job, prompts, max_new_tokens, sampling, seed) -> BatchRun:
    """One `generate` call on the batch of `prompts` (`[1, n_i]` each), left-padded with the tokenizer's pad."""
    pad_token_id = models.pad_token_id
    ids, mask = left_padded(prompts, pad_token_id)
    kwargs = METHODS[job.method].generate_kwargs(models, job.drafter, job.budget)
    out, start, end = timed_generate(
        models.target,
        ids,
        seed,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_token_id,
        **sampling,
        **kwargs,
    )
    stats = None if isinstance(out, torch.Tensor) else getattr(out, "tev_stats", None)
    if stats is not None and not isinstance(stats, list):  # one prompt: the single-prompt path's TEVStats
        stats = [stats]
    return BatchRun(end - start, sequences_of(out)[:, ids.shape[1] :].tolist(), stats)


def capture_logits_processor(target, input_ids, sampling):
    """The logits processors `generate` builds for these settings (through the `custom_generate` route)."""

    def capture(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
        return logits_processor

    return target.generate(input_ids, custom_generate=capture, max_new_tokens=1, **sampling)
