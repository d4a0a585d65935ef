"""Responses of SmolLM2-135M-Instruct to `prompts.jsonl`, written by the target itself: a resumable long job.

    nice python research/smollm2_drafter/generate_data.py --threads 1 --commit

Shard k covers prompts [k * 16, (k + 1) * 16): each prompt is answered twice, greedily and sampled at T = 1 (seed
`1000 + k`), up to 1,024 new tokens, chat-templated, in one batch per mode. A batch ends when 90% of its rows have
ended (the rest are kept, marked `"complete": false`). A shard is written to `data/shard_KKKKK.jsonl.partial`, then
renamed whole, and (with `--commit`) committed once, alone. A rerun skips every finished shard and starts the first
missing one, so a stopped job loses at most the shard it was in; with the same torch build and thread count a
shard is rewritten token for token. `--stop_at` ends the job cleanly at a wall-clock time (`HH:MM`). Two jobs share
the shards with `--every 2 --offset 0` and `--every 2 --offset 1` (one core each); a job skips a shard another
job holds (`shard_KKKKK.lock`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from datetime import datetime
from pathlib import Path

import torch
from filelock import FileLock, Timeout
from torch.nn.utils.rnn import pad_sequence
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

from hf_tev.packaged import packaged_model_path

HERE = Path(__file__).resolve().parent
TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"
SHARD_PROMPTS = 16
MAX_NEW_TOKENS = 1024
ENDED_SHARE = 0.9
SAMPLE_SEED = 1000


class MostRowsEnded(StoppingCriteria):
    """Stop the whole batch once `share` of its rows have ended: the few long rows would otherwise run alone."""

    def __init__(self, eos_id: int, prompt_width: int, share: float):
        self.eos_id, self.prompt_width, self.share = eos_id, prompt_width, share

    def __call__(self, input_ids, scores, **kwargs):
        ended = (input_ids[:, self.prompt_width :] == self.eos_id).any(dim=1)
        return torch.full_like(ended, bool(ended.float().mean() >= self.share))


def answer(target, prompts: list[list[int]], pad_id: int, eos_id: int, **sampling) -> list[tuple[list[int], bool]]:
    ids = pad_sequence([torch.tensor(p) for p in prompts], batch_first=True, padding_value=pad_id, padding_side="left")
    mask = pad_sequence([torch.ones(len(p), dtype=torch.long) for p in prompts], batch_first=True, padding_side="left")
    stop = StoppingCriteriaList([MostRowsEnded(eos_id, ids.shape[1], ENDED_SHARE)])
    with torch.inference_mode():
        out = target.generate(
            ids, attention_mask=mask, max_new_tokens=MAX_NEW_TOKENS, stopping_criteria=stop, pad_token_id=pad_id,
            eos_token_id=eos_id, top_k=None, top_p=None, **sampling,
        )  # fmt: skip
    responses = []
    for row in out[:, ids.shape[1] :].tolist():
        complete = eos_id in row
        responses.append((row[: row.index(eos_id) + 1] if complete else row, complete))
    return responses


def write_shard(index: int, rows: list[dict], commit: bool) -> None:
    path = HERE / "data" / f"shard_{index:05d}.jsonl"
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows))
    os.replace(partial, path)
    if commit:
        for _ in range(30):  # another git command may hold the index for a moment
            done = subprocess.run(["git", "add", str(path)], cwd=HERE, capture_output=True).returncode == 0
            done = done and subprocess.run(
                ["git", "commit", "-q", "-m", f"research/smollm2_drafter/data: shard {index}", "--", str(path)],
                cwd=HERE, capture_output=True,
            ).returncode == 0  # fmt: skip
            if done:
                return
            time.sleep(2)
        print(f"shard {index}: written, not committed (git busy)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--commit", action="store_true", help="commit each finished shard, alone")
    parser.add_argument("--stop_at", default=None, help="HH:MM: end cleanly before starting a shard after it")
    parser.add_argument("--every", type=int, default=1, help="with --offset: only shards k with k %% every == offset")
    parser.add_argument("--offset", type=int, default=0, help="(two jobs on two cores: --every 2 --offset 0 and 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    (HERE / "data").mkdir(exist_ok=True)

    path = packaged_model_path(TARGET)
    target = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    prompts = [json.loads(line) for line in (HERE / "prompts.jsonl").read_text().split("\n") if line]
    for index in range((len(prompts) + SHARD_PROMPTS - 1) // SHARD_PROMPTS):
        if index % args.every != args.offset or (HERE / "data" / f"shard_{index:05d}.jsonl").exists():
            continue
        lock = FileLock(str(HERE / "data" / f"shard_{index:05d}.lock"))
        try:  # another job is writing this shard: leave it to that job
            lock.acquire(timeout=0)
        except Timeout:
            continue
        if args.stop_at and datetime.now().strftime("%H:%M") >= args.stop_at:
            print(f"stopping before shard {index} ({args.stop_at})")
            return
        started = time.perf_counter()
        chunk = prompts[index * SHARD_PROMPTS : (index + 1) * SHARD_PROMPTS]
        encoded = [
            tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
            for r in chunk
        ]  # fmt: skip
        rows = []
        torch.manual_seed(SAMPLE_SEED + index)
        for mode, sampling in (("greedy", {"do_sample": False}), ("sampled", {"do_sample": True, "temperature": 1.0})):
            for k, (response, complete) in enumerate(answer(target, encoded, pad_id, eos_id, **sampling)):
                rows.append({"prompt_index": index * SHARD_PROMPTS + k, "source": chunk[k]["source"], "mode": mode,
                             "input_ids": encoded[k] + response, "prompt_length": len(encoded[k]),
                             "complete": complete})  # fmt: skip
        write_shard(index, rows, args.commit)
        lock.release()
        tokens = sum(len(r["input_ids"]) - r["prompt_length"] for r in rows)
        seconds = time.perf_counter() - started
        print(f"shard {index}: {tokens} response tokens in {seconds:.0f} s ({tokens / seconds:.1f} tok/s)", flush=True)


if __name__ == "__main__":
    main()
