"""`hf-tev <command>` (also `python -m hf_tev <command>`). Commands: `bench` (`hf_tev.bench`)."""

import sys

COMMANDS = {"bench": "decoding methods side by side: tau, coverage, SR, stage times (hf_tev.bench)"}


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        listing = "\n".join(f"  {name:<8} {text}" for name, text in COMMANDS.items())
        print(f"usage: hf-tev <command> [options]\n\ncommands:\n{listing}")
        if argv and argv[0] not in ("-h", "--help"):
            sys.exit(f"hf-tev: unknown command {argv[0]!r}; known: {', '.join(COMMANDS)}")
        return
    from . import bench

    bench.main(argv[1:], prog=f"hf-tev {argv[0]}")


if __name__ == "__main__":
    main()
