"""`examples/quickstart.py` runs as its docstring says: on the kit it decodes beside plain `generate`, says the greedy
tokens are identical, and without the kit it stops with one line that says how to install it."""

import sys

from helpers import run_command


def test_the_kit_quickstart_decodes_exactly(tmp_path):
    result = run_command(
        [sys.executable, "examples/quickstart.py", "--kit", "--threads", "1", "--max-new-tokens", "16"], tmp_path
    )
    assert "greedy tokens identical to the target's own generate: True" in result.stdout
    assert "hf_tev_tiny_kit/target" in result.stdout and "speedup" in result.stdout


def test_without_the_kit_it_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TEV_KIT", str(tmp_path / "no_kit"))
    result = run_command([sys.executable, "examples/quickstart.py", "--kit"], tmp_path, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "pip install -e ./tiny_kit" in result.stderr.splitlines()[-1]
