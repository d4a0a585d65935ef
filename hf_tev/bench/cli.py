"""The command line of `hf-tev bench` (also `python -m hf_tev.bench`): `main(argv, prog)`.

`hf-tev bench [options]` (or `hf-tev bench recipe.yaml [options]`) runs the bench and writes bench.json, bench.md and
bench.png; `hf-tev bench report DIR/bench.json [--output DIR2]` (or `report DIR`) re-renders bench.md and bench.png
from a stored bench.json, running nothing. The options are the fields of `BenchConfig`, parsed by transformers'
`HfArgumentParser` as `hf-tev train` parses its own: `--max_new_tokens` and `--max-new-tokens` both work, lists are
comma- or space-separated, and a YAML / JSON file of the same names can come first or follow `--config` (options
after it override it).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import typing
from dataclasses import field, fields, make_dataclass
from pathlib import Path

from ..cli_options import apply_config, owned_folder, record_given_names, refuse_names_given_twice, split_config
from ..help_view import ShortHelpFormatter, add_help_all, short_view
from ..packaged import KIT_DRAFTERS
from .config import DTYPES, BenchConfig
from .loading import check_sources
from .methods import KIT_PROMPT_SETS, METHODS, PAPER_PROMPT_SETS, PROMPT_SETS, REFERENCE_METHOD
from .report import (
    JSON_NAME,
    OUTPUT_NAMES,
    check_output_folder,
    markdown_report,
    read_document,
    write_outputs,
    write_report,
)
from .runner import run_bench

TITLE = "Decoding methods side by side in one process, interleaved per prompt: tau, 1 + C, SR, stage times."
FIRST_EXAMPLES = """\
    hf-tev bench                                    # the full table on the tiny kit (long on a CPU)
    hf-tev bench --methods ar,ddtree,tev --drafters drafter-dflash-l135 --budgets 32,64 --temperatures 0 \\
        --prompt_sets humaneval --max_prompts 4 --max_new_tokens 64 --output bench_out"""
MORE_EXAMPLES = """\
    hf-tev bench --methods ddtree,tev --drafters drafter-dflash-l135 --budgets 32,64,128 --temperatures 0.6 \\
        --prompt_sets humaneval --output bench_t06  # the paper's Table 3 is at T = 0.6
    python -m hf_tev.bench --target Qwen/Qwen3-4B --drafters z-lab/Qwen3-4B-DFlash-b16 --assistant Qwen/Qwen3-0.6B \\
        --device cuda --dtype bfloat16 --prompt_sets mt_bench,humaneval,gsm8k,math500 --temperatures 0,0.6,1
    hf-tev bench --methods ar,tev --drafters drafter-dflash-l135 --budgets 8,auto --batch_sizes 1,4,8 \\
        --temperatures 0 --max_prompts 8 --max_new_tokens 32 --output bench_batch   # batches against batched ar"""
LAST_EXAMPLES = """\
    hf-tev bench recipe.yaml --output bench_2     # the options of a YAML / JSON file; options after it override it
    hf-tev bench --config recipe.yaml             # the same
    hf-tev bench report bench_out/bench.json --output elsewhere   # re-render bench.md / bench.png, no run"""
NOTES = """\
Every option has both spellings (--max_new_tokens, --max-new-tokens); lists are comma- or space-separated; one
option given under two of its names (--drafters A --drafter B) is refused.
Every run uses the same prompts, max_new_tokens, dtype and device. Within one temperature and prompt set, the
runs are interleaved per prompt (all methods on prompt 1, --repeats times in rotating order, then prompt 2, ...),
and every run of a prompt starts from the same seed. `ar` always runs: it is the reference for SR and for the
greedy exactness check. T = 0 is greedy; T > 0 is pure temperature sampling from the target (top-k, top-p and
min-p off, whatever the model's generation config says, unless --top_k / --top_p / --min_p are given). Every run
produces exactly max_new_tokens tokens unless --stop_at_eos. bench.json records the settings each temperature
passed to `generate` (settings.generation); its schema is in docs/bench.md.
"""
DESCRIPTION = f"{TITLE}\n\n{FIRST_EXAMPLES}\n{MORE_EXAMPLES}\n{LAST_EXAMPLES}\n\n{NOTES}"  # the full --help
SHORT_DESCRIPTION = f"{TITLE}\n\n{FIRST_EXAMPLES}\n{LAST_EXAMPLES}"  # --help
SHORT_USAGE = "%(prog)s [RECIPE.yaml] [options]  |  %(prog)s report BENCH.json [--output DIR]"

