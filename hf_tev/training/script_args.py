"""`hf-tev train` (also `python -m hf_tev.train`): train a DFlash drafter with `ExitTrainer` from the command line.

    hf-tev train --target Qwen/Qwen3-4B --drafter z-lab/Qwen3-4B-DFlash-b16 --target_dtype bfloat16 \\
        --prompts my_prompts.jsonl --apply_chat_template --max_new_tokens 512 --eval_size 32 \\
        --objective exit --tree_budget 32 --max_steps 2000 --output_dir out --push_to_hub --hub_model_id me/drafter
    hf-tev train recipe.yaml                       # a YAML / JSON file of the same names; flags after it override it
    hf-tev train --config recipe.yaml --max_steps 10
    torchrun --nproc_per_node 8 -m hf_tev.train recipe.yaml     # or: accelerate launch -m hf_tev.train recipe.yaml

Arguments: `ExitScriptArguments` (target, drafter, data, model card) and every field of `ExitTrainingArguments`
(the ExitTrain knobs and `transformers.TrainingArguments`), parsed by `transformers.HfArgumentParser`. Both flag
spellings work (`--eval_size`, `--eval-size`); trl's names are aliases: `--model_name_or_path` (the drafter, the
model trained), `--teacher_model_name_or_path` (the target), `--dataset_name`, `--dataset_config`,
`--dataset_train_split` (the prompts). One argument given under two names (`--drafter A --model_name_or_path B`) is
refused, naming both.

What it does, in order:
  1. checks what needs no model: the target and drafter folders (safetensors weights; `--allow_pickle_target`
     lets a target load from `pytorch_model.bin`), the data files (read now: a broken line is named with its file
     and line), the checkpoint to resume from, and with `--push_to_hub` the Hub (offline it stops here); then
     creates (or reuses) the Hub repo. A mistake found here, or while loading the models and data, is reported
     in one line (exit status 2);
  2. loads the target (`--target`: Hub id or folder, `--target_dtype`, `--attn_implementation`) and its
     tokenizer, then the drafter: `--drafter` (a checkpoint) or a fresh one from `--num_draft_layers`,
     `--block_size`, `--target_layer_ids` (`DFlashDraftModel.from_target`, seeded by `--seed`);
  3. training rows: `--train_data` (JSONL / JSON files of rows: `input_ids` + `prompt_length` or `loss_mask`),
     or `--prompts` (a .json / .jsonl / .txt file, or a `datasets` name or folder with `--prompts_split`,
     `--prompts_config`, `--prompt_column`) whose responses the target writes (`generate_training_data`) into
     `--data_dir` (default `<output_dir>/_data`): a rerun reads them back and resumes an interrupted generation;
  4. evaluation rows (optional): `--eval_data`, `--eval_prompts`, or the last `--eval_size` prompts (or rows);
     evaluations then report `eval_loss` and `eval_tau` (real tree decoding), and one runs after training;
  5. with `--feature_cache DIR` (objective "dflash" only), the target features of the rows are computed once
     into a `FeatureCache` and the training steps skip the target forward;
  6. trains (`--resume_from_checkpoint PATH` or `last`: a checkpoint without its optimizer.pt, scheduler.pt or
     trainer_state.json is refused), saves the drafter and its model card to `--output_dir` (the card carries
     the measured `eval_tau`), and with `--push_to_hub` uploads them.
Under `torchrun` / `accelerate launch`, the main process generates the rows (and fills the feature cache) first;
the others read them. The steps after it are `ExitTrainer`'s own.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..cli_options import apply_config, record_given_names, refuse_names_given_twice, split_config
from ..help_view import ShortHelpFormatter, add_help_all, short_view
from .inputs import PROMPT_COLUMNS

DTYPES = ("auto", "float32", "bfloat16", "float16")
USAGE = (
    "%(prog)s [RECIPE.yaml | --config RECIPE.yaml] --target TARGET (--train_data ROWS.jsonl ... | --prompts PROMPTS) "
    "[--output_dir DIR] [options]"
)
# `--help`: the options a first run sets, by group (the rest: `--help_all`), with shorter help for some.
SHORT_SECTIONS = (
    ("model", ("target", "drafter", "target_dtype", "draft_vocab_size")),
    ("data", ("train_data", "prompts", "apply_chat_template", "max_new_tokens", "eval_size")),
    ("training", ("max_steps", "learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps", "seed")),
    ("ExitTrain", ("objective", "tree_budget", "tree_weight", "anchors_per_sequence", "max_length")),
    ("output", ("output_dir", "resume_from_checkpoint", "push_to_hub", "hub_model_id")),
)
SHORT_HELPS = {  # one line each at 80 columns
    "target": "the target: a Hub id or a folder",
    "drafter": "a drafter to start from (default: fresh)",
    "target_dtype": "the target's and drafter's dtype",
    "draft_vocab_size": "draft only the N tokens the target writes most",
    "train_data": "JSONL / JSON files of rows (or --prompts)",
    "prompts": "prompts to answer: a file or datasets name",
    "apply_chat_template": "string prompts become a user turn",
    "max_new_tokens": "length of the responses",
    "eval_size": "hold out the last N for eval",
    "max_steps": "training steps (default: --num_train_epochs)",
    "learning_rate": "learning rate",
    "per_device_train_batch_size": "rows per device and step",
    "gradient_accumulation_steps": "steps per optimizer update",
    "seed": "seed of the run",
    "objective": "the loss",
    "tree_budget": "drafted nodes per tree",
    "tree_weight": "weight of the tree loss",
    "anchors_per_sequence": "drafted blocks per row",
    "max_length": "truncate rows to N tokens",
    "output_dir": "the drafter, its model card, the checkpoints",
    "resume_from_checkpoint": "a checkpoint folder, or last",
    "push_to_hub": "upload the drafter and its card",
    "hub_model_id": "the Hub repo (default: output folder name)",
}


@dataclass
class ExitScriptArguments:
    r"""
    What `hf-tev train` trains and on which data (the training itself: [`ExitTrainingArguments`]).

    Parameters:
        target (`str`): the target model, a Hub id or a folder (`AutoModelForCausalLM`), loaded from safetensors
            weights; alias `--teacher_model_name_or_path` (trl's name for the model distilled from).
        target_dtype (`str`, defaults to `"auto"`): `auto` (the checkpoint's), `float32`, `bfloat16`, `float16`.
            The drafter gets the same dtype.
        attn_implementation (`str`, defaults to `"sdpa"`): the target's attention (`sdpa` or `eager`; the tree
            pass needs a 4D mask).
        allow_pickle_target (`bool`, defaults to `False`): also load a target whose folder or repo has only pickle
            weights (`pytorch_model.bin`), through transformers' weights-only `torch.load`.
        trust_remote_code (`bool`, defaults to `False`): passed to the target's and tokenizer's loading.
        drafter (`str`, *optional*): a DFlash drafter checkpoint to start from (Hub id or folder, safetensors
            only; alias `--model_name_or_path`, trl's name for the trained model); without it, a fresh drafter is
            built from the target with the fields below.
        num_draft_layers (`int`, defaults to `1`), block_size (`int`, defaults to `16`), target_layer_ids
            (`list[int]`, *optional*, the publishers' rule), mask_token_id (`int`, *optional*): the fresh drafter.
        draft_vocab_size (`int`, *optional*): the drafter scores only this many of the target's tokens: the EOS
            ids and the ones the target writes most often in the training rows (`draft_vocab_from_rows`), set on a
            fresh drafter (or a checkpoint without one) once the rows are read. A checkpoint that has a draft
            vocabulary keeps it (it must be this size).
        train_data (`list[str]`, *optional*): JSONL / JSON files of training rows (`input_ids` and optionally
            `prompt_length` / `loss_mask`), concatenated; `max_train_rows` keeps the first N.
        prompts (`str`, *optional*): prompts whose responses the target writes: a .json (a list), .jsonl or .txt
            (one prompt per line) file, or a `datasets` name / folder (`prompts_config`, `prompts_split`); aliases
            `--dataset_name`, `--dataset_config`, `--dataset_train_split` (trl's names).
            Entries are strings, token-id lists, chat conversations (`[{"role", "content"}, ...]`: the turns
            before the first assistant turn) or dicts with `prompt_column` (default: the first of
            `PROMPT_COLUMNS` present). `max_prompts` keeps the first N.
        apply_chat_template (`bool`, defaults to `False`): string prompts become one user turn of the tokenizer's
            chat template.
        eval_data (`list[str]`, *optional*), eval_prompts (`str`, *optional*, split `eval_prompts_split`,
            defaults to `prompts_split`), eval_size (`int`, defaults to `0`): evaluation rows: files of rows,
            prompts answered by the target, or the last `eval_size` prompts (or training rows) held out.
        max_new_tokens (`int`, defaults to `512`), generation_batch_size (`int`, defaults to `8`),
            response_temperature (`float`, *optional*): the target's responses: `None` follows the target's
            generation config, 0 is greedy, above 0 pure temperature sampling (no top-k / top-p).
        data_dir (`str`, *optional*): where the responses are written (`train.jsonl`, `eval.jsonl` and their
            `.settings.json`) and read back by a rerun; default `<output_dir>/_data` (never uploaded).
        feature_cache (`str`, *optional*): a `FeatureCache` folder (objective `dflash`); `feature_cache_dtype`
            (defaults to `"float16"`) its storage dtype.
        card_target_name (`str`, *optional*): the target as the model card names it (default: `target`; a Hub id
            becomes the card's `base_model`). dataset_description (`str`, *optional*): the card's data text
            (default: written from the data arguments). card_license (defaults to `"apache-2.0"`),
            card_datasets (`list[str]`, *optional*; default: `prompts` when it is a Hub id): card metadata.
        threads (`int`, *optional*): `torch.set_num_threads`.
    """

    target: str = field(
        metadata={
            "help": "The target model: a Hub id or a folder (safetensors weights).",
            "aliases": ["--teacher_model_name_or_path", "--teacher-model-name-or-path"],
        }
    )
    target_dtype: str = field(
        default="auto", metadata={"help": "The target's (and drafter's) dtype.", "choices": list(DTYPES)}
    )
    attn_implementation: str = field(
        default="sdpa",
        metadata={"help": "The target's attention (the tree pass needs a 4D mask).", "choices": ["sdpa", "eager"]},
    )
    allow_pickle_target: bool = field(
        default=False,
        metadata={
            "help": "Also load a target that has only pickle weights (pytorch_model.bin), with transformers' "
            "weights-only unpickler; by default targets load from safetensors only."
        },
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Trust remote code of the target."})
    drafter: str | None = field(
        default=None,
        metadata={
            "help": "DFlash drafter checkpoint to start from (safetensors; default: a fresh drafter).",
            "aliases": ["--model_name_or_path", "--model-name-or-path"],
        },
    )
    num_draft_layers: int = field(default=1, metadata={"help": "Layers of a fresh drafter."})
    block_size: int = field(default=16, metadata={"help": "Block size of a fresh drafter (drafts block_size - 1)."})
    target_layer_ids: list[int] | None = field(
        default=None, metadata={"help": "Target layers a fresh drafter reads (default: the publishers' rule)."}
    )
    mask_token_id: int | None = field(default=None, metadata={"help": "Mask token of a fresh drafter."})
    draft_vocab_size: int | None = field(
        default=None,
        metadata={"help": "Score only the N tokens the target writes most often in the rows (default: all)."},
    )
    train_data: list[str] | None = field(
        default=None, metadata={"help": "JSONL / JSON files of training rows (input_ids, prompt_length/loss_mask)."}
    )
    max_train_rows: int | None = field(default=None, metadata={"help": "Use the first N training rows only."})
    prompts: str | None = field(
        default=None,
        metadata={
            "help": "Prompts the target answers: a .json/.jsonl/.txt file or a datasets name or folder.",
            "aliases": ["--dataset_name", "--dataset-name"],
        },
    )
    prompts_config: str | None = field(
        default=None,
        metadata={"help": "The datasets config of --prompts.", "aliases": ["--dataset_config", "--dataset-config"]},
    )
    prompts_split: str = field(
        default="train",
        metadata={
            "help": "The datasets split of --prompts.",
            "aliases": ["--dataset_train_split", "--dataset-train-split"],
        },
    )
    prompt_column: str | None = field(
        default=None, metadata={"help": f"Column of the prompts (default: the first of {', '.join(PROMPT_COLUMNS)})."}
    )
    max_prompts: int | None = field(default=None, metadata={"help": "Use the first N prompts only."})
    apply_chat_template: bool = field(
        default=False, metadata={"help": "String prompts become one user turn of the chat template."}
    )
    eval_data: list[str] | None = field(default=None, metadata={"help": "JSONL / JSON files of evaluation rows."})
    eval_prompts: str | None = field(
        default=None, metadata={"help": "Evaluation prompts the target answers (same forms as --prompts)."}
    )
    eval_prompts_split: str | None = field(
        default=None, metadata={"help": "The datasets split of --eval_prompts (default: --prompts_split)."}
    )
    eval_size: int = field(
        default=0, metadata={"help": "Hold out the last N prompts (or training rows) as the evaluation set."}
    )
    max_new_tokens: int = field(default=512, metadata={"help": "Length limit of the target's responses."})
    generation_batch_size: int = field(default=8, metadata={"help": "Prompts per target generate call."})
    response_temperature: float | None = field(
        default=None,
        metadata={"help": "Responses: None = the target's generation config, 0 = greedy, > 0 = pure sampling."},
    )
    data_dir: str | None = field(
        default=None, metadata={"help": "Where responses are written and resumed (default: <output_dir>/_data)."}
    )
    feature_cache: str | None = field(
        default=None, metadata={"help": "FeatureCache folder of the target features (objective dflash)."}
    )
    feature_cache_dtype: str = field(
        default="float16",
        metadata={"help": "Storage dtype of the feature cache.", "choices": ["float16", "bfloat16", "float32"]},
    )
    card_target_name: str | None = field(
        default=None, metadata={"help": "The target as the model card names it (default: --target)."}
    )
    dataset_description: str | None = field(
        default=None, metadata={"help": "The model card's data text (default: written from the data arguments)."}
    )
    card_license: str = field(default="apache-2.0", metadata={"help": "The model card's license."})
    card_datasets: list[str] | None = field(
        default=None, metadata={"help": "Hub dataset ids for the card's metadata (default: --prompts if a Hub id)."}
    )
    threads: int | None = field(default=None, metadata={"help": "torch.set_num_threads (default: torch's)."})

    def __post_init__(self):
        sources = [name for name in ("train_data", "prompts") if getattr(self, name)]
        if len(sources) != 1:
            raise ValueError(
                "give the training data as exactly one of --train_data (rows) or --prompts (answered by the target)"
                + (f"; got both {sources}" if sources else "")
            )
        if self.eval_size < 0:
            raise ValueError(f"eval_size must be >= 0, got {self.eval_size}")
        if self.response_temperature is not None and self.response_temperature < 0:
            raise ValueError(f"response_temperature must be None or >= 0, got {self.response_temperature}")
        size = self.draft_vocab_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"--draft_vocab_size must be an int >= 1 (tokens the drafter scores), got {size!r}")
        if self.drafter is not None and self.target_layer_ids is not None:
            raise ValueError("--target_layer_ids builds a fresh drafter; a --drafter checkpoint keeps its own layers")


# ----------------------------------------------------------------------------------------------
# The parser


def build_parser(prog: str = "hf-tev train", full: bool = True):
    """`HfArgumentParser` over `(ExitScriptArguments, ExitTrainingArguments)`. The full view's `--help` shows this
    module's text, then this script's options, the ExitTrain knobs and the inherited `TrainingArguments`, in that
    order; the short view's (`full=False`, what the command parses with) shows the examples and the options of
    `SHORT_SECTIONS`, and its `--help_all` prints the full view's. Both views parse alike."""
    from transformers import HfArgumentParser

    from .exit_config import ExitTrainingArguments

    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    parser = HfArgumentParser(
        (ExitScriptArguments, ExitTrainingArguments),
        prog=prog,
        usage=USAGE,
        description=__doc__ if full else "\n\n".join(__doc__.split("\n\n")[:2]),  # the title and the examples
        formatter_class=Formatter if full else ShortHelpFormatter,
    )
    add_help_all(parser, functools.partial(build_parser, prog))
    if full:
        _group_options(parser, _full_sections())
    else:
        short_view(parser, SHORT_SECTIONS, SHORT_HELPS, prog)
    record_given_names(parser)
    return parser


def _full_sections() -> list[tuple[str, str, set[str]]]:
    """`(title, text, argument names)` of the full view's groups: this script's, ExitTrain's, TrainingArguments'."""
    from transformers import TrainingArguments

    from .exit_config import ExitTrainingArguments

    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    exit_knobs = {f.name for f in dataclasses.fields(ExitTrainingArguments)} - inherited
    exit_knobs |= {"learning_rate", "remove_unused_columns"}  # inherited, with ExitTrain's own defaults
    return [
        ("script options", "What to train, on which data, and the model card.", _field_names(ExitScriptArguments)),
        ("ExitTrain options", "The objective and its knobs (ExitTrainingArguments).", exit_knobs),
        ("training options", "transformers.TrainingArguments, inherited by ExitTrainingArguments.", inherited),
    ]


def _field_names(dataclass_type) -> set[str]:
    return {f.name for f in dataclasses.fields(dataclass_type)}


def _group_options(parser, sections) -> None:
    """Move the parser's options into one argument group per section, in order (`--help` prints groups in order)."""
    options = parser._optionals  # the default group: only -h stays in it
    groups = [(parser.add_argument_group(title, text), names) for title, text, names in sections]
    for action in list(options._group_actions):
        group = next((g for g, names in groups if action.dest in names), None)
        if group is not None:
            options._group_actions.remove(action)
            group._group_actions.append(action)


def parse_args(argv: Sequence[str] | None = None, prog: str = "hf-tev train"):
    """`(ExitScriptArguments, ExitTrainingArguments)` from flags, a config file (`FILE.yaml|yml|json` as the first
    argument, or `--config FILE`) or both: flags override the file. The file may use the aliases too."""
    parser = build_parser(prog, full=False)
    config, argv = split_config(parser, sys.argv[1:] if argv is None else argv)
    if config is not None:
        apply_config(parser, config)
    script_args, training_args = parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False)
    refuse_names_given_twice(parser)
    return script_args, training_args
