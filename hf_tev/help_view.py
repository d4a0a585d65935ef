"""The short `--help` of `hf-tev train` and `hf-tev bench`, and their `--help_all` (every option, as before).

A command builds its one parser (`HfArgumentParser`) twice, in two views that parse alike: the full view groups
every option; the short view (`short_view`) moves the options a first run sets into a few groups, hides the others'
help (`argparse.SUPPRESS`: they still parse) and ends with a line pointing to `--help_all`. `--help_all` prints the
full view's help. Both views hold the same actions, option strings, types and defaults; only the help differs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping

HELP_ALL = ("--help_all", "--help-all")
SHORT_METAVARS = {int: "N", float: "X"}


class HelpAllAction(argparse.Action):
    """`--help_all`: print the help of the full view (`full_parser()`) and exit, like `--help`."""

    def __init__(
        self,
        option_strings,
        full_parser: Callable[[], argparse.ArgumentParser],
        dest=argparse.SUPPRESS,
        default=argparse.SUPPRESS,
        help="show every option (the full help) and exit",
    ):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)
        self.full_parser = full_parser

    def __call__(self, parser, namespace, values, option_string=None):
        self.full_parser().print_help()
        parser.exit()


def add_help_all(parser: argparse.ArgumentParser, full_parser: Callable[[], argparse.ArgumentParser]) -> None:
    """Add `--help_all` (and `--help-all`) to `parser`'s own options group, next to `-h, --help`."""
    parser.add_argument(*HELP_ALL, action=HelpAllAction, full_parser=full_parser)


class ShortHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Compact lines: one spelling per option (its first: `--max_steps`, not `--max-steps` nor an alias), a short
    metavar (`N` for an int, `X` for a float, the choices, none for a flag), and the default when it says
    something (not None, False, an empty list, or a help that already names its default)."""

    def __init__(self, prog, indent_increment=2, max_help_position=34, width=None):
        super().__init__(prog, indent_increment, max_help_position, width)

    def _format_action_invocation(self, action):
        if not action.option_strings or action.nargs == 0:  # -h, --help: as argparse writes them
            return super()._format_action_invocation(action)
        if is_flag(action):
            return action.option_strings[0]
        return f"{action.option_strings[0]} {short_metavar(action)}"

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if "default" in text or default is None or default is False or default in ([], "", argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def is_flag(action: argparse.Action) -> bool:
    """A boolean option given alone (`--push_to_hub`): transformers parses bools with an optional value."""
    return action.nargs == "?" and action.const is True


def short_metavar(action: argparse.Action) -> str:
    if action.choices:
        return "{" + ",".join(str(choice) for choice in action.choices) + "}"
    name = SHORT_METAVARS.get(action.type) or action.metavar
    name = name or (action.dest.upper() if len(action.dest) <= 12 else "VALUE")
    return f"{name} ..." if action.nargs == "+" else name


def short_view(
    parser: argparse.ArgumentParser,
    sections: Iterable[tuple[str, Iterable[str]]],
    helps: Mapping[str, str],
    command: str,
) -> argparse.ArgumentParser:
    """Make `parser` (its options still in its own options group) the short view: one group per `(title, argument
    names)` of `sections`, in order, their help from `helps` where given; every other option's help suppressed;
    an epilog pointing to `--help_all`. Raises KeyError for a name that is no argument of the parser."""
    options = parser._optionals._group_actions  # the parser's own options group
    shown = {action.dest for action in options if action.nargs == 0 and action.dest in ("help", "help_all")}
    for title, names in sections:
        group = parser.add_argument_group(title)
        for name in names:
            moved = [action for action in options if action.dest == name]  # a bool's --no_ twin too
            if not moved:
                raise KeyError(f"the short help names {name!r}, which is no argument of {parser.prog}")
            for action in moved:
                options.remove(action)
                group._group_actions.append(action)
                action.help = helps.get(name, action.help)
            shown.add(name)
    hidden = {action.dest for action in options if action.dest not in shown}
    for action in options:
        if action.dest in hidden:
            action.help = argparse.SUPPRESS
    parser.epilog = (
        f"{len(hidden)} more options, and every name of each (both spellings, aliases): {command} --help_all"
    )
    return parser
