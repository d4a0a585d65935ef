"""What `import hf_tev` adds besides the route: its log lines under its own name at transformers' verbosity, and a
generation config's `tev_config` read back as a `TEVConfig`."""

import importlib
import json
import logging

import pytest
from transformers import GenerationConfig
from transformers.utils import logging as transformers_logging

import hf_tev  # noqa: F401  (configures hf_tev's logger, as any hf_tev import does)


def current_config_class():
    return importlib.import_module("hf_tev.config").TEVConfig  # (tests elsewhere reload the module)


def test_hf_tev_lines_print_as_hf_tev_once_and_obey_transformers_verbosity(capfd):
    logger = transformers_logging.get_logger("hf_tev.generation.checks")
    reaching_transformers = []  # what transformers' handler would print, as `[transformers] ...`
    recorder = logging.Handler()
    recorder.emit = lambda record: reaching_transformers.append(record.getMessage())
    transformers_logging.get_logger("transformers").addHandler(recorder)
    try:
        logger.warning("a probe line")
        transformers_logging.get_logger("transformers.generation.utils").warning("a transformers line")
    finally:
        transformers_logging.get_logger("transformers").removeHandler(recorder)
    # Only hf_tev's own line is asserted: transformers' handler may print its line too, depending on how pytest
    # captures (with -s it writes to the real stderr).
    probe_lines = [line for line in capfd.readouterr().err.splitlines() if "a probe line" in line]
    assert probe_lines == ["[hf_tev] a probe line"]
    assert reaching_transformers == ["a transformers line"]  # hf_tev's line is printed once, by hf_tev
    previous = transformers_logging.get_verbosity()
    try:
        transformers_logging.set_verbosity_error()
        logger.warning("silenced")
        transformers_logging.set_verbosity_info()
        logger.info("an info line")
    finally:
        transformers_logging.set_verbosity(previous)
    err = capfd.readouterr().err
    assert "silenced" not in err and "[hf_tev] an info line" in err
    assert logging.getLogger("hf_tev").propagate is False


def hf_tev_handlers() -> list[logging.Handler]:
    """hf_tev's own handlers on its logger, by class name (a reload makes a new class). pytest's logging plugin
    attaches capture handlers of its own to non-propagating loggers, so the logger's whole list depends on pytest's
    version and options."""
    return [h for h in logging.getLogger("hf_tev").handlers if type(h).__name__ == "StderrHandler"]


def test_configure_logging_again_adds_no_second_handler(capfd):
    from hf_tev.logs import configure_logging

    before = hf_tev_handlers()
    importlib.reload(importlib.import_module("hf_tev.logs")).configure_logging()
    configure_logging()
    assert len(hf_tev_handlers()) == len(before) == 1
    transformers_logging.get_logger("hf_tev.x").warning("once")
    assert capfd.readouterr().err.count("once") == 1


def test_a_generation_configs_tev_config_reads_back_as_a_tev_config(tmp_path):
    TEVConfig = current_config_class()
    assert not hasattr(GenerationConfig(), "tev_config")  # unset: no attribute, as before hf_tev
    config = GenerationConfig(max_new_tokens=8, tev_config={"budget": 5, "verifier": "residual"})
    assert isinstance(config.tev_config, TEVConfig) and config.tev_config.budget == 5
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "generation_config.json").read_text())["tev_config"]["budget"] == 5
    loaded = GenerationConfig.from_pretrained(tmp_path)
    assert loaded.tev_config == TEVConfig(budget=5, verifier="residual") and loaded.tev_config.budget == 5
    assert loaded == config  # transformers' own equality (its JSON) sees the same config
    # generate's `update(**kwargs)` keeps an unknown `tev_config` keyword for the model call, as without hf_tev
    assert GenerationConfig().update(tev_config={"budget": 3}) == {"tev_config": {"budget": 3}}
    del loaded.tev_config
    assert not hasattr(loaded, "tev_config")


def test_a_tev_config_no_tev_config_can_read_still_loads_and_is_refused_when_used(tmp_path):
    from helpers import make_drafter, make_target, transformers_log

    (tmp_path / "generation_config.json").write_text(json.dumps({"tev_config": {"budget": 4, "from_the_future": 1}}))
    with transformers_log() as messages:
        loaded = GenerationConfig.from_pretrained(tmp_path)
    assert loaded.tev_config == {"budget": 4, "from_the_future": 1}  # kept as read
    assert any("from_the_future" in m for m in messages)
    target = make_target("qwen3")
    with pytest.raises(ValueError, match="from_the_future"):
        target.generate(max_new_tokens=4, generation_config=loaded, assistant_model=make_drafter(target))
