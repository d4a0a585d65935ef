"""What a tree pass costs on a hybrid target (gated-DeltaNet linear attention + full attention), side by side.

    python benchmarks/hybrid_tree_cost.py --threads 1

A tiny random Qwen3.5 text target (hidden 128, 8 layers: 6 linear attention, 2 full attention) and a Qwen3 target
of the same attention shape (8 full-attention layers), float32, after a context of `--context` tokens. For
best-first trees of several sizes (a drafter-like peaked block of 15 depths), best of `--repeats`:

  - plain step: one token through the target (what plain `generate` pays per token);
  - tree pass: ONE hf_tev tree pass over the tree (each linear-attention layer computes every node on its own
    path at once; docs/design.md#hybrid-targets);
  - per path: one chain pass per root-to-leaf path, each from the committed cache (the leaves' paths cover every
    node): what verifying the same tree costs without a tree pass of the linear-attention layers.

Then the memory a tree node keeps in the linear-attention layers until the commit (measured in the cache's
windows, and for the config classes' default sizes), beside what a full state per node would take. Timings are
wall clock on this machine; only ratios measured side by side mean much.
"""

import argparse
import copy
import functools
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3_5TextConfig, Qwen3NextConfig

from hf_tev.generation.cache import PromptTreeInputs
from hf_tev.generation.forward import tree_forward
from hf_tev.generation.hybrid import linear_attention_modules
from hf_tev.target_layers import TreeStateLayer, full_length_cache, tree_state_bytes
from hf_tev.tree import build_tree


def make_target(model_type: str, vocab: int, seed: int = 0):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=128, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip
    if model_type == "qwen3_5_text":
        common |= dict(
            linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=32, linear_value_head_dim=32
        )
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **common)).eval()
    model.set_attn_implementation("sdpa")
    return model


def best(repeats: int, run) -> float:
    times = []
    for _ in range(repeats):
        times.append(run())
    return min(times)


def timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


class StepCache:
    """What a linear-attention layer reads and writes in a one-token step: the nodes' parents' full states."""

    def __init__(self, conv, recurrent):
        self.conv, self.recurrent = conv, recurrent

    def get_conv_state(self, layer_idx, state_idx=0):
        return self.conv

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return self.recurrent

    def is_recording_past(self, layer_idx):
        return False

    def update_recurrent_state(self, recurrent, layer_idx, state_idx=0, **kwargs):
        self.recurrent = recurrent
        return recurrent


def depth_by_depth(module, forward, levels, hidden_states, cache=None, **kwargs):
    """The alternative design: a full state per node, the nodes of one depth advanced at a time by the module's
    own one-token step from their parents' states (`levels`: per depth, the nodes and their parents' slots)."""
    layer = cache.layers[module.layer_idx]
    conv, recurrent = layer.conv_states[0], layer.recurrent_states[0]
    nodes = hidden_states.shape[1]
    convs, recurrents = conv.new_empty(1 + nodes, *conv.shape[1:]), recurrent.new_empty(1 + nodes, *recurrent.shape[1:])
    convs[0], recurrents[0] = conv[0], recurrent[0]  # slot 0: the committed states, slot 1 + i: node i's
    output = torch.zeros_like(hidden_states)
    for index, parents in levels:
        step = StepCache(convs[parents], recurrents[parents])
        output[0, index] = forward(hidden_states[0, index][:, None], cache=step)[:, 0]
        convs[1 + index], recurrents[1 + index] = step.conv, step.recurrent
    return output


def depth_by_depth_pass(target, tree, tokens, cache, masks, positions) -> float:
    depths, levels = [], []
    for node, parent in enumerate(tree.lists.parents):
        depths.append(0 if parent < 0 else depths[parent] + 1)
        if depths[-1] == len(levels):
            levels.append(([], []))
        levels[depths[-1]][0].append(node)
        levels[depths[-1]][1].append(1 + parent)
    levels = [(torch.tensor(index), torch.tensor(parents)) for index, parents in levels]
    modules = linear_attention_modules(target)
    for module in modules:
        module.forward = functools.partial(depth_by_depth, module, module.forward, levels)
    try:
        seconds = timed(lambda: target(tokens, cache=cache, position_ids=positions, attention_mask=masks))
    finally:
        for module in modules:
            del module.forward
    for layer in cache.layers:
        if not isinstance(layer, TreeStateLayer):  # the states were never changed: only the attention layers grew
            layer.crop(-tree.num_nodes)
    return seconds


