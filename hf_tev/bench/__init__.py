"""`hf-tev bench`: decoding methods side by side in one process, interleaved per prompt.

    hf-tev bench --methods ar,ddtree,tev --drafters drafter-dflash-l135 --budgets 32,64 --temperatures 0,0.6 \
        --prompt_sets humaneval --max_prompts 4 --max_new_tokens 64 --output bench_out
    hf-tev bench recipe.yaml                        # the same options from a YAML / JSON file
    hf-tev bench report bench_out/bench.json       # re-render bench.md and bench.png, no run

(`hf-tev bench --help` for every option; docs/bench.md for the user's guide.) The package: `methods` (the
registries `METHODS` and `PROMPT_SETS`), `config` (`BenchConfig`, and what `generate` gets from it), `loading`
(`check_sources`, models and prompts), `measure` (one timed `generate` call: `Job`, `ForwardProbe`, `Run`),
`runner` (`run_bench`: the plan and the interleaved loop, batch size one of its axes), `records` (the JSON
document and its records), `replay` (`same_tree_verifier_stage`), `summary` (labels, order and spreads over
prompts read from records), `report` (bench.md and the files, from the document alone), `plot` (bench.png) and
`cli` (`HfArgumentParser` over `BenchArguments`, the fields of `BenchConfig`).

Methods (`METHODS`): `ar` (the target's plain `generate`), `assisted` (transformers' assisted generation with a
small causal assistant, the kit's `assistant-ar` by default), `prompt_lookup` (transformers' prompt lookup
decoding), `dflash_native` (transformers' own `speculation_type="dflash"` chain with our drafter), and hf_tev's
`chain` (`TEVConfig(tree="chain")`, at most block_size - 1 nodes), `ddtree` (best-first tree, verifier
`"predraw"`) and `tev` (best-first tree, Tree Exit Verification). `ar` always runs: it is the reference for SR and
for the greedy exactness check. T = 0 is greedy; T > 0 is pure temperature sampling (top-k / top-p / min-p off
unless `--top_k` / `--top_p` / `--min_p`). By default every run produces exactly `max_new_tokens` tokens
(`eos_token_id=None`), so that at T > 0, where methods draw different samples, the SR time ratio still compares
equal work; `--stop_at_eos` stops at EOS.

What is measured, per method x drafter x budget x temperature x prompt set:
- tau: mean output-block length including the bonus token. hf_tev methods: accepted drafted nodes + 1 per cycle,
  pooled over every cycle of every prompt (`TEVStats`). Other methods: tokens produced per target forward after
  prefill, `sum(new_tokens - 1) / sum(target_forwards - 1)` with target forwards counted by a forward hook (the
  prefill forward yields one token in every method; `ar` gives exactly 1). `tau_counted` is that count for every
  method; for hf_tev methods it differs from tau only by tokens cut at the stop (the last cycle's bonus token
  past `max_new_tokens` counts in its block but is not emitted).
- coverage: mean 1 + C of the same trees (hf_tev methods); `coverage_z`: z statistic of the per-cycle
  differences tau_i - (1 + C)_i (mean / (std / sqrt(n))), which an exact verifier keeps within sampling error.
- SR (`speedup`): `ar_time_s / time_s`, where each is the sum over prompts of the median wall time of that
  prompt's runs. tokens_per_s: new tokens / time_s.
- Stage times per cycle (hf_tev methods; ms, medians over runs of each run's per-cycle mean): `draft_ms`,
  `build_ms`, `forward_ms`, `verify_ms` from `TEVStats`; `cycle_ms`: wall time of the decode loop (prefill end to
  return) per cycle; `model_ms`: time inside model forwards (target, drafter, their embedding / LM-head calls;
  forward hooks) per cycle; `overhead_ms = cycle_ms - model_ms` and `overhead_fraction` = hf_tev's own cost.
  `setup_ms`: generate's preparation before the prefill, per call; `prefill_ms`: the prefill, per call.
- Verifier stage (methods with a `replay_verifier`, `ddtree` and `tev`, at T > 0): the same-tree replay
  (`same_tree_verifier_stage`): for every realised tree, each verifier's stage (logits processing + decision +
  cache commit, excluding the tree forward; the paper's Table 3) is timed right after its own tree pass over the
  same tree and cache, cycle by cycle. Median ms per cycle: `verifier_stage_ms` (the method's verifier),
  `verifier_stage_ddtree_ms` (the reference, `REFERENCE_VERIFIER = "predraw"`), `verifier_stage_cycles`;
  `verifier_stage_reduction = 1 - verifier_stage_ms / verifier_stage_ddtree_ms` (null for the reference itself).
- greedy_exact (T = 0): every prompt's tokens equal `ar`'s. A mismatch is warned about loudly.

Output in `--output DIR`: `bench.json`, `bench.md` (tables shaped like the paper's Tables 1, 5 and 3, and a stage
table) and `bench.png` (tau and SR against budget). The document (`"schema": "hf_tev.bench/1"`, or
`"hf_tev.bench/batch-1"` for batches) and every field of a record (`RECORD_FIELDS`): docs/bench.md#benchjson.

Timings are wall clock on a possibly shared machine: the load average is recorded, and a warning is raised when
it exceeds the core count. On CPU, glibc hands buffers above its mmap threshold back to the OS when freed, so a
stage that allocates a fresh multi-MB buffer every cycle (predraw's float64 CDF over [N, V] at large B) pays page
faults each time; `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` change that, and the machine record keeps
any `MALLOC_*` setting.
"""

