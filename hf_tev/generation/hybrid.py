"""The tree pass of linear-attention layers (gated DeltaNet: Qwen3.5, Qwen3.5-MoE, Qwen3-Next): a state per node.

A linear-attention layer summarises the sequence in a running state (a recurrent state and the conv window of
its last inputs), so a tree mask alone cannot make a node see its own path only. In the tree pass each such layer
instead computes every node's output from its own path, for all nodes of all rows at once, with the layer's own
weights (projections, conv, `A_log` / `dt_bias` gates, gated norm, output projection):

- the conv: each node's window is gathered from its own ancestors, then the committed inputs before the root;
- the recurrence: transformers' chunked form of the gated delta rule (`torch_chunk_gated_delta_rule`, which
  solves a chunk of tokens at once with a triangular system) with the tree in place of the chunk: the causal mask
  becomes the ancestor mask and the decay is summed along each node's path. A node's output is then the one the
  recurrence gives along its own path, exactly (up to float rounding, as a chunked prefill and one-token steps
  differ); a chain is the chunk itself. Depth costs nothing extra: no per-depth loop.

No state is kept per node: each node's key, corrected value, path decay and conv input go into the layer's cache
(`hf_tev.target_layers.TreeStateLayer`), from which the commit builds the accepted path's final recurrent state
and conv window (docs/design.md#hybrid-targets).

How the structure reaches the layers: the tree pass's masks are a mapping per layer type, and the model hands
each layer its own entry, so the `linear_attention` entry is a `NodeTree` (`tree_pass_masks`). For the duration of
the pass, each linear-attention module's forward is wrapped (`linear_attention_trees`); the wrapper takes the
tree path when its mask is a `NodeTree` and calls the layer's own forward unchanged otherwise, so other calls
of the same model (another thread's plain `generate`) are not affected.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from dataclasses import dataclass

import torch
from transformers.activations import ACT2FN

from ..target_layers import LINEAR_ATTENTION_FAMILIES, layer_types

_MODULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its linear-attention modules
_WRAPPED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> [passes using the wrapper, saved]
_LOCK = threading.Lock()


def linear_attention_modules(model) -> tuple:
    """The target's linear-attention modules (their `layer_idx` indexes the cache), () for other targets."""
    modules = _MODULES.get(model)
    if modules is None:
        config = model.config.get_text_config()
        linear = "linear_attention" in layer_types(model) and config.model_type in LINEAR_ATTENTION_FAMILIES
        modules = tuple(
            module for module in model.modules() if linear and hasattr(module, "conv1d") and hasattr(module, "A_log")
        )
        _MODULES[model] = modules
    return modules


@dataclass
class NodeTree:
    """The tree pass's structure, as the linear-attention layers read it: `rows` trees padded to `nodes` nodes.

    `visibility` `[R, N, N]`: node j is node i's ancestor or i itself (a padding node sees itself only).
    `conv_index` `[R, N * kernel]`: for node i and m = 0 .. kernel - 1, where the input m steps back on its path is
    in the row's sequence `[committed conv window (kernel inputs), nodes]`: node a at `kernel + a`, the committed
    input m - depth steps before the root at `kernel - (m - depth)`.
    """

    rows: int
    nodes: int
    visibility: torch.Tensor
    conv_index: torch.Tensor

    @classmethod
    def of(cls, trees, nodes: int, kernel: int) -> NodeTree:
        """The structure of `trees` (one per row) padded to `nodes` nodes, for conv windows of `kernel` inputs."""
        device = trees[0].tokens.device
        visibility = torch.eye(nodes, dtype=torch.bool, device=device).repeat(len(trees), 1, 1)
        index = []
        for row, tree in enumerate(trees):
            visibility[row, : tree.num_nodes, : tree.num_nodes] = tree.visibility
            parents = tree.lists.parents + [-1] * (nodes - tree.num_nodes)  # padding nodes: roots of their own
            for node in range(nodes):
                walk, before = node, 0  # up the path, then back through the committed inputs
                for _ in range(kernel):
                    if walk >= 0:
                        index.append(kernel + walk)
                        walk = parents[walk]
                    else:
                        before += 1
                        index.append(kernel - before)
        conv_index = torch.tensor(index, dtype=torch.long).view(len(trees), nodes * kernel).to(device)
        return cls(len(trees), nodes, visibility, conv_index)


