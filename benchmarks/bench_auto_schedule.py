"""`budget="auto"` over many short calls: the budget kept across calls against a fresh budget per call.

    python benchmarks/bench_auto_schedule.py --temperature 1 --threads 2
    python benchmarks/bench_auto_schedule.py --temperature 0 --lookup

`hf_tev.generation.automatic_budget` keeps one `CostAwareBudget` per models and settings, so a call starts with
the drafter's pause and the cap the last call left (its probes start over). The baseline, `fresh`, empties that
store before each call, which is what every call did before: the calibration and the cost model are shared by
both, only the budget's schedule differs. On the kit target with its default drafter, 8 held-out + 8 HumanEval
prompts, 64 new tokens each; per prompt the methods run in rotating order, 3 times, and the fastest time of each
counts; no EOS, so every call makes the same number of tokens. Reports the speedup over plain `generate` (`ar`),
tau and the drafter's time per cycle.
"""

import argparse
import time

import torch

import hf_tev
import hf_tev.generation
from hf_tev.packaged import load_kit_model, load_kit_prompts, load_kit_tokenizer


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default="drafter-dflash-l135")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lookup", action="store_true", help="with context drafts (TEVConfig(lookup=True))")
    parser.add_argument("--prompts", type=int, default=8, help="per prompt set (held-out, HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, drafter = load_kit_model("target"), load_kit_model(args.drafter)
    tokenizer = load_kit_tokenizer()
    texts = load_kit_prompts("heldout", args.prompts) + load_kit_prompts("humaneval", args.prompts)
    prompts = [tokenizer(text, return_tensors="pt").input_ids for text in texts]
    # eos_token_id=None: every call makes max_new_tokens tokens (sampled runs stop at different places otherwise)
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0, eos_token_id=None)
    if args.temperature:
        settings.update(temperature=args.temperature, top_k=0)
    config = hf_tev.TEVConfig(lookup=args.lookup)

    def run(method: str, index: int, prompt) -> tuple[float, float, float]:
        torch.manual_seed(index)
        kwargs = {}
        if method != "ar":
            if method == "fresh":
                hf_tev.generation.forget_budgets()  # a new budget for this call, as before
            kwargs = dict(assistant_model=drafter, tev_config=config, return_dict_in_generate=True)
        start = time.perf_counter()
        out = target.generate(prompt, **settings, **kwargs)
        seconds = time.perf_counter() - start
        if method == "ar":
            return seconds, 1.0, 0.0
        summary = out.tev_stats.summary()
        return seconds, summary["tau"], summary["draft_s"]

    methods = ["ar", "kept", "fresh"]
    for method in methods:  # warm-up (and the one-time probe of the tree pass's cost)
        run(method, 0, prompts[0])
    best = {method: [float("inf")] * len(prompts) for method in methods}
    tau = {method: [0.0] * len(prompts) for method in methods}
    draft = {method: [0.0] * len(prompts) for method in methods}
    for repeat in range(args.repeats):
        for index, prompt in enumerate(prompts):
            for method in methods[repeat % 3 :] + methods[: repeat % 3]:
                seconds, tau[method][index], draft[method][index] = run(method, index, prompt)
                best[method][index] = min(best[method][index], seconds)
    total = {method: sum(times) for method, times in best.items()}
    print(
        f"kit, {args.drafter}, T = {args.temperature}, lookup={args.lookup}, {len(prompts)} prompts x "
        f"{args.max_new_tokens} tokens, {args.threads} threads, best of {args.repeats}"
    )
    print("| method | speedup over ar | tau | drafter ms per cycle |")
    print("|---|---|---|---|")
    for method in methods[1:]:
        mean_tau = sum(tau[method]) / len(prompts)
        mean_draft = 1e3 * sum(draft[method]) / len(prompts)
        print(f"| {method} | {total['ar'] / total[method]:.3f} | {mean_tau:.3f} | {mean_draft:.2f} |")


if __name__ == "__main__":
    main()
