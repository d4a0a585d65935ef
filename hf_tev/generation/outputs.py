"""What a tree-decoding call gives back: when it stops, its stage clock, and the output object.

Plain `generate` checks its stopping criteria after every appended token; `first_stop` does the same over the
block a cycle appends. `Outputs` collects what generate returns besides the tokens (scores and raw logits per
emitted token, the streamer) and assembles the result of one prompt or of a batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers.generation import EosTokenCriteria, GenerateDecoderOnlyOutput, MaxLengthCriteria

from ..config import TEVStats


@dataclass
class TEVGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus the per-cycle statistics of the tree decoder (a list, one per row, for
    a batch)."""

    tev_stats: TEVStats | list[TEVStats] | None = None


def first_stop(stopping_criteria, sequence: torch.Tensor, start: int, scores=None, new_ids=None, eos_ids=None):
    """Index (into `sequence` `[1, L]`) of the first token at or after `start` after which generation stops,
    or None.

    In closed form for the usual max-length / EOS criteria, token by token for any other criterion.

    Args:
        scores (`list[torch.FloatTensor]`, *optional*): processed scores of every generated token up to the end
            of `sequence` (kept when `output_scores` is returned). A criterion gets the tuple of those up to the
            token it checks, or None, as in plain `generate`.
        new_ids (`list[int]`, *optional*), eos_ids (`frozenset`, *optional*): the tokens from `start` on and the
            EOS criteria's ids (`host_eos_ids`), both on the host: the closed form then reads nothing from the
            device.
    """
    length = sequence.shape[1]
    if all(type(c) in (MaxLengthCriteria, EosTokenCriteria) for c in stopping_criteria):
        stops = [length]
        for criterion in stopping_criteria:
            if type(criterion) is MaxLengthCriteria:
                stops.append(max(start, criterion.max_length - 1))
            elif new_ids is not None and eos_ids is not None:
                stops.append(next((start + j for j, token in enumerate(new_ids) if token in eos_ids), length))
            else:
                eos = torch.isin(sequence[0, start:], criterion.eos_token_id.to(sequence.device))
                if eos.any():
                    stops.append(start + int(eos.nonzero()[0, 0]))
        stop = min(stops)
        return stop if stop < length else None
    for end in range(start + 1, length + 1):
        seen = None if scores is None else tuple(scores[: len(scores) - (length - end)])
        if stopping_criteria(sequence[:, :end], seen).any():
            return end - 1
    return None


def host_eos_ids(stopping_criteria) -> frozenset | None:
    """The token ids of every `EosTokenCriteria`, on the host (one read per call, not per cycle); None when the
    criteria are not all max-length / EOS ones (`first_stop` then asks them token by token)."""
    if not all(type(c) in (MaxLengthCriteria, EosTokenCriteria) for c in stopping_criteria):
        return None
    eos = [c.eos_token_id.reshape(-1) for c in stopping_criteria if type(c) is EosTokenCriteria]
    return frozenset(torch.cat(eos).tolist() if eos else ())