def tree_pass_masks(model, trees, masks, nodes: int):
    """The tree pass's `masks` for a target without linear-attention layers; for one with them, the mapping per
    layer type with the trees' `NodeTree` as the `linear_attention` entry (`masks` for the full-attention layers:
    None for a root alone with nothing hidden, where the target's own masks apply)."""
    if not linear_attention_modules(model):
        return masks
    node_tree = NodeTree.of(trees, nodes, model.config.get_text_config().linear_conv_kernel_dim)
    if isinstance(masks, dict):
        return {**masks, "linear_attention": node_tree}
    return {"full_attention": masks, "linear_attention": node_tree}


@contextlib.contextmanager
def linear_attention_trees(model, masks):
    """While the block runs, the target's linear-attention modules take `NodeTree` masks (the tree path); a no-op
    unless `masks` carries one. Wrappers are counted per module, so passes in several threads share them."""
    if not (isinstance(masks, dict) and isinstance(masks.get("linear_attention"), NodeTree)):
        yield
        return
    modules = linear_attention_modules(model)
    with _LOCK:
        for module in modules:
            wrap(module)
    try:
        yield
    finally:
        with _LOCK:
            for module in modules:
                unwrap(module)


def wrap(module) -> None:
    entry = _WRAPPED.get(module)
    if entry is None:
        saved = module.__dict__.get("forward")  # an instance forward someone set before (accelerate's hooks)
        module.__dict__["forward"] = functools.partial(dispatch, module, module.forward)
        entry = _WRAPPED[module] = [0, saved]
    entry[0] += 1


def unwrap(module) -> None:
    entry = _WRAPPED[module]
    entry[0] -= 1
    if entry[0] == 0:
        del _WRAPPED[module]
        if entry[1] is None:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = entry[1]


def dispatch(module, forward, *args, **kwargs):
    """A linear-attention module's forward while a tree pass may be running: the tree path for a `NodeTree`
    mask, the module's own forward for anything else."""
    nodes = kwargs.get("attention_mask")
    if not isinstance(nodes, NodeTree):
        return forward(*args, **kwargs)
    hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    return tree_linear_attention(module, hidden_states, kwargs["cache"].layers[module.layer_idx], nodes)


def project(module, hidden_states: torch.Tensor):
    """The module's input projections of `hidden_states` `[R, N, hidden]`: `(conv inputs [R, N, C], z
    [R, N, H, Dv], b [R, N, H], a [R, N, H])`, in Qwen3.5's layout (`in_proj_qkv`, `in_proj_z`, `in_proj_b`,
    `in_proj_a`) or Qwen3-Next's (`in_proj_qkvz`, `in_proj_ba`, regrouped by the module's own
    `fix_query_key_value_ordering`)."""
    if hasattr(module, "in_proj_qkvz"):
        projected = module.in_proj_qkvz(hidden_states), module.in_proj_ba(hidden_states)
        query, key, value, z, b, a = module.fix_query_key_value_ordering(*projected)
        inputs = torch.cat([x.reshape(*x.shape[:2], -1) for x in (query, key, value)], dim=-1)
        return inputs, z, b, a
    z = module.in_proj_z(hidden_states).reshape(*hidden_states.shape[:2], -1, module.head_v_dim)
    return module.in_proj_qkv(hidden_states), z, module.in_proj_b(hidden_states), module.in_proj_a(hidden_states)


