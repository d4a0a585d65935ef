"""`hf-tev bench` on the tiny kit: every method runs, outputs are complete, ddtree and tev agree, bad input fails."""

import json
import math
import time
from types import SimpleNamespace

import pytest
import torch

from hf_tev import bench
from hf_tev.__main__ import main as hf_tev_main
from hf_tev.bench import RECORD_FIELDS, BenchConfig, Job, plan_jobs, run_bench, z_statistic
from hf_tev.kit import kit_path

DRAFTER = "drafter-dflash"  # the kit's shipped drafter


@pytest.fixture(scope="module")
def kit_drafter():
    try:
        kit_path(DRAFTER)
    except FileNotFoundError as error:
        pytest.fail(f"the kit's {DRAFTER} is missing: {error}")
    return DRAFTER


HF_TEV_METHODS = ("chain", "ddtree", "tev")
STAGE_FIELDS = ("draft_ms", "build_ms", "forward_ms", "verify_ms", "cycle_ms", "model_ms", "overhead_ms",
                "overhead_fraction", "setup_ms", "prefill_ms", "cycles", "coverage", "coverage_z")


def test_every_method_tiny_run_writes_json_table_and_plot(tmp_path, kit_drafter):
    out = tmp_path / "bench"
    hf_tev_main(["bench", "--methods", "all", "--drafters", kit_drafter, "--budgets", "4", "--temperatures", "0,1",
                 "--prompt-sets", "humaneval,heldout", "--max-prompts", "1", "--max-new-tokens", "12",
                 "--repeats", "1", "--output", str(out), "--no-progress"])
    document = json.loads((out / "bench.json").read_text())
    assert document["schema"] == bench.SCHEMA
    assert set(document["machine"]) >= {"cpu_count", "torch_threads", "load_average", "device", "torch",
                                        "transformers", "dtype"}
    assert document["settings"]["max_new_tokens"] == 12 and document["settings"]["threads"] == 1
    records = document["records"]
    keys = {(r["method"], r["drafter"], r["budget"], r["temperature"], r["prompt_set"]) for r in records}
    expected = {(m, d, b, t, s) for t in (0.0, 1.0) for s in ("humaneval", "heldout")
                for m, d, b in [("ar", None, None), ("assisted", None, None), ("prompt_lookup", None, None),
                                ("dflash_native", kit_drafter, None)] + [(m, kit_drafter, 4) for m in HF_TEV_METHODS]}
    assert keys == expected and len(records) == len(expected)
    for r in records:
        assert tuple(r) == RECORD_FIELDS
        for name in ("tau", "tau_counted", "time_s", "ar_time_s", "speedup", "tokens_per_s", "tokens_sha1"):
            assert r[name] is not None, (name, r)
        assert r["new_tokens"] == 12 and r["prompts"] == 1  # exactly max_new_tokens: EOS is not a stop here
        assert r["greedy_exact"] is (True if r["temperature"] == 0 else None), r
        assert r["speedup"] == pytest.approx(r["ar_time_s"] / r["time_s"])
        if r["method"] == "ar":
            assert r["tau"] == 1 and r["speedup"] == 1 and r["target_forwards"] == 12
        if r["method"] in HF_TEV_METHODS:
            assert all(r[name] is not None for name in STAGE_FIELDS), r
            # Blocks are tokens per tree pass; they only differ where the stop cut a final block (the last bonus).
            emitted_by_cycles = r["new_tokens"] - r["prompts"]  # the prefill emits one token per prompt
            assert 0 <= round(r["tau"] * r["cycles"]) - emitted_by_cycles <= r["prompts"]
            assert r["tau_counted"] == pytest.approx(emitted_by_cycles / r["cycles"])
            assert r["target_forwards"] == r["cycles"] + 1  # prefill + one tree pass per cycle
            assert 0 < r["overhead_fraction"] < 1 and r["model_ms"] < r["cycle_ms"]
            assert r["draft_ms"] + r["build_ms"] + r["forward_ms"] + r["verify_ms"] <= r["cycle_ms"] * 1.01
        else:
            assert all(r[name] is None for name in STAGE_FIELDS), r
        staged = r["method"] in ("ddtree", "tev") and r["temperature"] > 0
        assert (r["verifier_stage_ms"] is not None) == staged
        if staged:
            assert r["verifier_stage_cycles"] > 0
        if r["method"] == "tev" and staged:
            ratio = r["verifier_stage_ms"] / r["verifier_stage_ddtree_ms"]
            assert r["verifier_stage_reduction"] == pytest.approx(1 - ratio)
    markdown = (out / "bench.md").read_text()
    for title in ("(Table 1)", "(Table 5)", "(Table 3", "cycle breakdown", "Greedy output equals ar's"):
        assert title in markdown
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ddtree_and_tev_agree_greedy_and_tau_matches_coverage_when_sampling(kit_drafter):
    config = BenchConfig(methods=["ddtree", "tev"], drafters=[kit_drafter], budgets=[8], temperatures=[0.0, 1.0],
                         prompt_sets=["humaneval", "heldout"], max_prompts=3, max_new_tokens=32, repeats=1,
                         progress=False)
    records = {(r["method"], r["temperature"], r["prompt_set"]): r for r in run_bench(config)["records"]}
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
    config = BenchConfig(methods=["chain", "tev", "assisted"], drafters=["d"], budgets=[4, 32, 64], target="x",
                         assistant="a")
    plan = plan_jobs(config, models)
    assert plan[("chain", "d", 32)] == plan[("chain", "d", 64)] == Job("chain", "d", 15)
    assert plan[("chain", "d", 4)] == Job("chain", "d", 4) and plan[("tev", "d", 64)] == Job("tev", "d", 64)
    assert plan[("assisted", None, None)] == Job("assisted") and plan[("ar", None, None)] == Job("ar")


