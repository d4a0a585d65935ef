"""`hf-tev <command>` (also `python -m hf_tev <command>`). A command is a module with `main(argv, prog)`."""

import sys
from importlib import import_module

# command -> (module with `main(argv, prog)`, one line of help). Modules load only when their command runs.
COMMANDS = {
    "bench": (
        "hf_tev.bench.cli",
        "decoding methods side by side: tau, coverage, SR, stage times "
        "(`hf-tev bench recipe.yaml` or flags; `hf-tev bench report bench.json` re-renders a stored run)",
    ),
    "train": (
        "hf_tev.training.cli",
        "train a DFlash drafter with ExitTrainer: target-written data, eval tau, model card, Hub upload "
        "(`hf-tev train recipe.yaml` or flags; also `python -m hf_tev.train`)",
    ),
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        listing = "\n".join(f"  {name:<8} {text}" for name, (_, text) in COMMANDS.items())
        print(f"usage: hf-tev <command> [options]\n\ncommands:\n{listing}")
        if argv and argv[0] not in ("-h", "--help"):
            sys.exit(f"hf-tev: unknown command {argv[0]!r}; known: {', '.join(COMMANDS)}")
        return
    module, _ = COMMANDS[argv[0]]
    import_module(module).main(argv[1:], prog=f"hf-tev {argv[0]}")  # its return value is not an exit status


if __name__ == "__main__":
    main()