def tree_conv(module, inputs: torch.Tensor, committed: torch.Tensor, nodes: NodeTree) -> torch.Tensor:
    """The causal conv of every node over its own path: `inputs` `[R, N, C]`, `committed` `[R, C, kernel]` (the
    cache's conv window) -> `[R, N, C]` after the activation, as `causal_conv1d_update` computes one step."""
    weight = module.conv1d.weight.squeeze(1)  # [C, kernel]
    kernel, channels = weight.shape[1], weight.shape[0]
    sequence = torch.cat([committed.transpose(1, 2), inputs.to(committed.dtype)], dim=1)  # [R, kernel + N, C]
    index = nodes.conv_index[..., None].expand(-1, -1, channels)
    windows = sequence.gather(1, index).view(nodes.rows, nodes.nodes, kernel, channels)  # m steps back, m < kernel
    out = torch.einsum("rnmc,cm->rnc", windows.to(weight.dtype), weight.flip(-1))
    if module.conv1d.bias is not None:
        out = out + module.conv1d.bias
    return ACT2FN[module.activation](out).to(inputs.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """As transformers' gated-DeltaNet fallbacks normalise queries and keys (the FLA library's form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def tree_gated_delta_rule(query, key, value, g, beta, initial_state, visibility):
    """`torch_chunk_gated_delta_rule` (with `use_qk_l2norm_in_kernel=True`) over a tree instead of a chunk.

    For a chunk, the gated delta rule's outputs solve a unit lower-triangular system whose entries pair each token
    with the tokens before it, decayed by the gates summed between them. Along a tree node's path the same holds
    with the node's ancestors in place of the tokens before it: the mask becomes the ancestor mask and the decay is
    summed along the path. Nodes come after their ancestors, so the system stays lower-triangular.

    Args:
        query, key (`torch.Tensor` of shape `(R, N, Hk, Dk)`), value (`(R, N, H, Dv)`), g, beta (`(R, N, H)`).
        initial_state (`torch.Tensor` of shape `(R, H, Dk, Dv)`): the committed recurrent state.
        visibility (`torch.BoolTensor` of shape `(R, N, N)`): ancestors-or-self.
    Returns:
        `(output (R, N, H, Dv), keys (R, H, N, Dk), values (R, H, N, Dv), decays (R, H, N))`: the outputs in the
        query's dtype, and per node the normalised key, corrected value and path decay (float32) from which
        `TreeStateLayer.settle` builds a path's final state.
    """
    heads = value.shape[2]
    if query.shape[2] != heads:  # grouped value attention, as the fallbacks repeat them
        query = query.repeat_interleave(heads // query.shape[2], dim=2)
        key = key.repeat_interleave(heads // key.shape[2], dim=2)
    dtype = query.dtype
    query, key, value, beta, g = [x.transpose(1, 2).float().contiguous() for x in (query, key, value, beta, g)]
    query, key = l2norm(query), l2norm(key)
    query = query * query.shape[-1] ** -0.5
    decays = torch.einsum("rij,rhj->rhi", visibility.float(), g)  # [R, H, N]: summed along each path
    pairwise = (decays[..., :, None] - decays[..., None, :]).masked_fill(~visibility[:, None], float("-inf")).exp()
    key_beta, value_beta = key * beta[..., None], value * beta[..., None]
    system = (key_beta @ key.transpose(-1, -2)) * pairwise  # its strictly lower part: ancestors only
    new_values = torch.linalg.solve_triangular(system, value_beta, upper=False, unitriangular=True)
    key_decays = torch.linalg.solve_triangular(
        system, key_beta * decays.exp()[..., None], upper=False, unitriangular=True
    )
    state = initial_state.float()
    values = new_values - key_decays @ state  # [R, H, N, Dv]
    output = (query * decays.exp()[..., None]) @ state + ((query @ key.transpose(-1, -2)) * pairwise) @ values
    return output.transpose(1, 2).to(dtype), key, values, decays


def tree_linear_attention(module, hidden_states: torch.Tensor, layer, nodes: NodeTree) -> torch.Tensor:
    """One linear-attention layer over every node of the tree pass, each on its own path.

    Args:
        module: the layer's gated-DeltaNet module (its weights).
        hidden_states (`torch.Tensor` of shape `(R, N, hidden)`): the layer's input for every node.
        layer (`TreeStateLayer`): the layer's cache: the committed states, and the window the nodes' pieces go to.
    Returns:
        The layer's output `(R, N, hidden)`.
    """
    rows, width = hidden_states.shape[:2]
    layer.settle()  # its states are the committed ones (after the last pass's accepted path)
    inputs, z, b, a = project(module, hidden_states)
    mixed = tree_conv(module, inputs, layer.conv_states[0], nodes)
    query, key, value = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    query = query.reshape(rows, width, -1, module.head_k_dim)
    key = key.reshape(rows, width, -1, module.head_k_dim)
    value = value.reshape(rows, width, -1, module.head_v_dim)
    beta = b.sigmoid()
    g = -module.A_log.float().exp() * torch.nn.functional.softplus(a.float() + module.dt_bias)
    core, keys, values, decays = tree_gated_delta_rule(
        query, key, value, g, beta, layer.recurrent_states[0], nodes.visibility
    )
    layer.open_window(inputs, keys, values, decays)
    core = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(rows, width, -1))


def text_position_ids(model_kwargs: dict) -> dict:
    """`model_kwargs` with 2D position ids: the Qwen3.5 multimodal wrapper's `generate` passes `(4, R, n)` ids (the
    text positions, then its three multimodal rope axes), which for a text prompt all equal the text positions;
    the model expands 2D ids back the same way. Ids whose axes differ (a prompt with images or video) are refused:
    tree decoding takes text prompts."""
    positions = model_kwargs.get("position_ids")
    if not isinstance(positions, torch.Tensor) or positions.dim() != 3:
        return model_kwargs
    if not bool((positions == positions[:1]).all()):
        raise ValueError(
            f"`position_ids` of shape {tuple(positions.shape)} hold multimodal rope positions that differ from the "
            "text positions (a prompt with images or video): hf_tev's tree decoding takes text prompts."
        )
    return {**model_kwargs, "position_ids": positions[0]}
