"""Model cards and Hub uploads of trained drafters (docs/training.md#model-cards).

The card template `drafter_card.md` is package data of `hf_tev.training`, read with `importlib.resources`
(it ships in the wheel). `render_model_card` fills it from plain values, no model needed, and returns a
`huggingface_hub.ModelCard` whose YAML metadata is a `ModelCardData`: `base_model` (the Hub ids of the target and
of the initial drafter, never a local path) with `base_model_relation: adapter`, `library_name: hf_tev`, tags,
license, datasets, no `pipeline_tag` (a drafter does not generate alone), and the decoded tau the trainer measured
as `model-index` results on the card's dataset. A local target or initial drafter is named by the Hub id its
location in the Hub cache or its `config.json` names (`model_reference`), else by its folder name only.
`trainer_model_card` collects those values from an `ExitTrainer`, its latest `eval_tau` with the budget and
temperature it was decoded at included. Uploads go through `huggingface_hub.HfApi` (`hub_api`, `upload_folder`),
which refuse in offline mode before anything is written.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any, NamedTuple

from huggingface_hub import EvalResult, HfApi, ModelCard, ModelCardData, is_offline_mode
from huggingface_hub.errors import OfflineModeIsEnabled
from huggingface_hub.utils import HFValidationError, validate_repo_id

from .._version import __version__
from ..exit_loss import ce_decays

TEMPLATE = "drafter_card.md"
# Every non-Python file of hf_tev.training read at run time (tests check that the wheel ships them).
PACKAGE_DATA = (TEMPLATE,)
TAGS = ("speculative-decoding", "dflash", "tev", "exittrain")
# How a drafter relates to the Hub models in its `base_model` (one of the Hub's relations: adapter, merge, quantized,
# finetune): it runs only on top of its target's weights (hidden states, embeddings, LM head), like an adapter.
BASE_MODEL_RELATION = "adapter"
# Never uploaded from the output folder: private files and checkpoints (the trainer adds training_args.bin).
UPLOAD_IGNORE = ("_*", "checkpoint-*")
# Knobs that only matter when trees are built (objectives "exit" and "prefix").
TREE_KNOBS = ("tree_budget", "tree_weight", "alpha", "tree_normalization", "tree_anchors", "tree_context_window")

OBJECTIVE_TITLES = {
    "exit": "ExitTrain, exit-weighted tree loss",
    "prefix": "prefix-weighted tree loss",
    "dflash": "standard DFlash objective",
    "opd": "Draft-OPD, on-policy distillation",
}
OBJECTIVE_DESCRIPTIONS = {
    "exit": "ExitTrain: a cross-entropy of every block position against the target-written continuation plus "
    "a tree loss on the inference-time draft tree weighted by exit weight `w(v) * depth(v)` (target "
    "mass that leaves the tree at node v, times its depth).",
    "prefix": "a cross-entropy of every block position against the target-written continuation plus a tree "
    "loss on the inference-time draft tree weighted by the target prefix probability `P(v)` (the "
    "prefix-weight ablation).",
    "dflash": "the standard DFlash objective alone: cross-entropy of every block position against the "
    'target-written continuation ("finetuned DFlash").',
    "opd": "Draft-OPD (on-policy distillation, Lei et al. 2026): rollouts by tree decoding with the target "
    "verifying this drafter's trees, its blocks replayed at the rollouts' cycles with the target's distributions "
    "as the teacher (forward KL at the accepted depths, position-decayed reverse KL at the rejected ones, where "
    "the teacher sees the drafter's own proposals), plus `ce_weight` times the standard DFlash cross-entropy on "
    "the target-written continuations.",
}


def load_template() -> str:
    """The card template's text, from the installed package."""
    return resources.files(__package__).joinpath(TEMPLATE).read_text(encoding="utf-8")


class ModelReference(NamedTuple):
    """A model as a card names it: its Hub id (None when it has none) and the text that describes it."""

    hub_id: str | None
    text: str | None


