"""`hf-tev bench` on the tiny kit: every method runs, outputs are complete, ddtree and tev agree, bad input fails."""

import dataclasses
import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

from hf_tev import bench
from hf_tev.__main__ import main as hf_tev_main
from hf_tev.bench import (
    METHODS,
    RECORD_FIELDS,
    BenchConfig,
    Job,
    capture_logits_processor,
    generate_kwargs_by_temperature,
    plan_jobs,
    plan_replays,
    run_bench,
    sampling_kwargs,
    z_statistic,
)
from hf_tev.bench.records import STAGE_FIELDS
from hf_tev.packaged import kit_path, load_kit_model

DRAFTER = "drafter-dflash"  # the kit's shipped drafter


@pytest.fixture(scope="module")
def kit_drafter():
    try:
        kit_path(DRAFTER)
    except FileNotFoundError as error:
        pytest.fail(f"the kit's {DRAFTER} is missing: {error}")
    return DRAFTER


HF_TEV_METHODS = ("chain", "ddtree", "tev", "tev_lookup", "default", "lookup_tree")
HF_TEV_FIELDS = (*STAGE_FIELDS, "setup_ms", "prefill_ms", "cycles", "coverage", "coverage_z")  # hf_tev methods only


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, kit_drafter):
    """The output folder of one tiny `hf-tev bench` run of every method (shared by the tests that read it)."""
    out = tmp_path_factory.mktemp("tiny_run") / "bench"
    hf_tev_main(
        [
            "bench",
            "--methods",
            "all",
            "--drafters",
            kit_drafter,
            "--budgets",
            "0,4,auto",
            "--temperatures",
            "0,1",
            "--prompt-sets",
            "humaneval,heldout",
            "--max-prompts",
            "1",
            "--max-new-tokens",
            "12",
            "--repeats",
            "1",
            "--output",
            str(out),
            "--no-progress",
        ]
    )
    return out


def first_of(records, record):
    """The first record of `record`'s method, drafter and budget: the one the warm-up's cost probe is booked to."""
    return next(r for r in records if (r["method"], r["drafter"], r["budget"]) == record_key(record))


def record_key(record):
    return record["method"], record["drafter"], record["budget"]


