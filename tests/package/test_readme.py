"""Every code block of the README runs as written, on the kit, offline.

The Python blocks run in order in one namespace, as a reader pastes them into one session. Blocks written for the
Hub and a GPU (Qwen3-4B, `device_map="cuda"`) run with the names and sizes in `SUBSTITUTIONS` replaced: the
kit's target (with a chat template, as Qwen3's tokenizer has) stands in for Qwen3-4B, the kit's drafter for the
published one, the CPU for the GPU, and fewer tokens and steps keep the run short. Each shell command is run
(with `COMMAND_SUBSTITUTIONS`, for the same reasons) or skipped with the reason in `SKIPPED`. Every substitution
and every rule must still match the README, and every command must match exactly one rule, so a README change
that no rule covers fails here rather than going unchecked.
"""

import json
import os
import re
import shlex
from pathlib import Path

import pytest

from hf_tev.__main__ import main as hf_tev_main
from hf_tev.packaged import kit_path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
STANDIN_CHAT_TEMPLATE = (
    "{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}# assistant:\n{% endif %}"
)

# (as written, what runs instead, why): the Python blocks
SUBSTITUTIONS = [
    ('"Qwen/Qwen3-4B"', '"{standin}"', "the Hub target: the kit's target, with a chat template"),
    ('"z-lab/Qwen3-4B-DFlash-b16"', '"{drafter}"', "the published drafter: the kit's"),
    ('device_map="cuda"', 'device_map="cpu"', "no GPU"),
    ('.to("cuda")', '.to("cpu")', "no GPU"),
    ("dtype=torch.bfloat16", "dtype=torch.float32", "the CPU computes in float32"),
    ("max_new_tokens=512", "max_new_tokens=24", "a short run"),
    ("max_new_tokens=256", "max_new_tokens=24", "a short run"),
    ("max_steps=2000", "max_steps=2", "a short run"),
]
# (as written, what runs instead, why): the shell commands, on their arguments
COMMAND_SUBSTITUTIONS = [
    ("--target Qwen/Qwen3-4B", "--target {standin}", "the Hub target: the kit's target, with a chat template"),
    ("--drafter z-lab/Qwen3-4B-DFlash-b16", "--drafter {drafter}", "the published drafter: the kit's"),
    ("--target_dtype bfloat16", "--target_dtype float32", "the CPU computes in float32"),
    (
        "--prompts HuggingFaceH4/ultrachat_200k --prompts_split train_sft",
        "--prompts {prompts}",
        "a Hub dataset: a local file of prompts",
    ),
    ("--max_prompts 20000", "--max_prompts 3", "a short run"),
    ("--max_new_tokens 512", "--max_new_tokens 8", "a short run"),
    ("--eval_size 32", "--eval_size 1", "a short run"),
    ("--tree_budget 32", "--tree_budget 4", "a short run"),
    ("--max_steps 2000", "--max_steps 1", "a short run"),
    ("--max-prompts 4", "--max-prompts 1", "a short run"),
    ("--max-new-tokens 64", "--max-new-tokens 8", "a short run"),
    ("--temperatures 0,1", "--temperatures 0", "a short run"),
    ("--threads 2", "--threads 1", "the test suite's one thread"),
]
# command prefix -> why it is not run here
SKIPPED = {
    "pip install": "installs packages (the test suite runs in the installed environment)",
    "hf-tev train examples/recipes/exit_qwen3_4b.yaml": "the Hub and a GPU; tests/training/test_recipes.py parses it",
    "hf-tev train examples/recipes/exit_kit.yaml": "tests/training/test_recipes.py runs it (shortened by flags)",
    "python benchmarks/gpu_check.py --device cuda": "a GPU; tests/bench/test_gpu_check.py runs its CPU shape",
    "python -m hf_tev.bench --target Qwen/Qwen3-4B": "the Hub and a GPU",
    "python -m pytest": "the test suite itself",
    "vllm serve": "vLLM and a GPU; tests/drafter/test_serving_layout.py checks the layout it loads",
    "python -m sglang.launch_server": "SGLang and a GPU; tests/drafter/test_serving_layout.py checks the layout",
}
RUN = ("hf-tev train --target", "hf-tev bench")  # command prefixes run here
SLOW = ("hf-tev bench",)  # prefixes among RUN whose commands include one on the real target, SmolLM2


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.M | re.S)


def commands() -> list[str]:
    """The shell commands of the README's bash blocks: continuation lines joined, comments dropped."""
    found = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                found.append(" ".join(words))
    return found


def rule_of(command: str) -> str:
    matching = [p for p in (*SKIPPED, *RUN) if command.startswith(p)]
    assert len(matching) == 1, f"README command matches {matching or 'no rule'}: {command}"
    return matching[0]