@pytest.mark.parametrize("kwargs, message", [
    (dict(methods=["tev", "medusa"]), "Unknown method \\['medusa'\\]"),
    (dict(prompt_sets=["humaneval", "nope"]), "Unknown prompt set \\['nope'\\]"),
    (dict(drafters=["drafter-nope"]), "Unknown drafter \\['drafter-nope'\\]"),
    (dict(budgets=[-1]), "budgets"),
    (dict(temperatures=[-0.5]), "temperatures"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(dtype="float8"), "dtype"),
    (dict(target="some/model", drafters=["some/drafter"]), "'assisted' needs --assistant"),
])
def test_bad_input_gives_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BenchConfig(**kwargs)


def test_command_line_bad_input_exits_with_the_message(capsys):
    with pytest.raises(SystemExit) as exit_info:
        hf_tev_main(["bench", "--methods", "ar,nope"])
    assert exit_info.value.code == 2 and "Unknown method ['nope']" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="unknown command 'benchmark'"):
        hf_tev_main(["benchmark"])


def test_hub_prompt_sets_offline_are_skipped_with_a_message_or_fail_clearly(monkeypatch):
    assert "HF_HUB_OFFLINE" in bench.hub_unreachable_reason()  # conftest runs tests offline
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    start = time.perf_counter()
    assert "127.0.0.1:9" in bench.hub_unreachable_reason(timeout=0.5)
    assert time.perf_counter() - start < 2
    notes = []
    config = BenchConfig(methods=["ar"], prompt_sets=["heldout", "gsm8k"], max_prompts=2)
    with pytest.warns(UserWarning, match="'gsm8k' needs the Hugging Face Hub"):
        texts = bench.load_prompt_texts(config, notes)
    assert list(texts) == ["heldout"] and len(texts["heldout"]) == 2 and "not reachable" in notes[0]
    hub_only = BenchConfig(methods=["ar"], prompt_sets=["mt_bench", "math500"])
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="No prompt set .* could be loaded"):
        bench.load_prompt_texts(hub_only, [])