@pytest.mark.slow
def test_every_method_tiny_run_writes_json_table_and_plot(tiny_run, kit_drafter):
    out = tiny_run
    document = json.loads((out / "bench.json").read_text())
    assert document["schema"] == bench.SCHEMA
    assert set(document["machine"]) >= {
        "cpu_count",
        "torch_threads",
        "load_average",
        "device",
        "torch",
        "transformers",
        "dtype",
    }
    assert document["settings"]["max_new_tokens"] == 12 and document["settings"]["threads"] == 1
    assert document["settings"]["generation"] == {  # what generate got: pure temperature sampling, no EOS stop
        "0": dict(do_sample=False, eos_token_id=None),
        "1": dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, min_p=None, eos_token_id=None),
    }
    records = document["records"]
    keys = {(r["method"], r["drafter"], r["budget"], r["temperature"], r["prompt_set"]) for r in records}
    expected = {
        (m, d, b, t, s)
        for t in (0.0, 1.0)
        for s in ("humaneval", "heldout")
        for m, d, b in [
            ("ar", None, None),
            ("assisted", None, None),
            ("prompt_lookup", None, None),
            ("dflash_native", kit_drafter, None),
        ]
        + [(m, None if m == "lookup_tree" else kit_drafter, b) for m in HF_TEV_METHODS for b in (0, 4, "auto")]
    }
    assert keys == expected and len(records) == len(expected)
    warm_up_probes = []  # booked to the first record of each automatic budget's job
    for r in records:
        assert tuple(r) == RECORD_FIELDS
        for name in ("tau", "tau_counted", "time_s", "ar_time_s", "speedup", "tokens_per_s", "tokens_sha1"):
            assert r[name] is not None, (name, r)
        assert r["new_tokens"] == 12 and r["prompts"] == 1  # exactly max_new_tokens: EOS is not a stop here
        assert r["greedy_exact"] is (True if r["temperature"] == 0 else None), r
        assert r["speedup"] == pytest.approx(r["ar_time_s"] / r["time_s"])
        # one prompt, one repeat: the total is the run itself, plus the warm-up's cost probe where it is booked (the
        # first record of an automatic budget); a probe inside a run is in its time already
        booked = r["total_time_s"] - r["time_s"]
        assert -1e-9 <= booked <= r["probe_s"] + 1e-9, r
        assert r["speedup_total"] == pytest.approx(r["ar_total_time_s"] / r["total_time_s"])
        if r["budget"] == "auto" and r is first_of(records, r):
            warm_up_probes.append(booked)
        if r["budget"] != "auto":
            assert r["probe_s"] == 0 and booked == pytest.approx(0, abs=1e-9), r
        if r["method"] == "ar":
            assert r["tau"] == 1 and r["speedup"] == 1 and r["target_forwards"] == 12
        if r["method"] in HF_TEV_METHODS:
            assert all(r[name] is not None for name in HF_TEV_FIELDS), r
            # Blocks are tokens per tree pass; they only differ where the stop cut a final block (the last bonus).
            emitted_by_cycles = r["new_tokens"] - r["prompts"]  # the prefill emits one token per prompt
            assert 0 <= round(r["tau"] * r["cycles"]) - emitted_by_cycles <= r["prompts"]
            assert r["tau_counted"] == pytest.approx(emitted_by_cycles / (r["target_forwards"] - r["prompts"]))
            # prefill + one tree pass per cycle; the automatic budget may also re-probe tree-pass costs inside a run
            # (a cost model measured under another load goes stale: docs/auto_budget.md), and those passes count
            extra = r["target_forwards"] - (r["cycles"] + 1)
            assert extra == 0 or (r["budget"] == "auto" and extra > 0), r
            assert 0 < r["overhead_fraction"] < 1 and r["model_ms"] < r["cycle_ms"]
            # each stage is inside the cycle in every run, so its median over runs is at most the cycle's (a sum of
            # medians need not be: under load the runs' medians come from different runs)
            assert all(r[name] <= r["cycle_ms"] * 1.01 for name in ("draft_ms", "build_ms", "forward_ms", "verify_ms"))
        else:
            assert all(r[name] is None for name in HF_TEV_FIELDS), r
        staged = r["method"] in ("ddtree", "tev") and r["temperature"] > 0 and r["budget"] != "auto"
        if r["method"] in HF_TEV_METHODS:  # the chosen sizes are recorded; only auto predicts a block length
            assert r["tree_size_mean"] is not None and len(r["tree_size_quartiles"]) == 3
            assert (r["predicted_tau"] is not None) == (r["budget"] == "auto")
            assert r["budget"] == "auto" or r["tree_size_quartiles"][2] <= 4
            if r["budget"] == "auto":  # what each prompt's call priced its trees by, in prompt order
                assert len(r["budget_models"]) == r["prompts"]
                assert all(model["probe_tokens"][0] == 1 for model in r["budget_models"])
        if r["budget"] != "auto":
            assert r["budget_models"] is None
        assert (r["verifier_stage_ms"] is not None) == staged
        if staged:
            assert r["verifier_stage_cycles"] > 0
        if r["method"] == "tev" and staged:
            ratio = r["verifier_stage_ms"] / r["verifier_stage_ddtree_ms"]
            assert r["verifier_stage_reduction"] == pytest.approx(1 - ratio)
        per_prompt = r["per_prompt"]  # one prompt: its own values are the record's
        assert per_prompt["speedup"] == [pytest.approx(r["speedup"])] and per_prompt["tau"] == [pytest.approx(r["tau"])]
        assert ("cycle_ms" in per_prompt) == (r["method"] in HF_TEV_METHODS)
        assert ("verifier_stage_ms" in per_prompt) == staged
    # The target's cost model is shared by every automatic job: the first one's warm-up probed it, and a user's
    # first call pays that, so the totals do.
    assert sum(p > 0 for p in warm_up_probes) >= 1
    markdown = (out / "bench.md").read_text()
    for title in (
        "SR over every set from total times, every run of every prompt and repeat summed, the automatic budget's "
        "cost probes included",
        "## Speedup and block length per prompt set at B = 4 (and auto), T = 0 (the paper's Table 1)",
        "## Speedup and block length across tree budgets, T = 1 (the paper's Table 5)",
        "## Verifier stage per cycle on the same trees, T = 1 (the paper's Table 3)",
        "## hf_tev cycle breakdown, T = 0",
        "Greedy output equals ar's",
        "T = 1: `do_sample=True, temperature=1.0, top_k=0, top_p=1.0, min_p=None, eos_token_id=None`",
    ):
        assert title in markdown
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_command_re_renders_a_stored_run_without_running(tiny_run, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench.runner, "load_bench_models", lambda config: pytest.fail("report loaded models"))
    other = tmp_path / "other"
    hf_tev_main(["bench", "report", str(tiny_run / "bench.json"), "--output", str(other)])
    assert (other / "bench.md").read_bytes() == (tiny_run / "bench.md").read_bytes()
    assert (other / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (other / "bench.json").exists() and "wrote" in capsys.readouterr().out
    copy = tmp_path / "copy"  # default output: the folder of the json
    copy.mkdir()
    (copy / "bench.json").write_bytes((tiny_run / "bench.json").read_bytes())
    hf_tev_main(["bench", "report", str(copy / "bench.json")])
    assert (copy / "bench.md").read_bytes() == (tiny_run / "bench.md").read_bytes() and (copy / "bench.png").exists()
    (copy / "bench.json").write_text(json.dumps({"schema": "something/else"}))
    with pytest.raises(SystemExit) as exit_info:
        hf_tev_main(["bench", "report", str(copy / "bench.json")])
    assert exit_info.value.code == 2 and "is not a bench.json" in capsys.readouterr().err


@pytest.mark.slow
def test_ddtree_and_tev_agree_greedy_and_tau_matches_coverage_when_sampling(kit_drafter):
    config = BenchConfig(
        methods=["ddtree", "tev"],
        drafters=[kit_drafter],
        budgets=[8],
        temperatures=[0.0, 1.0],
        prompt_sets=["humaneval", "heldout"],
        max_prompts=3,
        max_new_tokens=32,
        repeats=1,
        progress=False,
    )
    records = {(r["method"], r["temperature"], r["prompt_set"]): r for r in run_bench(config)["records"]}
    for record in records.values():  # each prompt's own values, from which the pooled ones are made
        per_prompt = record["per_prompt"]
        assert len(per_prompt["time_s"]) == len(per_prompt["speedup"]) == len(per_prompt["tau"]) == 3
        assert record["time_s"] == pytest.approx(sum(per_prompt["time_s"]))
        assert record["speedup"] == pytest.approx(sum(per_prompt["ar_time_s"]) / sum(per_prompt["time_s"]))
        replayed = record["temperature"] > 0 and record["method"] != "ar"
        assert len(per_prompt.get("verifier_stage_ms", [])) == (3 if replayed else 0)
    for prompt_set in ("humaneval", "heldout"):
        ddtree, tev = records[("ddtree", 0.0, prompt_set)], records[("tev", 0.0, prompt_set)]
        assert ddtree["tokens_sha1"] == tev["tokens_sha1"] == records[("ar", 0.0, prompt_set)]["tokens_sha1"]
        assert ddtree["tau"] == tev["tau"] and ddtree["cycles"] == tev["cycles"]
        assert ddtree["coverage"] == ddtree["tau"] and ddtree["coverage_z"] == 0  # at T = 0, tau is 1 + C exactly
        assert tev["tau"] > 1.2  # the kit's drafter gets drafts accepted, so the check below has variance to test
    for method in ("ddtree", "tev"):
        # Pool both prompt sets: per-cycle tau_i - (1 + C)_i has mean 0 for an exact verifier.
        sampled = [records[(method, 1.0, s)] for s in ("humaneval", "heldout")]
        cycles = sum(r["cycles"] for r in sampled)
        assert cycles >= 100
        z = sum(r["coverage_z"] * math.sqrt(r["cycles"]) for r in sampled) / math.sqrt(cycles)  # Stouffer, weighted
        assert abs(z) < 4, (method, [(r["tau"], r["coverage"], r["coverage_z"]) for r in sampled])


def test_z_statistic_detects_a_shift_and_not_noise():
    gen = torch.Generator().manual_seed(0)
    noise = (torch.rand(400, generator=gen) - 0.5).tolist()
    assert abs(z_statistic(noise)) < 4
    assert z_statistic([x + 0.1 for x in noise]) > 4  # a block-length bias of 0.1 over 400 cycles is caught
    assert z_statistic([0.0] * 5) == 0 and z_statistic([1.0]) is None


def test_chain_budgets_past_the_block_share_one_run():
    models = SimpleNamespace(drafters={"d": SimpleNamespace(config=SimpleNamespace(block_size=16))})
    config = BenchConfig(
        methods=["chain", "tev", "assisted"], drafters=["d"], budgets=[4, 32, 64], target="x", assistant="a"
    )
    plan = plan_jobs(config, models)
    assert plan[("chain", "d", 32)] == plan[("chain", "d", 64)] == Job("chain", "d", 15)
    assert plan[("chain", "d", 4)] == Job("chain", "d", 4) and plan[("tev", "d", 64)] == Job("tev", "d", 64)
    assert plan[("assisted", None, None)] == Job("assisted") and plan[("ar", None, None)] == Job("ar")


def test_a_registered_method_is_planned_and_replayed_from_its_entry_alone(monkeypatch):
    # A copy of tev under another name: nothing in the runner knows its name, yet it gets jobs and a replay row.
    monkeypatch.setitem(METHODS, "tev_copy", dataclasses.replace(METHODS["tev"], name="tev_copy"))
    models = SimpleNamespace(drafters={"d": SimpleNamespace(config=SimpleNamespace(block_size=16))})
    config = BenchConfig(methods=["tev_copy", "chain"], drafters=["d"], budgets=[4, 64], target="x")
    plan = plan_jobs(config, models)
    assert plan[("tev_copy", "d", 64)] == Job("tev_copy", "d", 64) and plan[("chain", "d", 64)] == Job("chain", "d", 15)
    assert plan_replays(plan) == {("d", 4): ("predraw", "tev"), ("d", 64): ("predraw", "tev")}
    only_ddtree = plan_jobs(BenchConfig(methods=["ddtree"], drafters=["d"], budgets=[8], target="x"), models)
    assert plan_replays(only_ddtree) == {("d", 8): ("predraw",)}


def test_the_loop_split_leaves_the_automatic_budgets_probe_in_the_prefill_stage(kit_drafter):
    """A fresh target has no tree-pass cost curve, so `budget="auto"` probes it in the prefill stage of its first
    call: those forwards are setup, not the loop's model time (counted there, they made the loop's model time
    exceed the loop itself, a negative overhead)."""
    from hf_tev.bench.loading import BenchModels
    from hf_tev.bench.measure import ForwardProbe, run_once

    target = load_kit_model("target")  # fresh: its first automatic call probes
    models = BenchModels(target, None, {kit_drafter: load_kit_model(kit_drafter)})
    probe = ForwardProbe(models, sync=False)
    try:
        prompt = torch.tensor([[5, 17, 29, 41, 53, 65, 77, 89]])
        run = run_once(models, probe, Job("tev", kit_drafter, "auto"), prompt, 12, sampling_kwargs(0, False), 0)
    finally:
        probe.remove()
    probe_forwards = run.target_forwards - (run.stats.num_cycles + 1)
    assert probe_forwards > 0  # the probe ran in this call
    assert 0 < run.stats.probe_time < run.stats.prefill_time  # and its time is recorded, inside the prefill stage
    loop_start = probe.first_forward_start + run.stats.prefill_time
    before_loop = [seconds for end, seconds in probe.calls if end <= loop_start]
    assert len(before_loop) == 1 + probe_forwards  # the prefill and the probe's passes, nothing of the loop
    assert run.loop_model_s == pytest.approx(sum(probe.calls[i][1] for i in range(len(before_loop), len(probe.calls))))
    assert 0 < run.loop_model_s < run.loop_s


@pytest.fixture(scope="module")
def kit_target():
    return load_kit_model("target")


@pytest.mark.parametrize(
    "temperature, truncation, processors",
    [
        (1.0, {}, []),  # T = 1 is the target's own law: nothing to apply (transformers drops the identity warper)
        (0.6, {}, ["TemperatureLogitsWarper"]),
        (
            0.6,
            dict(top_k=5, top_p=0.9, min_p=0.05),
            ["TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper"],
        ),
    ],
)
def test_bench_temperatures_are_pure_temperature_sampling(kit_target, temperature, truncation, processors):
    """What `generate` builds from `sampling_kwargs`: the paper's temperature sampling unless truncation is asked
    for (the kit target's generation config sets no top-k; a model whose config does is overridden the same way)."""
    input_ids = torch.tensor([[1, 2, 3]])
    found = capture_logits_processor(kit_target, input_ids, sampling_kwargs(temperature, False, **truncation))
    assert sorted(type(p).__name__ for p in found) == sorted(processors)
    if not truncation:
        scores = torch.randn(2, kit_target.config.vocab_size, generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(found(input_ids, scores.clone()), scores / temperature)


def test_generate_kwargs_by_temperature_are_what_generate_gets():
    target = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=7))
    args = bench.build_parser().parse_args(["--top-k", "5", "--top-p", "0.9", "--min-p", "0.05", "--stop-at-eos"])
    assert (args.top_k, args.top_p, args.min_p, args.stop_at_eos) == (5, 0.9, 0.05, True)
    config = BenchConfig(methods=["ar"], temperatures=[0, 0.6], top_k=5, top_p=0.9, min_p=0.05, stop_at_eos=True)
    assert generate_kwargs_by_temperature(config, target) == {
        "0": dict(do_sample=False, eos_token_id=7),
        "0.6": dict(do_sample=True, temperature=0.6, top_k=5, top_p=0.9, min_p=0.05, eos_token_id=7),
    }
    plain = BenchConfig(methods=["ar"], temperatures=[0.6])
    assert generate_kwargs_by_temperature(plain, target) == {
        "0.6": dict(do_sample=True, temperature=0.6, top_k=0, top_p=1.0, min_p=None, eos_token_id=None)
    }


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(methods=["tev", "medusa"]), "Unknown method \\['medusa'\\]"),
        (dict(prompt_sets=["humaneval", "nope"]), "Unknown prompt set \\['nope'\\]"),
        (dict(drafters=["drafter-nope"]), "Unknown drafter \\['drafter-nope'\\]"),
        (dict(budgets=[-1]), "budgets"),
        (dict(temperatures=[-0.5]), "temperatures"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(dtype="float8"), "dtype"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(device="nonsense"), "not a torch device"),
        (dict(target="some/model", drafters=["some/drafter"]), "'assisted' needs --assistant"),
    ],
)
def test_bad_input_gives_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BenchConfig(**kwargs)


