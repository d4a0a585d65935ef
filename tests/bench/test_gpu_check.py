"""The prepared GPU check runs its whole plan end to end on the CPU at tiny sizes (the same code the GPU run
executes), and its JSON holds every section the GPU window is for."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
TINY_SETTINGS = dict(device="cpu", shape="tiny", dtype="float32", context=16, max_tokens=16, budget=8, oracle_depth=4)
TINY_SETTINGS |= dict(new_tokens=24, repeats=1, kit_prompts=1, kit_new_tokens=12, law_draws=120, batch_rows=8)
TINY = [text for key, value in TINY_SETTINGS.items() for text in (f"--{key.replace('_', '-')}", str(value))]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measured(value) -> bool:
    """A timing of the report: a finite number. Per-unit times are differences of two runs' medians, which at
    these tiny sizes on a shared CPU can come out of either sign (a test run beside a training job gave -1.08 ms a
    cycle); what they are worth is measured on the device, never asserted here."""
    return isinstance(value, float) and math.isfinite(value)


@pytest.mark.slow
def test_gpu_check_runs_its_whole_plan_on_cpu_at_tiny_sizes(gpu_check, tmp_path):
    output = tmp_path / "gpu_check.json"
    report = gpu_check.main([*TINY, "--output", str(output)])
    assert json.loads(output.read_text())["settings"]["budget"] == 8  # the file is the report
    assert report["tree_pass"]["tokens"] == [1, 2, 4, 8, 9, 16]  # powers of two and the budget's pass (B + 1)

    eager = report["modes"]["eager"]
    for name in ("plain", "hf_tev", "transformers_dflash_chain"):
        row = eager[name]
        assert measured(row["seconds_per_unit"]) and row["units"][1] > row["units"][0], name
        assert row["per_unit"]["kernels"] > 0 and row["per_unit"]["host_waits"] >= 0, name
        assert "memory" in row  # None on the CPU, peak GiB on CUDA
    tev = eager["hf_tev"]
    # the oracle knows 4 tokens a block: cycles accept about 4 (the commit moves real entries), never more than 5
    assert 3 <= tev["stages"]["tau"] <= 5 and tev["stages"]["pass_nodes"] == 9
    # the oracle's decoys make accepted paths leave the tree's first nodes: commits move cache entries
    assert 0 < tev["stages"]["moved_commits"] <= tev["stages"]["commits"] == tev["stages"]["cycles"]
    assert tev["equals_plain_greedy"] and tev["first_mismatch"] is None and tev["oracle_settled"]
    assert {"draft_ms", "build_ms", "forward_ms", "verify_ms", "rest_ms"} <= set(tev["stages"])
    assert measured(tev["own_ms"]) and measured(tev["cycle_ms"])
    chain = eager["transformers_dflash_chain"]
    assert chain["new_tokens"][1] / chain["units"][1] > 2.5  # the chain's oracle is accepted as well
    assert measured(tev["sr_per_token"]) and measured(chain["sr_per_token"])

    paper = report["paper_tau"]
    assert set(paper["sr"]) == {"7.80", "8.85"} and paper["budget"] == 8
    assert paper["sr"]["8.85"] / paper["sr"]["7.80"] == pytest.approx(8.85 / 7.80)
    assert paper["oracle_tau"] == tev["stages"]["tau"]

    exact = report["exactness"]
    assert exact["all_exact"], exact
    greedy_runs = {"auto/tev", "8/tev", "64/tev", "64/tev/lookup_off", "64/tev/repetition_penalty", "batch"}
    assert set(exact["greedy"]["by_setting"]) == greedy_runs  # distinct runs: at T = 0 every verifier is one walk
    assert set(exact["sampling_t1"]["pvalues"]) == {"tev", "predraw", "residual", "batch"}
    assert exact["sampling_t1"]["has_power"] and exact["sampling_t1"]["draws"] == 4 * 120

    auto = report["auto"]["under_this_curve"]
    assert 0 <= auto["chosen_size_mean"] <= 15 and auto["tokens_per_s_auto"] > 0
    # per tree, auto maximises the ratio the fixed budgets are scored by: over all trees it cannot fall far behind
    assert auto["tokens_per_s_auto"] >= 0.95 * max(auto["tokens_per_s_fixed"].values())

    static = report["modes"]["static"]
    assert measured(static["plain"]["seconds_per_unit"])  # transformers' static cache (compiled on CUDA only)
    # hf_tev's static tree pass (compiled on CUDA only, --compile auto): exact, the same oracle accepted
    assert static["hf_tev"]["equals_plain_greedy"] and static["hf_tev"]["stages"]["pass_nodes"] == 9
    assert 3 <= static["hf_tev"]["stages"]["tau"] <= 5 and "compiled" not in static["hf_tev"]
    assert measured(static["hf_tev"]["sr_per_token"]) and static["hf_tev"]["first_call_s"] > 0
    assert report["paper_tau_static"]["oracle_tau"] == static["hf_tev"]["stages"]["tau"]
    assert measured(report["paper_tau_static"]["sr"]["7.80"])
    assert report["seconds"] > 0 and "eager" not in report and "static" not in report


def test_the_law_check_rejects_a_wrong_law(gpu_check, monkeypatch):
    """The T = 1 check can fail: against the law at temperature 0.5, the same draws are rejected."""
    exact = gpu_check.exact_last_two_law
    monkeypatch.setattr(gpu_check, "exact_last_two_law", lambda target, prompt, t: exact(target, prompt, 0.5 * t))
    law = gpu_check.sampling_law(torch.device("cpu"), 120, 8)
    assert not law["all_pass"] and max(law["pvalues"].values()) < 1e-2


def test_a_section_past_the_time_budget_is_skipped_and_a_failing_one_recorded(gpu_check):
    report, written = {}, []
    args = gpu_check.parse_args(["--time-budget", "0.5"])

    def fails():
        raise RuntimeError("no such kernel\nmore")

    sections = [("first", lambda: 1), ("broken", fails), ("late", lambda: __import__("time").sleep(0.6) or 2)]
    sections.append(("skipped", lambda: 3))
    gpu_check.run_sections(report, sections, args, __import__("time").perf_counter(), written.append)
    assert report["first"] == 1 and report["broken"] == {"failed": "RuntimeError: no such kernel"}
    assert report["late"] == 2 and report["skipped"] == {"skipped": "time budget of 0 s spent"}
    assert len(written) == 4  # the JSON after every section


def test_an_oracle_follows_the_method_once_it_leaves_the_plain_continuation(gpu_check):
    """A first mismatch against plain greedy is reported; the oracle then knows the method's own output."""
    known = [torch.tensor([[7, 7, 1, 2, 3, 4, 5, 6]])]  # a 2-token prompt, then plain greedy's continuation
    outputs = iter([torch.tensor([[7, 7, 1, 2, 9, 9]])] * 2)
    settled = gpu_check.settle_oracle(lambda n, output: next(outputs), known, 4, prompt_length=2)
    assert settled.pop("first_call_s") >= 0
    assert settled == {"equals_plain_greedy": False, "first_mismatch": 2, "oracle_rounds": 1, "oracle_settled": True}
    assert known[0].tolist() == [[7, 7, 1, 2, 9, 9, 5, 6]]


