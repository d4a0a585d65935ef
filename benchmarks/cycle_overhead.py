"""hf_tev's own work per decoding cycle, next to the two model forwards, on the kit; optionally against an older
revision of hf_tev in the same process.

    python benchmarks/cycle_overhead.py --threads 1
    python benchmarks/cycle_overhead.py --threads 1 --baseline cbe0360      # old and new, interleaved
    python benchmarks/cycle_overhead.py --threads 1 --target HuggingFaceTB/SmolLM2-135M-Instruct \
        --drafter hf_tev/shipped_drafters/SmolLM2-135M-Instruct-DFlash --budgets auto --lookup off,on

Per cycle (the loop's `decode_cycle`, prefill excluded), three wall times, each measured with `time.perf_counter`
(no profiler):

- cycle: the whole `decode_cycle` call;
- target: the target model's forward calls inside it (the tree pass: a module forward hook pair on the target);
- drafter: `drafter.draft_logits` inside it (the target's embedding of the block, the drafter's stack, the target's
  LM head on the used depths);
- own work: cycle - target - drafter: everything hf_tev does around the two forwards (waiting context, block
  inputs, log-softmax, tree building, masks, logits processors, the verifier, the cache commit, bookkeeping).

Beside them, a plain `generate` step of the same target on the same prompt (`(t(N) - t(1)) / (N - 1)` of two plain
calls of N and 1 new tokens, best of the repeats): what a cycle without a tree should cost (issue "A cycle that
costs only what it must"). `--target` (a packaged Hub id or a folder) and `--drafter` (a folder) run the real target,
on chat-templated prompts of MT-Bench and HumanEval; by default the kit's.

Each prompt runs `--repeats` times (old and new interleaved in rotating order with `--baseline`); per prompt the
smallest value of each quantity is kept, then they are averaged over prompts. The TEVStats stage times (draft,
build, forward, verify) of the same runs are printed beside them. `--baseline REV` extracts `hf_tev` at git revision
REV with `git archive` into a temporary folder as the package `hf_tev_old` (it imports itself relatively), loads its
own drafter class, and runs both decoders through transformers' `custom_generate` with both routes disabled.
Timings are wall clock on a shared machine: only numbers measured side by side in one run compare well.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import hf_tev
import hf_tev.generation.loop as new_loop
from hf_tev.bench.methods import PROMPT_SETS
from hf_tev.bench.records import load_average
from hf_tev.packaged import kit_dir, load_kit_model, load_kit_prompts, load_kit_tokenizer, pretrained_source

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class CycleTimer:
    """Accumulates per-cycle wall times of a decoder: the cycle, the target forwards and the drafter calls in it."""

    def __init__(self):
        self.in_cycle = False
        self.reset()

    def reset(self):
        self.cycles, self.cycle_s, self.target_s, self.drafter_s = 0, 0.0, 0.0, 0.0

    def wrap_cycle(self, decode_cycle):
        @functools.wraps(decode_cycle)
        def timed(state):
            self.in_cycle = True
            start = time.perf_counter()
            try:
                return decode_cycle(state)
            finally:
                self.cycle_s += time.perf_counter() - start
                self.cycles += 1
                self.in_cycle = False

        return timed

    def hook_target(self, target):
        started = []

        def before(module, args):
            started.append(time.perf_counter())

        def after(module, args, output):
            elapsed = time.perf_counter() - started.pop()
            if self.in_cycle and not started:  # the outermost forward only
                self.target_s += elapsed

        target.register_forward_pre_hook(before)
        target.register_forward_hook(after)

    def wrap_drafter(self, drafter):
        draft_logits = drafter.draft_logits

        @functools.wraps(draft_logits)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return draft_logits(*args, **kwargs)
            finally:
                if self.in_cycle:
                    self.drafter_s += time.perf_counter() - start

        drafter.draft_logits = timed  # an instance attribute: the decoder's `drafter.draft_logits(...)` finds it


def load_baseline(revision: str):
    """The package `hf_tev_old`: `hf_tev` at git revision `revision`, and its kit drafter loader."""
    os.environ.setdefault("HF_TEV_KIT", str(kit_dir()))  # the old kit module looks beside its own folder
    folder = tempfile.mkdtemp(prefix="hf_tev_old_")
    archive = subprocess.run(["git", "-C", REPO, "archive", revision, "hf_tev"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", folder], input=archive.stdout, check=True)
    os.rename(os.path.join(folder, "hf_tev"), os.path.join(folder, "hf_tev_old"))
    sys.path.insert(0, folder)
    old = importlib.import_module("hf_tev_old")
    old.disable()
    return importlib.import_module("hf_tev_old.generation.loop"), importlib.import_module("hf_tev_old.kit")


class Decoder:
    """One hf_tev version: its loop module (timed) and its drafter instance."""

    def __init__(self, name, loop, drafter, timer):
        self.name, self.loop, self.drafter, self.timer = name, loop, drafter, timer
        loop.decode_cycle = timer.wrap_cycle(loop.decode_cycle)  # the loop looks it up per call
        # the decoder's custom_generate entry, from its package (older versions kept it in the loop module)
        self.entry = sys.modules[loop.__package__].tree_speculative_decode
        timer.wrap_drafter(drafter)

    def run(self, target, input_ids, fields, temperature, max_new_tokens):
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature else {"do_sample": False}
        decode = functools.partial(self.entry, drafter=self.drafter, tev_config=dict(fields))
        self.timer.reset()
        out = target.generate(
            input_ids,
            custom_generate=decode,
            max_new_tokens=max_new_tokens,
            eos_token_id=None,
            return_dict_in_generate=True,
            **sampling,
        )
        stats, timer = out.tev_stats, self.timer
        cycles = max(1, timer.cycles)
        own = timer.cycle_s - timer.target_s - timer.drafter_s
        stages = stats.summary()
        return {
            "cycle": timer.cycle_s / cycles,
            "target": timer.target_s / cycles,
            "drafter": timer.drafter_s / cycles,
            "own": own / cycles,
            "tau": stats.tau,
            **{stage: stages[f"{stage}_s"] for stage in ("draft", "build", "forward", "verify")},
            "tokens": out.sequences.tolist(),
        }


def models_and_prompts(args):
    """The target (eval), its tokenizer and the prompt ids: the kit's (held-out and HumanEval completions), or
    `--target`'s with chat-templated MT-Bench and HumanEval prompts."""
    if args.target is None:
        tokenizer = load_kit_tokenizer()
        texts = load_kit_prompts("heldout", args.prompts) + load_kit_prompts("humaneval", args.prompts)
        return load_kit_model("target"), tokenizer, [tokenizer(t, return_tensors="pt").input_ids for t in texts]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = pretrained_source(args.target)
    tokenizer = AutoTokenizer.from_pretrained(source)
    target = AutoModelForCausalLM.from_pretrained(source, attn_implementation="sdpa").eval()
    texts = PROMPT_SETS["mt_bench"].load(args.prompts) + PROMPT_SETS["humaneval"].load(args.prompts)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      return_tensors="pt").input_ids
        for text in texts
    ]  # fmt: skip
    return target, tokenizer, prompts


