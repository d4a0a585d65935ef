"""Record 3-step training runs of every ExitTrain objective (and the hf-tev train command) on tiny random models,
to compare the outputs byte for byte before and after a refactor of hf_tev/training.

    python benchmarks/training_trace.py OUT_DIR    # writes OUT_DIR/record.json and the run folders
    diff <(jq . before/record.json) <(jq . after/record.json)

Recorded per run: sha256 of every saved weight tensor's bytes (and of the whole state dict), the full log history
minus wall-clock fields, the eval metrics, the sha256 of the model card text, and for the command the rows it wrote.
Self-contained (the tiny target is built here, not from tests/helpers.py, which others edit).
"""

import hashlib
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)

from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from hf_tev import DFlashDraftModel, ExitTrainer, ExitTrainingArguments  # noqa: E402
from hf_tev.training import CachedFeatureDataset, FeatureCache  # noqa: E402

TIMING = ("runtime", "per_second", "flos_per_second")


def make_target(seed=0):
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.set_attn_implementation("sdpa")
    return model.eval()


def make_drafter(target, seed=0):
    torch.manual_seed(seed)
    return DFlashDraftModel.from_target(target, num_layers=1, block_size=4)


def rows(n=8, length=16, prompt_length=3, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(3, 96, (length,), generator=generator).tolist(), "prompt_length": prompt_length}
        for _ in range(n)
    ]


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def weights_record(model) -> dict:
    state = model.state_dict()
    per_tensor = {name: digest(t.detach().contiguous().cpu().numpy().tobytes()) for name, t in sorted(state.items())}
    return {"all": digest(json.dumps(per_tensor, sort_keys=True).encode()), "tensors": per_tensor}


def clean_logs(history) -> list:
    return [{k: v for k, v in entry.items() if not any(t in k for t in TIMING)} for entry in history]


def args_for(out, **overrides):
    settings = dict(
        output_dir=str(out),
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
        per_device_train_batch_size=2,
        tree_budget=6,
        anchors_per_sequence=3,
        max_steps=3,
        seed=0,
        eval_tau_prompts=2,
        eval_tau_max_new_tokens=8,
    )
    settings.update(overrides)
    return ExitTrainingArguments(**settings)


def trainer_run(out: Path, name: str, cache: bool = False, resume_at: int | None = None, **overrides) -> dict:
    target = make_target()
    drafter = make_drafter(target)
    train, held_out = rows(8), rows(4, seed=2)
    folder = out / name
    if cache:
        feature_cache = FeatureCache(folder / "cache", target, drafter)
        feature_cache.update(train + held_out, show_progress=False)
        train, held_out = CachedFeatureDataset(train, feature_cache), CachedFeatureDataset(held_out, feature_cache)
    args = args_for(folder / "out", **overrides)
    trainer = ExitTrainer(model=drafter, target_model=target, args=args, train_dataset=train, eval_dataset=held_out)
    if resume_at is not None:  # train to a checkpoint, then resume from it in a new trainer
        first = ExitTrainer(
            model=make_drafter(target),
            target_model=target,
            args=args_for(folder / "out", save_strategy="steps", save_steps=resume_at, **overrides),
            train_dataset=train,
            eval_dataset=held_out,
        )
        first.train()
        trainer.train(resume_from_checkpoint=str(folder / "out" / f"checkpoint-{resume_at}"))
    else:
        trainer.train()
    metrics = trainer.evaluate()
    card = trainer.create_model_card(target_model_id="tiny/target", dataset_description="random rows")
    return {
        "weights": weights_record(trainer.accelerator.unwrap_model(trainer.model)),
        "log_history": clean_logs(trainer.state.log_history),
        "eval": {k: v for k, v in metrics.items() if not any(t in k for t in TIMING)},
        "total_flos": trainer.state.total_flos,
        "card_sha256": digest(card.encode()),
    }


def command_run(out: Path, name: str, *flags: str) -> dict:
    """`hf-tev train` through `cli.run(*cli.parse_args(argv))` on a saved tiny target and token-id prompts."""
    from hf_tev.training import cli

    folder = out / name
    target_dir = folder / "target"
    make_target().save_pretrained(target_dir)
    prompts = folder / "prompts.jsonl"
    generator = torch.Generator().manual_seed(5)
    prompts.write_text(
        "".join(json.dumps(torch.randint(3, 96, (4,), generator=generator).tolist()) + "\n" for _ in range(8))
    )
    argv = [
        "--target", str(target_dir), "--prompts", str(prompts), "--max_new_tokens", "10", "--eval_size", "2",
        "--output_dir", str(folder / "out"), "--block_size", "4", "--tree_budget", "4", "--anchors_per_sequence",
        "4", "--per_device_train_batch_size", "2", "--max_steps", "3", "--eval_tau_prompts", "2",
        "--eval_tau_max_new_tokens", "8", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true",
        "--threads", "1", "--seed", "0", "--use_cpu", "--logging_steps", "1", *flags,
    ]  # fmt: skip
    trainer = cli.run(*cli.parse_args(argv))
    data = folder / "out" / "_data"
    return {
        "weights": weights_record(trainer.accelerator.unwrap_model(trainer.model)),
        "log_history": clean_logs(trainer.state.log_history),
        "rows": {p.name: digest(p.read_bytes()) for p in sorted(data.glob("*.jsonl"))},
        "card_sha256": digest((folder / "out" / "README.md").read_bytes()),
    }


RUNS = {
    "dflash": dict(objective="dflash"),
    "dflash_cache": dict(objective="dflash", cache=True),
    "prefix": dict(objective="prefix"),
    "exit": dict(objective="exit"),
    "exit_deep": dict(objective="exit", tree_budget=110),  # past the 96 depth-1 nodes: exit and prefix weights differ
    "prefix_deep": dict(objective="prefix", tree_budget=110),
    "exit_window_all": dict(objective="exit", tree_anchors="all", tree_context_window=4, ce_decay=True),
    "opd": dict(objective="opd", opd_refresh_steps=2, eval_tau_temperature=0.7),
    "opd_greedy_no_ce": dict(objective="opd", ce_weight=0.0, opd_rollout_temperature=0.0),
    "exit_resumed": dict(objective="exit", resume_at=2),
    "opd_resumed": dict(objective="opd", opd_refresh_steps=1, resume_at=2),
}
COMMANDS = {
    "command_exit_sampled": ("--objective", "exit", "--response_temperature", "0.7"),
    "command_dflash_cache_greedy": (
        "--objective",
        "dflash",
        "--response_temperature",
        "0",
        "--feature_cache",
        "FEATURES",
    ),  # fmt: skip
    "command_opd_default_responses": ("--objective", "opd", "--opd_refresh_steps", "1"),
}


def main(out: Path, only=None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    record = {}
    for name, settings in RUNS.items():
        if only and name not in only:
            continue
        record[name] = trainer_run(out, name, **settings)
        print(name, record[name]["weights"]["all"][:16], flush=True)
    for name, flags in COMMANDS.items():
        if only and name not in only:
            continue
        flags = tuple(str(out / name / "features") if f == "FEATURES" else f for f in flags)
        record[name] = command_run(out, name, *flags)
        print(name, record[name]["weights"]["all"][:16], flush=True)
    (out / "record.json").write_text(json.dumps(record, indent=1, sort_keys=True))


if __name__ == "__main__":
    main(Path(sys.argv[1]), set(sys.argv[2:]) or None)