class StageClock:
    """Seconds between consecutive `lap()` calls: each lap is one stage's time.

    On the CPU a lap is the host time since the last one (the work is done when the host returns). On CUDA the
    host runs ahead of the device: a lap waits for the device first (the cost probe, the bench's replay). With
    `deferred=True` (the decoding loop) a lap instead records a CUDA event and waits for nothing: the host time it
    returns is provisional, and `settle()` gives each stage's time on the device's timeline, the time between
    consecutive events, which is what a synchronised lap measures (the device reaches an event once it has done
    the work before it and the host has issued it). It reads the events without a wait once the host has read
    something the device computed after them: the decoding cycle settles after its one read of the bonus tokens.
    """

    def __init__(self, device: torch.device, deferred: bool = False):
        self.device, on_cuda = device, device.type == "cuda"
        self.deferred, self.synchronize = on_cuda and deferred, on_cuda and not deferred
        self.last = time.perf_counter()
        self.marks = []  # deferred: (stage, event) of the laps since the last settled one, that one's first
        if self.deferred:
            self.marks.append((None, self._event()))

    @staticmethod
    def _event():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def lap(self, stage=None, synchronize: bool = False) -> float:
        """The host seconds since the last lap (after a wait for the device when the clock synchronises, or with
        `synchronize`); a deferred clock marks the end of `stage` for `settle` (stages may repeat: `settle` sums
        them)."""
        if self.synchronize or (synchronize and self.deferred):
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        if self.deferred:
            self.marks.append((stage, self._event()))
        return elapsed

    def settle(self) -> dict:
        """A deferred clock: the device seconds of each stage lapped since the last settle (summed per stage; the
        host must have waited past its last lap: `Event.elapsed_time` refuses an event not yet reached). {}
        for any other clock."""
        if not self.deferred:
            return {}
        (_, start), *laps = self.marks
        seconds = {}
        for stage, end in laps:
            seconds[stage] = seconds.get(stage, 0.0) + start.elapsed_time(end) / 1e3
            start = end
        self.marks = self.marks[-1:]
        return seconds


class Outputs:
    """What `generate` returns besides the tokens: scores / raw logits per emitted token, the streamer (one
    prompt only: a batch refuses them, `checks.check_batch`)."""

    def __init__(self, generation_config, streamer):
        self.return_dict = generation_config.return_dict_in_generate
        self.scores = [] if self.return_dict and generation_config.output_scores else None
        self.logits = [] if self.return_dict and generation_config.output_logits else None
        self.use_cache = generation_config.use_cache
        self.streamer = streamer

    def add(self, processed: torch.Tensor, raw: torch.Tensor) -> None:
        """Rows `[k, V]` of the k tokens just emitted (before any cut at a stop)."""
        if self.scores is not None:
            self.scores.extend(processed.unsqueeze(1).unbind(0))
        if self.logits is not None:
            self.logits.extend(raw.unsqueeze(1).unbind(0))

    def stream(self, tokens: torch.Tensor | list[int]) -> None:
        """Tokens `[k]` to the streamer: a device tensor, or host ids (no read of the device)."""
        if self.streamer is not None:
            self.streamer.put(torch.tensor(tokens, dtype=torch.long) if isinstance(tokens, list) else tokens.cpu())

    def result(self, sequence, prompt_length: int, cache, stats: TEVStats):
        """One prompt's result: the tokens, or the output with scores, logits, the cache and the statistics."""
        if self.streamer is not None:
            self.streamer.end()
        if not self.return_dict:
            return sequence
        length = sequence.shape[1] - prompt_length
        return TEVGenerateOutput(
            sequences=sequence,
            scores=tuple(self.scores[:length]) if self.scores is not None else None,
            logits=tuple(self.logits[:length]) if self.logits is not None else None,
            cache=cache if self.use_cache else None,  # as plain generate, which keeps no cache without use_cache
            tev_stats=stats,
        )

    def batch_result(self, sequences: list[torch.Tensor], stats: list[TEVStats], pad_token):
        """A batch's result: rows padded after their end with the pad token, as plain batched generate pads
        finished rows; no cache (rows leave it as they stop)."""
        length = max(sequence.shape[1] for sequence in sequences)
        if pad_token is None and any(sequence.shape[1] < length for sequence in sequences):
            raise ValueError(
                "Rows of the batch stopped at different lengths and there is no `pad_token_id` (nor EOS) to pad "
                "the shorter ones with: pass `pad_token_id=`."
            )
        fill = 0 if pad_token is None else int(pad_token.view(-1)[0])
        result = torch.full((len(sequences), length), fill, device=sequences[0].device)
        for r, sequence in enumerate(sequences):
            result[r, : sequence.shape[1]] = sequence[0]
        return TEVGenerateOutput(sequences=result, tev_stats=stats) if self.return_dict else result
