"""`hf-tev train` (also `python -m hf_tev.train`): the run itself. Its arguments, parser and `--help` text are in
`script_args` (`ExitScriptArguments`, `parse_args`); the files it reads and the model folders it checks, in `inputs`.

`run(script, args)` raises what goes wrong; `main` (the command) reports a mistake found before training starts
(in the arguments, the files, the checkpoint to resume from, the Hub access, loading the models or the data) in
one line on stderr, with exit status 2, and lets errors during training raise.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cli_options import owned_folder, read_config
from ..config import temperature_sampling
from .inputs import PROMPT_COLUMNS, check_model_roles, check_model_source, read_prompts, read_rows
from .script_args import ExitScriptArguments, build_parser, parse_args

__all__ = [
    "PROMPT_COLUMNS",
    "ExitScriptArguments",
    "Sources",
    "TrainingData",
    "build_parser",
    "load_data",
    "load_training_models",
    "main",
    "parse_args",
    "prepare",
    "read_config",
    "read_prompts",
    "read_rows",
    "run",
    "train_and_publish",
]
TRAIN_ROWS, EVAL_ROWS = "train.jsonl", "eval.jsonl"
# Held by the run that owns an output folder (and a `--data_dir` outside it); "_" keeps it out of Hub uploads.
RUN_LOCK = "_hf_tev_train.lock"
PICKLE_TARGET_HINT = (
    "hf-tev train loads targets from safetensors only. Convert the folder (load it once and save_pretrained: "
    "transformers writes safetensors), or pass --allow_pickle_target to load it with transformers' weights-only "
    "unpickler"
)
PICKLE_DRAFTER_HINT = "DFlash drafters load from safetensors only (save_pretrained writes model.safetensors)"


def _response_kwargs(temperature: float | None) -> dict[str, Any]:
    """`generate`'s sampling arguments of the target's responses: its generation config's at None, else pure
    temperature sampling (`hf_tev.config.temperature_sampling`)."""
    return {} if temperature is None else temperature_sampling(temperature)


# ----------------------------------------------------------------------------------------------
# The run


@dataclass
class Sources:
    """What a run trains and evaluates on, read before any model is loaded: the training rows (`--train_data`) or
    prompts (`--prompts`), the last `--eval_size` of them held out, the evaluation rows (`--eval_data`) or prompts
    (`--eval_prompts`), and the checked checkpoint to resume from."""

    train: list
    held_out: list
    eval_rows: list | None
    eval_prompts: list | None
    resume: str | None


@dataclass
class TrainingData:
    """The datasets of a run: the checked training and evaluation rows (with their cached features when a
    feature cache is used), how many training rows there are, and a description for the model card."""

    train_dataset: Any
    eval_dataset: Any
    num_train_rows: int
    description: str


def run(script: ExitScriptArguments, args):
    """Check and read the inputs, load, generate, train, save (and push); returns the `ExitTrainer` after
    training. Raises what goes wrong (`main` reports the mistakes found before training in one line)."""
    with run_folders_lock(script, args):  # 0. one run at a time per output folder
        sources = prepare(script, args)  # 1.
        target, drafter, tokenizer = load_training_models(script, args)  # 2.
        data = load_data(script, args, target, drafter, tokenizer, sources)  # 3-5.
        return train_and_publish(script, args, target, drafter, tokenizer, data, sources.resume)  # 6.


def run_folders_lock(script: ExitScriptArguments, args):
    """The locks of the folders a run writes, held for the whole run: `--output_dir`, and `--data_dir` where it is
    given (the rows written from prompts are appended there). Taken by the main process (the others of a
    distributed run write nothing of their own there); a folder another run holds is refused at once."""
    if args.process_index != 0:
        return nullcontext()
    folders = [("--output_dir", Path(args.output_dir))]
    if script.data_dir is not None:
        folders.append(("--data_dir", Path(script.data_dir)))
    stack = ExitStack()
    try:
        for option, folder in folders:
            stack.enter_context(owned_folder(option, folder, RUN_LOCK, "hf-tev train"))
    except BaseException:
        stack.close()
        raise
    return stack


def prepare(script: ExitScriptArguments, args) -> Sources:
    """Everything that needs no model, in order: the argument combinations, the Hub when pushing (offline fails
    here), the target and drafter folders, the checkpoint to resume from, the data files; then the Hub repo is
    created (or reused), so that without access the run fails before anything is loaded or written."""
    import torch

    if script.threads is not None:
        torch.set_num_threads(script.threads)
    if script.feature_cache is not None and args.objective != "dflash":
        raise ValueError(
            f"--feature_cache serves objective 'dflash' only; objective {args.objective!r} scores its trees "
            "against the target's own K/V and runs the target anyway"
        )
    if args.push_to_hub:
        check_online()
    check_model_source("--target", script.target, script.allow_pickle_target, PICKLE_TARGET_HINT)
    if script.drafter is not None:
        check_model_source("--drafter", script.drafter, False, PICKLE_DRAFTER_HINT)
    check_model_roles(script.target, script.drafter)  # a target given as the drafter (trl's habit), or the reverse
    resume = resume_checkpoint(args)
    sources = read_sources(script, resume)
    if args.push_to_hub and args.process_index == 0:
        create_hub_repo(args)
    return sources


def check_online() -> None:
    """`--push_to_hub` needs the Hub: refuse offline mode (`HF_HUB_OFFLINE`) before anything is done."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise ValueError(
            "--push_to_hub needs the Hugging Face Hub, but offline mode is on (HF_HUB_OFFLINE=1): unset it, or train "
            "without --push_to_hub and upload the output folder later"
        )


