"""Target-written training rows (`generate_training_data`): the target answers the prompts itself, the rows are
written to a JSONL file as they come, with the settings they were generated with beside it, and a rerun resumes
an interrupted generation (its settings and prompts checked)."""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from .columns import INPUT_IDS, PROMPT_LENGTH
from .features import FINGERPRINT_FORMAT, target_fingerprint
from .prompts import encode_prompt, eos_token_ids, pad_token_id_of

# Beside the rows file `NAME.jsonl` of `generate_training_data(..., output_path=...)`: how they were generated.
SETTINGS_SUFFIX = ".settings.json"


@torch.no_grad()
def generate_training_data(
    target,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    tokenizer=None,
    max_new_tokens: int = 512,
    batch_size: int = 8,
    apply_chat_template: bool = False,
    show_progress: bool = True,
    output_path: str | os.PathLike | None = None,
    metadata: Mapping[str, Any] | None = None,
    **generate_kwargs,
) -> list[dict[str, Any]]:
    """Training rows whose responses are written by the target itself (the drafter must imitate the target).

    Args:
        target: the target causal LM (its `generate` is used, batched with left padding).
        prompts: strings (need `tokenizer`), chat conversations (lists of `{"role", "content"}` dicts: the turns
            before the first assistant turn are the prompt, always through the chat template) or token-id lists.
        tokenizer: tokenizes string prompts; with `apply_chat_template=True` each prompt becomes one user turn.
        max_new_tokens: response length limit.
        batch_size: prompts per `generate` call.
        show_progress: a tqdm progress bar over prompts, with the response tokens written per second.
        output_path: a `.jsonl` file the rows are appended to as they are generated (one JSON row per line,
            flushed after every batch), with the generation settings beside it in `<name>.settings.json` (the
            target's name and fingerprint, `max_new_tokens`, the sampling settings in effect, versions,
            `metadata`). A run that stopped keeps what it wrote; a rerun with the same target and settings
            resumes after the last complete row (its prompts must be the same, in the same order: checked),
            and one with other settings is refused.
        metadata: recorded in the settings file (e.g. where the prompts come from); not compared on resume.
        **generate_kwargs: passed to `target.generate` (e.g. `do_sample=True, temperature=0.7`); the
            target's generation config applies otherwise.

    Returns:
        A list of `{"input_ids": prompt + response token ids, "prompt_length": int}`, one per prompt in order
        (with `output_path`, the rows read back from the file followed by the new ones); responses end at the
        first EOS (kept). `datasets.Dataset.from_list(rows)` turns it into a dataset to save.
    """
    from tqdm.auto import tqdm

    if isinstance(prompts, (str, bytes)):
        raise TypeError("prompts must be a sequence of prompts, not one string")
    encoded = [encode_prompt(prompt, tokenizer, apply_chat_template) for prompt in prompts]
    pad_id = pad_token_id_of(target, tokenizer)
    eos_ids = eos_token_ids(target, tokenizer, generate_kwargs.get("eos_token_id"))
    rows, out = [], None
    if output_path is not None:
        settings = generation_settings(target, max_new_tokens, apply_chat_template, eos_ids, generate_kwargs)
        rows = _resume_rows(Path(output_path), settings, encoded)
        _write_json(
            settings_file(output_path),
            {**settings, "batch_size": batch_size, "num_prompts": len(encoded), "metadata": dict(metadata or {})},
        )
        out = open(output_path, "a", encoding="utf-8")  # noqa: SIM115 (closed in the finally below)
    progress = tqdm(
        total=len(encoded), initial=len(rows), desc="target-written responses", unit="prompt", disable=not show_progress
    )
    started, new_tokens = time.perf_counter(), 0
    try:
        for start in range(len(rows), len(encoded), batch_size):
            batch = encoded[start : start + batch_size]
            written = _answer_batch(target, batch, pad_id, eos_ids, max_new_tokens, generate_kwargs)
            if out is not None:
                out.write("".join(json.dumps(row) + "\n" for row in written))
                out.flush()
                os.fsync(out.fileno())
            rows += written
            new_tokens += sum(len(row[INPUT_IDS]) - row[PROMPT_LENGTH] for row in written)
            progress.update(len(batch))
            progress.set_postfix_str(f"{new_tokens / max(time.perf_counter() - started, 1e-9):.1f} tok/s")
    finally:
        progress.close()
        if out is not None:
            out.close()
    return rows


