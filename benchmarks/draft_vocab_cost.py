"""What a reduced draft vocabulary saves on SmolLM2-135M-Instruct: the drafter's call and a training step, with the
whole vocabulary and with draft vocabularies of a few sizes, each against a plain target step, side by side in one
process.

    python benchmarks/draft_vocab_cost.py --threads 1 --sizes 8192,16384 --output vocab_cost.json

- plain step: the target's forward of one token after `--context` tokens (a `DynamicCache`, cropped back);
- draft stage: what the decoder's draft stage computes for one block with 4 new context rows after `--context`
  cached ones (the drafter's cache cropped back), every depth scored: `draft_logits` (the drafter's stack and the
  target's LM head, whole or restricted; with a draft vocabulary its scores as scored, `target_vocab=False`) and
  the log-softmax of its scores;
- training step: the "dflash" loss over cached features of `--train_rows` rows of `--train_length` tokens,
  `--anchors` blocks each, forward and backward (`hf_tev.training.losses.rows_loss`).

The draft vocabularies are the tokens the target wrote most often in `research/smollm2_drafter/data` (all but its
last shard, with the EOS ids); their coverage is measured on the last shard's target-written tokens. A drafter that
ships with its own draft vocabulary (`--drafter`, default: the target's shipped drafter) is also measured as it
ships ("as shipped"). Variants run
interleaved, `--repeats` rounds; each figure is given as the median and the sum over the rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "research" / "smollm2_drafter" / "data"
TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"


def read_shards() -> list[list[dict]]:
    return [[json.loads(line) for line in path.read_text().splitlines()] for path in sorted(DATA.glob("shard_*.jsonl"))]


def timed(function) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def plain_step(target, context: int):
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    ids = torch.randint(100, 20000, (1, context + 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        target(ids[:, :context], cache=cache)

    def step():
        with torch.no_grad():
            target(ids[:, context:], cache=cache)
        cache.crop(-1)

    return step


def draft_stage(target, drafter, context: int):
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    features = torch.randn(1, context + 4, width, generator=torch.Generator().manual_seed(1))
    cache = drafter.new_cache()
    block = torch.full((1, drafter.config.block_size), drafter.config.mask_token_id)
    block[0, 0] = 28
    with torch.no_grad():
        drafter.draft_logits(target, features[:, :context], block, torch.arange(context + block.shape[1])[None], cache)
    positions = torch.arange(context, context + 4 + block.shape[1])[None]
    options = {} if drafter.draft_vocab is None else {"target_vocab": False}  # as the decoder calls it

    def call():
        with torch.no_grad():
            logits = drafter.draft_logits(target, features[:, context:], block, positions, cache, **options)
            torch.log_softmax(logits.float(), dim=-1)  # the decoder's log-probs (`candidates.finite_depths`)
        cache.crop(-4)  # the 4 new context rows (draft_logits removes the block's own)

    return call


def training_step(target, drafter, rows: list[dict], anchors: int, length: int):
    from hf_tev.training import ExitTrainingArguments
    from hf_tev.training.batch import target_context
    from hf_tev.training.losses import rows_loss

    ids = torch.tensor([row["input_ids"][:length] for row in rows])
    mask = torch.ones_like(ids)
    mask[:, :64] = 0
    features = drafter.context_features(target_context(target, drafter, ids, use_cache=False).hidden_states)
    inputs = {"input_ids": ids, "loss_mask": mask, "context_features": features}
    args = ExitTrainingArguments(output_dir="unused", use_cpu=True, anchors_per_sequence=anchors, report_to=[])
    drafter.train()

    def step():
        loss, _ = rows_loss(drafter, drafter, target, inputs, args, "dflash", 1.0, torch.Generator().manual_seed(0))
        loss.loss.backward()
        drafter.zero_grad(set_to_none=True)

    return step


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--sizes", default="8192,16384", help="draft vocabulary sizes, comma-separated")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--train_rows", type=int, default=2)
    parser.add_argument("--train_length", type=int, default=384)
    parser.add_argument("--anchors", type=int, default=16)
    parser.add_argument("--drafter", default=None, help="a drafter folder (default: the target's shipped drafter)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from hf_tev import DFlashDraftModel
    from hf_tev.models.dflash.vocabulary import draft_token_ids
    from hf_tev.packaged import default_drafter, packaged_model_path
    from hf_tev.training import draft_vocab_from_rows
    from hf_tev.training.draft_vocab import response_token_counts

    target = AutoModelForCausalLM.from_pretrained(packaged_model_path(TARGET), dtype=torch.float32).eval()
    target.requires_grad_(False)  # frozen, as ExitTrainer holds it (its head rows are then gathered once)
    vocab = target.get_output_embeddings().weight.shape[0]
    shards = read_shards()
    train, held_out = [row for shard in shards[:-1] for row in shard], shards[-1]
    held_counts = response_token_counts(held_out, vocab)
    long_rows = [row for row in train if len(row["input_ids"]) >= args.train_length][: args.train_rows]

    variants, coverage = {}, {}
    folder = args.drafter or default_drafter(TARGET)
    shipped = DFlashDraftModel.from_pretrained(folder, dtype=torch.float32).config.draft_vocab_size
    # "full": the whole head; each size: a draft vocabulary of this data; "as shipped": the drafter's own, if it has one
    for size in [None, *(int(s) for s in args.sizes.split(",")), *(["as shipped"] if shipped else [])]:
        drafter = DFlashDraftModel.from_pretrained(folder, dtype=torch.float32).eval()
        if size is None:
            drafter.set_draft_vocab(None)
        elif size == "as shipped":
            ids = draft_token_ids(drafter.get_buffer("d2t"))
            coverage[size] = float(held_counts[ids].sum() / held_counts.sum())
        else:
            ids = draft_vocab_from_rows(train, size, vocab, always=[target.config.eos_token_id])
            drafter.set_draft_vocab(ids)
            coverage[size] = float(held_counts[ids].sum() / held_counts.sum())
        name = "full" if size is None else str(size)
        variants[name] = {
            "draft stage": draft_stage(target, drafter, args.context),
            "training step": training_step(target, drafter, long_rows, args.anchors, args.train_length),
        }
    step = plain_step(target, args.context)
    times: dict[str, list[float]] = {"plain step": []}
    for _ in range(args.repeats):
        times["plain step"].append(timed(step))
        for name, parts in variants.items():
            for part, function in parts.items():
                times.setdefault(f"{part} {name}", []).append(timed(function))
    plain_median, plain_sum = statistics.median(times["plain step"]), sum(times["plain step"])
    report = {
        "threads": args.threads,
        "context": args.context,
        "repeats": args.repeats,
        "train": {"rows": len(long_rows), "length": args.train_length, "anchors": args.anchors},
        "held_out_coverage": coverage,
        "held_out_tokens": int(held_counts.sum()),
        "seconds": {name: {"median": statistics.median(values), "sum": sum(values)} for name, values in times.items()},
    }
    print(f"threads {args.threads}, context {args.context}, {args.repeats} rounds; ratios: median (sum)")
    for name, values in times.items():
        median, total = statistics.median(values), sum(values)
        line = f"{name:24s} {1e3 * median:8.2f} ms  {median / plain_median:6.3f} ({total / plain_sum:6.3f}) plain steps"
        print(line)
    for name in variants:
        if name != "full":
            full, ours = report["seconds"]["training step full"], report["seconds"][f"training step {name}"]
            ratios = f"{ours['median'] / full['median']:.3f} ({ours['sum'] / full['sum']:.3f})"
            print(f"training step {name} / full: {ratios}")
    for size, share in coverage.items():
        print(f"draft vocabulary {size}: covers {100 * share:.1f}% of {report['held_out_tokens']} held-out tokens")
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