def resume_checkpoint(args) -> str | None:
    """The checked checkpoint of `--resume_from_checkpoint` (`last`: the newest in `--output_dir`), or None."""
    from transformers.trainer_utils import get_last_checkpoint

    from .checkpoints import check_checkpoint, check_checkpoint_settings

    resume = args.resume_from_checkpoint
    if resume is None:
        return None
    if resume == "last":
        resume = get_last_checkpoint(args.output_dir) if Path(args.output_dir).is_dir() else None
        if resume is None:
            raise ValueError(f"--resume_from_checkpoint last: no checkpoint in {args.output_dir}")
    check_checkpoint(resume, optimizer=not (args.deepspeed or args.fsdp))
    check_checkpoint_settings(resume, args)
    return str(resume)


def read_sources(script: ExitScriptArguments, resume: str | None) -> Sources:
    """The rows or prompts of the run, read from their files (or `datasets`), the evaluation ones held out."""
    if script.prompts is not None:
        prompts = read_prompts(
            script.prompts, script.prompts_split, script.prompts_config, script.prompt_column, script.max_prompts
        )
        train, held_out = _hold_out(prompts, script.eval_size, "prompts", script.prompts)
    else:
        rows = read_rows(script.train_data, script.max_train_rows)
        train, held_out = _hold_out(rows, script.eval_size, "rows", ", ".join(script.train_data))
    eval_rows = read_rows(script.eval_data) if script.eval_data else None
    eval_prompts = None
    if not script.eval_data and script.eval_prompts is not None:
        split = script.eval_prompts_split or script.prompts_split
        eval_prompts = read_prompts(script.eval_prompts, split, script.prompts_config, script.prompt_column)
    return Sources(train, held_out, eval_rows, eval_prompts, resume)


def create_hub_repo(args) -> None:
    """Create (or reuse) the Hub repo `--hub_model_id` (default: the output folder's name)."""
    from . import hub

    repo_id = args.hub_model_id or Path(args.output_dir).absolute().name
    hub.hub_api(args.hub_token).create_repo(repo_id, private=args.hub_private_repo, exist_ok=True)


