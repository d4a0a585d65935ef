"""`python -m hf_tev.bench ...`: the same as `hf-tev bench ...`."""

from .cli import main

main(prog="python -m hf_tev.bench")
