"""Rebuild the committed prompt files from their public sources (read from local git mirrors, no network).

    python benchmarks/make_prompt_sets.py --fastchat FASTCHAT.git --gsm8k GRADE_SCHOOL_MATH.git \
        --math500 BUDGETTHINKER.git

writes `hf_tev/bench/prompts/{mt_bench,gsm8k,math500}.jsonl` (benchmark prompts: test splits only) and
`research/smollm2_table2/prompts/train.jsonl` (training prompts: train splits and sets no benchmark uses). Each source's
repository, commit, path and license are in `hf_tev/bench/prompts/SOURCES.md`; the script refuses a mirror at
another commit, and checks MATH-500's file against the digest prm800k publishes for it.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "hf_tev" / "bench" / "prompts"
TRAIN_FILE = ROOT / "examples" / "smollm2" / "prompts" / "train.jsonl"

SOURCES = {
    "fastchat": ("lm-sys/FastChat", "0e6d3e4beaab66f4d3f93db72541a4abab8af28d"),
    "gsm8k": ("openai/grade-school-math", "3101c7d5072418e28b9008a6636bde82a006892c"),
    "math500": ("MobileLLM/BudgetThinker", "f0466b9d37595f46603387baa5930e312fefb7f5"),
}
# prm800k keeps prm800k/math_splits/test.jsonl in Git LFS; its pointer names this digest, and BudgetThinker's
# evaluation/data/math500/test_ori.jsonl is that very file.
MATH500_SHA256 = "35dc41080a3680858b27fa7e0533d2d547825316fc5dafe5d316f4ccc5a06132"
GSM8K_TEST_COUNT = 250  # of 1,319: enough prompts for a paired interval, a small file
GSM8K_TRAIN_COUNT = 640
# Standard-library functions whose docstrings become "write this function" prompts (code answers for training,
# apart from HumanEval, which only the bench uses).
STDLIB_CODE = [
    "bisect.bisect_left",
    "bisect.insort",
    "heapq.merge",
    "heapq.nlargest",
    "itertools.accumulate",
    "itertools.groupby",
    "itertools.permutations",
    "itertools.combinations",
    "itertools.product",
    "textwrap.dedent",
    "textwrap.shorten",
    "textwrap.wrap",
    "os.path.commonprefix",
    "os.path.splitext",
    "os.path.normpath",
    "os.path.relpath",
    "statistics.median",
    "statistics.mode",
    "statistics.stdev",
    "statistics.variance",
    "statistics.harmonic_mean",
    "statistics.geometric_mean",
    "math.gcd",
    "math.isqrt",
    "math.comb",
    "math.perm",
    "math.dist",
    "math.prod",
    "shlex.split",
    "shlex.quote",
    "fnmatch.fnmatch",
    "fnmatch.translate",
    "difflib.get_close_matches",
    "string.capwords",
    "html.escape",
    "html.unescape",
    "urllib.parse.quote",
    "urllib.parse.urlsplit",
    "urllib.parse.parse_qs",
    "base64.b64encode",
    "binascii.crc32",
    "calendar.isleap",
    "calendar.monthrange",
    "colorsys.rgb_to_hsv",
    "colorsys.hsv_to_rgb",
    "json.dumps",
    "csv.reader",
    "random.shuffle",
    "random.choices",
    "random.sample",
    "functools.reduce",
    "operator.itemgetter",
    "glob.glob",
    "zlib.adler32",
    "ipaddress.ip_address",
    "keyword.iskeyword",
]
CODE_TASKS = [
    "Write a Python function that reverses the words of a sentence.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python class for a stack with push, pop and peek.",
    "Write a Python function that counts the vowels in a string.",
    "Write a Python function that flattens a nested list.",
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that merges two dictionaries, summing values of shared keys.",
    "Write a Python function that removes duplicates from a list while keeping order.",
    "Write a Python function that converts a Roman numeral to an integer.",
    "Write a Python function that finds the longest common prefix of a list of strings.",
    "Write a Python function that rotates a matrix by 90 degrees.",
    "Write a Python function that validates a balanced-brackets string.",
    "Write a Python function that computes the factorial of n recursively.",
    "Write a Python function that reads a CSV file and returns its rows as dictionaries.",
    "Write a Python function that returns the k most frequent words in a text.",
    "Write a Python function that performs binary search on a sorted list.",
]


def git_show(mirror: str, commit: str, path: str) -> bytes:
    return subprocess.run(["git", "-C", mirror, "show", f"{commit}:{path}"], check=True, capture_output=True).stdout


def check_commit(mirror: str, name: str) -> str:
    head = subprocess.run(["git", "-C", mirror, "rev-parse", "HEAD"], check=True, capture_output=True, text=True)
    repo, commit = SOURCES[name]
    if head.stdout.strip() != commit:
        raise SystemExit(f"--{name}: {mirror} is at {head.stdout.strip()}, the prompts come from {repo}@{commit}")
    return commit


def json_lines(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    print(f"{path.relative_to(ROOT)}: {len(rows)} prompts")


def stdlib_prompts() -> list[str]:
    import importlib

    prompts = []
    for dotted in STDLIB_CODE:
        module_name, name = dotted.rsplit(".", 1)
        function = getattr(importlib.import_module(module_name), name)
        summary = (inspect.getdoc(function) or "").strip().split("\n\n")[0].replace("\n", " ")
        prompts.append(f"Write a Python function `{name}` without using the `{module_name}` module. {summary}")
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in SOURCES:
        parser.add_argument(f"--{name}", required=True, help=f"a git mirror of {SOURCES[name][0]}")
    args = parser.parse_args()

    commit = check_commit(args.fastchat, "fastchat")
    mt_bench = json_lines(git_show(args.fastchat, commit, "fastchat/llm_judge/data/mt_bench/question.jsonl"))
    write_jsonl(
        BENCH_DIR / "mt_bench.jsonl",
        [{"id": q["question_id"], "category": q["category"], "prompt": q["turns"][0]} for q in mt_bench],
    )
    vicuna = json_lines(git_show(args.fastchat, commit, "fastchat/llm_judge/data/vicuna_bench/question.jsonl"))

    commit = check_commit(args.gsm8k, "gsm8k")
    gsm_test = json_lines(git_show(args.gsm8k, commit, "grade_school_math/data/test.jsonl"))
    gsm_train = json_lines(git_show(args.gsm8k, commit, "grade_school_math/data/train.jsonl"))
    gsm_rows = [{"id": i, "prompt": q["question"]} for i, q in enumerate(gsm_test[:GSM8K_TEST_COUNT])]
    write_jsonl(BENCH_DIR / "gsm8k.jsonl", gsm_rows)

    commit = check_commit(args.math500, "math500")
    data = git_show(args.math500, commit, "evaluation/data/math500/test_ori.jsonl")
    if hashlib.sha256(data).hexdigest() != MATH500_SHA256:
        raise SystemExit("--math500: test_ori.jsonl is not prm800k's math_splits/test.jsonl (sha256 differs)")
    write_jsonl(BENCH_DIR / "math500.jsonl", [{"id": q["unique_id"], "prompt": q["problem"]} for q in json_lines(data)])

    train = [{"source": "gsm8k-train", "prompt": q["question"]} for q in gsm_train[:GSM8K_TRAIN_COUNT]]
    train += [{"source": "vicuna-bench", "prompt": q["turns"][0]} for q in vicuna]
    train += [{"source": "python-stdlib-docstrings", "prompt": p} for p in stdlib_prompts()]
    train += [{"source": "hf-tev-code-tasks", "prompt": p} for p in CODE_TASKS]
    write_jsonl(TRAIN_FILE, train)


if __name__ == "__main__":
    main()