def is_hub_id(name: str | None) -> bool:
    """True for a Hub model id `org/name` that is not a local path (absolute, `./`, `~`, or existing here)."""
    if not name or os.path.isabs(name) or name.startswith((".", "~")) or os.path.exists(name):
        return False
    if name.count("/") != 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def model_reference(name: str | None) -> ModelReference:
    """How a card names a model given as a Hub id, a local folder or a free description.

    A Hub id is itself. A local path (existing here, absolute, or starting with `.` or `~`) is never written out:
    it is named by the Hub id its location in the Hub cache (`models--org--name/snapshots/...`) or its
    `config.json` (`_name_or_path`) names, else by its folder name only. Anything else is a description, kept as
    given.
    """
    if not name:
        return ModelReference(None, None)
    name = str(name)
    if is_hub_id(name):
        return ModelReference(name, f"`{name}`")
    if not (os.path.exists(name) or os.path.isabs(name) or name.startswith((".", "~"))):
        return ModelReference(None, name)
    path = Path(os.path.abspath(os.path.expanduser(name)))
    hub_id = _hub_id_of_folder(path)
    if hub_id is not None:
        return ModelReference(hub_id, f"`{hub_id}`")
    return ModelReference(None, f"`{path.name}` (a local model folder)")


def _hub_id_of_folder(path: Path) -> str | None:
    """The Hub id a local model folder names: from its Hub cache location, else its config's `_name_or_path`."""
    parts = path.parts
    for folder, child in zip(parts, parts[1:], strict=False):
        if folder.startswith("models--") and child == "snapshots":
            candidate = folder[len("models--") :].replace("--", "/")
            if is_hub_id(candidate):
                return candidate
    config = (path if path.is_dir() else path.parent) / "config.json"
    try:
        named = json.loads(config.read_text(encoding="utf-8")).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    return named if isinstance(named, str) and is_hub_id(named) else None


def card_metadata(
    target_model_id: str | None,
    objective: str,
    license: str = "apache-2.0",
    datasets: Sequence[str] | None = None,
    eval_tau: Sequence[Mapping[str, Any]] | None = None,
    model_name: str | None = None,
    init_from: str | None = None,
) -> ModelCardData:
    """The card's YAML metadata. `base_model` lists the Hub ids of the target and of the initial drafter (a local
    folder counts when it names one, see `model_reference`), with `base_model_relation: adapter`; no
    `pipeline_tag`. Every `eval_tau` record (see `render_model_card`) becomes a `model-index` result: metric type
    `tau`, with its budget and temperature in the metric's `config` and `args`, on the record's `dataset`, else
    the first of `datasets`."""
    tags = list(TAGS) + ([objective] if objective not in TAGS else [])
    bases = [ref.hub_id for ref in (model_reference(target_model_id), model_reference(init_from)) if ref.hub_id]
    bases = list(dict.fromkeys(bases))
    results = [_eval_result(record, datasets) for record in eval_tau or ()]
    return ModelCardData(
        base_model=(bases[0] if len(bases) == 1 else bases) or None,
        base_model_relation=BASE_MODEL_RELATION if bases else None,
        library_name="hf_tev",
        tags=tags,
        license=license,
        datasets=list(datasets) if datasets else None,
        model_name=model_name if results else None,
        eval_results=results or None,
    )


def _eval_result(record: Mapping[str, Any], datasets: Sequence[str] | None) -> EvalResult:
    dataset = record.get("dataset") or (datasets[0] if datasets else None)
    return EvalResult(
        task_type="text-generation",
        task_name="speculative decoding (tree decoding with TEV)",
        dataset_type=dataset or "custom",
        dataset_name=dataset or "held-out prompts",
        dataset_split=record.get("eval_split"),
        metric_type="tau",
        metric_name=f"mean tau (budget {record['budget']}, T={record['temperature']:g})",
        metric_value=round(float(record["tau"]), 4),
        metric_config=f"budget={record['budget']},temperature={record['temperature']:g}",
        metric_args={
            key: record[key]
            for key in ("budget", "temperature", "max_new_tokens", "cycles", "step")
            if record.get(key) is not None
        },
    )


