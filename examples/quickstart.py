"""Quickstart: lossless tree speculative decoding with TEV inside `model.generate`.

    python examples/quickstart.py                      # the offline tiny kit shipped in examples/tiny_kit
    python examples/quickstart.py --target Qwen/Qwen3-4B --drafter z-lab/Qwen3-4B-DFlash-b16 \
        --device cuda --dtype bfloat16                 # real models, where the Hub and a GPU are reachable

It generates a completion for a code prompt with TEV, prints the text, tau (mean output-block length
including the bonus token), the speedup against the target's plain `generate` measured in the same run,
and whether the greedy tokens are identical.
"""

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_tev

KIT = Path(__file__).resolve().parent / "tiny_kit"
PROMPT = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n'''


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
    parser.add_argument("--budget", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (then tokens must be identical)")
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
    sampling = dict(do_sample=True, temperature=args.temperature) if args.temperature > 0 else dict(do_sample=False)
    common = dict(max_new_tokens=args.max_new_tokens, **sampling)
    tev_config = hf_tev.TEVConfig(budget=args.budget)

    def plain():
        return target.generate(input_ids, **common)

    def tev():
        return target.generate(
            input_ids, assistant_model=drafter, tev_config=tev_config, return_dict_in_generate=True, **common
        )

    plain(), tev()  # warm-up
    plain_times, tev_times = [], []
    for _ in range(3):  # interleaved, medians
        expected, seconds = timed(plain)
        plain_times.append(seconds)
        out, seconds = timed(tev)
        tev_times.append(seconds)
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731

    completion = tokenizer.decode(out.sequences[0, input_ids.shape[1] :], skip_special_tokens=True)
    print(args.prompt.rstrip() + completion)
    print("-" * 60)
    stats = out.tev_stats
    print(f"target {args.target} | drafter {args.drafter} | budget {args.budget} | T = {args.temperature}")
    print(f"tau (mean output-block length incl. bonus): {stats.tau:.2f} over {stats.num_cycles} cycles")
    print(
        f"plain generate {median(plain_times):.3f} s | TEV {median(tev_times):.3f} s | "
        f"speedup {median(plain_times) / median(tev_times):.2f}x (medians of 3 interleaved runs)"
    )
    if args.temperature == 0:
        print(f"greedy tokens identical to the target's own generate: {out.sequences.tolist() == expected.tolist()}")


if __name__ == "__main__":
    main()
