"""Tree speculative decoding inside `model.generate`.

`hf_tev.route` turns `generate(..., assistant_model=drafter, tev_config=...)` into transformers' supported
`custom_generate` route, so generate still prepares the logits processors, stopping criteria, special tokens,
length limits and cache, and then hands the loop the call resolved before (`decode_with_trees`). The documented
entry of its own, `generate(custom_generate=hf_tev.tree_speculative_decode, drafter=..., tev_config=...)`, goes
through the route too, or, without it, resolves its call the same way (`custom_generate`).

Modules, one concern each, in the order of a cycle (docs/design.md#the-decoding-loop):
  `candidates`  stages 1-2: the tree candidate generator (drafting, tree building)
  `forward`     stages 0 and 3: prefill, the tree pass
  `processors`  logits processors on a tree (the processor contract)
  `verifier`    stage 4: processing, the exact decision, the cache commit
  `cache`       cache surgery and the tree pass's masks (one prompt, batches)
  `hybrid`      the tree pass of linear-attention layers (Qwen3.5, Qwen3-Next): each node on its own path
  `auto`        the automatic budget's kept state and the size stage
  `checks`      checks of the prepared inputs, models and cache, before any model call
  `custom_generate`  `tree_speculative_decode`, the decoder as transformers' own hook: what it drops, recovered
                from the generate call or refused, then the call resolved as on the route
  `outputs`     stops, the stage clock, what generate returns
  `loop`        the loop of a resolved call: one cycle for every batch size
"""

from .auto import automatic_budget, forget_budgets
from .candidates import TreeCandidateGenerator
from .custom_generate import tree_speculative_decode
from .loop import decode_cycle, decode_with_trees, start, tree_pass_and_verify
from .outputs import TEVGenerateOutput

__all__ = [
    "TEVGenerateOutput",
    "TreeCandidateGenerator",
    "automatic_budget",
    "decode_cycle",
    "decode_with_trees",
    "forget_budgets",
    "start",
    "tree_pass_and_verify",
    "tree_speculative_decode",
]