def render_model_card(
    *,
    target_model_id: str | None,
    objective: str,
    block_size: int,
    target_layer_ids: Sequence[int],
    repo_id: str | None = None,
    model_name: str | None = None,
    num_draft_layers: int | None = None,
    mask_token_id: int | None = None,
    init_from: str | None = None,
    knobs: Mapping[str, Any] | None = None,
    knob_help: Mapping[str, str] | None = None,
    steps: int | None = None,
    training: Mapping[str, Any] | None = None,
    dataset_description: str | None = None,
    measured_tau: Mapping[Any, float] | None = None,
    tau_temperature: float | None = None,
    license: str = "apache-2.0",
    datasets: Sequence[str] | None = None,
    eval_tau: Sequence[Mapping[str, Any]] | None = None,
) -> ModelCard:
    """Fill the card template. Only the target, the objective and the drafter's block size and target layers
    are required; everything else is written when given. No local path is written anywhere (`model_reference`).

    Args:
        target_model_id: the target's Hub id (in the metadata's `base_model`), a local folder (named by the Hub
            id it names, else its folder name) or a description (shown in the text only).
        repo_id: the drafter's Hub id (`owner/name`): the usage snippet loads it, and its name is the card's
            title and `model-index` name. Anything else (a local output folder) is not written out.
        model_name: the card's title and `model-index` name (default: the name part of `repo_id`, else
            `<target name>-DFlash-b<block_size>`, as the published DFlash drafters are named).
        init_from: the drafter the training started from (Hub id, local folder or description); a Hub id joins
            `base_model`.
        knobs, knob_help: ExitTrain knobs by name and their meanings; only the knobs `objective` uses are written.
        steps: optimizer steps trained.
        training: further optimisation settings, label -> value (learning rate, batch size, ...).
        measured_tau: mean tau by setting: `{64: 6.1}` (budget), `{(64, 0.0): 6.1}` (budget, temperature)
            or `{"HumanEval, budget 64, T=0": 6.1}`; `tau_temperature` applies to keys without one.
        license, datasets: metadata (`datasets`: Hub dataset ids of the training prompts; the first is also the
            `model-index` dataset of the trainer's tau, whose held-out prompts come from the same source).
        eval_tau: decoded tau measured by the trainer, one dict per evaluation split: `tau`, `budget`,
            `temperature`, optionally `split`, `eval_split`, `dataset` (a Hub id), `max_new_tokens`, `cycles`,
            `step`. Each is a row of the tau table and a `model-index` result in the metadata.
    """
    target = model_reference(target_model_id)
    repo_id = repo_id if is_hub_id(repo_id) else None
    model_name = model_name or _default_model_name(repo_id, target_model_id, block_size)
    optimisation = dict(training or {})
    if steps is not None:
        optimisation["optimizer steps"] = steps
    knobs = {name: value for name, value in (knobs or {}).items() if _knob_used(objective, knobs, name)}
    knob_rows = [(f"`{name}`", value, (knob_help or {}).get(name, "")) for name, value in knobs.items()]
    metadata = card_metadata(target_model_id, objective, license, datasets, eval_tau, model_name, init_from)
    fields = {
        "card_data": metadata.to_yaml(),
        "model_name": model_name,
        "repo_id": repo_id or f"path/to/{model_name}",
        "target": target.text or "the target model it was trained with",
        "target_load": f'AutoModelForCausalLM.from_pretrained("{target.hub_id}")'
        if target.hub_id
        else "the target model, loaded with transformers",
        "objective": objective,
        "objective_title": OBJECTIVE_TITLES[objective],
        "objective_description": OBJECTIVE_DESCRIPTIONS[objective],
        "block_size": block_size,
        "draft_depth": block_size - 1,
        "num_draft_layers": _or_unknown(num_draft_layers),
        "target_layer_ids": list(target_layer_ids),
        "mask_token_id": _or_unknown(mask_token_id),
        "init_from": model_reference(init_from).text or "a freshly built drafter",
        "loss_details": _loss_details(objective, knobs),
        "knob_table": _table(("knob", "value", "meaning"), knob_rows) if knobs else "Not recorded.",
        "training_table": _table(("setting", "value"), list(optimisation.items())) if optimisation else "Not recorded.",
        "data_description": _without_local_paths((dataset_description or "Not described by the uploader.").strip()),
        "measured_tau": _tau_table(measured_tau, tau_temperature, eval_tau),
        "hf_tev_version": __version__,
    }
    return ModelCard(Template(load_template()).substitute(fields))


