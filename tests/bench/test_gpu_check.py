"""The prepared GPU check runs end to end on the CPU at tiny sizes (the same code the GPU run executes)."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def test_gpu_check_runs_on_cpu_at_tiny_sizes(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    output = tmp_path / "gpu_check.json"
    report = gpu_check.main(
        [
            "--device",
            "cpu",
            "--shape",
            "tiny",
            "--dtype",
            "float32",
            "--context",
            "16",
            "--max-tokens",
            "16",
            "--repeats",
            "1",
            "--kit-prompts",
            "1",
            "--new-tokens",
            "12",
            "--output",
            str(output),
        ]
    )
    assert json.loads(output.read_text())["tree_pass"]["tokens"] == [1, 2, 4, 8, 16]
    assert report["kit_greedy_exact"]["all_equal"] and len(report["kit_greedy_exact"]["by_setting"]) == 9
    assert [row["budget"] for row in report["overhead"]] == ["auto"]  # fixed budgets only below --max-tokens
    auto = report["auto_under_this_curve"]
    assert 0 <= auto["chosen_size_mean"] <= 15 and auto["tokens_per_s_auto"] > 0
    # per tree, auto maximises the ratio the fixed budgets are scored by: over all trees it cannot fall far behind
    assert auto["tokens_per_s_auto"] >= 0.95 * max(auto["tokens_per_s_fixed"].values())
