"""`TEVConfig` (how a `generate` call decodes with trees), `TEVStats` (what one call measured) and
`temperature_sampling` (`generate`'s arguments of pure temperature sampling).

Plain Python: importing this module does not import transformers.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from .tree import TREE_BUILDERS
from .verify import SAMPLING_VERIFIERS

# The largest tree a cycle may draft (`budget`, `max_budget`). One cycle holds about N x vocab logits several
# times over (raw, float32, processed) and an N x (max_length + N) mask for N = budget + 1 nodes; past a few
# thousand nodes a tree costs far more than it can return (tau is bounded by the drafter's block size).
MAX_TREE_NODES = 4096


@dataclass
class TEVConfig:
    """How `generate(..., assistant_model=drafter, tev_config=TEVConfig(...))` decodes.

    Args:
        budget (`int` or `"auto"`, defaults to `"auto"`): drafted tree nodes per cycle, the root excluded; 0 is
            plain decoding. `"auto"` chooses every cycle's size by expected tokens per second from the
            drafter's confidence, calibrated online against what the target accepts, and the measured cost of
            a cycle on this machine, down to plain decoding when no tree pays (`hf_tev.budget`,
            docs/design.md#the-automatic-budget). What it learns (the calibration, the cost model, the drafter's
            pauses) is kept for later calls on the same models.
        max_budget (`int`, defaults to 128): the largest tree `"auto"` may choose.

            `budget` and `max_budget` are at most `MAX_TREE_NODES` (4096); a call whose largest tree would take
            more than 1 GiB per cycle warns with the estimate (`tree_memory_bytes`).
        verifier (`str`, defaults to `"tev"`): `"tev"` (Tree Exit Verification), `"predraw"` (DDTree's
            predraw-and-follow) or `"residual"` (sequential residual). All are exact and share one output law;
            at temperature 0 (greedy) all three reduce to the same argmax walk (`VERIFIERS["greedy"]`).
        tree (`str`, defaults to `"best_first"`): a tree source of `hf_tev.tree.TREE_BUILDERS`: `"best_first"`
            (DDTree's builder) or `"chain"` (one argmax child per depth, plain DFlash; at most
            `min(budget, block_size - 1)` nodes).
        block_size (`int`, *optional*): drafting block (root + masks), at most the drafter's own block size.
        seed (`int`, *optional*): seeds a private `torch.Generator` for the verifier's draws: any seed
            `torch.Generator.manual_seed` takes, -2**63 <= seed < 2**64 (a negative seed is seed + 2**64). `None`
            uses torch's global RNG, like `generate` itself, so `torch.manual_seed` before the call reproduces a
            run of a fixed `budget`. With `"auto"` the tree sizes follow measured times and earlier calls, and the
            draws a cycle makes follow its tree, so a seed reproduces the output law (exact either way), not the
            sample.
        lookup (`bool` or `"auto"`, defaults to `"auto"`): add context drafts to the tree (`hf_tev.lookup`,
            docs/design.md#context-drafts): continuations of earlier occurrences of the text's last n tokens (plus
            the root), merged with the drafter's candidates in one best-first order. With no `assistant_model` it
            is tree lookup decoding with no drafter at all. `"auto"` decides per call (`for_call`): on for greedy
            decoding, where they pay (the kit: docs/usage.md#what-to-expect), off for sampling, where they do
            not, and off where `no_repeat_ngram_size` bans the repeats they propose.
        lookup_min_ngram (`int`, defaults to 1), lookup_max_ngram (`int`, defaults to 3): match lengths tried,
            longest first. lookup_length (`int`, defaults to 10): tokens per continuation. lookup_branches
            (`int`, defaults to 3): distinct continuations per cycle.

    Fields are checked on construction and again when a call uses the config (`validate`), so a field
    changed afterwards cannot slip through.
    """

    budget: int | str = "auto"
    verifier: str = "tev"
    tree: str = "best_first"
    block_size: int | None = None
    seed: int | None = None
    max_budget: int = 128
    lookup: bool | str = "auto"
    lookup_min_ngram: int = 1
    lookup_max_ngram: int = 3
    lookup_length: int = 10
    lookup_branches: int = 3

    def __post_init__(self):
        self.validate()

    def validate(self) -> TEVConfig:
        """Raise a clear error for any field out of range (or an attribute that is no field); return the config."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(vars(self)) - known)
        if unknown:
            raise ValueError(f"TEVConfig has no fields {unknown} (set after construction?); fields: {sorted(known)}")
        self._check_budgets()
        if self.verifier not in SAMPLING_VERIFIERS:
            raise ValueError(f"TEVConfig.verifier must be one of {list(SAMPLING_VERIFIERS)}, got {self.verifier!r}")
        if self.tree not in TREE_BUILDERS:
            raise ValueError(f"TEVConfig.tree must be one of {list(TREE_BUILDERS)}, got {self.tree!r}")
        if self.block_size is not None and (
            isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 2
        ):
            raise ValueError(
                f"TEVConfig.block_size must be an int >= 2 (root + at least one mask), got {self.block_size!r}"
            )
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"TEVConfig.seed must be an int or None, got {type(self.seed).__name__}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(
                f"TEVConfig.seed must be in [-2**63, 2**64) (the seeds torch.Generator.manual_seed takes), "
                f"got {self.seed}"
            )
        self._check_lookup()
        return self

    def _check_budgets(self) -> None:
        if isinstance(self.budget, str):
            if self.budget != "auto":
                raise ValueError(f'TEVConfig.budget must be an int >= 0 or "auto", got {self.budget!r}')
        elif isinstance(self.budget, bool) or not isinstance(self.budget, int):
            raise TypeError(f'TEVConfig.budget must be an int or "auto", got {type(self.budget).__name__}')
        elif not 0 <= self.budget <= MAX_TREE_NODES:
            raise ValueError(
                f"TEVConfig.budget must be in [0, {MAX_TREE_NODES}] (0 = plain decoding; a tree of N nodes holds "
                f"N x vocab logits per cycle), got {self.budget}"
            )
        if (
            isinstance(self.max_budget, bool)
            or not isinstance(self.max_budget, int)
            or not 1 <= self.max_budget <= MAX_TREE_NODES
        ):
            raise ValueError(f"TEVConfig.max_budget must be an int in [1, {MAX_TREE_NODES}], got {self.max_budget!r}")

    def _check_lookup(self) -> None:
        if not isinstance(self.lookup, bool) and self.lookup != "auto":
            raise TypeError(f'TEVConfig.lookup must be a bool or "auto", got {self.lookup!r}')
        for name in ("lookup_min_ngram", "lookup_max_ngram", "lookup_length", "lookup_branches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
                raise ValueError(f"TEVConfig.{name} must be an int in [1, 64], got {value!r}")
        if self.lookup is True and self.tree != "best_first":
            raise ValueError(
                f'TEVConfig.lookup merges context drafts into the best-first tree: tree must be "best_first", '
                f"got {self.tree!r}"
            )
        if self.lookup_min_ngram > self.lookup_max_ngram:
            raise ValueError(
                f"TEVConfig.lookup_min_ngram ({self.lookup_min_ngram}) exceeds "
                f"lookup_max_ngram ({self.lookup_max_ngram})"
            )

    def for_call(self, generation_config, has_drafter: bool) -> TEVConfig:
        """This config for one `generate` call, `lookup="auto"` decided: context drafts without a drafter (tree
        lookup decoding), and with one for greedy decoding of the best-first tree unless `no_repeat_ngram_size`
        bans the repeats they propose. They do not pay when sampling: the text's continuations are far less
        likely to be the target's draws (measured: docs/usage.md#what-to-expect)."""
        if self.lookup != "auto":
            return self
        lookup = not has_drafter or (
            not generation_config.do_sample
            and self.tree == "best_first"
            and not (getattr(generation_config, "no_repeat_ngram_size", None) or 0)
        )
        return dataclasses.replace(self, lookup=lookup)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def attach_to(self, generation_config):
        """Store this config as `generation_config.tev_config`, so that it is saved to and loaded from
        `generation_config.json` (as a dict of its fields, read back as a `TEVConfig`) and used by every
        `generate` call with a DFlash drafter.

        A plain `generation_config.tev_config = config` works too, on a fresh `GenerationConfig(...)`; a
        generation config transformers derived from the model config (`_from_model_config=True`, e.g. the
        `model.generation_config` of a checkpoint without `generation_config.json`) would drop the field when
        it is loaded again, so this method also clears that flag. Returns `generation_config`.
        """
        vars(generation_config).update(tev_config=self.validate(), _from_model_config=False)
        return generation_config

    @property
    def is_auto(self) -> bool:
        return self.budget == "auto"

    @property
    def largest_tree(self) -> int:
        """The most drafted nodes a cycle can have: `budget`, or `max_budget` for `"auto"`."""
        return self.max_budget if self.is_auto else self.budget

    @classmethod
    def coerce(cls, value) -> TEVConfig:
        """A validated `TEVConfig` from a `TEVConfig`, a plain dict of its fields (e.g. read back from a
        `generation_config.json`), or a `TEVConfig` of an earlier copy of this module (after
        `importlib.reload`, its class is another object with the same name)."""
        if isinstance(value, cls):
            return value.validate()
        if type(value).__module__ == cls.__module__ and type(value).__qualname__ == cls.__qualname__:
            return cls(**dataclasses.asdict(value))
        if isinstance(value, Mapping):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"tev_config has unknown fields {unknown}; TEVConfig fields are {sorted(known)}")
            return cls(**value)
        raise TypeError(f"`tev_config` must be an hf_tev.TEVConfig or a dict of its fields, got {type(value).__name__}")


