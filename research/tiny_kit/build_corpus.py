"""Build the tiny kit's Python-code corpus from offline sources only.

Collects every `.py` file under the interpreter's standard library (with its
`site-packages`) and Debian's system Python directories, keeps the files the
tiny-code-target was trained on (200 B to 200 kB, UTF-8, no line over 1000
characters), removes exact duplicates by SHA-1 of the file bytes, and splits by the
target's rule: a file is held out when the first byte of its SHA-1 is < 3.

Writes under --out (default research/tiny_kit/build/):
    files_train.json, files_heldout.json   [{"root", "path", "sha1", "bytes"}], sorted by sha1
    train.bin, heldout.bin                 uint16 token ids, documents joined by <|endoftext|>
    corpus_stats.json                      counts, and the overlap with the target's held-out list

Run:
    nice -n 10 python research/tiny_kit/build_corpus.py
"""

import argparse
import hashlib
import json
import os
import random
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import paths

MIN_BYTES, MAX_BYTES, MAX_LINE_CHARS = 200, 200_000, 1000
HELDOUT_FIRST_BYTE = 3  # held out when sha1(file bytes)[0] < 3, the target's rule
EOT = "<|endoftext|>"


def default_roots() -> dict[str, Path]:
    """Source roots, named as in the target's heldout_files.json, in dedup priority order.

    The target also read a virtual environment's site-packages ("venv_site"); on this
    machine those packages live in the interpreter's own site-packages, so identical
    files are found there (the split is by content, so they land on the same side).
    """
    roots = {
        "stdlib311": Path(sysconfig.get_paths()["stdlib"]),
        "debian_py": Path("/usr/lib/python3"),
        "debian_py311": Path("/usr/lib/python3.11"),
    }
    if sys.prefix != sys.base_prefix:  # running inside a virtual environment
        roots["venv_site"] = Path(sysconfig.get_paths()["purelib"])
    return {name: path for name, path in roots.items() if path.is_dir()}


def iter_py_files(root: Path):
    """Every `.py` file under root, in sorted order (reproducible dedup winners)."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


def accept_text(data: bytes) -> str | None:
    """The target's filters: size, strict UTF-8, no line over 1000 characters."""
    if not MIN_BYTES <= len(data) <= MAX_BYTES:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if max(len(line) for line in text.splitlines() or [""]) > MAX_LINE_CHARS:
        return None
    return text


def collect(roots: dict[str, Path]) -> tuple[list[dict], dict[str, str], dict]:
    """Filtered, deduplicated files; returns (records, text by sha1, counts)."""
    records, texts = [], {}
    counts = {"seen": 0, "rejected": 0, "duplicates": 0}
    for root_name, root in roots.items():
        for path in iter_py_files(root):
            if not path.is_file():
                continue
            counts["seen"] += 1
            data = path.read_bytes()
            text = accept_text(data)
            if text is None:
                counts["rejected"] += 1
                continue
            sha1 = hashlib.sha1(data).hexdigest()
            if sha1 in texts:
                counts["duplicates"] += 1
                continue
            texts[sha1] = text
            records.append({"root": root_name, "path": str(path.relative_to(root)), "sha1": sha1, "bytes": len(data)})
    return records, texts, counts


def is_heldout(sha1: str) -> bool:
    return int(sha1[:2], 16) < HELDOUT_FIRST_BYTE


def tokenize_to_bin(records: list[dict], texts: dict[str, str], tokenizer, out_path: Path, seed: int) -> int:
    """Shuffled documents, each followed by <|endoftext|>, written as uint16; returns the token count."""
    order = list(records)
    random.Random(seed).shuffle(order)
    eot_id = tokenizer.token_to_id(EOT)
    total = 0
    with open(out_path, "wb") as f:
        for start in range(0, len(order), 256):
            chunk = [texts[r["sha1"]] for r in order[start : start + 256]]
            for encoding in tokenizer.encode_batch(chunk, add_special_tokens=False):
                ids = np.asarray(encoding.ids + [eot_id], dtype=np.uint16)
                f.write(ids.tobytes())
                total += len(ids)
    return total


