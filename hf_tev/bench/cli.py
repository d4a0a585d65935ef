"""The command line of `hf-tev bench` (also `python -m hf_tev.bench`): `main(argv, prog)`.

`hf-tev bench [options]` runs the bench and writes bench.json, bench.md and bench.png; `hf-tev bench report
DIR/bench.json [--output DIR2]` re-renders bench.md and bench.png from a stored bench.json, running nothing.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

from ..kit import KIT_DRAFTERS
from .config import DTYPES, BenchConfig
from .methods import METHODS, PROMPT_SETS, REFERENCE_METHOD
from .report import JSON_NAME, check_output_folder, markdown_report, read_document, write_outputs, write_report
from .runner import run_bench

DESCRIPTION = """\
Decoding methods side by side in one process, interleaved per prompt: tau, 1 + C, SR, stage times.

    hf-tev bench                                    # the full table on the tiny kit (long on a CPU)
    hf-tev bench --methods ar,ddtree,tev --drafters drafter-exittrain --budgets 32,64 --temperatures 0 \\
        --prompt-sets humaneval --max-prompts 4 --max-new-tokens 64 --output bench_out
    hf-tev bench --methods ddtree,tev --drafters drafter-exittrain --budgets 32,64,128 --temperatures 0.6 \\
        --prompt-sets humaneval --output bench_t06  # the paper's Table 3 is at T = 0.6
    python -m hf_tev.bench --target Qwen/Qwen3-4B --drafters z-lab/Qwen3-4B-DFlash-b16 --assistant Qwen/Qwen3-0.6B \\
        --device cuda --dtype bfloat16 --prompt-sets mt_bench,humaneval,gsm8k,math500 --temperatures 0,0.6,1
    hf-tev bench --methods ar,tev --drafters drafter-dflash-l135 --budgets 8,auto --batch-sizes 1,4,8 \\
        --temperatures 0 --max-prompts 8 --max-new-tokens 32 --output bench_batch   # batches against batched ar
    hf-tev bench report bench_out/bench.json --output elsewhere   # re-render bench.md / bench.png, no run