def load_training_models(script: ExitScriptArguments, args):
    """`(target, drafter, tokenizer or None)`: the target on the training device (safetensors weights unless
    `--allow_pickle_target`), its tokenizer when it has one, and the drafter: a checkpoint, or a fresh one built
    from the target (seeded like the training)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    from ..models.dflash.modeling_dflash import DFlashDraftModel

    check_model_roles(script.target, script.drafter, hub=True)  # a Hub id given in the other's place, named
    set_seed(args.seed)
    dtype = script.target_dtype if script.target_dtype == "auto" else getattr(torch, script.target_dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(script.target, trust_remote_code=script.trust_remote_code)
    except (OSError, ValueError):
        tokenizer = None  # token-id prompts and rows need none
    try:
        target = AutoModelForCausalLM.from_pretrained(
            script.target,
            dtype=dtype,
            attn_implementation=script.attn_implementation,
            trust_remote_code=script.trust_remote_code,
            use_safetensors=None if script.allow_pickle_target else True,
        )
    except OSError as error:
        if script.allow_pickle_target or "safetensors" not in str(error):
            raise
        raise OSError(f"--target {script.target}: {error} {PICKLE_TARGET_HINT}") from error
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
    vocab_size = target.get_output_embeddings().weight.shape[0]
    if script.draft_vocab_size is not None and script.draft_vocab_size > vocab_size:
        raise ValueError(
            f"--draft_vocab_size {script.draft_vocab_size} is larger than the target's vocabulary ({vocab_size} tokens)"
        )
    return target, drafter, tokenizer


def load_data(script: ExitScriptArguments, args, target, drafter, tokenizer, sources: Sources) -> TrainingData:
    """The rows, read or written by the target (the main process first; the others read its files), checked, and
    with `--feature_cache` their target features computed into the cache; first, the checkpoint to resume from must
    hold this drafter's weights."""
    import torch

    from .checkpoints import check_checkpoint_drafter
    from .data import check_rows
    from .features import CachedFeatureDataset, FeatureCache

    check_resumed = sources.resume is not None and not (args.deepspeed or args.fsdp)
    if check_resumed and script.draft_vocab_size is None:  # before the rows are written
        check_checkpoint_drafter(sources.resume, drafter)
    vocab_size = target.get_input_embeddings().weight.shape[0]
    data_dir = Path(script.data_dir or Path(args.output_dir) / "_data")
    with args.main_process_first(local=args.save_on_each_node, desc="training rows"):
        train_rows, eval_rows, description = _rows(script, args, target, tokenizer, data_dir, sources)
        train_rows = check_rows(train_rows, "train_dataset", vocab_size, args.max_length)
        eval_rows = check_rows(eval_rows, "eval_dataset", vocab_size, args.max_length) if eval_rows else None
        set_draft_vocab(script, drafter, target, train_rows)
        if check_resumed and script.draft_vocab_size is not None:  # the vocabulary is part of the drafter
            check_checkpoint_drafter(sources.resume, drafter)
        data = TrainingData(train_rows, eval_rows, len(train_rows), description)
        if script.feature_cache is not None:
            cache = FeatureCache(
                script.feature_cache, target, drafter, getattr(torch, script.feature_cache_dtype), args.max_length
            )
            cache.update(train_rows + (eval_rows or []), show_progress=not args.disable_tqdm)
            data.train_dataset = CachedFeatureDataset(train_rows, cache)
            data.eval_dataset = CachedFeatureDataset(eval_rows, cache) if eval_rows else None
    return data


def set_draft_vocab(script: ExitScriptArguments, drafter, target, train_rows) -> None:
    """With `--draft_vocab_size`, give a drafter without a draft vocabulary the one of the training rows (the same
    rows give the same vocabulary, so a resumed run rebuilds its own); a drafter that has one keeps it, and must
    have that size."""
    from .draft_vocab import draft_vocab_from_rows

    size = script.draft_vocab_size
    if size is None:
        return
    if drafter.draft_vocab is not None:
        if len(drafter.draft_vocab) != size:
            raise ValueError(
                f"--draft_vocab_size {size}: the drafter {script.drafter} already scores a draft vocabulary of "
                f"{len(drafter.draft_vocab)} tokens (leave --draft_vocab_size out to keep it)"
            )
        return
    eos = target.config.get_text_config().eos_token_id
    eos_ids = [] if eos is None else eos if isinstance(eos, (list, tuple)) else [eos]
    drafter.set_draft_vocab(draft_vocab_from_rows(train_rows, size, drafter.config.vocab_size, always=eos_ids))


