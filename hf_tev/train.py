"""`python -m hf_tev.train [config.yaml] [--flags]`: the same as `hf-tev train` (see `hf_tev.training.cli`); runs
unchanged under `torchrun --nproc_per_node N -m hf_tev.train ...` and `accelerate launch -m hf_tev.train ...`."""

from .training.cli import main

if __name__ == "__main__":
    main(prog="python -m hf_tev.train")
