"""Per-stage cost of one tree-decoding cycle, and the verifier stage of TEV vs predraw on the SAME trees.

    python benchmarks/bench_stages.py                 # B = 32, 64; T = 1
    python benchmarks/bench_stages.py --budgets 16,32,64,128 --cycles-tokens 160

A tiny random Qwen3 target (vocab 4096) and a fresh 1-layer DFlash drafter (block 16). Part 1 runs
`generate` per verifier and reports the mean time of each stage per cycle (draft, build, tree forward,
verifier stage) with tau. Part 2 is `hf_tev.bench.same_tree_verifier_stage` (the replay `hf-tev bench` uses for
the paper's Table 3): for every tree, each verifier's stage (per-node logits processing + decision + cache
commit, excluding the tree forward) is timed right after its own tree pass over the same tree and cache; the
median per cycle is reported. `hf-tev bench` runs the same replay on the tiny kit.
Timings are wall clock on this machine; only ratios measured side by side mean much.
"""

import argparse
import statistics

import torch
from transformers import LogitsProcessorList, Qwen3Config, Qwen3ForCausalLM, TemperatureLogitsWarper

import hf_tev
from hf_tev.bench import same_tree_verifier_stage
from hf_tev.verify import VERIFIERS


def make_pair(vocab, hidden, layers, block_size, seed=0):
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        head_dim=64,
        tie_word_embeddings=True,
    )
    target = Qwen3ForCausalLM(config).eval()
    target.set_attn_implementation("sdpa")
    drafter = hf_tev.DFlashDraftModel.from_target(target, num_layers=1, block_size=block_size).eval()
    return target, drafter


def stage_table(target, drafter, prompt, budgets, max_new_tokens):
    print("\n## Stage times per cycle from generate (ms), T = 1")
    print("| B | verifier | tau | draft | build | tree forward | verifier stage |")
    print("|---|---|---|---|---|---|---|")
    for budget in budgets:
        for verifier in ("predraw", "tev"):
            torch.manual_seed(0)
            out = target.generate(
                prompt,
                do_sample=True,
                max_new_tokens=max_new_tokens,
                assistant_model=drafter,
                tev_config=hf_tev.TEVConfig(budget=budget, verifier=verifier),
                return_dict_in_generate=True,
            )
            s = out.tev_stats.summary()
            print(
                f"| {budget} | {verifier} | {s['tau']:.2f} | {1e3 * s['draft_s']:.2f} | {1e3 * s['build_s']:.2f} "
                f"| {1e3 * s['forward_s']:.2f} | {1e3 * s['verify_s']:.3f} |"
            )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", default="32,64")
    parser.add_argument("--cycles-tokens", type=int, default=96, help="tokens decoded by the same-tree replay")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    budgets = [int(b) for b in args.budgets.split(",")]
    target, drafter = make_pair(args.vocab, args.hidden, args.layers, block_size=16)
    prompt = torch.randint(1, args.vocab, (1, 64), generator=torch.Generator().manual_seed(0))
    print(
        f"target: Qwen3 random, vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers; "
        f"drafter: DFlash 1 layer, block 16; torch threads {args.threads}"
    )
    stage_table(target, drafter, prompt, budgets, args.max_new_tokens)
    print("\n## Verifier stage on the same trees (median ms per cycle; decision + cache commit, T = 1)")
    print("| B | predraw | residual | tev | tev / predraw |")
    print("|---|---|---|---|---|")
    processors = LogitsProcessorList([TemperatureLogitsWarper(1.0)])
    for budget in budgets:
        times = same_tree_verifier_stage(
            target, drafter, [prompt], budget, processors, args.cycles_tokens, verifiers=tuple(VERIFIERS)
        )
        med = {name: statistics.median(t) for name, t in times.items()}
        print(
            f"| {budget} | {1e3 * med['predraw']:.3f} | {1e3 * med['residual']:.3f} | {1e3 * med['tev']:.3f} "
            f"| {med['tev'] / med['predraw']:.2f} |"
        )


if __name__ == "__main__":
    main()