def substituted(text: str, table, used: set, **names) -> str:
    for written, instead, _why in table:
        if written in text:
            used.add(written)
            text = text.replace(written, instead.format(**names))
    return text


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> Path:
    """The kit's target folder, with a chat template (the README's Qwen3-4B blocks apply one)."""
    folder = tmp_path_factory.mktemp("hub") / "Qwen3-4B"
    folder.mkdir()
    for file in kit_path("target").iterdir():
        if file.name != "tokenizer_config.json":
            os.symlink(file, folder / file.name)
    config = json.loads((kit_path("target") / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": STANDIN_CHAT_TEMPLATE}))
    return folder


def test_every_rule_and_substitution_still_matches_the_readme():
    rules = [rule_of(command) for command in commands()]
    unused = (set(SKIPPED) | set(RUN)) - set(rules)
    assert not unused, f"rules no README command uses: {unused}"
    python, shell = "\n".join(blocks("python")), "\n".join(commands())
    assert [w for w, _, _ in SUBSTITUTIONS if w not in python] == []
    assert [w for w, _, _ in COMMAND_SUBSTITUTIONS if w not in shell] == []
    assert set(re.findall(r"^```(\w*)", README, flags=re.M)) - {""} == {"python", "bash"}  # nothing else to run


@pytest.mark.slow  # the quick start loads the real target, SmolLM2
def test_no_block_rebinds_the_quick_starts_models_but_the_hub_one():
    """A reader on a CPU pastes the quick start, skips the GPU block and goes on: no other block may rebind the
    quick start's target, tokenizer or drafter (the kit block has its own names), and no output comment is copied
    into a block it does not describe."""
    import ast

    python = blocks("python")
    quick_start_names = {"target", "tokenizer", "drafter"}
    for block in python[1:]:
        if 'device_map="cuda"' in block:  # the Hub block: it replaces the models on purpose
            continue
        bound = {node.id for node in ast.walk(ast.parse(block)) if isinstance(node, ast.Name)
                 and isinstance(node.ctx, ast.Store)}  # fmt: skip
        assert not bound & quick_start_names, (bound & quick_start_names, block[:80])
    comments = [line.split("#", 1)[1].strip() for block in python for line in block.splitlines() if "  # " in line]
    assert comments.count("def largest(...): return max(numbers)") == 1


def test_the_python_blocks_run_in_order_in_one_session(standin, smollm2_folder, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)  # the training block writes "out"
    monkeypatch.setenv("HF_TEV_CACHE", str(smollm2_folder.parent.parent))  # the session's converted SmolLM2
    used, namespace = set(), {"__name__": "__readme__"}
    for number, block in enumerate(blocks("python")):
        code = substituted(block, SUBSTITUTIONS, used, standin=standin, drafter=kit_path("drafter-dflash-l135"))
        exec(compile(code, f"README.md python block {number}", "exec"), namespace)
    assert used == {w for w, _, _ in SUBSTITUTIONS}
    assert (tmp_path / "out" / "model.safetensors").is_file() and (tmp_path / "out" / "config.json").is_file()
    out, err = capfd.readouterr()
    assert namespace["pipe"] is not None and out.count("\n") >= 4  # every block printed
    warned = [line for line in err.splitlines() if "warn" in line.lower()]
    assert len(warned) == len(set(warned)), f"a warning printed twice: {warned}"


@pytest.mark.parametrize("prefix", [pytest.param(p, marks=pytest.mark.slow) if p in SLOW else p for p in RUN])
def test_the_shell_commands_run(prefix, standin, request, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    if prefix in SLOW:  # the session's converted SmolLM2
        monkeypatch.setenv("HF_TEV_CACHE", str(request.getfixturevalue("smollm2_folder").parent.parent))
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["Write a function that adds two numbers.", "Sort a list.", "Read a file."]))
    chosen = [c for c in commands() if rule_of(c) == prefix]
    assert chosen
    for number, command in enumerate(chosen):
        names = dict(standin=standin, drafter=kit_path("drafter-dflash-l135"), prompts=prompts)
        words = shlex.split(substituted(command, COMMAND_SUBSTITUTIONS, set(), **names))
        if "--output" in words:  # a fresh folder: the stored results stay as they are
            words[words.index("--output") + 1] = str(tmp_path / f"bench-{number}")
        if "--output_dir" in words:
            words[words.index("--output_dir") + 1] = str(tmp_path / f"train-{number}")
        assert words[0] == "hf-tev"
        capfd.readouterr()
        hf_tev_main(words[1:])
        warned = [line for line in capfd.readouterr().err.splitlines() if "warn" in line.lower()]
        assert len(warned) == len(set(warned)), f"a warning printed twice by {command}: {warned}"
        written = tmp_path / (f"bench-{number}" if words[1] == "bench" else f"train-{number}")
        expected = ["bench.json", "bench.md", "bench.png"] if words[1] == "bench" else ["model.safetensors"]
        assert all((written / name).is_file() for name in expected), (command, sorted(written.iterdir()))