def _default_model_name(repo_id: str | None, target_model_id: str | None, block_size: int) -> str:
    """The name part of the drafter's Hub id, else `<target name>-DFlash-b<block_size>` (the published drafters'
    naming), the target named by its Hub id or folder name."""
    if repo_id:
        return repo_id.split("/")[-1]
    target = model_reference(target_model_id)
    if target.hub_id:
        stem = target.hub_id.split("/")[-1]
    elif target_model_id and target.text != target_model_id:  # a local folder
        stem = Path(os.path.abspath(os.path.expanduser(str(target_model_id)))).name
    else:
        stem = "drafter"
    return f"{stem}-DFlash-b{block_size}"


def trainer_model_card(
    trainer,
    repo_id: str | None = None,
    target_model_id: str | None = None,
    dataset_description: str | None = None,
    model_name: str | None = None,
    **card,
) -> ModelCard:
    """`render_model_card` with the drafter, the target and every knob of an `ExitTrainer`.

    `target_model_id` defaults to the target's `name_or_path`, the initial drafter is the drafter's
    `name_or_path` (local folders are named as `model_reference` says); `repo_id` defaults to
    `args.hub_model_id` (a local output folder given as `repo_id` is not written out); `model_name` to the name
    part of the Hub id (see `render_model_card`); `card` (`measured_tau`, `tau_temperature`, `license`, `datasets`)
    goes to `render_model_card` as given. The latest decoded tau of each evaluation split in the
    trainer's log history (`eval_tau`, see `ExitTrainer`) is added with the budget and temperature it was decoded
    at (`trainer_eval_tau`).
    """
    args = trainer.args
    drafter = trainer.accelerator.unwrap_model(trainer.model)
    config = drafter.config
    target_model_id = target_model_id or getattr(trainer.target_model, "name_or_path", "") or None
    repo_id = repo_id if is_hub_id(repo_id) else args.hub_model_id
    fields = type(args).__dataclass_fields__
    knobs = {name: getattr(args, name) for name in args.knob_names}
    knob_help = {name: fields[name].metadata.get("help", "") for name in args.knob_names}
    training = {
        "learning rate": args.learning_rate,
        "lr schedule / warmup steps": f"{getattr(args.lr_scheduler_type, 'value', args.lr_scheduler_type)} / "
        f"{_plain_number(args.warmup_steps)}",
        "weight decay": args.weight_decay,
        "epochs trained": round(trainer.state.epoch or 0.0, 2),  # max_steps overrides num_train_epochs
        "effective batch size (sequences)": args.per_device_train_batch_size
        * args.gradient_accumulation_steps
        * max(args.world_size, 1),
        "precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
        "seed": args.seed,
    }
    description = [dataset_description.strip()] if dataset_description else ["Not described by the uploader."]
    if trainer.train_dataset is not None and hasattr(trainer.train_dataset, "__len__"):
        description.append(f"{len(trainer.train_dataset)} training sequences.")
    init_from = getattr(drafter, "name_or_path", "") or None
    return render_model_card(
        target_model_id=target_model_id,
        objective=args.objective,
        block_size=config.block_size,
        target_layer_ids=config.target_layer_ids,
        repo_id=repo_id,
        model_name=model_name,
        num_draft_layers=config.num_hidden_layers,
        mask_token_id=config.mask_token_id,
        init_from=init_from,
        knobs=knobs,
        knob_help=knob_help,
        steps=trainer.state.global_step,
        training=training,
        dataset_description=" ".join(description),
        eval_tau=trainer_eval_tau(trainer),
        **card,
    )


_TAU_KEY = re.compile(r"^(eval(?:_.+)?)_tau$")


