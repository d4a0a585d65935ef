"""The training prompts of SmolLM2's strong drafter, rebuilt from local git mirrors and this Python (no network).

    python research/smollm2_drafter/make_prompts.py --gsm8k GRADE_SCHOOL_MATH.git --self_instruct SELF_INSTRUCT.git

writes `prompts.jsonl` beside this file: one `{"source", "prompt"}` row per prompt, the sources interleaved in a
fixed order so that any prefix of the file (what a few hours of generation reach) is a mix. Sources, commits and
licenses are in this folder's README; the script refuses a mirror at another commit. No benchmark prompt is a
training prompt: every prompt of `hf_tev/bench/prompts/` is excluded by its text.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUTPUT = Path(__file__).resolve().parent / "prompts.jsonl"
EARLIER_PROMPTS = ROOT / "examples" / "smollm2" / "prompts" / "train.jsonl"  # vicuna, stdlib, code tasks
MIRRORS = {
    "gsm8k": ("openai/grade-school-math", "3101c7d5072418e28b9008a6636bde82a006892c"),
    "self_instruct": ("yizhongw/self-instruct", "0b26ccaa415992100fa32df62d41b994cf928e23"),
}
# Modules whose documented public functions become "write this function" requests (code answers).
STDLIB_MODULES = [
    "bisect", "heapq", "itertools", "textwrap", "os.path", "statistics", "math", "string", "fnmatch", "shlex",
    "base64", "binascii", "calendar", "colorsys", "difflib", "functools", "operator", "random", "re", "glob",
    "json", "csv", "html", "urllib.parse", "ipaddress", "datetime", "fractions", "decimal", "copy", "zlib",
]  # fmt: skip
SEED = 0


def git_json_lines(mirror: str, name: str, path: str) -> list[dict]:
    repo, commit = MIRRORS[name]
    head = subprocess.run(["git", "-C", mirror, "rev-parse", "HEAD"], check=True, capture_output=True, text=True)
    if head.stdout.strip() != commit:
        raise SystemExit(f"--{name}: {mirror} is at {head.stdout.strip()}, the prompts come from {repo}@{commit}")
    data = subprocess.run(["git", "-C", mirror, "show", f"{commit}:{path}"], check=True, capture_output=True).stdout
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


def self_instruct_prompt(task: dict) -> str:
    given = task["instances"][0]["input"].strip()
    return task["instruction"].strip() + (f"\n\n{given}" if given else "")


def stdlib_prompts() -> list[str]:
    prompts = []
    for module_name in STDLIB_MODULES:
        module = importlib.import_module(module_name)
        for name, function in sorted(vars(module).items()):
            if name.startswith("_") or not (inspect.isfunction(function) or inspect.isbuiltin(function)):
                continue
            summary = (inspect.getdoc(function) or "").strip().split("\n\n")[0].replace("\n", " ")
            if len(summary) >= 40:
                prompts.append(f"Write a Python function `{name}` without using the `{module_name}` module. {summary}")
    return prompts


def interleave(groups: list[list[dict]]) -> list[dict]:
    """Round-robin over the shuffled sources, so a prefix of the file holds every source."""
    rng = random.Random(SEED)
    queues = [rng.sample(group, len(group)) for group in groups]
    rows = []
    while any(queues):
        rows += [queue.pop() for queue in queues if queue]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, (repo, _) in MIRRORS.items():
        parser.add_argument(f"--{name}", required=True, help=f"a git mirror of {repo}")
    args = parser.parse_args()

    bench = {json.loads(line)["prompt"].strip() for f in (ROOT / "hf_tev/bench/prompts").glob("*.jsonl")
             for line in f.read_text().splitlines()}  # fmt: skip
    earlier = [json.loads(line) for line in EARLIER_PROMPTS.read_text().splitlines()]
    gsm8k = [q["question"] for q in git_json_lines(args.gsm8k, "gsm8k", "grade_school_math/data/train.jsonl")]
    tasks = git_json_lines(args.self_instruct, "self_instruct", "data/seed_tasks.jsonl")
    code = [r["prompt"] for r in earlier if r["source"] in ("python-stdlib-docstrings", "hf-tev-code-tasks")]
    code += [p for p in stdlib_prompts() if p not in code]
    groups = {
        "gsm8k-train": gsm8k,
        "self-instruct-seeds": [self_instruct_prompt(t) for t in tasks],
        "vicuna-bench": [r["prompt"] for r in earlier if r["source"] == "vicuna-bench"],
        "code": code,
    }
    kept = {source: [p for p in dict.fromkeys(ps) if p.strip() not in bench] for source, ps in groups.items()}
    rows = interleave([[{"source": s, "prompt": p} for p in ps] for s, ps in kept.items()])
    OUTPUT.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    counts = {s: sum(r["source"] == s for r in rows) for s in groups}
    print(f"{OUTPUT.relative_to(ROOT)}: {len(rows)} prompts {counts}")


if __name__ == "__main__":
    main()