from .cli import (
    BenchArguments,
    build_parser,
    build_report_parser,
    config_from_arguments,
    main,
    parse_config,
    report_main,
)
from .config import DTYPES, BenchConfig, generate_kwargs_by_temperature, sampling_kwargs
from .loading import BenchModels, check_sources, load_bench_models, load_prompt_texts, tokenize_prompts
from .measure import ForwardProbe, Job, Run, capture_logits_processor, run_once
from .methods import (
    METHODS,
    PROMPT_SETS,
    REFERENCE_METHOD,
    REFERENCE_VERIFIER,
    Method,
    PromptSet,
    register_method,
    register_prompt_set,
)
from .plot import batch_figure, budget_figure, plot_report
from .records import (
    PER_PROMPT_FIELDS,
    RECORD_FIELDS,
    check_load,
    greedy_mismatch,
    machine_info,
    make_records,
    summarise,
    z_statistic,
)
from .replay import same_tree_verifier_stage
from .report import (
    JSON_NAME,
    MARKDOWN_NAME,
    OUTPUT_NAMES,
    PLOT_NAME,
    STAGE_COLUMNS,
    check_output_folder,
    markdown_report,
    markdown_table,
    read_document,
    write_outputs,
    write_report,
)
from .runner import plan_jobs, plan_replays, run_bench
from .summary import BATCH_SCHEMA, SCHEMA, prompt_spread

__all__ = [
    "BATCH_SCHEMA",
    "DTYPES",
    "OUTPUT_NAMES",
    "PER_PROMPT_FIELDS",
    "BenchArguments",
    "batch_figure",
    "budget_figure",
    "check_sources",
    "config_from_arguments",
    "markdown_table",
    "parse_config",
    "prompt_spread",
    "JSON_NAME",
    "MARKDOWN_NAME",
    "METHODS",
    "PLOT_NAME",
    "PROMPT_SETS",
    "RECORD_FIELDS",
    "REFERENCE_METHOD",
    "REFERENCE_VERIFIER",
    "SCHEMA",
    "STAGE_COLUMNS",
    "BenchConfig",
    "BenchModels",
    "ForwardProbe",
    "Job",
    "Method",
    "PromptSet",
    "Run",
    "build_parser",
    "build_report_parser",
    "capture_logits_processor",
    "check_load",
    "check_output_folder",
    "generate_kwargs_by_temperature",
    "greedy_mismatch",
    "load_bench_models",
    "load_prompt_texts",
    "machine_info",
    "main",
    "make_records",
    "markdown_report",
    "plan_jobs",
    "plan_replays",
    "plot_report",
    "read_document",
    "register_method",
    "register_prompt_set",
    "report_main",
    "run_bench",
    "run_once",
    "same_tree_verifier_stage",
    "sampling_kwargs",
    "summarise",
    "tokenize_prompts",
    "write_outputs",
    "write_report",
    "z_statistic",
]
