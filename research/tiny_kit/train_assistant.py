"""Train the kit's "assistant-ar": a small Qwen3 causal LM for transformers' classic
assisted generation (`target.generate(..., assistant_model=assistant)`), the ecosystem's
baseline next to hf_tev's tree decoding.

Same tokenizer and vocabulary (4096) as the tiny-code-target, trained from scratch on the
tokenised TRAIN split written by build_corpus.py (build/train.bin) with the target's
recipe scaled down: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), linear
warm-up then cosine decay to 10% over a fixed wall-clock budget, gradient clipping 1.0,
bf16 autocast on CPU. Validation loss on fixed windows of the held-out split
(build/heldout.bin) every --eval-every seconds, logged to trainlog.json. At the end the
model, tokenizer, log and a model card (numbers read from the log) are saved to --out, by default
research/tiny_kit/build/assistant-ar (git-ignored). The shipped copy lives in the kit package,
tiny_kit/hf_tev_tiny_kit/assistant-ar: copy a new one there to ship it.

Run (about 30 minutes, one thread, politely):
    nohup nice -n 10 python research/tiny_kit/train_assistant.py --minutes 30 \
        > research/tiny_kit/build/assistant.log 2>&1 &
"""

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import paths
import torch


def make_model(args):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=4096,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.hidden_size // 64,
        num_key_value_heads=args.hidden_size // 64,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(args.seed)
    return Qwen3ForCausalLM(config)


def random_batch(tokens: np.ndarray, batch_size: int, seq_len: int, rng: np.random.Generator) -> torch.Tensor:
    """[B, seq_len + 1] windows at random offsets of the token stream (documents are joined by <|endoftext|>)."""
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)
    return torch.from_numpy(np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int64))


def fixed_windows(tokens: np.ndarray, count: int, seq_len: int) -> torch.Tensor:
    """[count, seq_len + 1] evenly spaced windows: the same validation set every time."""
    starts = np.linspace(0, len(tokens) - seq_len - 1, count).astype(np.int64)
    return torch.from_numpy(np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int64))


@torch.no_grad()
def mean_loss(model, windows: torch.Tensor, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy (nats/token) over windows [N, L + 1]."""
    model.eval()
    total, count = 0.0, 0
    for chunk in windows.split(batch_size):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(chunk[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
        total += loss.item()
        count += chunk[:, 1:].numel()
    model.train()
    return total / count


def learning_rate(elapsed_fraction: float, step: int, args) -> float:
    """Linear warm-up over steps, then cosine decay to 10% of the peak over the wall-clock budget."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = min(max(elapsed_fraction, 0.0), 1.0)
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def make_optimizer(model, args):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )


def write_model_card(out: Path, args, model, log: dict):
    final = log["log"][-1]
    rows = "\n".join(
        f"| {e['tokens'] / 1e6:.1f}M | {e['step']} | {e['sec']} | {e['val']:.3f} |" for e in log["log"][1:]
    )
    n_params = sum(p.numel() for p in model.parameters())
    text = f"""---
license: mit
library_name: transformers
pipeline_tag: text-generation
tags: [code, python, tiny, qwen3, assisted-generation]
---
# tiny-code-assistant-ar

A tiny autoregressive assistant (draft) model for the **tiny-code-target** (`../target/`),
for transformers' classic assisted generation:
`target.generate(**inputs, assistant_model=assistant)`. It is the ecosystem's baseline that
hf_tev's tree decoding is compared against.

`Qwen3ForCausalLM`, {args.num_layers} layers, hidden {args.hidden_size}, {args.hidden_size // 64} heads of 64,
MLP {args.intermediate_size}, vocabulary 4096 (the target's byte-level BPE tokenizer, `<|endoftext|>` = id 0
as BOS / EOS / PAD), tied embeddings, {n_params / 1e6:.2f}M parameters, float32.

## Data
The TRAIN split of the kit's corpus (`research/tiny_kit/build_corpus.py`): every `.py` file
(200 B to 200 kB, UTF-8, no line over 1000 characters) of the interpreter's standard library
with its `site-packages` and Debian's `/usr/lib/python3*`, deduplicated by SHA-1, files whose
SHA-1 starts with a byte < 3 held out (the target's rule). Train: {log["corpus"]["train_files"]:,} files,
{log["corpus"]["train_tokens"] / 1e6:.1f}M tokens; held-out: {log["corpus"]["heldout_files"]} files,
{log["corpus"]["heldout_tokens"] / 1e6:.2f}M tokens.

## Training
From scratch, seed {args.seed}. AdamW (betas 0.9 / 0.95, weight decay {args.weight_decay} on matrices),
peak LR {args.lr}, {args.warmup_steps} warm-up steps, cosine decay to 10% over a wall-clock budget of
{args.minutes} min, gradient clipping 1.0, batch {args.batch_size} x {args.seq_len} tokens, bf16 autocast on CPU,
{args.threads} thread(s) under `nice -n 10` on a 2-core machine shared with other jobs.
Wall clock {final["sec"]:,} s, {final["step"]:,} steps, {final["tokens"] / 1e6:.1f}M tokens
({final["tokens"] / max(final["sec"], 1):,.0f} tokens/s).

Validation: mean next-token loss (nats/token) on {args.val_windows} fixed windows of {args.seq_len} tokens
from the held-out split. Final **{final["val"]:.3f}** (perplexity {math.exp(final["val"]):.1f});
the tiny-code-target scores {log["target_val"]:.3f} on the same windows, the untrained model {log["log"][0]["val"]:.3f}.

| tokens seen | step | seconds | validation loss |
|---|---|---|---|
{rows}

## Use
```python
from hf_tev.packaged import load_kit_model, load_kit_tokenizer  # pip install -e ./tiny_kit (from a checkout)
tok = load_kit_tokenizer()
target = load_kit_model("target")
assistant = load_kit_model("assistant-ar")
out = target.generate(**tok("def fib(n):", return_tensors="pt"), assistant_model=assistant, max_new_tokens=64)
```
Strip trailing whitespace from prompts (byte-level BPE merges a newline with the following
indentation). Reproduce with `python research/tiny_kit/train_assistant.py` (see
`research/tiny_kit/README.md`); the full log is `trainlog.json`.
"""
    (out / "README.md").write_text(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", type=Path, default=paths.BUILD)
    parser.add_argument("--out", type=Path, default=paths.BUILD / "assistant-ar")
    parser.add_argument(
        "--target", type=Path, default=paths.model_path("target"), help="for the tokenizer and a reference val loss"
    )
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=192)
    parser.add_argument("--intermediate-size", type=int, default=512)
    parser.add_argument("--minutes", type=float, default=30.0, help="wall-clock training budget")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--val-windows", type=int, default=128)
    parser.add_argument("--eval-every", type=float, default=180.0, help="seconds between validation passes")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    train_tokens = np.memmap(args.build / "train.bin", dtype=np.uint16, mode="r")
    heldout_tokens = np.memmap(args.build / "heldout.bin", dtype=np.uint16, mode="r")
    val = fixed_windows(heldout_tokens, args.val_windows, args.seq_len)
    model = make_model(args)
    model.train()
    optimizer = make_optimizer(model, args)
    rng = np.random.default_rng(args.seed)
    print(
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; train {len(train_tokens):,} tokens",
        flush=True,
    )

    corpus = json.loads((args.build / "corpus_stats.json").read_text())
    log = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "corpus": {k: corpus[k] for k in ("train_files", "heldout_files", "train_tokens", "heldout_tokens")},
        "log": [{"step": 0, "tokens": 0, "sec": 0, "val": round(mean_loss(model, val), 4)}],
    }
    budget = args.minutes * 60.0
    started = last_eval = time.time()
    step, tokens, train_ema = 0, 0, None
    while True:
        elapsed = time.time() - started
        if elapsed >= budget:
            break
        lr = learning_rate(elapsed / budget, step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = random_batch(train_tokens, args.batch_size, args.seq_len, rng)  # [B, L + 1]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        tokens += batch[:, 1:].numel()
        train_ema = loss.item() if train_ema is None else 0.98 * train_ema + 0.02 * loss.item()
        if time.time() - last_eval >= args.eval_every:
            last_eval = time.time()
            entry = {
                "step": step,
                "tokens": tokens,
                "sec": round(last_eval - started),
                "train_ema": round(train_ema, 4),
                "val": round(mean_loss(model, val), 4),
                "lr": lr,
            }
            log["log"].append(entry)
            print(json.dumps(entry), flush=True)
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "trainlog.json").write_text(json.dumps(log, indent=1))

    seconds = round(time.time() - started)
    log["log"].append(
        {
            "step": step,
            "tokens": tokens,
            "sec": seconds,
            "train_ema": round(train_ema, 4),
            "val": round(mean_loss(model, val), 4),
            "final": True,
        }
    )
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    log["target_val"] = round(mean_loss(target, val), 4)
    print(json.dumps(log["log"][-1]), "target val", log["target_val"], flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    model.generation_config.update(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model.save_pretrained(args.out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(args.target / name, args.out / name)
    (args.out / "trainlog.json").write_text(json.dumps(log, indent=1))
    write_model_card(args.out, args, model, log)
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