REPORT_DESCRIPTION = """\
Re-render bench.md and bench.png from a bench.json written by `hf-tev bench`, without running anything.
The markdown is the one the run wrote (byte for byte, with the same hf_tev)."""

# Every field of BenchConfig, in the order `--help` lists them (what users look for first at the top), with its help.
OPTIONS = {
    "target": "the target model: a Hub id or a folder (default: the tiny kit's target)",
    "drafters": f"DFlash drafters: kit names ({', '.join(KIT_DRAFTERS)}) or folders / Hub ids (default: the kit "
    "drafters present)",
    "methods": f"from {', '.join(METHODS)} (default: all; {REFERENCE_METHOD} is always added)",
    "budgets": "tree budgets: ints >= 0 and/or auto, the automatic budget (default: auto,4,16,64; 0: no tree, "
    "every cycle one plain target forward through hf_tev's loop)",
    "temperatures": "0: greedy; > 0: pure temperature sampling (default: 0,1; the paper's Table 3 is at 0.6)",
    "prompt_sets": f"from {', '.join(PROMPT_SETS)} (default: {', '.join(KIT_PROMPT_SETS)} on the kit, "
    f"{', '.join(PAPER_PROMPT_SETS)} with --target)",
    "max_prompts": "prompts per set, the first ones (default: 16)",
    "max_new_tokens": "tokens per run, exactly unless --stop_at_eos (default: 128)",
    "output": "folder for bench.json, bench.md and bench.png (default: bench_out)",
    "overwrite_output_dir": "replace the bench.json / bench.md / bench.png an earlier run left in --output "
    "(without it such a folder is refused before the run)",
    "assistant": "causal assistant for 'assisted', with the target's tokenizer (kit: assistant-ar)",
    "device": "default: cuda when available, else cpu",
    "dtype": "default: float32",
    "threads": "torch threads, >= 1 (default: 1 on CPU)",
    "repeats": "timed runs per prompt and method; the median is kept (default: 3)",
    "batch_sizes": "e.g. 1,4,8: the batch bench instead (prompts R at a time; hf_tev methods against batched ar)",
    "top_k": "top-k at T > 0 (default: off)",
    "top_p": "top-p at T > 0 (default: off)",
    "min_p": "min-p at T > 0 (default: off)",
    "stop_at_eos": "stop at EOS (default: exactly max_new_tokens)",
    "seed": "prompt i of every method runs from seed + i (default: 0)",
    "prompt_lookup_num_tokens": "prompt_lookup's n-gram draft length (default: 10)",
    "chat_template": "wrap prompts in the tokenizer's chat template when it has one (default: on; --no_chat_template)",
    "progress": "a progress bar (default: on; --no_progress)",
    "allow_pickle_target": "load a target (and assistant) without safetensors weights through transformers' "
    "weights_only pickle loading (default: safetensors only)",
}
LISTS = {
    "methods": str,
    "drafters": str,
    "budgets": None,
    "temperatures": float,
    "prompt_sets": str,
    "batch_sizes": int,
}
# `--help`: the options a first run sets, by group (the rest: `--help_all`), with shorter help for some.
SHORT_SECTIONS = (
    ("what to compare", ("target", "drafters", "methods", "budgets", "temperatures")),
    ("prompts", ("prompt_sets", "max_prompts", "max_new_tokens")),
    ("run", ("device", "dtype", "threads", "repeats", "output", "overwrite_output_dir")),
)
SHORT_HELPS = {  # one line each at 80 columns, but for the lists of names
    "target": "a Hub id or a folder (default: the kit's)",
    "drafters": "kit names, folders, Hub ids (default: kit's)",
    "methods": f"{', '.join(METHODS)} (default: all; {REFERENCE_METHOD} always runs)",
    "budgets": "ints >= 0, auto (default: auto,4,16,64)",
    "temperatures": "0: greedy; > 0: sampling (default: 0,1)",
    "prompt_sets": f"{', '.join(PROMPT_SETS)} (default: the kit's; the paper's with --target)",
    "max_prompts": "prompts per set (default: 16)",
    "max_new_tokens": "tokens per run (default: 128)",
    "repeats": "timed runs per prompt; the median is kept",
    "output": "folder of the results (default: bench_out)",
    "overwrite_output_dir": "replace an earlier run's files in --output",
}
EXTRA = {"drafters": {"aliases": ["--drafter"]}, "dtype": {"choices": sorted(DTYPES)}}


