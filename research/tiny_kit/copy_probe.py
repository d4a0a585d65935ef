"""Does a drafter copy from its context? Per-depth accuracy on the target's own repetition loops.

    python research/tiny_kit/copy_probe.py drafter-dflash-l135 drafter-dflash-3l

The kit's target falls into repetition loops when greedy, so at temperature 0 most of its continuations are
verbatim copies of its own earlier output. A drafter that reads the context can draft those blocks whole (a
context lookup does: `TEVConfig(lookup=True)` reaches tau 3.5 at B = 16 on them). This probe measures whether the
drafter does: for each prompt it takes the target's greedy continuation, and at every anchor `a` in it asks
whether the next `--depth` tokens already occurred, in order, right after an earlier occurrence of the anchor's
n-gram (`--ngram` tokens ending at `a`) — a *copyable* block. For copyable and other anchors it reports the
drafter's mean probability of the target's token and its top-1 accuracy at each depth (one drafter forward per
anchor, the same inputs as at decoding time: context features before the anchor, `[x_a, MASK, ...]`).
"""

import argparse
import json

import paths
import torch

import hf_tev
from hf_tev.packaged import load_kit_model, load_kit_prompts, load_kit_tokenizer


def copyable(seq: list[int], anchor: int, ngram: int, depth: int) -> bool:
    """Whether `seq[anchor+1 : anchor+1+depth]` follows an earlier occurrence of the n-gram ending at `anchor`."""
    key = seq[anchor - ngram + 1 : anchor + 1]
    future = seq[anchor + 1 : anchor + 1 + depth]
    for start in range(anchor - ngram, -1, -1):  # the latest earlier occurrence, as a lookup drafter takes it
        if seq[start : start + ngram] == key:
            return seq[start + ngram : start + ngram + depth] == future
    return False


@torch.no_grad()
def probe(drafter, target, prompts, args) -> dict:
    sums = {kind: torch.zeros(2, args.depth) for kind in ("copyable", "other")}  # [prob, top-1] per depth
    counts = {"copyable": 0, "other": 0}
    for input_ids in prompts:
        seq_ids = target.generate(input_ids, do_sample=False, max_new_tokens=args.max_new_tokens)
        features = drafter.context_features(target(seq_ids, output_hidden_states=True).hidden_states)
        seq = seq_ids[0].tolist()
        for anchor in range(input_ids.shape[1], len(seq) - args.depth):
            block = torch.full((1, drafter.config.block_size), drafter.config.mask_token_id)
            block[0, 0] = seq[anchor]
            positions = torch.arange(anchor + block.shape[1])[None]
            logits = drafter.draft_logits(target, features[:, :anchor], block, positions, num_depths=args.depth)
            probs = logits[0].softmax(-1)
            truth = seq_ids[0, anchor + 1 : anchor + 1 + args.depth]
            kind = "copyable" if copyable(seq, anchor, args.ngram, args.depth) else "other"
            sums[kind][0] += probs.gather(-1, truth[:, None])[:, 0]
            sums[kind][1] += (probs.argmax(-1) == truth).float()
            counts[kind] += 1
    return {
        kind: {
            "anchors": counts[kind],
            "p_target": [round(v, 3) for v in (sums[kind][0] / max(counts[kind], 1)).tolist()],
            "top1": [round(v, 3) for v in (sums[kind][1] / max(counts[kind], 1)).tolist()],
        }
        for kind in sums
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafters", nargs="+", help="kit or study drafter names, or folders")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per set (held-out, HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--depth", type=int, default=4, help="depths scored (and the copyable block's length)")
    parser.add_argument("--ngram", type=int, default=2, help="tokens ending at the anchor that must match")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_kit_tokenizer()
    target = load_kit_model("target")
    prompts = [
        tokenizer(prompt, return_tensors="pt").input_ids
        for name in ("heldout", "humaneval")
        for prompt in load_kit_prompts(name, args.prompts)
    ]
    results = {}
    for name in args.drafters:
        drafter = hf_tev.DFlashDraftModel.from_pretrained(paths.model_path(name)).eval()
        results[name] = probe(drafter, target, prompts, args)
        for kind, result in results[name].items():
            print(
                f"{name} {kind:>8} ({result['anchors']} anchors): p(target token) by depth {result['p_target']}, "
                f"top-1 {result['top1']}",
                flush=True,
            )
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
