"""The settings of `hf-tev bench`: `BenchConfig`, checked in full before any model is loaded, and what
`generate` gets from them at each temperature (`sampling_kwargs`, `generate_kwargs_by_temperature`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import temperature_sampling
from ..packaged import KIT_DRAFTERS, default_drafter, kit_dir
from .methods import KIT_PROMPT_SETS, METHODS, PAPER_PROMPT_SETS, PROMPT_SETS, REFERENCE_METHOD

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class BenchConfig:
    """What `hf-tev bench` runs. Lists are comma-separated on the command line.

    Args:
        methods (`list[str]`, defaults to every method in `METHODS`): `ar` is always added (SR reference).
        drafters (`list[str]`, defaults to the kit drafters present, or with `target` the drafter trained for a
            packaged target, `hf_tev.packaged.default_drafter`): kit drafter names, or folders / Hub ids of DFlash
            drafters when `target` is given.
        budgets (`list[int | str]`, defaults to `["auto", 4, 16, 64]`): tree budgets B (drafted nodes, root excluded),
            or `"auto"` (the cost-aware automatic budget, `TEVConfig(budget="auto")`).
        temperatures (`list[float]`, defaults to `[0.0, 1.0]`): 0 is greedy; > 0 samples from the target's
            temperature-scaled distribution (the paper's setting), with top-k / top-p / min-p off unless set below.
        top_k (`int`, *optional*), top_p (`float`, *optional*), min_p (`float`, *optional*): truncation at T > 0,
            passed to `generate` when set; default off (`top_k=0, top_p=1.0, min_p=None`, whatever the model's
            generation config says).
        prompt_sets (`list[str]`, *optional*): names in `PROMPT_SETS`; default `KIT_PROMPT_SETS` on the kit,
            `PAPER_PROMPT_SETS` (MT-Bench, HumanEval, GSM8K, MATH-500: committed files, no network) with `target`.
        max_prompts (`int`, defaults to 16): prompts per set (the first ones).
        max_new_tokens (`int`, defaults to 128): tokens per run (exactly, unless `stop_at_eos`).
        repeats (`int`, defaults to 3): timed runs per prompt and method; the median is kept.
        output (`str`, defaults to `"bench_out"`): folder for bench.json, bench.md, bench.png.
        overwrite_output_dir (`bool`, defaults to False): replace the bench.json, bench.md and bench.png an earlier
            run left in `output`; without it a folder holding any of them is refused before the run.
        target (`str`, *optional*): model id or folder; default: the tiny kit's target.
        allow_pickle_target (`bool`, defaults to False): the target (and the assistant) load from safetensors
            only unless this is set; then transformers' own loading, which reads pickle weights with
            `torch.load(weights_only=True)`.
        assistant (`str`, *optional*): causal assistant for `assisted`; default: the kit's `assistant-ar` when the
            target is the kit's.
        device (`str`, *optional*): default `cuda` when available, else `cpu`; a CUDA device without CUDA is an
            error. dtype (`str`, defaults to float32).
        threads (`int`, *optional*): `torch.set_num_threads` (>= 1); default 1 on CPU, untouched elsewhere.
        seed (`int`, defaults to 0): prompt i of every method runs from `torch.manual_seed(seed + i)`.
        prompt_lookup_num_tokens (`int`, defaults to 10), stop_at_eos (`bool`, defaults to False),
        chat_template (`bool`, defaults to True: applied when the tokenizer has one), progress (`bool`).
        batch_sizes (`list[int]`, *optional*): the batch bench instead (the batch size is one more axis of the
            runner): the prompts R at a time through `generate`, for every R, hf_tev's methods against `ar` (plain
            batched generate).
    """

    methods: list[str] = field(default_factory=lambda: list(METHODS))
    drafters: list[str] | None = None
    budgets: list[int | str] = field(default_factory=lambda: ["auto", 4, 16, 64])
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    prompt_sets: list[str] | None = None
    max_prompts: int = 16
    max_new_tokens: int = 128
    repeats: int = 3
    output: str = "bench_out"
    target: str | None = None
    assistant: str | None = None
    device: str | None = None
    dtype: str = "float32"
    threads: int | None = None
    seed: int = 0
    prompt_lookup_num_tokens: int = 10
    stop_at_eos: bool = False
    chat_template: bool = True
    progress: bool = True
    batch_sizes: list[int] | None = None
    overwrite_output_dir: bool = False
    allow_pickle_target: bool = False

    def __post_init__(self):
        if self.prompt_sets is None:  # the kit writes Python; a real target gets the paper's four sets
            self.prompt_sets = list(KIT_PROMPT_SETS if self.target is None else PAPER_PROMPT_SETS)
        self._check_registry_names()
        self._check_models()
        self._check_numbers()
        self._settle_device()
        if self.batch_sizes is not None:
            self.batch_sizes = list(dict.fromkeys(self.batch_sizes))
        for name in ("methods", "drafters", "budgets", "temperatures", "prompt_sets"):  # a repeat adds nothing
            setattr(self, name, list(dict.fromkeys(getattr(self, name))))

    def _check_registry_names(self) -> None:
        for name, known in (("methods", METHODS), ("prompt_sets", PROMPT_SETS)):
            unknown = [item for item in getattr(self, name) if item not in known]
            if unknown:
                raise ValueError(f"Unknown {name.replace('_', ' ')[:-1]} {unknown}; known: {sorted(known)}")
            if not getattr(self, name):
                raise ValueError(f"{name} is empty")
        if REFERENCE_METHOD not in self.methods:
            self.methods = [REFERENCE_METHOD, *self.methods]

    def _check_models(self) -> None:
        need_assistant = [m for m in self.methods if METHODS[m].uses_assistant]
        if self.target is not None and need_assistant and self.assistant is None:
            raise ValueError(
                f"Method {', '.join(map(repr, need_assistant))} needs --assistant (a small causal LM "
                "with the target's tokenizer) when --target is given"
            )
        if self.drafters is None:
            self.drafters = _default_drafters(self.target) if self.target else _present_kit_drafters()
        if self.target is None:
            unknown = [d for d in self.drafters if d not in KIT_DRAFTERS and not Path(d).is_dir()]
            if unknown:
                raise ValueError(
                    f"Unknown drafter {unknown}: the kit has {KIT_DRAFTERS}; a folder of a DFlash drafter "
                    "also works (a Hub id needs --target as well)"
                )
        needs_drafter = [m for m in self.methods if METHODS[m].uses_drafter]
        if needs_drafter and not self.drafters:
            raise ValueError(f"Methods {needs_drafter} need a drafter: pass --drafters")

    def _check_numbers(self) -> None:
        if not self.budgets or any(b != "auto" and not _is_int_at_least(b, 0) for b in self.budgets):
            raise ValueError(f'budgets must be non-empty non-negative ints or "auto", got {self.budgets}')
        if not self.temperatures or any(not math.isfinite(t) or t < 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be non-empty finite numbers >= 0, got {self.temperatures}")
        if self.top_k is not None and not _is_int_at_least(self.top_k, 0):
            raise ValueError(f"top_k must be an int >= 0 (0: off), got {self.top_k!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1: off), got {self.top_p!r}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("max_prompts", "max_new_tokens", "repeats", "prompt_lookup_num_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.batch_sizes is not None and (
            not self.batch_sizes or any(not _is_int_at_least(r, 1) for r in self.batch_sizes)
        ):
            raise ValueError(f"batch_sizes must be non-empty ints >= 1, got {self.batch_sizes}")
        if self.threads is not None and not _is_int_at_least(self.threads, 1):
            raise ValueError(f"threads must be an int >= 1 (torch threads), got {self.threads!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    def _settle_device(self) -> None:
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        _check_device(self.device)
        if self.threads is None and self.device == "cpu":
            self.threads = 1


def _is_int_at_least(value, low: int) -> bool:
    """An int (not a bool, which Python counts as one) >= `low`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _check_device(name: str) -> None:
    """A clear error now for a device this machine does not have (instead of one deep inside the first run)."""
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ValueError(f"device {name!r} is not a torch device: {error}") from None
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ValueError(f"device {name!r}: CUDA is not available ({why}; torch {torch.__version__}); use --device cpu")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")