FIELD_NAME = "tev_config"


class TEVConfigField:
    """`GenerationConfig.tev_config` read back as a `TEVConfig`.

    transformers saves an unknown generation-config field to `generation_config.json` and sets it again, as read,
    when the config is loaded: a `TEVConfig` would come back a plain dict. This data descriptor (put on
    `GenerationConfig` when transformers loads, unless `HF_TEV_NO_PATCH` is set) turns a dict of `TEVConfig`
    fields into a `TEVConfig` as it is set; anything else is stored as given (a dict that is no valid
    `TEVConfig`, say of a newer hf_tev, with a logged warning: the route refuses it by name when a call uses it,
    and the config still loads). A config that never set the field has no such attribute, as before, so
    transformers' own `hasattr` checks see no difference."""

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        try:
            return vars(instance)[FIELD_NAME]
        except KeyError:
            raise AttributeError(f"{type(instance).__name__!r} object has no attribute {FIELD_NAME!r}") from None

    def __set__(self, instance, value):
        if isinstance(value, Mapping):
            try:
                value = TEVConfig.coerce(value)
            except (TypeError, ValueError) as error:
                logging.getLogger(__name__).warning("generation config `tev_config` kept as a dict: %s", error)
        vars(instance)[FIELD_NAME] = value

    def __delete__(self, instance):
        if FIELD_NAME not in vars(instance):
            raise AttributeError(FIELD_NAME)
        del vars(instance)[FIELD_NAME]