def configs(budgets, temperatures, lookups):
    for lookup in lookups:
        for temperature in temperatures:
            for budget in budgets:
                fields = {"budget": budget, "lookup": lookup}
                if temperature:
                    fields.update(verifier="tev", seed=0)
                yield fields, temperature


def plain_step(target, input_ids, temperature, max_new_tokens, repeats) -> float:
    """Seconds of one plain `generate` step on this prompt: (t(N) - t(1)) / (N - 1), each the best of `repeats`."""
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature else {"do_sample": False}

    def best(tokens):
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            target.generate(input_ids, max_new_tokens=tokens, min_new_tokens=tokens, eos_token_id=None, **sampling)
            times.append(time.perf_counter() - started)
        return min(times)

    return (best(max_new_tokens) - best(1)) / (max_new_tokens - 1)


def measure(decoders, target, prompts, fields, temperature, args):
    """Per decoder: each quantity's per-prompt minimum over the repeats, averaged over prompts; tau's mean; and
    whether every decoder gave the same tokens (the first repeat's). Also a plain step, averaged over prompts."""
    per = {d.name: [] for d in decoders}
    tokens = {d.name: [] for d in decoders}
    for input_ids in prompts:
        best = {d.name: {} for d in decoders}
        for repeat in range(args.repeats):
            order = decoders[repeat % len(decoders) :] + decoders[: repeat % len(decoders)]
            for decoder in order:
                result = decoder.run(target, input_ids, fields, temperature, args.max_new_tokens)
                if repeat == 0:
                    tokens[decoder.name].append(result.pop("tokens"))
                result.pop("tokens", None)
                kept = best[decoder.name]
                for key, value in result.items():
                    kept[key] = value if key == "tau" else min(kept.get(key, value), value)
        step = plain_step(target, input_ids, temperature, args.max_new_tokens, args.repeats)
        for decoder in decoders:
            per[decoder.name].append({**best[decoder.name], "plain": step})
    means = {name: {key: statistics.mean(p[key] for p in rows) for key in rows[0]} for name, rows in per.items()}
    same = len({str(t) for t in tokens.values()}) == 1
    return means, same


