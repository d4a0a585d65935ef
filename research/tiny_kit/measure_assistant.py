"""How well the assistant-ar predicts the target, teacher-forced on held-out code.

On fixed windows of the held-out split (research/tiny_kit/build/heldout.bin, from build_corpus.py) it
reports, per position:
    greedy_agreement   P(argmax q == argmax p): the chance that one greedy draft token is accepted
    expected_accept_t1 E[sum_x min(p(x), q(x))] = 1 - total variation: the chance that one draft
                       token is accepted by speculative sampling at temperature 1
    loss_assistant, loss_target  next-token cross-entropy (nats/token) of each model
with p the target's and q the assistant's next-token distribution. Prints one JSON object.

Run:
    nice -n 10 python research/tiny_kit/measure_assistant.py
"""

import argparse
import json
from pathlib import Path

import numpy as np
import paths
import torch


@torch.no_grad()
def compare(target, assistant, windows: torch.Tensor, batch_size: int = 8) -> dict[str, float]:
    sums = {"greedy_agreement": 0.0, "expected_accept_t1": 0.0, "loss_assistant": 0.0, "loss_target": 0.0}
    count = 0
    for chunk in windows.split(batch_size):  # chunk: [b, L + 1]
        inputs, labels = chunk[:, :-1], chunk[:, 1:].flatten()
        logp = target(inputs).logits.float().log_softmax(-1).flatten(0, 1)  # [b*L, V]
        logq = assistant(inputs).logits.float().log_softmax(-1).flatten(0, 1)  # [b*L, V]
        sums["greedy_agreement"] += (logp.argmax(-1) == logq.argmax(-1)).sum().item()
        sums["expected_accept_t1"] += torch.minimum(logp.exp(), logq.exp()).sum().item()
        sums["loss_target"] -= logp.gather(1, labels[:, None]).sum().item()
        sums["loss_assistant"] -= logq.gather(1, labels[:, None]).sum().item()
        count += labels.numel()
    return {name: round(value / count, 4) for name, value in sums.items()} | {"positions": count}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=paths.model_path("target"))
    parser.add_argument("--assistant", type=Path, default=paths.model_path("assistant-ar"))
    parser.add_argument("--heldout", type=Path, default=paths.BUILD / "heldout.bin")
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    tokens = np.memmap(args.heldout, dtype=np.uint16, mode="r")
    starts = np.linspace(0, len(tokens) - args.seq_len - 1, args.windows).astype(np.int64)
    windows = torch.from_numpy(np.stack([tokens[s : s + args.seq_len + 1] for s in starts]).astype(np.int64))
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    assistant = AutoModelForCausalLM.from_pretrained(args.assistant, dtype=torch.float32).eval()
    print(json.dumps({"windows": args.windows, "seq_len": args.seq_len, **compare(target, assistant, windows)}))


if __name__ == "__main__":
    main()
