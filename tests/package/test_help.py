"""`hf-tev train --help` and `hf-tev bench --help`: a short view a newcomer can read (the options a first run sets,
grouped, and a pointer to the rest), `--help_all` with every option, and both views parsing alike."""

import argparse

import pytest

from hf_tev.__main__ import main as hf_tev_main
from hf_tev.bench import cli as bench_cli
from hf_tev.training import script_args

# command -> (its module with build_parser and SHORT_SECTIONS, the most lines of --help at 80 columns)
COMMANDS = {"train": (script_args, 60), "bench": (bench_cli, 50)}


def help_text(command, flag, capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exit_info:
        hf_tev_main([command, flag])
    assert exit_info.value.code in (0, None)
    return capsys.readouterr().out


def settings(action: argparse.Action) -> tuple:
    """Everything of an action that parsing reads (a type by name: transformers makes choice types per parser)."""
    kind = getattr(action.type, "__name__", action.type)
    return (type(action).__name__, action.dest, action.nargs, action.const, action.default, kind, action.required)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_short_and_the_full_view_parse_alike(command):
    module, _ = COMMANDS[command]
    short, full = module.build_parser(full=False), module.build_parser(full=True)
    assert set(short._option_string_actions) == set(full._option_string_actions)
    for option, action in full._option_string_actions.items():
        assert settings(short._option_string_actions[option]) == settings(action), option
        assert short._option_string_actions[option].choices == action.choices, option
    hidden = [action for action in short._actions if action.help is argparse.SUPPRESS]
    assert hidden and all(action.help is not argparse.SUPPRESS for action in full._actions)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_is_short_grouped_and_points_to_help_all(command, capsys, monkeypatch):
    module, most = COMMANDS[command]
    text = help_text(command, "--help", capsys, monkeypatch)
    lines = text.splitlines()
    assert len(lines) <= most, text
    places = [text.index(f"\n{title}:\n") for title, _ in module.SHORT_SECTIONS]
    assert places == sorted(places)
    for title, names in module.SHORT_SECTIONS:  # each option once, in its group, under its first name
        section = text[text.index(f"\n{title}:\n") :].split("\n\n")[0]
        assert [line.split()[0] for line in section.splitlines() if line.startswith("  --")] == [
            f"--{name}" for name in names
        ]
    listed = [line.split()[0] for line in text[text.index("\noptions:\n") :].splitlines() if line.startswith("  -")]
    shown = ["-h,", "--help_all,"] + [f"--{name}" for _, names in module.SHORT_SECTIONS for name in names]
    assert listed == shown
    hidden = {a.dest for a in module.build_parser(full=False)._actions if a.help is argparse.SUPPRESS}
    assert lines[-1].startswith(f"{len(hidden)} more options") and lines[-1].endswith(f"hf-tev {command} --help_all")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_all_lists_every_option(command, capsys, monkeypatch):
    module, most = COMMANDS[command]
    text = help_text(command, "--help_all", capsys, monkeypatch)
    assert len(text.splitlines()) > most
    options = {option for option in module.build_parser(full=True)._option_string_actions}
    words = {word.strip("[],") for word in text.split()}
    assert not options - words
    assert help_text(command, "--help-all", capsys, monkeypatch) == text