def trainer_eval_tau(trainer) -> list[dict[str, Any]]:
    """The latest decoded tau of every evaluation split in `trainer.state.log_history` (keys `eval_tau`,
    `eval_<split>_tau`), with the decoding settings of `trainer.args` (`eval_tau_budget` or `tree_budget`,
    `eval_tau_temperature`, `eval_tau_max_new_tokens`)."""
    args = trainer.args
    latest = {}
    for entry in trainer.state.log_history:
        for key, value in entry.items():
            match = _TAU_KEY.match(key)
            if match and isinstance(value, (int, float)):
                prefix = match.group(1)
                latest[prefix] = {
                    "split": "eval_dataset" if prefix == "eval" else f"eval_dataset[{prefix[len('eval_') :]!r}]",
                    "eval_split": None if prefix == "eval" else prefix[len("eval_") :],
                    "tau": float(value),
                    "budget": args.eval_tau_tree_budget,
                    "temperature": float(args.eval_tau_temperature),
                    "max_new_tokens": args.eval_tau_max_new_tokens,
                    "cycles": entry.get(f"{prefix}_tau_cycles"),
                    "step": entry.get("step"),
                }
    return list(latest.values())


def require_online(action: str) -> None:
    """Raise `huggingface_hub.errors.OfflineModeIsEnabled` (a `ConnectionError`) naming `action` when offline
    mode is on (`HF_HUB_OFFLINE=1`): every Hub write is refused before anything is written, remotely or locally."""
    if is_offline_mode():
        raise OfflineModeIsEnabled(
            f"Cannot {action}: offline mode is enabled (HF_HUB_OFFLINE=1). Unset HF_HUB_OFFLINE to reach the Hub, "
            "or save the drafter locally without pushing it."
        )


def hub_api(token: str | None = None) -> HfApi:
    """An `HfApi` client that identifies hf_tev (library name and version) to the Hub; refused in offline mode
    (`require_online`), before anything is created or written."""
    require_online("push to the Hugging Face Hub")
    return HfApi(token=token, library_name="hf_tev", library_version=__version__)


def upload_folder(
    api: HfApi,
    repo_id: str,
    folder: str | os.PathLike,
    ignore_patterns: Sequence[str] = UPLOAD_IGNORE,
    commit_message: str | None = None,
    revision: str | None = None,
    blocking: bool = True,
):
    """Upload a saved drafter folder (weights, config, README.md); a future when `blocking=False`. Refused in
    offline mode (`require_online`) before `api` is called."""
    require_online(f"upload {Path(folder).name} to {repo_id}")
    return api.upload_folder(
        repo_id=repo_id,
        folder_path=str(folder),
        commit_message=commit_message,
        revision=revision,
        run_as_future=not blocking,
        ignore_patterns=list(ignore_patterns),
    )


# ----------------------------------------------------------------------------------------------
# Pieces of the card text


# An absolute or home-relative local path inside free text (not a URL's `//host/...`, not a ratio like `1/2`).
_LOCAL_PATH = re.compile(r"(?<![\w.:/~-])(?:~|/)[^\s`'\"()|,;]*/([^\s`'\"()|,;/]+)")


def _without_local_paths(text: str) -> str:
    """`text` with every absolute (or `~/`) path replaced by its last component: no local path in a card."""
    return _LOCAL_PATH.sub(lambda match: match.group(1), text)