def train_and_publish(
    script: ExitScriptArguments, args, target, drafter, tokenizer, data: TrainingData, resume: str | None = None
):
    """Train (resuming from the checkpoint `resume`), evaluate, save the drafter and its model card (and push
    them); the main process prints a one-line summary. Returns the trainer."""
    from . import hub
    from .exit_trainer import ExitTrainer

    trainer = ExitTrainer(
        model=drafter,
        target_model=target,
        args=args,
        train_dataset=data.train_dataset,
        eval_dataset=data.eval_dataset,
        processing_class=tokenizer,
    )
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


def _rows(script, args, target, tokenizer, data_dir: Path, sources: Sources):
    """`(train_rows, eval_rows or None, a description of the data for the model card)`: the rows read, or the
    target's responses to the prompts."""
    answer = _responder(script, args, target, tokenizer, data_dir)
    if script.prompts is not None:
        train_rows = answer(sources.train, TRAIN_ROWS, f"{script.prompts} (split {script.prompts_split})")
        description = (
            f"{len(train_rows)} prompts of `{script.prompts}` (split `{script.prompts_split}`) with responses "
            f"written by the target ({_responses_text(script.response_temperature)}, at most "
            f"{script.max_new_tokens} new tokens)."
        )
    else:
        train_rows = sources.train
        files = ", ".join(f"`{Path(path).name}`" for path in script.train_data)
        description = f"{len(train_rows)} target-written rows from {files}."
    eval_rows = sources.eval_rows
    if eval_rows is None and sources.eval_prompts is not None:
        split = script.eval_prompts_split or script.prompts_split
        eval_rows = answer(sources.eval_prompts, EVAL_ROWS, f"{script.eval_prompts} (split {split})")
    elif eval_rows is None and sources.held_out and script.prompts is not None:
        eval_rows = answer(sources.held_out, EVAL_ROWS, f"{script.prompts}: the last {len(sources.held_out)} prompts")
    elif eval_rows is None and sources.held_out:
        eval_rows = sources.held_out
    if eval_rows:
        description += f" Evaluated on {len(eval_rows)} held-out rows."
    return train_rows, eval_rows, description


def _hold_out(items: list, eval_size: int, what: str, source: str) -> tuple[list, list]:
    """`(items to train on, the last eval_size items)`; at least one item must be left to train on."""
    if eval_size >= len(items):
        raise ValueError(f"--eval_size {eval_size} leaves none of the {len(items)} {what} of {source} to train on")
    return items[: len(items) - eval_size], items[len(items) - eval_size :] if eval_size else []


def _responder(script, args, target, tokenizer, data_dir: Path):
    """`answer(prompts, file name, source)`: the rows of `prompts` with the target's responses
    (`generate_training_data`), written to `data_dir / name` and resumed from it by a rerun."""
    from .data import generate_training_data

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
    """The command: `run`, with a mistake found before training starts (a `ValueError` or `OSError`: the arguments,
    files, checkpoint, Hub access, models, data) reported in one line on stderr and exit status 2."""
    with ExitStack() as held:
        try:
            script, args = parse_args(argv, prog)
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            held.enter_context(run_folders_lock(script, args))  # before anything is read, loaded or written
            sources = prepare(script, args)
            target, drafter, tokenizer = load_training_models(script, args)
            data = load_data(script, args, target, drafter, tokenizer, sources)
        except (ValueError, OSError) as error:
            print(f"{prog}: error: {' '.join(str(error).split())}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        train_and_publish(script, args, target, drafter, tokenizer, data, sources.resume)