def _default_drafters(target: str) -> list[str]:
    trained = default_drafter(target)  # the drafter shipped for a packaged target (SmolLM2), if any
    return [str(trained)] if trained is not None else []


def _present_kit_drafters() -> list[str]:
    try:
        root = kit_dir()
    except FileNotFoundError:
        return []
    return [name for name in KIT_DRAFTERS if (root / name / "config.json").is_file()]


def sampling_kwargs(
    temperature: float,
    stop_at_eos: bool,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> dict:
    """What `generate` gets at `temperature`: greedy at 0, else pure temperature sampling (top-k / top-p / min-p
    off whatever the model's defaults, unless given). Without `stop_at_eos`, `eos_token_id=None`: every run
    produces exactly `max_new_tokens`."""
    kwargs = temperature_sampling(temperature)
    if kwargs["do_sample"]:
        kwargs.update({name: value for name, value in (("top_k", top_k), ("top_p", top_p)) if value is not None})
        kwargs["min_p"] = min_p
    if not stop_at_eos:
        kwargs["eos_token_id"] = None
    return kwargs


def config_sampling(config: BenchConfig, temperature: float) -> dict:
    """`sampling_kwargs` at `temperature` with the truncation and EOS settings of `config`."""
    return sampling_kwargs(temperature, config.stop_at_eos, config.top_k, config.top_p, config.min_p)


def generate_kwargs_by_temperature(config: BenchConfig, target) -> dict[str, dict]:
    """`f"{T:g}"` -> the keyword arguments `generate` gets at T (the `sampling_kwargs`), with `eos_token_id` as
    the target's generation config gives it when the run stops at EOS."""
    settings = {}
    for temperature in config.temperatures:
        kwargs = config_sampling(config, temperature)
        eos = kwargs.get("eos_token_id", target.generation_config.eos_token_id)
        settings[f"{temperature:g}"] = {**kwargs, "eos_token_id": eos}
    return settings