def row(means) -> str:
    m = {key: 1e3 * value for key, value in means.items() if key != "tau"}
    share = 100 * means["own"] / means["cycle"]
    return (
        f"{m['cycle']:7.2f} {m['target']:7.2f} {m['drafter']:7.2f} {m['own']:6.2f} {share:5.1f}% "
        f"| {m['draft']:5.2f} {m['build']:5.2f} {m['forward']:6.2f} {m['verify']:5.2f} | {means['tau']:4.2f} "
        f"| {m['plain']:7.2f} {means['cycle'] / means['plain']:5.3f}"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--target", default=None, help="a packaged Hub id or a folder (default: the kit's target)")
    parser.add_argument("--drafter", default="drafter-dflash-l135", help="a kit drafter, or a folder with --target")
    parser.add_argument("--prompts", type=int, default=3, help="prompts of each kit set (held-out, HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--budgets", default="4,16,64,auto")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--lookup", default="off,on", help="off, on, or both: off,on")
    parser.add_argument("--repeats", type=int, default=3, help="runs per prompt; each quantity's minimum is kept")
    parser.add_argument("--baseline", help="a git revision of hf_tev to measure side by side (as hf_tev_old)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    hf_tev.disable()  # both decoders through transformers' own custom_generate route
    target, tokenizer, prompts = models_and_prompts(args)
    timer = CycleTimer()
    timer.hook_target(target)
    decoders = []
    if args.baseline:
        old_loop, old_kit = load_baseline(args.baseline)
        old_drafter = (
            old_kit.load_kit_model(args.drafter)
            if args.target is None
            else sys.modules["hf_tev_old"].DFlashDraftModel.from_pretrained(args.drafter).eval()
        )
        decoders.append(Decoder(f"old {args.baseline}", old_loop, old_drafter, timer))
    new_drafter = (
        load_kit_model(args.drafter)
        if args.target is None
        else hf_tev.DFlashDraftModel.from_pretrained(args.drafter).eval()
    )
    decoders.append(Decoder("new", new_loop, new_drafter, timer))
    budgets = [b if b == "auto" else int(b) for b in args.budgets.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    lookups = [flag == "on" for flag in args.lookup.split(",")]
    load = load_average()  # None where the OS has no load average
    load = "n/a" if load is None else f"{load:.2f}"
    print(
        f"{args.target or 'kit target'} + {args.drafter}, {len(prompts)} prompts x {args.max_new_tokens} tokens, "
        "torch threads "
        f"{torch.get_num_threads()}, best of {args.repeats} per prompt, 1-min load {load} on {os.cpu_count()} cores"
    )
    print(
        "ms per cycle: cycle target drafter own own% | TEVStats: draft build forward verify | tau | plain cycle/plain"
    )
    with torch.no_grad():
        for fields, temperature in configs(budgets, temperatures, lookups):
            means, same = measure(decoders, target, prompts, fields, temperature, args)
            label = f"B={fields['budget']!s:4s} T={temperature:g} lookup={'on ' if fields['lookup'] else 'off'}"
            for decoder in decoders:
                print(f"{label} {decoder.name:12s} {row(means[decoder.name])}", flush=True)
            if len(decoders) > 1:
                old, new = (means[d.name] for d in decoders)
                print(
                    f"{label} new/old      cycle {new['cycle'] / old['cycle']:.3f} own {new['own'] / old['own']:.3f} "
                    f"drafter {new['drafter'] / old['drafter'] if old['drafter'] else float('nan'):.3f}; "
                    f"tokens identical: {same}",
                    flush=True,
                )
    print(f"1-min load at the end {load_average()}")


if __name__ == "__main__":
    main()
