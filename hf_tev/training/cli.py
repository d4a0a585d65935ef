"""`hf-tev train` (also `python -m hf_tev.train`): train a DFlash drafter with `ExitTrainer` from the command line.

    hf-tev train --target Qwen/Qwen3-4B --drafter z-lab/Qwen3-4B-DFlash-b16 --target_dtype bfloat16 \\
        --prompts my_prompts.jsonl --apply_chat_template --max_new_tokens 512 --eval_size 32 \\
        --objective exit --tree_budget 32 --max_steps 2000 --output_dir out --push_to_hub --hub_model_id me/drafter
    hf-tev train recipe.yaml                       # a YAML / JSON file of the same names; flags after it override it
    hf-tev train --config recipe.yaml --max_steps 10
    torchrun --nproc_per_node 8 -m hf_tev.train recipe.yaml     # or: accelerate launch -m hf_tev.train recipe.yaml

Arguments: `ExitScriptArguments` (target, drafter, data, model card; below) and every field of
`ExitTrainingArguments` (the ExitTrain knobs and `transformers.TrainingArguments`), parsed by
`transformers.HfArgumentParser`.

What it does, in order:
  1. with `--push_to_hub`, creates (or reuses) the Hub repo first: offline, or without access, it fails before
     anything is loaded, generated or written;
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
  6. trains (`--resume_from_checkpoint PATH` or `last`), saves the drafter and its model card to `--output_dir`
     (the card carries the measured `eval_tau`), and with `--push_to_hub` uploads them.
Under `torchrun` / `accelerate launch`, the main process generates the rows (and fills the feature cache) first;
the others read them. The steps after it are `ExitTrainer`'s own.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Text columns a prompt is read from when `--prompt_column` is not given, in this order.
PROMPT_COLUMNS = ("prompt", "text", "question", "instruction", "input", "messages", "conversations")
DTYPES = ("auto", "float32", "bfloat16", "float16")
TRAIN_ROWS, EVAL_ROWS = "train.jsonl", "eval.jsonl"


@dataclass
class ExitScriptArguments:
    r"""
    What `hf-tev train` trains and on which data (the training itself: [`ExitTrainingArguments`]).

    Parameters:
        target (`str`): the target model, a Hub id or a folder (`AutoModelForCausalLM`).
        target_dtype (`str`, defaults to `"auto"`): `auto` (the checkpoint's), `float32`, `bfloat16`, `float16`.
            The drafter gets the same dtype.
        attn_implementation (`str`, defaults to `"sdpa"`): the target's attention (`sdpa` or `eager`; the tree
            pass needs a 4D mask).
        trust_remote_code (`bool`, defaults to `False`): passed to the target's and tokenizer's loading.
        drafter (`str`, *optional*): a DFlash drafter checkpoint to start from (Hub id or folder); without it, a
            fresh drafter is built from the target with the three fields below.
        num_draft_layers (`int`, defaults to `1`), block_size (`int`, defaults to `16`), target_layer_ids
            (`list[int]`, *optional*, the publishers' rule), mask_token_id (`int`, *optional*): the fresh drafter.
        train_data (`list[str]`, *optional*): JSONL / JSON files of training rows (`input_ids` and optionally
            `prompt_length` / `loss_mask`), concatenated; `max_train_rows` keeps the first N.
        prompts (`str`, *optional*): prompts whose responses the target writes: a .json (a list), .jsonl or .txt
            (one prompt per line) file, or a `datasets` name / folder (`prompts_config`, `prompts_split`).
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

    target: str = field(metadata={"help": "The target model: a Hub id or a folder."})
    target_dtype: str = field(
        default="auto", metadata={"help": "The target's (and drafter's) dtype.", "choices": list(DTYPES)}
    )
    attn_implementation: str = field(
        default="sdpa",
        metadata={"help": "The target's attention (the tree pass needs a 4D mask).", "choices": ["sdpa", "eager"]},
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Trust remote code of the target."})
    drafter: str | None = field(
        default=None, metadata={"help": "DFlash drafter checkpoint to start from (default: a fresh drafter)."}
    )
    num_draft_layers: int = field(default=1, metadata={"help": "Layers of a fresh drafter."})
    block_size: int = field(default=16, metadata={"help": "Block size of a fresh drafter (drafts block_size - 1)."})
    target_layer_ids: list[int] | None = field(
        default=None, metadata={"help": "Target layers a fresh drafter reads (default: the publishers' rule)."}
    )
    mask_token_id: int | None = field(default=None, metadata={"help": "Mask token of a fresh drafter."})
    train_data: list[str] | None = field(
        default=None, metadata={"help": "JSONL / JSON files of training rows (input_ids, prompt_length/loss_mask)."}
    )
    max_train_rows: int | None = field(default=None, metadata={"help": "Use the first N training rows only."})
    prompts: str | None = field(
        default=None,
        metadata={"help": "Prompts the target answers: a .json/.jsonl/.txt file or a datasets name or folder."},
    )
    prompts_config: str | None = field(default=None, metadata={"help": "The datasets config of --prompts."})
    prompts_split: str = field(default="train", metadata={"help": "The datasets split of --prompts."})
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
        if self.drafter is not None and self.target_layer_ids is not None:
            raise ValueError("--target_layer_ids builds a fresh drafter; a --drafter checkpoint keeps its own layers")


# ----------------------------------------------------------------------------------------------
# Arguments


def build_parser(prog: str = "hf-tev train"):
    """`HfArgumentParser` over `(ExitScriptArguments, ExitTrainingArguments)`; `--help` shows this module's text."""
    import argparse

    from transformers import HfArgumentParser

    from .exit_config import ExitTrainingArguments

    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    return HfArgumentParser(
        (ExitScriptArguments, ExitTrainingArguments), prog=prog, description=__doc__, formatter_class=Formatter
    )


def parse_args(argv: Sequence[str] | None = None, prog: str = "hf-tev train"):
    """`(ExitScriptArguments, ExitTrainingArguments)` from flags, a config file (`FILE.yaml|yml|json` as the first
    argument, or `--config FILE`) or both: flags override the file."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    config = None
    if "--config" in argv:
        at = argv.index("--config")
        if at + 1 >= len(argv):
            parser.error("--config needs a file")
        config, argv = argv[at + 1], argv[:at] + argv[at + 2 :]
    elif argv and not argv[0].startswith("-") and argv[0].endswith((".yaml", ".yml", ".json")):
        config, argv = argv[0], argv[1:]
    if config is not None:
        values = read_config(config)
        known = {action.dest for action in parser._actions}
        unknown = sorted(set(values) - known)
        if unknown:
            parser.error(f"{config}: unknown arguments {unknown}")
        parser.set_defaults(**values)
        for action in parser._actions:
            if action.dest in values:
                action.required = False
    script_args, training_args = parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False)
    return script_args, training_args


def read_config(path) -> dict[str, Any]:
    """A YAML or JSON mapping of argument names to values."""
    text = Path(path).read_text(encoding="utf-8")
    if str(path).endswith(".json"):
        values = json.loads(text)
    else:
        import yaml

        values = yaml.safe_load(text) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{path} must hold a mapping of argument names to values, got {type(values).__name__}")
    return values


# ----------------------------------------------------------------------------------------------
# Data


def read_rows(paths: Sequence[str], limit: int | None = None) -> list[dict[str, Any]]:
    """Rows from JSONL files (one JSON object a line) or JSON files (a list of objects), concatenated."""
    rows = []
    for path in paths:
        text = Path(path).read_text(encoding="utf-8")
        if str(path).endswith(".json"):
            loaded = json.loads(text)
            if not isinstance(loaded, list):
                raise ValueError(f"{path} must hold a JSON list of rows, got {type(loaded).__name__}")
            rows += loaded
        else:
            rows += [json.loads(line) for line in text.splitlines() if line.strip()]
    return rows[:limit] if limit is not None else rows


def read_prompts(
    source: str, split: str = "train", config: str | None = None, column: str | None = None, limit: int | None = None
) -> list:
    """Prompts (strings, token-id lists or chat conversations) from a .json / .jsonl / .txt file or a `datasets`
    name or folder (`datasets.load_dataset(source, config, split=split)`)."""
    path = Path(source)
    if path.is_file() and path.suffix in (".json", ".jsonl", ".txt"):
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".txt":
            items = [line for line in text.splitlines() if line.strip()]
        elif path.suffix == ".json":
            items = json.loads(text)
            if not isinstance(items, list):
                raise ValueError(f"{source} must hold a JSON list of prompts, got {type(items).__name__}")
        else:
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        try:
            import datasets
        except ImportError as error:
            raise ImportError(f"reading prompts from {source!r} needs `pip install datasets`") from error
        items = datasets.load_dataset(source, config, split=split)
    prompts = []
    for index, item in enumerate(items):
        if limit is not None and len(prompts) >= limit:
            break
        if isinstance(item, dict):
            name = column or next((c for c in PROMPT_COLUMNS if c in item), None)
            if name is None or name not in item:
                wanted = repr(column) if column else "among " + ", ".join(PROMPT_COLUMNS)
                raise ValueError(
                    f"{source} entry {index} has no prompt column {wanted}; it has {sorted(item)} "
                    "(pass --prompt_column)"
                )
            item = item[name]
        if isinstance(item, str) and not item.strip():
            raise ValueError(f"{source} entry {index} is an empty prompt")
        prompts.append(item)
    if not prompts:
        raise ValueError(f"{source} holds no prompts")
    return prompts


def _response_kwargs(temperature: float | None) -> dict[str, Any]:
    if temperature is None:
        return {}
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


# ----------------------------------------------------------------------------------------------
# The run


@dataclass
class TrainingData:
    """The datasets of a run: the checked training and evaluation rows (with their cached features when a
    feature cache is used), how many training rows there are, and a description for the model card."""

    train_dataset: Any
    eval_dataset: Any
    num_train_rows: int
    description: str


def run(script: ExitScriptArguments, args):
    """Load, generate, train, save (and push); returns the `ExitTrainer` after training."""
    import torch

    if script.threads is not None:
        torch.set_num_threads(script.threads)
    if script.feature_cache is not None and args.objective != "dflash":
        raise ValueError(
            f"--feature_cache serves objective 'dflash' only; objective {args.objective!r} scores its trees "
            "against the target's own K/V and runs the target anyway"
        )
    # 1. The Hub repo first: offline or without access this fails before anything is loaded or written.
    if args.push_to_hub and args.process_index == 0:
        create_hub_repo(args)
    target, drafter, tokenizer = load_models(script, args)  # 2.
    data = load_data(script, args, target, drafter, tokenizer)  # 3-5.
    return train_and_publish(script, args, target, drafter, tokenizer, data)  # 6.


def create_hub_repo(args) -> None:
    """Create (or reuse) the Hub repo `--hub_model_id` (default: the output folder's name)."""
    from . import hub

    repo_id = args.hub_model_id or Path(args.output_dir).absolute().name
    hub.hub_api(args.hub_token).create_repo(repo_id, private=args.hub_private_repo, exist_ok=True)


def load_models(script: ExitScriptArguments, args):
    """`(target, drafter, tokenizer or None)`: the target on the training device, its tokenizer when it has one,
    and the drafter: a checkpoint, or a fresh one built from the target (seeded like the training)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    from ..modeling_dflash import DFlashDraftModel

    set_seed(args.seed)
    dtype = script.target_dtype if script.target_dtype == "auto" else getattr(torch, script.target_dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(script.target, trust_remote_code=script.trust_remote_code)
    except (OSError, ValueError):
        tokenizer = None  # token-id prompts and rows need none
    target = AutoModelForCausalLM.from_pretrained(
        script.target,
        dtype=dtype,
        attn_implementation=script.attn_implementation,
        trust_remote_code=script.trust_remote_code,
    )
    target = target.to(args.device).eval()
    if script.drafter is not None:
        drafter = DFlashDraftModel.from_pretrained(script.drafter, dtype=target.dtype)
    else:
        drafter = DFlashDraftModel.from_target(
            target,
            num_layers=script.num_draft_layers,
            block_size=script.block_size,
            mask_token_id=script.mask_token_id,
            target_layer_ids=script.target_layer_ids,
        )
    drafter.check_target(target)
    return target, drafter, tokenizer


def load_data(script: ExitScriptArguments, args, target, drafter, tokenizer) -> TrainingData:
    """The rows, read or written by the target (the main process first; the others read its files), checked, and
    with `--feature_cache` their target features computed into the cache."""
    import torch

    from .data import check_rows
    from .features import CachedFeatureDataset, FeatureCache

    vocab_size = target.get_input_embeddings().weight.shape[0]
    data_dir = Path(script.data_dir or Path(args.output_dir) / "_data")
    with args.main_process_first(local=args.save_on_each_node, desc="training rows"):
        train_rows, eval_rows, description = _rows(script, args, target, tokenizer, data_dir)
        train_rows = check_rows(train_rows, "train_dataset", vocab_size, args.max_length)
        eval_rows = check_rows(eval_rows, "eval_dataset", vocab_size, args.max_length) if eval_rows else None
        data = TrainingData(train_rows, eval_rows, len(train_rows), description)
        if script.feature_cache is not None:
            cache = FeatureCache(
                script.feature_cache, target, drafter, getattr(torch, script.feature_cache_dtype), args.max_length
            )
            cache.update(train_rows + (eval_rows or []), show_progress=not args.disable_tqdm)
            data.train_dataset = CachedFeatureDataset(train_rows, cache)
            data.eval_dataset = CachedFeatureDataset(eval_rows, cache) if eval_rows else None
    return data


def train_and_publish(script: ExitScriptArguments, args, target, drafter, tokenizer, data: TrainingData):
    """Train (resuming `--resume_from_checkpoint`), evaluate, save the drafter and its model card (and push them);
    the main process prints a one-line summary. Returns the trainer."""
    from transformers.trainer_utils import get_last_checkpoint

    from . import hub
    from .trainer import ExitTrainer

    trainer = ExitTrainer(
        model=drafter,
        target_model=target,
        args=args,
        train_dataset=data.train_dataset,
        eval_dataset=data.eval_dataset,
        processing_class=tokenizer,
    )
    resume = args.resume_from_checkpoint
    if resume == "last":
        resume = get_last_checkpoint(args.output_dir)
        if resume is None:
            raise ValueError(f"--resume_from_checkpoint last: no checkpoint in {args.output_dir}")
    trainer.train(resume_from_checkpoint=resume)
    if data.eval_dataset is not None:
        trainer.evaluate()
    hub_prompts = [script.prompts] if script.prompts and hub.is_hub_id(script.prompts) else None
    card = dict(
        target_model_id=script.card_target_name or script.target,
        dataset_description=script.dataset_description or data.description,
        license=script.card_license,
        datasets=script.card_datasets or hub_prompts,
    )
    if args.push_to_hub:
        trainer.push_to_hub(**card)
    else:
        trainer.save_model()
        trainer.create_model_card(repo_id=args.hub_model_id or args.output_dir, **card)
    if trainer.is_world_process_zero():
        summary = {"output_dir": args.output_dir, "steps": trainer.state.global_step, "train_rows": data.num_train_rows}
        summary |= {key: value for key, value in (trainer.state.log_history or [{}])[-1].items() if "tau" in key}
        summary |= {"total_flos": trainer.state.total_flos}
        print(f"hf-tev train: saved the drafter and its model card: {json.dumps(summary)}", flush=True)
    return trainer


def _rows(script, args, target, tokenizer, data_dir: Path):
    """`(train_rows, eval_rows or None, a description of the data for the model card)`."""
    answer = _responder(script, args, target, tokenizer, data_dir)
    if script.prompts is not None:
        prompts = read_prompts(
            script.prompts, script.prompts_split, script.prompts_config, script.prompt_column, script.max_prompts
        )
        train_prompts, held_out = _hold_out(prompts, script.eval_size, "prompts")
        train_rows = answer(train_prompts, TRAIN_ROWS, f"{script.prompts} (split {script.prompts_split})")
        description = (
            f"{len(train_rows)} prompts of `{script.prompts}` (split `{script.prompts_split}`) with responses "
            f"written by the target ({_responses_text(script.response_temperature)}, at most "
            f"{script.max_new_tokens} new tokens)."
        )
    else:
        train_rows, held_out = _hold_out(read_rows(script.train_data, script.max_train_rows), script.eval_size, "rows")
        files = ", ".join(f"`{Path(path).name}`" for path in script.train_data)
        description = f"{len(train_rows)} target-written rows from {files}."
    eval_rows = None
    if script.eval_data:
        eval_rows = read_rows(script.eval_data)
    elif script.eval_prompts is not None:
        split = script.eval_prompts_split or script.prompts_split
        eval_prompts = read_prompts(script.eval_prompts, split, script.prompts_config, script.prompt_column)
        eval_rows = answer(eval_prompts, EVAL_ROWS, f"{script.eval_prompts} (split {split})")
    elif held_out and script.prompts is not None:
        eval_rows = answer(held_out, EVAL_ROWS, f"{script.prompts}: the last {len(held_out)} prompts")
    elif held_out:
        eval_rows = held_out
    if eval_rows:
        description += f" Evaluated on {len(eval_rows)} held-out rows."
    return train_rows, eval_rows, description


def _hold_out(items: list, eval_size: int, what: str) -> tuple[list, list]:
    """`(items to train on, the last eval_size items)`; at least one item must be left to train on."""
    if eval_size >= len(items):
        raise ValueError(f"--eval_size {eval_size} leaves none of the {len(items)} {what} to train on")
    return items[: len(items) - eval_size], items[len(items) - eval_size :] if eval_size else []


def _responder(script, args, target, tokenizer, data_dir: Path):
    """`answer(prompts, file name, source)`: the rows of `prompts` with the target's responses
    (`generate_training_data`), written to `data_dir / name` and resumed from it by a rerun."""
    from .data_generation import generate_training_data

    def answer(prompts, name: str, source: str):
        return generate_training_data(
            target,
            prompts,
            tokenizer=tokenizer,
            max_new_tokens=script.max_new_tokens,
            batch_size=script.generation_batch_size,
            apply_chat_template=script.apply_chat_template,
            show_progress=not args.disable_tqdm,
            output_path=data_dir / name,
            metadata={"prompts": source, "seed": args.seed},
            **_response_kwargs(script.response_temperature),
        )

    return answer


def _responses_text(temperature: float | None) -> str:
    if temperature is None:
        return "the target's generation config"
    return "greedy" if temperature == 0 else f"sampled at temperature {temperature:g}"


def main(argv: Sequence[str] | None = None, prog: str = "hf-tev train") -> None:
    script, args = parse_args(argv, prog)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run(script, args)
