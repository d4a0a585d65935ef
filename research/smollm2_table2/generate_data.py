"""Training rows for SmolLM2-135M-Instruct's drafters, written by the target itself (greedy, chat-templated).

    python research/smollm2_table2/generate_data.py --threads 2

reads `prompts/train.jsonl` (train splits and sets no benchmark uses; sources in hf_tev/bench/prompts/SOURCES.md)
and appends rows to `data/train.jsonl` as they are generated, with the settings beside it; a rerun resumes after
the last complete row (hf_tev.generate_training_data). Greedy decoding in fixed batches on a CPU, so a rerun from
scratch with the same torch build and thread count writes the same tokens.
"""

from __future__ import annotations

import argparse
import json

import torch
from study import HERE, TARGET
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_tev import generate_training_data
from hf_tev.packaged import packaged_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max_new_tokens", type=int, default=192)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    parser.add_argument("--output", default=str(HERE / "data" / "train.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    path = packaged_model_path(TARGET)
    target = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = [json.loads(line) for line in (HERE / "prompts" / "train.jsonl").read_text().splitlines()]
    prompts = [row["prompt"] for row in rows[: args.limit]]
    generate_training_data(
        target,
        prompts,
        tokenizer=tokenizer,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        apply_chat_template=True,
        output_path=args.output,
        metadata={"prompts": "research/smollm2_table2/prompts/train.jsonl", "target": TARGET},
        do_sample=False,
    )


if __name__ == "__main__":
    main()
