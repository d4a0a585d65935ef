"""ExitTrain: exit-guided training of a DFlash drafter as a `transformers.Trainer` subclass (docs/design.md#exittrain).

```python
from hf_tev import ExitTrainer, ExitTrainingArguments, generate_training_data

rows = generate_training_data(target, prompts, tokenizer=tokenizer, max_new_tokens=512)  # target-written data
args = ExitTrainingArguments(output_dir="out", objective="exit", tree_budget=32, ce_weight=1.0,
                             tree_weight=0.1, learning_rate=1e-4, num_train_epochs=2,
                             per_device_train_batch_size=4)
trainer = ExitTrainer(model=drafter, target_model=target, args=args, train_dataset=rows)
trainer.train()
trainer.push_to_hub("me/my-exittrained-drafter", dataset_description="...")
```

The defaults of the objectives "exit" and "prefix" follow the authors' released training code (hsj576/TEV,
SpecForge `exittrain`); every difference to hf_tev before 0.1.0 is a knob of `ExitTrainingArguments`
(`exit_config.py`).

`ExitTrainer` is the list of `Trainer` hooks below; the work they do lives beside it:
  - `compute_loss`: one step of objective "exit", "prefix" or "dflash" on a batch of training rows
    (`losses.rows_loss`: a target context forward, all blocks in one drafter forward, the inference-time trees
    scored by one target forward, `exit_loss.exittrain_loss`), or of Draft-OPD (`losses.replay_loss` on the
    rollouts of `rollouts.RolloutPool`); anchors and replayed cycles come from seeded generators
    (`checkpoints.seeded_generator`), so a resumed run draws what an uninterrupted one would;
  - `evaluation_loop` / `prediction_step`: the loss on anchors drawn the same at every evaluation, then the
    decoded tau (`rollouts.decoded_tau`: real tree decoding, `target.generate(..., assistant_model=drafter,
    tev_config=TEVConfig(budget=..., lookup=False))`: the drafter's own trees, no context drafts; the same
    decoding as the Draft-OPD rollouts: `rollouts.collect_rollouts`);
  - `log` / `floating_point_ops`: the step metrics (`StepMetrics`, below) and FLOPs (`losses.FlopCounter`);
  - `_save`, `_save_rng_state` / `_load_rng_state`: the drafter alone in its published layout, and the Draft-OPD
    rollouts in checkpoints;
  - `create_model_card`, `init_hf_repo`, `push_to_hub`: the model card and the Hub upload (`hub`).

Multi-process training uses Trainer's own engines (DDP through accelerate): on GPUs,
`accelerate launch --num_processes 8 train.py` or `torchrun --nproc_per_node 8 train.py`; every
process holds its own frozen copy of the target (not wrapped by DDP). On CPU, `torchrun` with
`ExitTrainingArguments(use_cpu=True, ddp_backend="gloo")` works the same way.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import zipfile
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, Trainer
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_utils import get_last_checkpoint

from ..models.dflash.modeling_dflash import DFlashDraftModel
from . import hub
from .checkpoints import (
    NEW_RUN,
    SETTINGS_NAME,
    DrawCounter,
    check_checkpoint,
    check_checkpoint_drafter,
    check_checkpoint_settings,
    objective_settings,
    seeded_generator,
)
from .data import ExitDataCollator, check_trainer_datasets
from .exit_config import ExitTrainingArguments
from .losses import OPD_DRAFT_VOCAB, FlopCounter, StepLoss, replay_loss, rows_loss
from .rollouts import RolloutPool, decoded_tau, tau_prompts
from .rows import encode_prompt, pad_token_id_of


class ExitTrainer(Trainer):
    """Trains a DFlash drafter against a frozen target with the standard, prefix-weighted or exit-weighted
    objective (docs/design.md#exittrain; the objective and every knob are in [`ExitTrainingArguments`]).

    Args:
        model ([`DFlashDraftModel`]): the drafter, the only trained (and saved) model.
        target_model ([`~transformers.PreTrainedModel`]): the frozen target. It stays on the trainer:
            `requires_grad_(False)`, `eval()`, never optimised, saved or wrapped by DDP; its `embed_tokens`
            and `lm_head` are used by the drafter at run time without becoming drafter submodules.
        args ([`ExitTrainingArguments`], *optional*): defaults to `ExitTrainingArguments("tmp_trainer")`.
        train_dataset / eval_dataset: rows with an `input_ids` column and optionally `prompt_length` or
            `loss_mask` (see [`ExitDataCollator`], [`generate_training_data`]); a list or `datasets.Dataset`.
            A [`CachedFeatureDataset`] (rows with the target's features from a `FeatureCache`) spares the
            target forward of every step with objective `"dflash"`; the tree objectives still run the target
            (they score the trees against its K/V cache) and ignore the cached features.
            Every row is checked before training starts (`check_rows`): a wrong row (no tokens, text, floats or
            nested lists as `input_ids`, a token id outside the target's vocabulary, a negative `prompt_length`,
            ...) raises a ValueError naming it; rows with no supervised token to predict are skipped with a
            counted warning, and if none is left, ValueError. An empty dataset is refused.
        data_collator (*optional*): defaults to `ExitDataCollator(pad_token_id, args.max_length, vocab_size)`.
        processing_class (*optional*): a tokenizer saved next to the drafter (and used for string `eval_prompts`).
        callbacks, optimizers, **kwargs: as for [`~transformers.Trainer`].
        eval_prompts (*optional*): the prompts decoded for `eval_tau` (strings, chat conversations or token-id
            lists; the first `args.eval_tau_prompts` are used) instead of the prompts of the evaluation rows.

    Logged per step (averaged over the logging window and across processes; `eval_`-prefixed in
    `evaluate`): `loss_dflash`, the cross-entropy term (decayed or not, see `ce_decay`); for the tree
    objectives `loss_tree`, the tree term before `tree_weight`, and `tree_1_plus_c`: the mean over the
    training trees of `1 + C` under the target, C = sum of the unfloored prefix probabilities `P(v)` of the
    drafted nodes (raw target softmax at temperature 1, with the context the tree loss uses). It is the tau an
    exact verifier would reach on those trees, not a decoding measurement. Steps where no tree was built
    (no anchor with a full horizon) leave both tree metrics out of the averages; a logging window without
    any tree does not log them. Objective `"opd"` logs `loss_dflash` (when `ce_weight` > 0), `loss_opd`,
    `loss_opd_accept`, `loss_opd_reject` (the two streams of the Draft-OPD loss, left out when a batch has none)
    and `opd_rollout_tau`, the mean block length of the current rollouts (the decoded tau of the drafter that made
    them); its `eval_loss` is the standard objective's cross-entropy.

    Evaluation: `eval_loss`, `eval_loss_dflash` (and the tree metrics) on anchors that are drawn the same at every
    evaluation, and `eval_tau`, the mean accepted block length (accepted draft tokens + 1) of real tree decoding
    with the frozen target and the drafter's trees alone (context drafts off) over the first `eval_tau_prompts`
    prompts, at `eval_tau_budget` and `eval_tau_temperature` (greedy by default), with `eval_tau_cycles` (the
    decoding cycles it averages).
    `total_flos` counts the FLOPs of the steps (an estimate like `Trainer`'s: see `floating_point_ops`).

    Multi-process: launch the same script with `accelerate launch` or `torchrun` (DDP on the drafter; every
    process keeps its own target). On CPU pass `use_cpu=True, ddp_backend="gloo"`.
    """

    # compute_loss returns a per-batch mean; Trainer divides it by the accumulation steps.
    loss_is_scaled_for_ga = False

    def __init__(
        self,
        model: DFlashDraftModel,
        target_model: PreTrainedModel,
        args: ExitTrainingArguments | None = None,
        train_dataset=None,
        eval_dataset=None,
        data_collator=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        eval_prompts=None,
        **kwargs,
    ):
        _check_models(model, target_model)
        if args is None:
            args = ExitTrainingArguments(output_dir="tmp_trainer")
        if getattr(args, "objective", None) == "opd" and getattr(model, "draft_vocab", None) is not None:
            raise ValueError(OPD_DRAFT_VOCAB)
        if not isinstance(args, ExitTrainingArguments):
            raise TypeError(f"args must be ExitTrainingArguments, got {type(args).__name__}")
        # Every row is checked before training starts; rows with nothing to train are dropped (counted warning).
        vocab_size = target_model.get_input_embeddings().weight.shape[0]
        train_dataset, eval_dataset = check_trainer_datasets(
            train_dataset, eval_dataset, target_model, args.max_length, model.config.target_layer_ids
        )
        pad_token_id = pad_token_id_of(target_model, processing_class)
        if data_collator is None:
            data_collator = ExitDataCollator(pad_token_id, args.max_length, vocab_size)
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            **kwargs,
        )
        self.model_accepts_loss_kwargs = False  # the drafter's forward takes **kwargs but computes no loss
        target_model.requires_grad_(False).eval()
        if getattr(target_model, "hf_device_map", None) is None:  # a device-mapped target stays where it is
            target_model.to(self.args.device)
        self.target_model = target_model
        self.pad_token_id = pad_token_id
        self.eval_prompts = None
        if eval_prompts is not None:
            self.eval_prompts = [encode_prompt(prompt, processing_class, False) for prompt in eval_prompts]
        self.step_metrics = StepMetrics()
        self.flop_counter = FlopCounter(model, target_model)
        self.rollout_pool = RolloutPool(self.args, target_model, self.train_dataset, pad_token_id)
        self._anchor_draws = DrawCounter()  # anchor draws at the current (mode, step)
        self._eval_draws = DrawCounter()  # batches of the current evaluation

    # -- resuming -----------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """`Trainer.train`, with the checkpoint to resume from checked first (`checkpoints.check_checkpoint`): a
        checkpoint without `trainer_state.json`, `model.safetensors`, `optimizer.pt` or `scheduler.pt`, or with one
        of them damaged, or whose weights are another drafter's, or written under another objective (its
        `exit_train_settings.json`), is refused before any step instead of resuming with a fresh optimizer, failing
        on a size mismatch or mixing two trainings. `True` resumes from the last
        checkpoint in `args.output_dir`."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = (
                get_last_checkpoint(self.args.output_dir) if Path(self.args.output_dir).is_dir() else None
            )
            if resume_from_checkpoint is None:
                raise ValueError(f"resume_from_checkpoint=True: no checkpoint in {self.args.output_dir}")
        if resume_from_checkpoint not in (None, False):
            own_layout = not (self.is_deepspeed_enabled or self.is_fsdp_enabled)  # theirs keep their own files
            check_checkpoint(resume_from_checkpoint, optimizer=own_layout)
            if own_layout:
                check_checkpoint_drafter(resume_from_checkpoint, self.accelerator.unwrap_model(self.model))
            check_checkpoint_settings(resume_from_checkpoint, self.args)
        return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # The files were checked before training; what torch.load still finds wrong is named with the file.
        try:
            super()._load_optimizer_and_scheduler(checkpoint)
        except (RuntimeError, ValueError, KeyError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as error:
            raise ValueError(
                f"the optimizer or scheduler state in {checkpoint} cannot be resumed ({type(error).__name__}: "
                f"{error}); {NEW_RUN.format(path=checkpoint)}"
            ) from error

    # -- loss ---------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if model.training else "eval"
        drafter = self.accelerator.unwrap_model(model)
        args = self.args
        if args.objective != "opd":
            step = self._rows_step(model, drafter, inputs, mode, args.objective, args.ce_weight)
        elif mode == "eval":  # the rollouts are a training device: evaluations report the standard objective's CE
            step = self._rows_step(model, drafter, inputs, mode, "dflash", 1.0)
        else:
            step = self._opd_step(model, drafter, inputs)
        self.step_metrics.record(mode, step.metrics, self.accelerator.gather)
        return (step.loss, {"draft_logits": step.draft_logits}) if return_outputs else step.loss

    def _rows_step(self, model, drafter, inputs, mode: str, objective: str, ce_weight: float) -> StepLoss:
        """`losses.rows_loss` of `objective` on a batch of training rows; its FLOPs counted in training."""
        generator = self._anchor_generator(mode)
        step, size = rows_loss(model, drafter, self.target_model, inputs, self.args, objective, ce_weight, generator)
        if mode == "train":
            self.flop_counter.add(size)
        return step

    def _opd_step(self, model, drafter, inputs) -> StepLoss:
        """`ce_weight * CE` on the training rows (the standard objective) + `opd_weight * OPD` on this
        micro-batch's rollouts (rolled out anew first when a refresh is due)."""
        args = self.args
        step = StepLoss(0.0, {}, None)
        if args.ce_weight > 0:
            step = self._rows_step(model, drafter, inputs, "train", "dflash", args.ce_weight)
        rollouts, generator = self.rollout_pool.next_batch(self.state.global_step, drafter)
        parts, size = replay_loss(model, drafter, self.target_model, rollouts, args, generator, self.pad_token_id)
        self.flop_counter.add(size)
        metrics = {**step.metrics, "loss_opd": parts.loss, "loss_opd_accept": parts.accept}
        metrics |= {"loss_opd_reject": parts.reject, "opd_rollout_tau": parts.loss.new_tensor(self.rollout_pool.tau)}
        return StepLoss(step.loss + args.opd_weight * parts.loss, metrics, step.draft_logits)

    def _anchor_generator(self, mode: str) -> torch.Generator:
        """The generator of a batch's anchors, seeded by (seed, mode, step, draw within the step, process).
        Evaluation anchors are seeded by (seed, batch of the evaluation, process) only: every evaluation draws
        the same anchors."""
        args = self.args
        if mode == "eval":
            return seeded_generator(args.seed, "eval", f"batch{self._eval_draws.next('eval')}", args.process_index)
        step = self.state.global_step
        return seeded_generator(args.seed, mode, step, self._anchor_draws.next((mode, step)), args.process_index)

    def floating_point_ops(self, inputs) -> int:
        """The FLOPs of the training steps since the last call (`metrics.FlopCounter`); `Trainer` sums them into
        `state.total_flos`."""
        return self.flop_counter.pop()

    # -- evaluation and logs ----------------------------------------------------------------------

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ):
        """Trainer's loop (the loss and its parts, on the same anchors at every evaluation), then the decoded
        tau of the evaluation prompts: `{metric_key_prefix}_tau` and `{metric_key_prefix}_tau_cycles`."""
        self._eval_draws = DrawCounter()
        output = super().evaluation_loop(
            dataloader,
            description,
            prediction_loss_only=prediction_loss_only,
            ignore_keys=ignore_keys,
            metric_key_prefix=metric_key_prefix,
        )
        prompts = tau_prompts(getattr(dataloader, "dataset", None), self.eval_prompts, self.args.eval_tau_prompts)
        if prompts:
            drafter = self.accelerator.unwrap_model(self.model)
            tau, cycles = decoded_tau(self.target_model, drafter, prompts, self.args, self.accelerator.gather)
            output.metrics[f"{metric_key_prefix}_tau"] = tau
            output.metrics[f"{metric_key_prefix}_tau_cycles"] = cycles
        return output

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation = the training loss under no_grad (with its metrics); no logits are gathered."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Trainer's log, with the step metrics averaged over the logging window (`eval_`-prefixed in evaluation)."""
        mode = "train" if self.model.training else "eval"
        prefix = "eval_" if mode == "eval" else ""
        averaged = self.step_metrics.pop_averages(mode)
        logs.update({f"{prefix}{name}": value for name, value in averaged.items()})  # in place: evaluate() returns it
        super().log(logs, start_time)

    # -- saving and the Hub ---------------------------------------------------------------------

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The drafter alone through its `save_pretrained` (published DFlash layout, loadable by
        `DFlashDraftModel.from_pretrained`); the target is never written."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        drafter = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        drafter.save_pretrained(output_dir, state_dict=state_dict)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_rng_state(self, output_dir: str) -> None:
        # What only a checkpoint holds (Trainer calls this for checkpoints alone). The objective's settings, read
        # back without unpickling when the run resumes (`check_checkpoint_settings`); and every process's current
        # rollouts: a resumed run trains on the same ones.
        super()._save_rng_state(output_dir)
        if self.args.should_save:
            with open(os.path.join(output_dir, SETTINGS_NAME), "w") as f:
                json.dump(objective_settings(self.args), f, indent=1)
        if self.args.objective == "opd":
            self.rollout_pool.save(output_dir)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        super()._load_rng_state(checkpoint)
        if self.args.objective == "opd" and checkpoint is not None:
            self.rollout_pool.load(checkpoint)

    def create_model_card(
        self,
        repo_id: str | None = None,
        target_model_id: str | None = None,
        dataset_description: str | None = None,
        measured_tau: Mapping[Any, float] | None = None,
        tau_temperature: float | None = None,
        license: str = "apache-2.0",
        datasets: Sequence[str] | None = None,
        **_unused,
    ) -> str:
        """Write `README.md` into `args.output_dir` (main process) from the package's card template
        (`hf_tev/training/drafter_card.md`, see `hub.render_model_card`) and return its text.

        Args:
            repo_id: Hub id the drafter is published under (used in the usage snippet).
            target_model_id: the target's Hub id (the card's `base_model`); defaults to the target's
                `name_or_path`. A local folder or a description is shown in the text, never as `base_model`.
            dataset_description: free text on the training data (prompts, how responses were generated).
            measured_tau: mean tau measured with this drafter: `{64: 6.1}` (budget -> tau), `{(64, 0.0): 6.1}`
                (budget, temperature) or `{"HumanEval, budget 64, T=0": 6.1}`; omitted when not given.
            tau_temperature: the sampling temperature of `measured_tau` entries that do not carry one.
            license: the card's license (metadata). datasets: Hub ids of the training data (metadata).
        """
        fields = dict(measured_tau=measured_tau, tau_temperature=tau_temperature, license=license, datasets=datasets)
        card = hub.trainer_model_card(self, repo_id, target_model_id, dataset_description, **fields)
        if self.is_world_process_zero():
            card.save(Path(self.args.output_dir, "README.md"))
        return card.content

    def _hub_api(self, token: str | None):
        return hub.hub_api(token if token is not None else self.args.hub_token)

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """Create (or reuse) the Hub repo `args.hub_model_id` (default: the output folder's name)."""
        if not self.is_world_process_zero():
            return
        repo_id = self.args.hub_model_id or Path(self.args.output_dir).absolute().name
        private = private if private is not None else self.args.hub_private_repo
        self.hub_model_id = self._hub_api(token).create_repo(repo_id, private=private, exist_ok=True).repo_id
        self.push_in_progress = None

    def push_to_hub(
        self,
        repo_id: str | None = None,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        **card,
    ):
        """Upload the drafter (published layout: `config.json` + safetensors) and a filled model card.

        Creates the repo first (so offline, or without access, it fails before anything is written), then
        saves into `args.output_dir` and uploads it with `huggingface_hub.HfApi.upload_folder`; checkpoints,
        `training_args.bin` and `_*` files stay local. `repo_id` defaults to `args.hub_model_id`, then the
        output folder's name. `card`: the fields of the model card, as `create_model_card` takes them
        (`target_model_id`, `dataset_description`, `measured_tau`, `tau_temperature`, `license`, `datasets`).
        Returns the `upload_folder` result (a future when `blocking=False`); None on processes other than the main
        one.
        """
        if repo_id is not None:
            self.args.hub_model_id = repo_id
            self.hub_model_id = None
        if getattr(self, "hub_model_id", None) is None:
            self.init_hf_repo(token=token, private=private)
        self.save_model(_internal_call=True)  # every process: some engines gather weights collectively
        if not self.is_world_process_zero():
            return None
        self.create_model_card(repo_id=self.hub_model_id, **card)
        self._finish_current_push()
        return hub.upload_folder(
            self._hub_api(token),
            self.hub_model_id,
            self.args.output_dir,
            ignore_patterns=[*hub.UPLOAD_IGNORE, TRAINING_ARGS_NAME],
            commit_message=commit_message,
            revision=revision if revision is not None else self.args.hub_revision,
            blocking=blocking,
        )


def _check_models(model, target_model) -> None:
    """Refuse anything but a DFlash drafter that fits a transformers causal LM target."""
    if not isinstance(model, DFlashDraftModel):
        raise TypeError(f"model must be a hf_tev.DFlashDraftModel (the drafter), got {type(model).__name__}")
    if not isinstance(target_model, PreTrainedModel) or target_model.get_output_embeddings() is None:
        raise TypeError(
            f"target_model must be a transformers causal LM with an LM head, got {type(target_model).__name__}"
        )
    model.check_target(target_model)


class StepMetrics:
    """What `ExitTrainer` logs besides the loss: the metrics of the steps since the last log, per mode (`"train"`,
    `"eval"`), averaged over the logging window and across processes."""

    def __init__(self):
        self.values = {"train": defaultdict(list), "eval": defaultdict(list)}

    def record(self, mode: str, metrics: dict[str, torch.Tensor], gather: Callable) -> None:
        """Record one step's metrics, averaged across processes by `gather` (`accelerator.gather`): one small
        all-gather per step (every process records the same names) and no host sync."""
        values = torch.stack([value.detach().float().reshape(()) for value in metrics.values()])  # [m]
        values = gather(values).view(-1, len(metrics)).nanmean(0)
        for name, value in zip(metrics, values, strict=True):
            self.values[mode][name].append(value)

    def pop_averages(self, mode: str) -> dict[str, float]:
        """Every metric averaged over the recorded steps, NaNs left out (e.g. steps without a tree), then
        forgotten; a metric with no value at all is not returned."""
        averaged = {name: torch.stack(values).nanmean().item() for name, values in self.values[mode].items() if values}
        self.values[mode].clear()
        return {name: value for name, value in averaged.items() if not math.isnan(value)}