Every run uses the same prompts, max_new_tokens, dtype and device. Within one temperature and prompt set, the
runs are interleaved per prompt (all methods on prompt 1, --repeats times in rotating order, then prompt 2, ...),
and every run of a prompt starts from the same seed. `ar` always runs: it is the reference for SR and for the
greedy exactness check. T = 0 is greedy; T > 0 is pure temperature sampling from the target (top-k, top-p and
min-p off, whatever the model's generation config says, unless --top-k / --top-p / --min-p are given). Every run
produces exactly max_new_tokens tokens unless --stop-at-eos. bench.json records the settings each temperature
passed to `generate` (settings.generation); its schema is in hf_tev.bench's docstring.
"""

REPORT_DESCRIPTION = """\
Re-render bench.md and bench.png from a bench.json written by `hf-tev bench`, without running anything.
The markdown is the one the run wrote (byte for byte, with the same hf_tev)."""


def _csv(text, cast=str):
    return [cast(item.strip()) for item in str(text).split(",") if item.strip()]


def _registry_listing() -> str:
    methods = "\n".join(f"  {name:<14} {method.description}" for name, method in METHODS.items())
    sets = "\n".join(f"  {name:<14} {prompt_set.description}" for name, prompt_set in PROMPT_SETS.items())
    return f"methods:\n{methods}\n\nprompt sets:\n{sets}"


def _budget(text: str) -> int | str:
    return "auto" if text == "auto" else int(text)


def build_parser(prog="hf-tev bench") -> argparse.ArgumentParser:
    defaults = {f.name: f.default for f in fields(BenchConfig)}
    parser = argparse.ArgumentParser(
        prog=prog,
        description=DESCRIPTION,
        epilog=_registry_listing(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--methods",
        type=_csv,
        default=None,
        help=f"comma-separated, from {', '.join(METHODS)} (default: all; {REFERENCE_METHOD} is always added)",
    )
    parser.add_argument(
        "--drafters",
        "--drafter",
        type=_csv,
        default=None,
        help=f"kit drafters ({', '.join(KIT_DRAFTERS)}; default: those present) or folders / Hub ids",
    )
    parser.add_argument(
        "--budgets",
        type=lambda s: _csv(s, _budget),
        default=None,
        help="ints and/or auto (the automatic budget); default auto,4,16,64",
    )
    parser.add_argument(
        "--temperatures",
        type=lambda s: _csv(s, float),
        default=None,
        help="default 0,1 (0: greedy; the paper's Table 3 is at 0.6)",
    )
    parser.add_argument("--top-k", type=int, default=None, help="top-k at T > 0 (default: off)")
    parser.add_argument("--top-p", type=float, default=None, help="top-p at T > 0 (default: off)")
    parser.add_argument("--min-p", type=float, default=None, help="min-p at T > 0 (default: off)")
    parser.add_argument("--prompt-sets", type=_csv, default=None, help=f"from {', '.join(PROMPT_SETS)} (default: all)")
    parser.add_argument("--max-prompts", type=int, default=defaults["max_prompts"])
    parser.add_argument("--max-new-tokens", type=int, default=defaults["max_new_tokens"])
    parser.add_argument("--repeats", type=int, default=defaults["repeats"], help="timed runs per prompt (median)")
    parser.add_argument("--output", default=defaults["output"], help="folder for bench.json/.md/.png")
    parser.add_argument("--target", default=None, help="model id or folder (default: the tiny kit's target)")
    parser.add_argument("--assistant", default=None, help="causal assistant for 'assisted' (kit: assistant-ar)")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", default=defaults["dtype"], choices=sorted(DTYPES))
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default 1 on CPU)")
    parser.add_argument("--seed", type=int, default=defaults["seed"])
    parser.add_argument("--prompt-lookup-num-tokens", type=int, default=defaults["prompt_lookup_num_tokens"])
    parser.add_argument("--stop-at-eos", action="store_true", help="stop at EOS (default: exactly max_new_tokens)")
    parser.add_argument(
        "--batch-sizes",
        type=lambda s: _csv(s, int),
        default=None,
        help="e.g. 1,4,8: the batch bench instead (prompts R at a time; hf_tev methods against batched ar)",
    )
    parser.add_argument("--no-chat-template", dest="chat_template", action="store_false")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    return parser


def build_report_parser(prog="hf-tev bench report") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=REPORT_DESCRIPTION)
    parser.add_argument("json", type=Path, help=f"a {JSON_NAME} written by hf-tev bench")
    parser.add_argument(
        "--output", type=Path, default=None, help="folder for bench.md and bench.png (default: the folder of the json)"
    )
    return parser


def main(argv: list[str] | None = None, prog: str = "hf-tev bench") -> dict:
    """Run the bench (or, with `report` first, re-render a stored one) and return the JSON document."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["report"]:
        return report_main(argv[1:], prog=f"{prog} report")
    parser = build_parser(prog)
    args = vars(parser.parse_args(argv))
    expand = {"methods": list(METHODS), "prompt_sets": list(PROMPT_SETS)}
    for name, every in expand.items():  # "all" is the default list
        if args[name] == ["all"]:
            args[name] = every
    try:  # every check that needs no model, before any is loaded
        config = BenchConfig(**{k: v for k, v in args.items() if v is not None})
        check_output_folder(config.output)
    except ValueError as error:
        parser.error(str(error))
    document = run_bench(config)
    paths = write_outputs(document, config.output)
    print(markdown_report(document))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return document


def report_main(argv: list[str], prog: str = "hf-tev bench report") -> dict:
    parser = build_report_parser(prog)
    args = parser.parse_args(argv)
    output = args.json.parent if args.output is None else args.output
    try:
        document = read_document(args.json)
        check_output_folder(output)
    except ValueError as error:
        parser.error(str(error))
    paths = write_report(document, output)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return document
