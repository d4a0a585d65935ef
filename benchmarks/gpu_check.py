"""The prepared GPU check: what only an accelerator shows, in one short run with nothing downloaded.

    python benchmarks/gpu_check.py --device cuda --output gpu_check.json          # about 3-6 minutes on one GPU
    python benchmarks/gpu_check.py --device cpu --shape tiny --max-tokens 16      # the same code, in seconds (tests)

1. **Tree-pass cost curve.** A randomly initialised target of Qwen3-4B's shape (36 layers, hidden 2560, 32 heads /
   8 KV heads of 128, MLP 9728, vocabulary 151,936) in bf16: the time of one tree pass over n = 1, 2, 4, ...,
   `--max-tokens` tokens after a `--context`-token prompt, against one token (the ratio is what a tree costs).
2. **hf_tev's per-cycle overhead** against the forward: tree decoding with a random drafter of the same shape at
   fixed budgets and "auto"; stage times per cycle from `TEVStats` (build + verifier stage vs the model forwards).
3. **What `budget="auto"` chooses under that cost curve**, with the drafter path probabilities and the
   acceptance calibration measured on the tiny kit (its drafter is real, the kit ships it): every kit tree's
   nested sizes scored with the GPU cost curve (the CPU's for comparison), the chosen size and the
   predicted tokens per second against each fixed budget.
4. **Greedy exactness of the kit on the device**: tree decoding (auto and fixed budgets, every verifier at T = 0)
   equals the kit target's own greedy `generate`.

Writes one JSON document (`--output`) and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

SHAPES = {  # name -> Qwen3Config fields (random weights)
    "qwen3-4b": dict(
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
    ),
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_target(shape: str, device, dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        **SHAPES[shape], max_position_embeddings=8192, tie_word_embeddings=False, attn_implementation="sdpa"
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    return model.to(dtype).eval()


@torch.no_grad()
def tree_pass_curve(target, context: int, max_tokens: int, repeats: int) -> dict:
    """Seconds of a tree pass over n tokens (a chain: the cost does not depend on the shape) after `context`."""
    from transformers import DynamicCache

    from hf_tev.tree import TreeInputs, build_chain

    device = target.device
    prompt = torch.randint(0, target.config.vocab_size, (1, context), device=device)
    cache = DynamicCache(config=target.config)
    target(prompt, cache=cache, logits_to_keep=1)
    inputs = TreeInputs(context + max_tokens, target.dtype, device)
    sizes = [1 << i for i in range(max_tokens.bit_length()) if (1 << i) <= max_tokens]
    seconds = []
    for size in sizes:
        chain = build_chain(torch.zeros(size - 1, 1, device=device), size - 1, torch.tensor(1, device=device))
        mask, positions = inputs(chain, context, context)
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            sync(device)
            start = time.perf_counter()
            target(chain.tokens[None], position_ids=positions, attention_mask=mask, cache=cache, logits_to_keep=0)
            sync(device)
            times.append(time.perf_counter() - start)
            cache.crop(context - cache.get_seq_length())
        seconds.append(statistics.median(times[1:]))
    return {"tokens": sizes, "seconds": seconds, "ratio_to_one_token": [s / seconds[0] for s in seconds]}


@torch.no_grad()
def decoding_overhead(target, budgets, max_new_tokens: int) -> list[dict]:
    """Per-cycle stage times of tree decoding with a random drafter (tau ~ 1: the costs, not the speed)."""
    import hf_tev  # noqa: F401  (routes generate)
    from hf_tev import DFlashDraftModel, TEVConfig

    drafter = DFlashDraftModel.from_target(target, num_layers=1, block_size=16)
    prompt = torch.randint(0, target.config.vocab_size, (1, 64), device=target.device)
    rows = []
    for budget in budgets:
        for _ in range(2):  # the first call warms up (and, for auto, probes the cost curve)
            out = target.generate(
                prompt,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                assistant_model=drafter,
                tev_config=TEVConfig(budget=budget),
                return_dict_in_generate=True,
            )
        stats = out.tev_stats.summary()
        model = stats["draft_s"] + stats["forward_s"]
        own = stats["build_s"] + stats["verify_s"]
        rows.append(
            dict(
                budget=budget,
                cycles=stats["cycles"],
                tree_size=stats["tree_size"],
                draft_ms=1e3 * stats["draft_s"],
                build_ms=1e3 * stats["build_s"],
                forward_ms=1e3 * stats["forward_s"],
                verify_ms=1e3 * stats["verify_s"],
                overhead_fraction=own / (own + model),
            )
        )
    return rows


@torch.no_grad()
def kit_trees(device, prompts: int, max_new_tokens: int, max_budget: int):
    """The kit drafter's trees (path log-probs, nested: the first n nodes are the best tree of size n) along
    greedy decoding of a few held-out prompts, and the acceptance calibration an "auto" run learns there."""
    from transformers import GenerationConfig

    from hf_tev import TEVConfig
    from hf_tev.generation import TreeCandidateGenerator, automatic_budget
    from hf_tev.kit import load_kit_model, load_kit_prompts, load_kit_tokenizer

    target, drafter = load_kit_model("target", device=device), load_kit_model("drafter-dflash-l135", device=device)
    tokenizer = load_kit_tokenizer()
    captured = []
    build = TreeCandidateGenerator.build

    def capture(self, draft_logprobs, root, *args, **kwargs):  # every cycle's full tree, for its nested sizes
        if draft_logprobs is not None:
            captured.append(self.builder(draft_logprobs, max_budget, root).path_logprobs)
        return build(self, draft_logprobs, root, *args, **kwargs)

    TreeCandidateGenerator.build = capture
    try:
        for text in load_kit_prompts("heldout", prompts):
            ids = tokenizer(text, return_tensors="pt").input_ids.to(device)
            target.generate(
                ids,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                assistant_model=drafter,
                tev_config=TEVConfig(budget="auto", max_budget=max_budget),
            )
    finally:
        TreeCandidateGenerator.build = build
    config = TEVConfig(budget="auto", max_budget=max_budget)  # the calibration the calls above learnt
    budget = automatic_budget(target, drafter, config, GenerationConfig(do_sample=False))
    return captured, budget.calibration


def auto_choice(trees, calibration, curve: dict, draft_s: float, max_budget: int) -> dict:
    """Under a tree-pass cost curve: the size `auto` picks on every kit tree, and expected tokens per second of
    auto against every fixed budget (the same calibrated acceptance, the same cost model)."""
    from hf_tev.budget import CostAwareBudget, CycleCost

    cost = CycleCost()
    cost.set_probe(curve["tokens"], curve["seconds"])
    cost.observe_draft(draft_s)
    chosen, auto_tokens, auto_time = [], 0.0, 0.0
    fixed = {b: [0.0, 0.0] for b in (1, 4, 16, 64, 256, 1024) if b <= max_budget}
    for log_qs in trees:
        budget = CostAwareBudget(max_budget, calibration, cost)
        rule = budget.size_rule()
        size = next((n - 1 for n in range(1, len(log_qs)) if not rule(n, log_qs[n])), len(log_qs) - 1)
        chosen.append(size)
        accepted = [calibration(q) for q in log_qs[1:]]
        auto_tokens += 1 + sum(accepted[:size])
        auto_time += cost.cycle(size)
        for b in fixed:
            fixed[b][0] += 1 + sum(accepted[:b])
            fixed[b][1] += cost.cycle(min(b, len(log_qs) - 1))
    sizes = sorted(chosen)
    return {
        "chosen_sizes_quartiles": [sizes[int(q * (len(sizes) - 1))] for q in (0.25, 0.5, 0.75)],
        "chosen_size_mean": statistics.fmean(chosen),
        "tokens_per_s_auto": auto_tokens / auto_time,
        "tokens_per_s_fixed": {b: tokens / seconds for b, (tokens, seconds) in fixed.items()},
        "tokens_per_s_plain": 1 / cost.cycle(0, drafted=False),
    }


@torch.no_grad()
def kit_greedy_exact(device, prompts: int, max_new_tokens: int) -> dict:
    from hf_tev import TEVConfig
    from hf_tev.kit import load_kit_model, load_kit_prompts, load_kit_tokenizer

    target, drafter = load_kit_model("target", device=device), load_kit_model("drafter-dflash-l135", device=device)
    tokenizer = load_kit_tokenizer()
    results = {}
    for text in load_kit_prompts("humaneval", prompts):
        ids = tokenizer(text, return_tensors="pt").input_ids.to(device)
        expected = target.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)
        for budget in ("auto", 8, 64):
            for verifier in ("tev", "predraw", "residual"):
                out = target.generate(
                    ids,
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    assistant_model=drafter,
                    tev_config=TEVConfig(budget=budget, verifier=verifier),
                )
                key = f"{budget}/{verifier}"
                results[key] = results.get(key, True) and torch.equal(out, expected)
    return {"all_equal": all(results.values()), "by_setting": results}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-4b")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens before the tree pass")
    parser.add_argument("--max-tokens", type=int, default=1024, help="largest tree pass (tokens)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kit-prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    started = time.perf_counter()
    report = {
        "settings": vars(args),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }

    target = random_target(args.shape, device, dtype)
    report["tree_pass"] = tree_pass_curve(target, args.context, args.max_tokens, args.repeats)
    budgets = [b for b in (16, 64, 256) if b < args.max_tokens] + ["auto"]
    report["overhead"] = decoding_overhead(target, budgets, args.new_tokens)
    del target
    if device.type == "cuda":
        torch.cuda.empty_cache()

    max_budget = args.max_tokens - 1
    trees, calibration = kit_trees(device, args.kit_prompts, args.new_tokens, max_budget)
    draft_s = next(row["draft_ms"] for row in report["overhead"] if row["budget"] == "auto") / 1e3
    report["auto_under_this_curve"] = auto_choice(trees, calibration, report["tree_pass"], draft_s, max_budget)
    cpu_like = {
        "tokens": report["tree_pass"]["tokens"],
        "seconds": [report["tree_pass"]["seconds"][0] * k for k in report["tree_pass"]["tokens"]],
    }
    report["auto_under_a_per_token_curve"] = auto_choice(trees, calibration, cpu_like, draft_s, max_budget)
    report["kit_greedy_exact"] = kit_greedy_exact(device, args.kit_prompts, args.new_tokens)
    report["seconds"] = time.perf_counter() - started

    text = json.dumps(report, indent=1, default=str)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    curve = report["tree_pass"]
    print(
        "tree pass / one token:",
        ", ".join(f"{n}: {r:.2f}x" for n, r in zip(curve["tokens"], curve["ratio_to_one_token"], strict=True)),
    )
    for row in report["overhead"]:
        print(
            f"budget {row['budget']}: tree size {row['tree_size']:.1f}, overhead {100 * row['overhead_fraction']:.1f}%"
        )
    auto = report["auto_under_this_curve"]
    print(
        f"auto on kit trees: sizes p25/p50/p75 {auto['chosen_sizes_quartiles']}, tokens/s auto "
        f"{auto['tokens_per_s_auto']:.1f} vs fixed {auto['tokens_per_s_fixed']}"
    )
    print("kit greedy exact on", args.device, ":", report["kit_greedy_exact"]["all_equal"])
    print(f"done in {report['seconds']:.0f} s")
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["kit_greedy_exact"]["all_equal"] else 1)
