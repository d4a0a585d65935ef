"""Quickstart: lossless tree speculative decoding inside `model.generate`, on a code-completion task.

    python examples/quickstart.py --threads 1              # the offline tiny kit shipped in examples/tiny_kit
    python examples/quickstart.py --prompt "def fib(n):"  # any prompt
    python examples/quickstart.py --temperature 0.8 --seed 0   # sampling: the same law as plain generate
    python examples/quickstart.py --target Qwen/Qwen3-4B --drafter z-lab/Qwen3-4B-DFlash-b16 \
        --device cuda --dtype bfloat16                     # real models, where the Hub and a GPU are reachable

The task: complete a class whose next method mirrors the ones above it (`get_height` after `get_width` /
`set_width`), the kind of completion an editor asks a code model for, where the answer draws on the context. It
runs the target's plain `generate` and hf_tev's tree decoding with `TEVConfig()` side by side in one process
(interleaved, medians of 3) and prints the completion, whether the tokens are identical (greedy: they must be),
tau (mean output block, bonus token included), the speedup, whether context drafts were used (`lookup="auto"`:
on for greedy decoding) and the tree sizes the automatic budget chose.

What to expect on the kit (CPU): the 12M-parameter target writes the mirrored method right, then repeats
itself, as models this small do; the drafter and the context drafts (which copy what the text already holds)
propose those repeats and the target accepts them, so tree decoding is faster than plain `generate`, with the
same tokens. The measured figures, with their commands, are in README.md ("What speedup to expect").
"""

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_tev

KIT = Path(__file__).resolve().parent / "tiny_kit"
PROMPT = """class Rectangle:
    def __init__(self, width, height):
        self.width = width
        self.height = height

    def get_width(self):
        return self.width

    def set_width(self, width):
        self.width = width

    def get_height(self):"""


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(KIT / "target"), help="target model folder or Hub id")
    parser.add_argument("--drafter", default=str(KIT / "drafter-dflash-l135"), help="DFlash drafter folder or Hub id")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--budget", default="auto", help='"auto" (default) or a fixed number of tree nodes')
    parser.add_argument(
        "--lookup", default="auto", choices=["auto", "on", "off"], help='context drafts (default "auto": on for greedy)'
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (then tokens must be identical)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling at T > 0")
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--no-repeat-ngram-size", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0, help="torch.manual_seed before each sampled run")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    dtype = getattr(torch, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype, attn_implementation="sdpa")
    target = target.to(args.device).eval()
    drafter = hf_tev.DFlashDraftModel.from_pretrained(args.drafter, dtype=dtype).to(args.device).eval()

    # Byte-level BPE merges a newline with the next line's indentation: a prompt ending in whitespace is
    # out of distribution, so strip it.
    input_ids = tokenizer(args.prompt.rstrip(), return_tensors="pt").input_ids.to(args.device)
    if args.temperature > 0:
        sampling = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=0)
    else:
        sampling = dict(do_sample=False)
    common = dict(
        max_new_tokens=args.max_new_tokens,
        repetition_penalty=args.repetition_penalty,
        no_repeat_ngram_size=args.no_repeat_ngram_size,
        **sampling,
    )
    budget = args.budget if args.budget == "auto" else int(args.budget)
    lookup = {"auto": "auto", "on": True, "off": False}[args.lookup]
    tev_config = hf_tev.TEVConfig(budget=budget, lookup=lookup)

    def plain():
        torch.manual_seed(args.seed)
        return target.generate(input_ids, **common)

    def tev():
        torch.manual_seed(args.seed)
        return target.generate(
            input_ids, assistant_model=drafter, tev_config=tev_config, return_dict_in_generate=True, **common
        )

    plain(), tev()  # warm-up (the automatic budget also measures this machine's tree-pass costs here)
    plain_times, tev_times = [], []
    for _ in range(3):  # interleaved, medians
        expected, seconds = timed(plain)
        plain_times.append(seconds)
        out, seconds = timed(tev)
        tev_times.append(seconds)

    completion = tokenizer.decode(out.sequences[0, input_ids.shape[1] :], skip_special_tokens=True)
    print(args.prompt.rstrip() + completion)
    print("-" * 72)
    stats = out.tev_stats
    print(f"target {args.target} | drafter {args.drafter}")
    print(f"settings: {common}")
    sizes = stats.tree_sizes
    chosen = f"budget {args.budget}"
    if budget == "auto":
        chosen += (
            f": tree sizes chosen per cycle mean {statistics.fmean(sizes):.1f} (median {statistics.median(sizes):g},"
            f" max {max(sizes)}), {sum(s == 0 for s in sizes)} of {len(sizes)} cycles without a tree;"
            f" predicted tau {statistics.fmean(stats.predicted_lengths):.2f}"
        )
    print(chosen)
    sources = stats.accepted_by_source
    used = "on" if tev_config.for_call(target.generation_config.__class__(**sampling), True).lookup else "off"
    print(f"context drafts (lookup={args.lookup!r}): {used}; accepted tokens by source {sources}")
    print(f"tau (mean output-block length incl. bonus): {stats.tau:.2f} over {stats.num_cycles} cycles")
    plain_s, tev_s = statistics.median(plain_times), statistics.median(tev_times)
    print(f"plain generate {plain_s:.3f} s | hf_tev {tev_s:.3f} s | speedup {plain_s / tev_s:.2f}x (medians of 3)")
    if args.temperature == 0:
        print(f"greedy tokens identical to the target's own generate: {out.sequences.tolist() == expected.tolist()}")
    else:
        print(
            "sampled: the output has the target's own sampling law (tokens differ from run to run and method to method)"
        )


if __name__ == "__main__":
    main()
