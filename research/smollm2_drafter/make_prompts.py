"""The training prompts of SmolLM2's strong drafter, rebuilt from local git mirrors and this Python (no network).

    python research/smollm2_drafter/make_prompts.py --gsm8k GRADE_SCHOOL_MATH.git --self_instruct SELF_INSTRUCT.git \
        --algorithms THE_ALGORITHMS_PYTHON.git

writes `prompts.jsonl` beside this file: one `{"source", "prompt"}` row per prompt, the sources interleaved in a
fixed order so that any prefix of the file (what a few hours of generation reach) is a mix. Sources, commits and
licenses are in this folder's README; the script refuses a mirror at another commit. No benchmark prompt is a
training prompt: every prompt of `hf_tev/bench/prompts/` is excluded by its text.

The file grew once. Its first `ANSWERED_BEFORE_GROWTH` rows are the first version's (four sources), already answered
by the committed shards, so they never move; the rest of that version (GSM8K only) is interleaved again with the
sources added since (code from TheAlgorithms/Python, more of the standard library).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import random
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUTPUT = Path(__file__).resolve().parent / "prompts.jsonl"
EARLIER_PROMPTS = ROOT / "research" / "smollm2_table2" / "prompts" / "train.jsonl"  # vicuna, stdlib, code tasks
MIRRORS = {
    "gsm8k": ("openai/grade-school-math", "3101c7d5072418e28b9008a6636bde82a006892c"),
    "self_instruct": ("yizhongw/self-instruct", "0b26ccaa415992100fa32df62d41b994cf928e23"),
    "algorithms": ("TheAlgorithms/Python", "f5988cc09713315817df6a7e327e258013a94440"),
}
# Shards 0-59 (prompts 0-959) were answered before the sources grew: those rows stay where they are.
ANSWERED_BEFORE_GROWTH = 960
# Modules whose documented public functions become "write this function" requests (code answers).
STDLIB_MODULES = [
    "bisect", "heapq", "itertools", "textwrap", "os.path", "statistics", "math", "string", "fnmatch", "shlex",
    "base64", "binascii", "calendar", "colorsys", "difflib", "functools", "operator", "random", "re", "glob",
    "json", "csv", "html", "urllib.parse", "ipaddress", "datetime", "fractions", "decimal", "copy", "zlib",
]  # fmt: skip
# Added with TheAlgorithms: the rest of the standard library's pure-Python modules with documented functions.
MORE_STDLIB_MODULES = [
    "abc", "argparse", "ast", "collections", "contextlib", "dataclasses", "email.utils", "enum", "filecmp",
    "getopt", "gettext", "graphlib", "gzip", "hashlib", "hmac", "inspect", "keyword", "linecache", "locale",
    "mimetypes", "netrc", "numbers", "pathlib", "pickle", "pkgutil", "platform", "plistlib", "pprint", "quopri",
    "reprlib", "sched", "secrets", "shutil", "socket", "tarfile", "tempfile", "textwrap", "timeit", "token",
    "tokenize", "traceback", "types", "typing", "unicodedata", "uuid", "warnings", "weakref", "webbrowser",
    "wsgiref.util", "xml.sax.saxutils", "zipfile", "zoneinfo",
]  # fmt: skip
SEED = 0


def git(mirror: str, *args: str) -> str:
    return subprocess.run(["git", "-C", mirror, *args], check=True, capture_output=True).stdout.decode()


def checked_commit(mirror: str, name: str) -> str:
    repo, commit = MIRRORS[name]
    head = git(mirror, "rev-parse", "HEAD").strip()
    if head != commit:
        raise SystemExit(f"--{name}: {mirror} is at {head}, the prompts come from {repo}@{commit}")
    return commit


def git_json_lines(mirror: str, name: str, path: str) -> list[dict]:
    data = git(mirror, "show", f"{checked_commit(mirror, name)}:{path}")
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def self_instruct_prompt(task: dict) -> str:
    given = task["instances"][0]["input"].strip()
    return task["instruction"].strip() + (f"\n\n{given}" if given else "")


def summary_of(docstring: str | None) -> str:
    """A docstring's first paragraph on one line, or "" when it is too short to ask for a function."""
    summary = (docstring or "").strip().split("\n\n")[0]
    summary = " ".join(summary.split())
    return summary if len(summary) >= 40 and ">>>" not in summary else ""


def stdlib_prompts(module_names: list[str]) -> list[str]:
    prompts = []
    for module_name in module_names:
        module = importlib.import_module(module_name)
        for name, function in sorted(vars(module).items()):
            if name.startswith("_") or not (inspect.isfunction(function) or inspect.isbuiltin(function)):
                continue
            if module_name in STDLIB_MODULES:  # the first version's rule, kept so its prompts are unchanged
                summary = (inspect.getdoc(function) or "").strip().split("\n\n")[0].replace("\n", " ")
                summary = summary if len(summary) >= 40 else ""
            else:
                summary = summary_of(inspect.getdoc(function))
            if summary:
                prompts.append(f"Write a Python function `{name}` without using the `{module_name}` module. {summary}")
    return prompts


def algorithm_prompts(mirror: str) -> list[str]:
    """A "write this function" request per documented top-level function of TheAlgorithms/Python (tests excluded)."""
    commit = checked_commit(mirror, "algorithms")
    prompts = []
    for path in sorted(git(mirror, "ls-tree", "-r", "--name-only", commit).splitlines()):
        if not path.endswith(".py") or "/" not in path or Path(path).name.startswith("test_"):
            continue
        try:
            tree = ast.parse(git(mirror, "show", f"{commit}:{path}"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith(("_", "test")):
                summary = summary_of(ast.get_docstring(node))
                if summary:
                    prompts.append(f"Write a Python function `{node.name}`. {summary}")
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
    code += [p for p in stdlib_prompts(STDLIB_MODULES) if p not in code]
    first_version = {
        "gsm8k-train": gsm8k,
        "self-instruct-seeds": [self_instruct_prompt(t) for t in tasks],
        "vicuna-bench": [r["prompt"] for r in earlier if r["source"] == "vicuna-bench"],
        "code": code,
    }
    answered = interleave(rows_of(first_version, bench))[:ANSWERED_BEFORE_GROWTH]
    seen = {row["prompt"] for row in answered}
    grown = {
        "gsm8k-train": [p for p in gsm8k if p not in seen],
        "the-algorithms": algorithm_prompts(args.algorithms),
        "python-stdlib-more": [p for p in stdlib_prompts(MORE_STDLIB_MODULES) if p not in code],
    }
    rows = answered + interleave(rows_of(grown, bench | seen))
    OUTPUT.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    counts = {s: sum(r["source"] == s for r in rows) for s in dict.fromkeys([*first_version, *grown])}
    print(f"{OUTPUT.relative_to(ROOT)}: {len(rows)} prompts {counts}")


def rows_of(groups: dict[str, list[str]], excluded: set[str]) -> list[list[dict]]:
    """Each source's prompts as rows, deduplicated, without the benchmark's (or already answered) prompts."""
    kept = {source: [p for p in dict.fromkeys(ps) if p.strip() not in excluded] for source, ps in groups.items()}
    return [[{"source": s, "prompt": p} for p in ps] for s, ps in kept.items()]


if __name__ == "__main__":
    main()