def _plain_number(value):
    """`40.0` -> `40` (transformers parses `warmup_steps` from the command line as a float)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _or_unknown(value) -> str:
    return "not recorded" if value is None else str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _knob_used(objective: str, knobs: Mapping[str, Any], name: str) -> bool:
    """Whether `objective` reads the knob `name` (the card records only those)."""
    # Objective "opd" uses the standard objective's cross-entropy, and tree_budget only as the rollouts' budget.
    ce_objective = "dflash" if objective == "opd" else objective
    unused = (
        (objective == "dflash" and name in TREE_KNOBS)
        or (objective == "opd" and name in TREE_KNOBS and name != "tree_budget")
        or (objective != "opd" and name.startswith("opd_"))
        or (name == "gamma" and not ce_decays(ce_objective, knobs.get("ce_decay")))
    )
    return not unused


def _loss_details(objective: str, knobs: Mapping[str, Any]) -> str:
    """What the recorded knobs mean for this run, one bullet each (only for the knobs given)."""
    lines = []
    if objective in ("exit", "prefix", "dflash", "opd") and ("ce_decay" in knobs or "gamma" in knobs):
        if ce_decays("dflash" if objective == "opd" else objective, knobs.get("ce_decay")):
            lines.append(
                f"- cross-entropy: position `k` weighted `exp(-(k-1)/gamma)`, gamma = {knobs.get('gamma')}, "
                "normalised by the weight sum"
            )
        else:
            lines.append("- cross-entropy: plain mean over the supervised block positions (no position decay)")
    if objective == "opd" and "opd_weight" in knobs:
        lines.append(
            f"- total loss = {knobs.get('ce_weight')} * cross-entropy + {knobs['opd_weight']} * Draft-OPD loss; "
            f"Draft-OPD = ({knobs.get('opd_accept_weight')} * forward KL at accepted depths + "
            f"{knobs.get('opd_reject_weight')} * reverse KL at rejected depths, decay "
            f"{knobs.get('opd_reject_decay')}) / the weights' sum; rollouts refreshed every "
            f"{knobs.get('opd_refresh_steps')} steps at temperature {knobs.get('opd_rollout_temperature')}"
        )
    if objective in ("exit", "prefix"):
        if "tree_normalization" in knobs:
            lines.append(
                "- tree loss: "
                + (
                    "summed over the trees of a batch and divided by their number of drafted nodes (root excluded)"
                    if knobs["tree_normalization"] == "nodes"
                    else "each tree divided by its own weight sum, then averaged over the trees"
                )
            )
        if "tree_anchors" in knobs:
            lines.append(
                "- trees built for "
                + (
                    "the anchors whose whole horizon (block_size - 1 following tokens) is supervised; "
                    "the cross-entropy covers every anchor"
                    if knobs["tree_anchors"] == "full_horizon"
                    else "every anchor"
                )
            )
        if "tree_context_window" in knobs:
            window = knobs["tree_context_window"]
            lines.append(
                "- the target scores the tree nodes "
                + (
                    "with the full context before the anchor"
                    if window is None
                    else f"seeing only the last {window} tokens before the anchor (an attention mask over the "
                    "full-context cache; positions stay absolute)"
                )
            )
        if "ce_weight" in knobs and "tree_weight" in knobs:
            lines.append(f"- total loss = {knobs['ce_weight']} * cross-entropy + {knobs['tree_weight']} * tree loss")
    elif "ce_weight" in knobs:
        lines.append(f"- total loss = {knobs['ce_weight']} * cross-entropy; no trees are built")
    return "\n".join(lines)


def _tau_table(
    measured_tau: Mapping[Any, float] | None,
    temperature: float | None,
    eval_tau: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    if not measured_tau and not eval_tau:
        return "Not measured for this upload."
    rows = []
    for setting, tau in (measured_tau or {}).items():
        budget, t = setting if isinstance(setting, tuple) else (setting, temperature)
        label = f"budget {budget}" if isinstance(budget, int) else str(budget)
        rows.append((label, "not given" if t is None else t, f"{float(tau):.3f}"))
    for record in eval_tau or ():
        details = [f"{record['max_new_tokens']} new tokens per prompt"] if record.get("max_new_tokens") else []
        details += [f"{record['cycles']} cycles"] if record.get("cycles") is not None else []
        details += [f"step {record['step']}"] if record.get("step") is not None else []
        label = (
            f"budget {record['budget']}, {record.get('split') or 'eval_dataset'} prompts, tree decoding by the trainer"
            " with the drafter's trees alone"
        )
        label += f" ({', '.join(details)})" if details else ""
        rows.append((label, record["temperature"], f"{float(record['tau']):.3f}"))
    return _table(("setting", "temperature", "mean tau"), rows)