def test_a_packaged_target_defaults_to_its_trained_drafter():
    from hf_tev.packaged import default_drafter

    trained = default_drafter("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert trained is not None and (trained / "model.safetensors").is_file()
    config = BenchConfig(target="HuggingFaceTB/SmolLM2-135M-Instruct", methods=["default"])
    assert config.drafters == [str(trained)]
    assert BenchConfig(target="some/model", methods=["lookup_tree"]).drafters == []  # nothing trained for it
    with pytest.raises(ValueError, match="need a drafter"):
        BenchConfig(target="some/model", methods=["default"])


def test_command_line_bad_input_exits_with_the_message(capsys):
    with pytest.raises(SystemExit) as exit_info:
        hf_tev_main(["bench", "--methods", "ar,nope"])
    assert exit_info.value.code == 2 and "Unknown method ['nope']" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="unknown command 'benchmark'"):
        hf_tev_main(["benchmark"])


def _read_only_folder(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    folder = tmp_path / "read_only"
    folder.mkdir(mode=0o500)
    return folder / "out"


@pytest.mark.parametrize(
    "case, message",
    [
        ("under_a_file", "cannot be written"),
        ("a_file", "cannot be written"),
        ("read_only", "cannot be written"),
        ("cuda", "CUDA is not available"),
        ("cuda:0", "CUDA is not available"),
    ],
)
def test_up_front_checks_fail_before_any_model_is_loaded(case, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench.cli, "run_bench", lambda config: pytest.fail("the bench started"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (tmp_path / "file").write_text("")
    argv, output = [], {"under_a_file": tmp_path / "file" / "out", "a_file": tmp_path / "file"}.get(case)
    if case == "read_only":
        output = _read_only_folder(tmp_path)
    if case.startswith("cuda"):
        argv, output = ["--device", case], tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        hf_tev_main(["bench", "--methods", "ar", "--output", str(output), *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.fixture
def bench_log(caplog):
    """caplog of transformers' and hf_tev's loggers (which do not propagate by default), at WARNING."""
    import logging as std_logging

    from transformers.utils import logging

    logging.enable_propagation()
    caplog.set_level("WARNING")
    std_logging.getLogger("hf_tev").addHandler(caplog.handler)
    yield caplog
    std_logging.getLogger("hf_tev").removeHandler(caplog.handler)
    logging.disable_propagation()


def test_paper_prompt_sets_load_offline_from_the_committed_files(monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    config = BenchConfig(methods=["ar"], target="some/target", prompt_sets=None, max_prompts=500)
    assert config.prompt_sets == ["mt_bench", "humaneval", "gsm8k", "math500"]  # a real target's default
    texts = bench.load_prompt_texts(config)
    assert {name: len(prompts) for name, prompts in texts.items()} == {
        "mt_bench": 80,
        "humaneval": 164,
        "gsm8k": 250,
        "math500": 500,
    }
    assert texts["gsm8k"][0].startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert texts["mt_bench"][0].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert texts["math500"][0].startswith("Convert the point $(0,3)$ in rectangular coordinates to polar")
    assert all(prompt and prompt == prompt.rstrip() for prompts in texts.values() for prompt in prompts)
    assert BenchConfig(methods=["ar"]).prompt_sets == ["humaneval", "heldout", "heldout_copy"]  # the kit's


def test_bench_warnings_obey_transformers_verbosity(bench_log):
    from transformers.utils import logging

    from hf_tev.bench.records import add_warning

    notes = []
    add_warning(notes, "machine is loaded")
    previous = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        add_warning(notes, "not shown")
    finally:
        logging.set_verbosity(previous)
    assert notes == ["machine is loaded", "not shown"]  # the document keeps every warning
    assert [r.getMessage() for r in bench_log.records] == ["machine is loaded"]
