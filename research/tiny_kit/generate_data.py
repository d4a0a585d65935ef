"""Target-generated training sequences for the kit's drafters (docs/design.md#exittrain: the drafter
must imitate the target, not the dataset).

Continues the TRAIN prompts of make_prompts.py (build/prompts_train.json, in file order)
with the kit's tiny-code-target, sampling at temperature 1 with no top-k / top-p truncation,
through `hf_tev.training.generate_training_data` (batched `target.generate` with left
padding). Rows are appended to a JSONL file chunk by chunk, so the job can be stopped at
any time (--minutes) and resumed by running it again:
    {"input_ids": prompt + response ids, "prompt_length": int, "prompt_id": str}
Responses end at the first <|endoftext|> (kept) or after --max-new-tokens.

Run (one thread, politely, in the background):
    nohup nice -n 10 python research/tiny_kit/generate_data.py --num 3000 --minutes 25 \
        > research/tiny_kit/build/generate.log 2>&1 &
The shipped rows (the first 3,000 prompts) are the kit's data/train_generated.jsonl, in tiny_kit/hf_tev_tiny_kit/.
"""

import argparse
import json
import time
from pathlib import Path

import paths
import torch


def count_rows(path: Path) -> int:
    if not path.exists():
        return 0
    with open(path) as f:
        return sum(1 for line in f if line.strip())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=paths.model_path("target"))
    parser.add_argument("--prompts", type=Path, default=paths.BUILD / "prompts_train.json")
    parser.add_argument("--out", type=Path, default=paths.BUILD / "train_generated.jsonl")
    parser.add_argument("--start", type=int, default=0, help="skip the first START prompts of --prompts")
    parser.add_argument("--num", type=int, default=3000, help="prompts to continue (N prompts from --start)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per generate call")
    parser.add_argument("--chunk", type=int, default=64, help="prompts per write (and per seed)")
    parser.add_argument("--minutes", type=float, default=None, help="stop starting new chunks after this wall time")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_tev.training import generate_training_data

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    prompts = json.loads(args.prompts.read_text())[args.start : args.start + args.num]
    done = count_rows(args.out)  # resume: rows are written in prompt order, chunk by chunk
    if done % args.chunk and done < len(prompts):
        raise ValueError(f"{args.out} has {done} rows, not a multiple of --chunk {args.chunk}; use the same --chunk")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.temperature == 0:  # greedy continuations: what the target writes at T = 0
        sampling = dict(do_sample=False)
    else:
        sampling = dict(do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0)

    started = time.time()
    new_rows = new_tokens = 0
    progress = tqdm(total=len(prompts), initial=done, desc="target continuations", unit="seq", mininterval=10)
    for start in range(done, len(prompts), args.chunk):
        if args.minutes is not None and time.time() - started > args.minutes * 60:
            break
        chunk = prompts[start : start + args.chunk]
        # similar lengths in one generate call waste less compute on left padding
        chunk = sorted(chunk, key=lambda p: len(p["prompt"]))
        torch.manual_seed(args.seed * 1_000_003 + start)  # each chunk reproducible on its own (resume)
        rows = generate_training_data(
            target,
            [p["prompt"] for p in chunk],
            tokenizer=tokenizer,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            show_progress=False,
            **sampling,
        )
        with open(args.out, "a") as f:
            for prompt, row in zip(chunk, rows, strict=True):
                f.write(json.dumps({**row, "prompt_id": prompt["id"]}) + "\n")
        new_rows += len(rows)
        new_tokens += sum(len(r["input_ids"]) - r["prompt_length"] for r in rows)
        progress.update(len(rows))
    progress.close()
    seconds = time.time() - started
    print(
        json.dumps(
            {
                "rows_written": new_rows,
                "rows_total": count_rows(args.out),
                "new_tokens": new_tokens,
                "seconds": round(seconds, 1),
                "rows_per_s": round(new_rows / max(seconds, 1e-9), 3),
                "new_tokens_per_s": round(new_tokens / max(seconds, 1e-9), 1),
                **vars(args),
            },
            default=str,
        )
    )


if __name__ == "__main__":
    main()
