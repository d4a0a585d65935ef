"""Where the tiny-kit study's files are.

The shipped kit (target, assistant-ar, drafter-dflash, drafter-dflash-l135, prompts/ and
data/train_generated.jsonl) is the package `tiny_kit/` of the repository (`pip install -e ./tiny_kit`), found
through `hf_tev.packaged`. This folder, research/tiny_kit, holds the scripts that built it, the other data files,
the study's outputs (ablation/, runs/, tau_T*.json), its own drafters (drafters/) and, git-ignored, build/.

The scripts import this module as `import paths`: run as `python research/tiny_kit/X.py`, their folder is on
`sys.path`.
"""

from pathlib import Path

from hf_tev.packaged import KIT_MODELS, kit_dir, kit_path

HERE = Path(__file__).resolve().parent  # research/tiny_kit
BUILD = HERE / "build"  # git-ignored outputs: the tokenised corpus, prompts, generated rows, runs
# The study's own drafters (Table 2 arms and the 3-layer run), not shipped in the kit.
STUDY_DRAFTERS = ("drafter-finetuned", "drafter-prefix", "drafter-exittrain", "drafter-dflash-3l")
STUDY_DRAFTER_DIR = HERE / "drafters"


def model_path(name) -> Path:
    """The folder of a model named on a command line: a shipped kit model (`kit_path`), a study drafter, or else
    `name` itself, a folder given by the user."""
    if name in KIT_MODELS:
        return kit_path(name)
    if name in STUDY_DRAFTERS:
        return STUDY_DRAFTER_DIR / name
    return Path(name)


def data_file(name: str) -> Path:
    """A data file by name: `train_generated.jsonl` ships in the kit package, the others live in data/ here."""
    if name == "train_generated.jsonl":
        return kit_dir() / "data" / name
    return HERE / "data" / name