def compare_with_target(heldout: list[dict], target_list: Path) -> dict:
    """Overlap of our held-out files with the target's, by content (sha1) and by path."""
    theirs = json.loads(target_list.read_text())
    their_sha = {r["sha1"] for r in theirs}
    our_sha = {r["sha1"] for r in heldout}
    their_paths = {r["path"].split("site-packages/")[-1].split("dist-packages/")[-1] for r in theirs}
    our_paths = {r["path"].split("site-packages/")[-1].split("dist-packages/")[-1] for r in heldout}
    missing = sorted((r["root"], r["path"]) for r in theirs if r["sha1"] not in our_sha)
    return {
        "target_heldout_files": len(theirs),
        "our_heldout_files": len(heldout),
        "shared_by_sha1": len(their_sha & our_sha),
        "shared_by_path_suffix": len(their_paths & our_paths),
        "target_only": len(their_sha - our_sha),
        "ours_only": len(our_sha - their_sha),
        "target_only_by_root": {
            root: sum(1 for r, _ in missing if r == root) for root in sorted({r for r, _ in missing})
        },
        "target_only_examples": [f"{r}/{p}" for r, p in missing[:20]],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = paths.model_path("target")  # the kit's copy of the tiny-code-target
    parser.add_argument("--out", type=Path, default=paths.BUILD)
    parser.add_argument("--tokenizer", type=Path, default=target / "tokenizer.json")
    parser.add_argument("--target-heldout", type=Path, default=target / "heldout_files.json")
    parser.add_argument(
        "--root",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="extra source root (e.g. venv_site=/path/to/venv/lib/python3.11/site-packages)",
    )
    parser.add_argument("--seed", type=int, default=0, help="document shuffle seed for the .bin files")
    args = parser.parse_args()

    from tokenizers import Tokenizer

    started = time.time()
    roots = default_roots()
    for spec in args.root:
        name, _, path = spec.partition("=")
        roots[name] = Path(path)
    print("roots:", {k: str(v) for k, v in roots.items()}, flush=True)

    records, texts, counts = collect(roots)
    records.sort(key=lambda r: r["sha1"])
    heldout = [r for r in records if is_heldout(r["sha1"])]
    train = [r for r in records if not is_heldout(r["sha1"])]
    print(
        f"{counts['seen']} .py files, {counts['rejected']} rejected by the filters, "
        f"{counts['duplicates']} duplicates; train {len(train)}, held-out {len(heldout)}",
        flush=True,
    )

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "files_train.json").write_text(json.dumps(train, indent=0))
    (args.out / "files_heldout.json").write_text(json.dumps(heldout, indent=0))

    tokenizer = Tokenizer.from_file(str(args.tokenizer))
    heldout_tokens = tokenize_to_bin(heldout, texts, tokenizer, args.out / "heldout.bin", args.seed)
    print(f"held-out: {heldout_tokens:,} tokens", flush=True)
    train_tokens = tokenize_to_bin(train, texts, tokenizer, args.out / "train.bin", args.seed)
    print(f"train: {train_tokens:,} tokens", flush=True)

    stats = {
        "roots": {k: str(v) for k, v in roots.items()},
        **counts,
        "train_files": len(train),
        "heldout_files": len(heldout),
        "train_bytes": sum(r["bytes"] for r in train),
        "heldout_bytes": sum(r["bytes"] for r in heldout),
        "train_tokens": train_tokens,
        "heldout_tokens": heldout_tokens,
        "chars_per_token_train": round(sum(len(texts[r["sha1"]]) for r in train) / train_tokens, 3),
        "target_comparison": compare_with_target(heldout, args.target_heldout),
        "seconds": round(time.time() - started, 1),
    }
    (args.out / "corpus_stats.json").write_text(json.dumps(stats, indent=1))
    print(json.dumps(stats["target_comparison"], indent=1))
    print(f"done in {stats['seconds']} s -> {args.out}")


if __name__ == "__main__":
    main()