def _argument_field(name: str, kind) -> tuple:
    """The `BenchArguments` field of BenchConfig's field `name`: lists as strings (split below), booleans as flags,
    everything else optional (None: BenchConfig's default)."""
    metadata = {"help": OPTIONS[name], **EXTRA.get(name, {})}
    if name in LISTS:
        return name, list[str] | None, field(default=None, metadata=metadata)
    if kind is bool:
        default = next(f.default for f in fields(BenchConfig) if f.name == name)
        return name, bool, field(default=default, metadata=metadata)
    base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
    return name, base | None, field(default=None, metadata=metadata)


def _bench_arguments():
    """The dataclass `HfArgumentParser` parses: a field per entry of `OPTIONS` (every field of BenchConfig)."""
    hints = typing.get_type_hints(BenchConfig)
    return make_dataclass("BenchArguments", [_argument_field(name, hints[name]) for name in OPTIONS])


BenchArguments = _bench_arguments()


def _registry_listing() -> str:
    methods = "\n".join(f"  {name:<14} {method.description}" for name, method in METHODS.items())
    sets = "\n".join(f"  {name:<14} {prompt_set.description}" for name, prompt_set in PROMPT_SETS.items())
    return f"methods:\n{methods}\n\nprompt sets:\n{sets}"


def build_parser(prog="hf-tev bench", full: bool = True) -> argparse.ArgumentParser:
    """`HfArgumentParser` over `BenchArguments` (every field of `BenchConfig`). The full view's `--help` lists every
    option, method and prompt set; the short view's (`full=False`, what the command parses with) the examples and
    the options of `SHORT_SECTIONS`, and its `--help_all` prints the full view's. Both views parse alike."""
    from transformers import HfArgumentParser

    if full:
        view = dict(
            description=DESCRIPTION, epilog=_registry_listing(), formatter_class=argparse.RawDescriptionHelpFormatter
        )
    else:
        view = dict(usage=SHORT_USAGE, description=SHORT_DESCRIPTION, formatter_class=ShortHelpFormatter)
    parser = HfArgumentParser(BenchArguments, prog=prog, **view)
    add_help_all(parser, functools.partial(build_parser, prog))
    if not full:
        short_view(parser, SHORT_SECTIONS, SHORT_HELPS, prog)
    record_given_names(parser)  # --drafters A --drafter B is refused, not settled by keeping B
    return parser


def build_report_parser(prog="hf-tev bench report") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=REPORT_DESCRIPTION)
    parser.add_argument("json", type=Path, help=f"a {JSON_NAME} written by hf-tev bench, or the folder holding it")
    parser.add_argument(
        "--output", type=Path, default=None, help="folder for bench.md and bench.png (default: the folder of the json)"
    )
    parser.add_argument(
        "--overwrite_output_dir",
        "--overwrite-output-dir",
        action="store_true",
        help="replace the bench files of another run in --output (the json's own folder is always re-rendered)",
    )
    return parser


