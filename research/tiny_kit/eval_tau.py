"""Mean output-block length tau of the kit's drafters with TEV, per budget and temperature, on held-out prompts.

    python research/tiny_kit/eval_tau.py --drafters drafter-dflash,drafter-finetuned,drafter-prefix,drafter-exittrain \
        --budgets 16,32,64,128 --temperatures 0,1 --prompts 16 --max-new-tokens 64 \
        --output research/tiny_kit/build/tau.json

`--drafters` takes kit drafter names (shipped in tiny_kit/hf_tev_tiny_kit/), the study drafters' names
(`paths.STUDY_DRAFTERS`) or drafter folders.

Prompts: the first `--prompts` held-out corpus prompts (`prompts/heldout.json`, files the target never saw)
and the first `--prompts` HumanEval prompts (`prompts/humaneval.json`), trailing whitespace stripped.
tau pools every cycle of every prompt (sum of block lengths / cycles); `1 + C` is the mean coverage of the
same trees. Every drafter sees the same prompts and, at T = 1, the same seeds.
"""

import argparse
import json
from pathlib import Path

import paths
import torch

import hf_tev
from hf_tev.packaged import load_kit_model, load_kit_prompts, load_kit_tokenizer


def load_prompts(count):
    tokenizer = load_kit_tokenizer()
    return {
        name: [tokenizer(prompt, return_tensors="pt").input_ids for prompt in load_kit_prompts(name, count)]
        for name in ("heldout", "humaneval")
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafters", default="drafter-dflash,drafter-finetuned,drafter-prefix,drafter-exittrain")
    parser.add_argument("--budgets", default="16,32,64,128")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default=str(paths.HERE / "tau.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target = load_kit_model("target")
    prompt_sets = load_prompts(args.prompts)
    drafters = {
        name: hf_tev.DFlashDraftModel.from_pretrained(paths.model_path(name)).eval()
        for name in args.drafters.split(",")
    }  # kit or study drafter names, or drafter folders
    records = []
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        sampling = dict(do_sample=True, temperature=temperature, top_k=0) if temperature > 0 else dict(do_sample=False)
        for budget in [int(b) for b in args.budgets.split(",")]:
            for set_name, prompts in prompt_sets.items():
                for name, drafter in drafters.items():
                    blocks, coverage = [], []
                    for index, input_ids in enumerate(prompts):
                        torch.manual_seed(index)  # the same seeds for every drafter
                        out = target.generate(
                            input_ids,
                            assistant_model=drafter,
                            max_new_tokens=args.max_new_tokens,
                            tev_config=hf_tev.TEVConfig(budget=budget, lookup=False),  # the drafter's own tau
                            return_dict_in_generate=True,
                            **sampling,
                        )
                        blocks += out.tev_stats.accepted_lengths
                        coverage += out.tev_stats.coverages
                    record = dict(
                        drafter=name,
                        budget=budget,
                        temperature=temperature,
                        prompt_set=set_name,
                        tau=sum(blocks) / len(blocks),
                        coverage=sum(coverage) / len(coverage),
                        cycles=len(blocks),
                        prompts=len(prompts),
                        max_new_tokens=args.max_new_tokens,
                    )
                    records.append(record)
                    print(
                        f"T={temperature:g} B={budget:<3} {set_name:<9} {name:<18} tau {record['tau']:.3f} "
                        f"1+C {record['coverage']:.3f} ({len(blocks)} cycles)",
                        flush=True,
                    )
    Path(args.output).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