def measure(target, prompt, tree, repeats: int) -> dict:
    past = prompt.shape[1]
    cache = full_length_cache(target)
    target(prompt, cache=cache)
    root = tree.tokens[:1][None]
    position = torch.tensor([[past]])

    def plain_step():
        step_cache = copy.deepcopy(cache)
        return timed(lambda: target(root, cache=step_cache, position_ids=position))

    inputs = PromptTreeInputs(target, past + tree.num_nodes, prompt.device)
    tokens, masks, positions = inputs([tree], past, [past])

    def tree_pass():
        seconds = timed(lambda: tree_forward(target, tokens, cache, masks, positions, None))
        cache.crop(-tree.num_nodes)  # the window goes: every layer back to the committed tokens
        return seconds

    leaves = [i for i in range(tree.num_nodes) if i not in set(tree.lists.parents)]
    paths = [tree.visibility[leaf].nonzero()[:, 0] for leaf in leaves]

    def per_path():
        total = 0.0
        for path in paths:
            path_cache = copy.deepcopy(cache)
            chain = tree.tokens[path][None]
            chain_positions = torch.arange(past, past + chain.shape[1])[None]
            total += timed(lambda: target(chain, cache=path_cache, position_ids=chain_positions))  # noqa: B023
        return total

    result = {name: best(repeats, run) for name, run in (("step", plain_step), ("tree", tree_pass))}
    if linear_attention_modules(target):
        result["depths"] = best(repeats, lambda: depth_by_depth_pass(target, tree, tokens, cache, masks, positions))
    result["paths"] = best(max(1, repeats // 2), per_path)
    tree_forward(target, tokens, cache, masks, positions, None)
    windows = [layer.window for layer in cache.layers if isinstance(layer, TreeStateLayer)]
    window_bytes = sum(piece.numel() * piece.element_size() for window in windows for piece in window)
    result["state_bytes_per_node"] = window_bytes / tree.num_nodes
    result["leaves"], result["depth"] = len(paths), tree.max_depth
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--sizes", default="4,16,32,64", help="drafted nodes per tree (root excluded)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    vocab = 4096
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (1, args.context), generator=generator)
    draft = torch.randn(15, vocab, generator=generator) * 2
    for rank, boost in enumerate((13.0, 11.0, 10.0)):  # a likely token per depth and two runners-up: deep trees
        draft[torch.arange(15), torch.randint(3, vocab, (15,), generator=generator)] += boost - rank
    logprobs = torch.log_softmax(draft, -1)
    targets = {name: make_target(name, vocab) for name in ("qwen3_5_text", "qwen3")}
    print(f"threads {args.threads}, context {args.context}, float32, best of {args.repeats} (per path: of "
          f"{max(1, args.repeats // 2)})\n")  # fmt: skip
    print(
        "| target | tree nodes (depth, leaves) | plain step | tree pass | per path | depth by depth | tree / step | "
        "per path / tree | depth by depth / tree |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    state_bytes = None
    for size in [int(s) for s in args.sizes.split(",")]:
        tree = build_tree(logprobs, size, torch.tensor(5))
        for name, target in targets.items():
            with torch.no_grad():
                r = measure(target, prompt, tree, args.repeats)
            state_bytes = r["state_bytes_per_node"] if name == "qwen3_5_text" else state_bytes
            depths, tree_s = r.get("depths"), r["tree"]
            by_depth = ("-", "-") if depths is None else (f"{1e3 * depths:.2f} ms", f"{depths / tree_s:.1f}x")
            print(
                f"| {name} | {tree.num_nodes} ({r['depth']}, {r['leaves']}) | {1e3 * r['step']:.2f} ms | "
                f"{1e3 * tree_s:.2f} ms | {1e3 * r['paths']:.2f} ms | {by_depth[0]} | {tree_s / r['step']:.1f}x | "
                f"{r['paths'] / tree_s:.1f}x | {by_depth[1]} |"
            )
    hybrid = targets["qwen3_5_text"]
    print(f"\nkept per tree node in the linear-attention layers: {state_bytes / 2**10:.1f} KiB measured in the "
          f"cache's windows, {tree_state_bytes(hybrid) / 2**10:.1f} KiB by `tree_state_bytes` (6 layers); a full "
          f"state per node would be {full_state_bytes(hybrid.config, 4) / 2**10:.1f} KiB")  # fmt: skip
    for config in (Qwen3_5TextConfig(), Qwen3NextConfig()):
        stand_in = argparse.Namespace(config=config, dtype=torch.bfloat16)
        print(
            f"{config.model_type} config defaults ({config.layer_types.count('linear_attention')} linear-attention "
            f"layers, bfloat16): {tree_state_bytes(stand_in) / 2**20:.2f} MiB kept per tree node; a full state per "
            f"node would be {full_state_bytes(config, 2) / 2**20:.1f} MiB"
        )


def full_state_bytes(config, dtype_bytes: int) -> int:
    """A node's own recurrent state (float32) and conv window, over all linear-attention layers."""
    heads, key_dim, value_dim = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    conv_dim = 2 * config.linear_num_key_heads * key_dim + heads * value_dim
    per_layer = heads * key_dim * value_dim * 4 + conv_dim * config.linear_conv_kernel_dim * dtype_bytes
    return config.layer_types.count("linear_attention") * per_layer


if __name__ == "__main__":
    main()