def install_generation_config_field(configuration_utils) -> None:
    """Put `TEVConfigField` on `configuration_utils.GenerationConfig` (once; a `tev_config` transformers itself
    might define one day is left alone)."""
    config_class = configuration_utils.GenerationConfig
    existing = vars(config_class).get(FIELD_NAME)
    if existing is None or type(existing).__qualname__ == TEVConfigField.__qualname__:  # ours, maybe reloaded
        setattr(config_class, FIELD_NAME, TEVConfigField())


def tree_memory_bytes(nodes: int, vocab_size: int, max_length: int, dtype_bytes: int) -> int:
    """Estimated bytes one tree cycle of `nodes` nodes (root included) holds at once: the tree pass's logits in
    the model dtype, their float32 copy, the processed scores and the verifier's normalised rows (float32), and
    the `[nodes, max_length + nodes]` tree mask."""
    return nodes * vocab_size * (dtype_bytes + 3 * 4) + nodes * (max_length + nodes) * dtype_bytes


@dataclass
class TEVStats:
    """Per-cycle statistics of one tree-decoding call (one entry per cycle, seconds for times).

    `accepted_lengths[i]` is the cycle's block length as the paper counts it (tau: accepted drafted nodes + 1
    for the bonus token); `coverages[i]` is the tree's expected block length under the target, 1 + C.
    Stage times: `draft` (drafter forward), `build` (tree builder), `forward` (target tree pass),
    `verify` (the verifier stage: logits processing, decision and cache commit).
    """

    accepted_lengths: list[int] = field(default_factory=list)
    coverages: list[float] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    draft_times: list[float] = field(default_factory=list)
    build_times: list[float] = field(default_factory=list)
    forward_times: list[float] = field(default_factory=list)
    verify_times: list[float] = field(default_factory=list)
    prefill_time: float = 0.0
    # budget="auto": seconds of the tree-pass cost probe this call took (part of `prefill_time`; 0 when the models'
    # cost model was already measured)
    probe_time: float = 0.0
    # budget="auto": the block length predicted for each cycle's tree (A_cal; 1.0 when no tree was drafted)
    # and the cost model at the end of the call (milliseconds).
    predicted_lengths: list[float] = field(default_factory=list)
    budget_model: dict | None = None
    # accepted drafted nodes by who proposed them ("drafter", "lookup", "both"); every cycle adds one more
    # token, its bonus ("bonus"): the counts add up to the tokens the cycles emitted.
    accepted_by_source: dict = field(default_factory=dict)
    # a batch (`generate` of R > 1 prompts returns one TEVStats per row): per cycle of this row, the rows in the
    # batch's tree pass and its padded node count (draft, forward and verify times are the batch's, build times
    # the row's own).
    pass_rows: list[int] = field(default_factory=list)
    pass_nodes: list[int] = field(default_factory=list)

    def count_sources(self, sources: list[str] | None, path: list[int]) -> None:
        """Count one cycle's accepted nodes (`path`, root first) by source (`DraftTree.node_info.sources`; None:
        every node is the drafter's)."""
        counts = self.accepted_by_source
        for node in path[1:]:
            source = "drafter" if sources is None else sources[node]
            counts[source] = counts.get(source, 0) + 1
        counts["bonus"] = counts.get("bonus", 0) + 1

    def record(self, accepted: int, tree_size: int, draft: float, build: float, forward: float, verify: float):
        """One cycle's block length, drafted nodes and stage times."""
        self.accepted_lengths.append(accepted)
        self.tree_sizes.append(tree_size)
        self.draft_times.append(draft)
        self.build_times.append(build)
        self.forward_times.append(forward)
        self.verify_times.append(verify)

    @property
    def num_cycles(self) -> int:
        return len(self.accepted_lengths)

    @property
    def tau(self) -> float:
        """Mean output-block length including the bonus token."""
        return sum(self.accepted_lengths) / max(1, self.num_cycles)

    @property
    def mean_coverage(self) -> float:
        return sum(self.coverages) / max(1, len(self.coverages))

    def summary(self) -> dict:
        def mean(values):
            return sum(values) / max(1, len(values))

        return {
            "cycles": self.num_cycles,
            "tau": self.tau,
            "coverage": self.mean_coverage,
            "tree_size": mean(self.tree_sizes),
            "draft_s": mean(self.draft_times),
            "build_s": mean(self.build_times),
            "forward_s": mean(self.forward_times),
            "verify_s": mean(self.verify_times),
            "prefill_s": self.prefill_time,
            "probe_s": self.probe_time,
            "predicted_tau": mean(self.predicted_lengths) if self.predicted_lengths else None,
        }


def temperature_sampling(temperature: float) -> dict:
    """`generate`'s keyword arguments of pure temperature sampling at `temperature`: greedy at 0, else
    `do_sample=True` with top-k and top-p off (`top_k=0`, `top_p=1.0`), whatever the model's generation config
    sets. The bench, Draft-OPD's rollouts and `hf-tev train`'s response generation sample this way."""
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