def _answer_batch(target, batch: list[list[int]], pad_id: int, eos_ids: set[int], max_new_tokens: int, generate_kwargs):
    """The target's responses to one batch of prompts as rows, each response cut after its first EOS."""
    prompts = [torch.tensor(ids, dtype=torch.long) for ids in batch]
    # Left padding: generation continues every prompt at the right edge.
    input_ids = pad_sequence(prompts, batch_first=True, padding_value=pad_id, padding_side="left")
    attention_mask = pad_sequence([torch.ones_like(ids) for ids in prompts], batch_first=True, padding_side="left")
    width = input_ids.shape[1]
    device = next(target.parameters()).device
    output = target.generate(
        input_ids.to(device),
        attention_mask=attention_mask.to(device),
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
        **generate_kwargs,
    )
    sequences = output.sequences if hasattr(output, "sequences") else output
    rows = []
    for ids, response in zip(batch, sequences[:, width:].tolist(), strict=True):
        end = next((i + 1 for i, token in enumerate(response) if token in eos_ids), len(response))
        rows.append({INPUT_IDS: list(ids) + response[:end], PROMPT_LENGTH: len(ids)})
    return rows


def settings_file(output_path: str | os.PathLike) -> Path:
    """Where `generate_training_data` records the settings of the rows file `output_path` (`x.jsonl` ->
    `x.settings.json`)."""
    path = Path(output_path)
    return path.with_name(path.stem + SETTINGS_SUFFIX)


def generation_settings(target, max_new_tokens: int, apply_chat_template: bool, eos_ids, generate_kwargs) -> dict:
    """What decides the rows `generate_training_data` writes (compared when a rows file is resumed)."""
    import transformers

    from .._version import __version__

    config = copy.deepcopy(getattr(target, "generation_config", None))
    sampling = {}
    if config is not None:
        config.update(**{k: v for k, v in generate_kwargs.items() if hasattr(config, k)})
        names = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "no_repeat_ngram_size")
        sampling = {name: getattr(config, name, None) for name in names}
    return json.loads(
        json.dumps(
            {
                "target": getattr(target, "name_or_path", None) or "",
                "target_fingerprint": target_fingerprint(target),
                # 2: every parameter byte is hashed (`features.target_fingerprint`); a file written under format 1
                # is refused with this line naming the change, not as another target's.
                "target_fingerprint_format": FINGERPRINT_FORMAT,
                "target_dtype": str(target.dtype),
                "max_new_tokens": max_new_tokens,
                "apply_chat_template": apply_chat_template,
                "eos_token_ids": sorted(eos_ids),
                "sampling": sampling,
                "generate_kwargs": dict(generate_kwargs),
                "versions": {
                    "hf_tev": __version__,
                    "transformers": transformers.__version__,
                    "torch": torch.__version__,
                },
            },
            default=repr,
            sort_keys=True,
        )
    )


def _resume_rows(path: Path, settings: dict, encoded: list[list[int]]) -> list[dict[str, Any]]:
    """The complete rows already in `path` (a partial last line is cut off), checked against this run."""
    if not path.is_file() or path.stat().st_size == 0:
        return []  # a fresh start: the settings file is written anew
    recorded_path = settings_file(path)
    recorded = json.loads(recorded_path.read_text()) if recorded_path.is_file() else None
    if recorded is None:
        raise ValueError(f"{path} holds rows but no {recorded_path.name}: it was not written by this function")
    compared = [key for key in settings if key not in ("versions", "target")]
    different = [
        f"{key}: file {recorded.get(key)!r}, now {settings[key]!r}"
        for key in compared
        if recorded.get(key) != settings[key]
    ]
    if different:
        raise ValueError(
            f"{path} was generated with other settings ({'; '.join(different)}); use another output_path or "
            "delete it to start over"
        )
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) < len(data):  # a run stopped in the middle of a row
        with open(path, "r+b") as f:
            f.truncate(len(complete))
    rows = [json.loads(line) for line in complete.decode("utf-8").splitlines() if line.strip()]
    if len(rows) > len(encoded):
        raise ValueError(f"{path} holds {len(rows)} rows, more than the {len(encoded)} prompts of this run")
    for index, (row, prompt) in enumerate(zip(rows, encoded, strict=False)):
        if row[INPUT_IDS][: row[PROMPT_LENGTH]] != prompt:
            raise ValueError(
                f"{path} row {index} was generated for another prompt than prompt {index} of this run; pass the "
                "same prompts in the same order to resume, or another output_path"
            )
    return rows


def _write_json(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1, sort_keys=True, default=repr))
    os.replace(tmp, path)