def _cast(name: str, item):
    """One item of list option `name`, as BenchConfig takes it."""
    if name == "budgets":
        if item == "auto" or isinstance(item, int):
            return item
        if isinstance(item, str) and item.strip().lstrip("-").isdigit():
            return int(item)
        raise ValueError(f"--budgets: {item!r} is neither an int nor auto")
    try:
        return LISTS[name](item)
    except (TypeError, ValueError):
        raise ValueError(f"--{name}: {item!r} is not {'a number' if LISTS[name] is float else 'an int'}") from None


def config_from_arguments(values: dict) -> BenchConfig:
    """`BenchConfig` from the parsed options (None: its default). List items may hold comma-separated values."""
    values = {name: value for name, value in values.items() if value is not None}
    for name in LISTS.keys() & values.keys():
        given = values[name] if isinstance(values[name], list) else [values[name]]
        items = [part for item in given for part in (item.split(",") if isinstance(item, str) else [item])]
        items = [item.strip() if isinstance(item, str) else item for item in items]
        values[name] = [_cast(name, item) for item in items if item != ""]
    for name, every in (("methods", list(METHODS)), ("prompt_sets", list(PROMPT_SETS))):  # "all": the default list
        if values.get(name) == ["all"]:
            values[name] = every
    return BenchConfig(**values)


RUN_LOCK = "_hf_tev_bench.lock"  # in --output while a run writes it: one run per folder


def parse_config(argv: list[str], prog: str = "hf-tev bench") -> BenchConfig:
    """The checked `BenchConfig` of a command line: options, a YAML / JSON file (first, or `--config FILE`) and
    options that override it; one option given under two of its names is refused."""
    parser = build_parser(prog, full=False)
    config, argv = split_config(parser, argv)
    if config is not None:
        try:
            apply_config(parser, config)
        except (ValueError, OSError) as error:
            parser.error(" ".join(str(error).split()))
    arguments, *unknown = parser.parse_args_into_dataclasses(
        args=argv, look_for_args_file=False, return_remaining_strings=True
    )
    if unknown and unknown[0]:
        parser.error(f"unrecognized arguments: {' '.join(unknown[0])}")
    try:  # every check that needs no model, before any is loaded
        refuse_names_given_twice(parser)
        config = config_from_arguments(vars(arguments))
        check_sources(config)
        check_output_folder(config.output, overwrite=config.overwrite_output_dir)
    except ValueError as error:
        parser.error(str(error))
    return config


def main(argv: list[str] | None = None, prog: str = "hf-tev bench") -> dict:
    """Run the bench (or, with `report` first, re-render a stored one) and return the JSON document."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["report"]:
        return report_main(argv[1:], prog=f"{prog} report")
    config = parse_config(argv, prog)
    with contextlib.ExitStack() as owned:
        try:  # one run per output folder: a second one is refused before any model loads
            owned.enter_context(owned_folder("--output", Path(config.output), RUN_LOCK, prog))
        except ValueError as error:
            build_parser(prog, full=False).error(str(error))
        document = run_bench(config)
        paths = write_outputs(document, config.output)
    print(markdown_report(document))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return document


def report_main(argv: list[str], prog: str = "hf-tev bench report") -> dict:
    parser = build_report_parser(prog)
    args = parser.parse_args(argv)
    if args.json.is_dir():  # the folder of a run: its bench.json
        args.json = args.json / JSON_NAME
    output = args.json.parent if args.output is None else args.output
    own_folder = Path(output).resolve() == args.json.resolve().parent  # re-rendering the json's own files
    try:
        document = read_document(args.json)
        check_output_folder(output, overwrite=own_folder or args.overwrite_output_dir, replaced=OUTPUT_NAMES)
    except ValueError as error:
        parser.error(str(error))
    paths = write_report(document, output)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return document