def test_cuda_events_count_waits_kernels_and_launches(gpu_check):
    """The CUDA branch of the counts (no GPU here): synchronisations and blocking copies are waits, device
    events other than copies and fills are kernels."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(name, device_type):
        return SimpleNamespace(name=name, device_type=device_type, cpu_children=[])

    events = [event(name, DeviceType.CPU) for name in ("cudaStreamSynchronize", "cudaLaunchKernel", "cudaMemcpy")]
    events += [event("cudaMemcpyAsync", DeviceType.CPU), event("cudaDeviceSynchronize", DeviceType.CPU)]
    events += [event(name, DeviceType.CUDA) for name in ("ampere_gemm", "Memcpy DtoH (Device -> Pageable)")]
    events += [event("void at::native::elementwise_kernel", DeviceType.CUDA), event("Memset (Device)", DeviceType.CUDA)]
    warned = ["called a synchronizing CUDA operation", "something else"]
    counts = gpu_check.count_events(events, warned, cuda=True)
    assert counts == {"host_waits": 3, "sync_warnings": 1, "kernels": 2, "launches": 1}


def test_a_bare_device_finds_the_kit_in_the_checkout(gpu_check, monkeypatch):
    """The device image has no kit installed, only the carried checkout: the check points HF_TEV_KIT there."""
    from hf_tev import packaged

    monkeypatch.delenv("HF_TEV_KIT", raising=False)
    monkeypatch.setattr(packaged, "installed_package_dir", lambda name: None)
    with pytest.raises(FileNotFoundError, match="tiny kit is not installed"):
        packaged.kit_dir()
    gpu_check.find_kit()
    assert packaged.kit_dir() == gpu_check.CHECKOUT_KIT
    assert (packaged.kit_path("drafter-dflash-l135") / "config.json").is_file()
