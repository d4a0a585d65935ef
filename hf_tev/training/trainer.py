"""ExitTrain: exit-guided training of a DFlash drafter as a `transformers.Trainer` subclass (SPEC section 6).

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

One training step, per batch of target-generated sequences:
  1. context: one no-grad target forward over the sequences; only the drafter's layers are returned
     as hidden states (and, for the tree objectives, the K/V cache is kept).
  2. draft:   `anchors_per_sequence` random anchors per sequence; every anchor's block
              `[x_a, MASK, ...]` sees the context strictly before `a` and itself, and all blocks of a
              sequence share ONE drafter forward through a block-structured 4D float mask.
  3. standard objective: decayed cross-entropy of `q_k` against `x_{a+k}` (`exit_loss.dflash_loss`).
  4. trees (objectives "exit" and "prefix"): with no gradient, the inference-time tree of every anchor
     (`hf_tev.tree.build_tree`, the decoder's own builder) from the drafter's log q at `tree_budget`;
     ONE target forward per batch scores all trees of all sequences against the cached context (tree
     of anchor `a` sees cache positions `< a` and its own ancestors; the root slot holds `x_a`); node
     weights from the target flow and the tree loss (`exit_loss.node_weights`, `exit_loss.tree_loss`).

Multi-process training uses Trainer's own engines (DDP through accelerate): on GPUs,
`accelerate launch --num_processes 8 train.py` or `torchrun --nproc_per_node 8 train.py`; every
process holds its own frozen copy of the target (not wrapped by DDP). On CPU, `torchrun` with
`ExitTrainingArguments(use_cpu=True, ddp_backend="gloo")` works the same way.
"""

from __future__ import annotations

import hashlib
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from typing import Any

import torch
from huggingface_hub import HfApi
from transformers import PreTrainedModel, Trainer, TrainingArguments
from transformers.trainer import TRAINING_ARGS_NAME

from .exit_loss import OBJECTIVES, dflash_loss, expected_block_length, node_weights, tree_loss
from .modeling_dflash import DFlashDraftModel
from .tree import DraftTree, build_tree

# Dataset columns (see `ExitDataCollator`).
INPUT_IDS = "input_ids"
LOSS_MASK = "loss_mask"
PROMPT_LENGTH = "prompt_length"

MODEL_CARD_TEMPLATE = Path(__file__).resolve().parent.parent / "model_cards" / "exittrain_drafter.md"

OBJECTIVE_DESCRIPTIONS = {
    "exit": "ExitTrain: the standard DFlash cross-entropy plus a tree loss on the inference-time draft tree "
            "weighted by exit weight `w(v) * depth(v)` (target mass that leaves the tree at node v, times "
            "its depth).",
    "prefix": "the standard DFlash cross-entropy plus a tree loss on the inference-time draft tree weighted "
              "by the target prefix probability `P(v)` (the prefix-weight ablation).",
    "dflash": "the standard DFlash objective alone: cross-entropy of every block position against the "
              "target-generated continuation, weighted `exp(-(k-1)/gamma)` (\"finetuned DFlash\").",
}


# ----------------------------------------------------------------------------------------------
# Arguments


@dataclass
class ExitTrainingArguments(TrainingArguments):
    r"""
    Training arguments of [`ExitTrainer`]: every knob of ExitTrain (SPEC section 6) on top of
    [`~transformers.TrainingArguments`]. Only the fields below are specific to ExitTrain or have a
    different default.

    Parameters:
        objective (`str`, *optional*, defaults to `"exit"`):
            `"exit"`: tree loss with exit weight `w(v) * depth(v)` (ExitTrain); `"prefix"`: tree loss with
            prefix weight `P(v)`; `"dflash"`: the standard DFlash objective alone (no trees are built).
        tree_budget (`int`, *optional*, defaults to `32`):
            Drafted nodes (root excluded) of the inference-time tree built for every anchor.
        ce_weight (`float`, *optional*, defaults to `1.0`):
            Weight of the standard DFlash cross-entropy in the total loss.
        tree_weight (`float`, *optional*, defaults to `0.1`):
            Weight of the tree loss in the total loss (ignored by `objective="dflash"`).
        alpha (`float`, *optional*, defaults to `1e-4`):
            Floor of an edge probability `p(v)` in the product `P(v)` of the node weights.
        gamma (`float`, *optional*, defaults to `7.0`):
            Depth decay of the standard objective: block position `k` has weight `exp(-(k-1)/gamma)`.
        anchors_per_sequence (`int`, *optional*, defaults to `8`):
            Random anchor positions (starts of drafted blocks) per training sequence and step; every
            anchor's next token must be supervised. Sequences with fewer such positions use all of them.
        max_length (`int` or `None`, *optional*, defaults to `2048`):
            Sequences are truncated to this many tokens by the default collator; `None` keeps them whole.
        learning_rate (`float`, *optional*, defaults to `1e-4`):
            Overrides the `TrainingArguments` default with the public ExitTrain recipe's value.
        remove_unused_columns (`bool`, *optional*, defaults to `False`):
            Must stay `False`: the drafter's forward does not take the dataset columns, the trainer does.
    """

    objective: str = field(
        default="exit",
        metadata={"help": "'exit' (tree loss weighted w(v) * depth(v), ExitTrain), 'prefix' (tree loss weighted "
                          "P(v)) or 'dflash' (the standard DFlash objective alone).",
                  "choices": list(OBJECTIVES)},
    )
    tree_budget: int = field(
        default=32, metadata={"help": "Drafted nodes (root excluded) of the inference-time tree of every anchor."}
    )
    ce_weight: float = field(default=1.0, metadata={"help": "Weight of the standard DFlash cross-entropy."})
    tree_weight: float = field(
        default=0.1, metadata={"help": "Weight of the tree loss (ignored by objective='dflash')."}
    )
    alpha: float = field(
        default=1e-4, metadata={"help": "Floor of an edge probability in the product P(v) of the node weights."}
    )
    gamma: float = field(
        default=7.0, metadata={"help": "Depth decay of the standard objective: weight exp(-(k-1)/gamma)."}
    )
    anchors_per_sequence: int = field(
        default=8, metadata={"help": "Random anchor positions (drafted blocks) per training sequence and step."}
    )
    max_length: int | None = field(
        default=2048, metadata={"help": "Truncate training sequences to this many tokens (None: no truncation)."}
    )
    learning_rate: float = field(default=1e-4, metadata={"help": "The initial learning rate for the optimizer."})
    remove_unused_columns: bool = field(
        default=False,
        metadata={"help": "Must be False: the trainer, not the drafter's forward, reads the dataset columns."},
    )

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if isinstance(self.tree_budget, bool) or not isinstance(self.tree_budget, int) or self.tree_budget < 1:
            raise ValueError(f"tree_budget must be an int >= 1, got {self.tree_budget!r}")
        if self.ce_weight < 0 or self.tree_weight < 0:
            raise ValueError(f"ce_weight and tree_weight must be >= 0, got {self.ce_weight} and {self.tree_weight}")
        active = self.ce_weight if self.objective == "dflash" else self.ce_weight + self.tree_weight
        if active <= 0:
            raise ValueError(f"objective {self.objective!r} with ce_weight={self.ce_weight} and "
                             f"tree_weight={self.tree_weight} has no loss to train")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if not self.gamma > 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma}")
        if isinstance(self.anchors_per_sequence, bool) or not isinstance(self.anchors_per_sequence, int) \
                or self.anchors_per_sequence < 1:
            raise ValueError(f"anchors_per_sequence must be an int >= 1, got {self.anchors_per_sequence!r}")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"max_length must be None or >= 2, got {self.max_length}")
        if self.remove_unused_columns:
            raise ValueError("ExitTrainer needs remove_unused_columns=False: the drafter's forward does not take "
                             "the dataset columns (input_ids, loss_mask), the trainer reads them")
        super().__post_init__()


# ----------------------------------------------------------------------------------------------
# Data


@dataclass
class ExitDataCollator:
    """Pads target-generated sequences into a training batch.

    Rows (dicts, e.g. of a `datasets.Dataset` or a plain list) have the columns:
        input_ids (`list[int]` or 1-D tensor, required): token ids of a sequence whose response was generated
            by the target itself (prompt + response).
        prompt_length (`int`, optional): the first `prompt_length` tokens are prompt: not supervised.
        loss_mask (`list[int | bool]`, optional, same length as `input_ids`): 1 where a token is supervised.
    Without either optional column every token is supervised; with both, a token is supervised when both
    allow it. Other columns are ignored.

    Returns a dict of tensors: `input_ids` `[B, T]` (right-padded with `pad_token_id`), `attention_mask`
    `[B, T]` (1 on real tokens) and `loss_mask` `[B, T]` bool (supervised real tokens).
    """

    pad_token_id: int = 0
    max_length: int | None = None

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        sequences, masks = zip(*(self._row(row) for row in rows))
        length = max(len(ids) for ids in sequences)
        input_ids = torch.full((len(rows), length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
        loss_mask = torch.zeros((len(rows), length), dtype=torch.bool)
        for i, (ids, mask) in enumerate(zip(sequences, masks)):
            input_ids[i, : len(ids)] = ids
            attention_mask[i, : len(ids)] = 1
            loss_mask[i, : len(ids)] = mask
        return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}

    def _row(self, row: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(row, Mapping) or INPUT_IDS not in row:
            found = sorted(row) if isinstance(row, Mapping) else type(row).__name__
            raise ValueError(f"ExitTrainer rows need an '{INPUT_IDS}' column (token ids of target-generated "
                             f"sequences), optionally '{PROMPT_LENGTH}' or '{LOSS_MASK}'; got {found}")
        ids = torch.as_tensor(row[INPUT_IDS], dtype=torch.long).reshape(-1)
        mask = torch.ones(len(ids), dtype=torch.bool)
        if row.get(LOSS_MASK) is not None:
            given = torch.as_tensor(row[LOSS_MASK]).reshape(-1).bool()
            if len(given) != len(ids):
                raise ValueError(f"'{LOSS_MASK}' has {len(given)} entries for {len(ids)} '{INPUT_IDS}'")
            mask &= given
        if row.get(PROMPT_LENGTH) is not None:
            mask[: int(row[PROMPT_LENGTH])] = False
        if self.max_length is not None:
            ids, mask = ids[: self.max_length], mask[: self.max_length]
        return ids, mask


def check_dataset(dataset, name: str = "train_dataset") -> None:
    """Raise a clear error when `dataset` cannot feed `ExitDataCollator` (no `input_ids` column, empty)."""
    if dataset is None:
        return
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, dict):  # a DatasetDict
        raise ValueError(f"{name} is a dict of splits {sorted(columns)}; pass one split, e.g. dataset['train']")
    if columns is None and isinstance(dataset, torch.utils.data.IterableDataset):
        return  # nothing to look at without consuming it; the collator checks every row
    if columns is None:
        if len(dataset) == 0:
            raise ValueError(f"{name} is empty")
        first = dataset[0]
        columns = list(first) if isinstance(first, Mapping) else None
        if columns is None:
            raise ValueError(f"{name} rows must be dicts with an '{INPUT_IDS}' column, got {type(first).__name__}")
    if INPUT_IDS not in columns:
        raise ValueError(f"{name} needs an '{INPUT_IDS}' column (token ids of target-generated sequences), "
                         f"optionally '{PROMPT_LENGTH}' or '{LOSS_MASK}'; it has {sorted(columns)}. "
                         "Turn prompts into such rows with hf_tev.generate_training_data.")


@torch.no_grad()
def generate_training_data(target, prompts: Sequence[str] | Sequence[Sequence[int]], tokenizer=None,
                           max_new_tokens: int = 512, batch_size: int = 8, apply_chat_template: bool = False,
                           show_progress: bool = True, **generate_kwargs) -> list[dict[str, Any]]:
    """Training rows whose responses are written by the target itself (the drafter must imitate the target).

    Args:
        target: the target causal LM (its `generate` is used, batched with left padding).
        prompts: strings (need `tokenizer`) or token-id lists.
        tokenizer: tokenizes string prompts; with `apply_chat_template=True` each prompt becomes one user turn.
        max_new_tokens: response length limit.
        batch_size: prompts per `generate` call.
        show_progress: a tqdm progress bar over batches.
        **generate_kwargs: passed to `target.generate` (e.g. `do_sample=True, temperature=0.7`); the
            target's generation config applies otherwise.

    Returns:
        A list of `{"input_ids": prompt + response token ids, "prompt_length": int}`; responses end at the
        first EOS (kept). `datasets.Dataset.from_list(rows)` turns it into a dataset to save.
    """
    from tqdm.auto import tqdm

    if isinstance(prompts, (str, bytes)):
        raise TypeError("prompts must be a sequence of prompts, not one string")
    encoded = [_encode_prompt(prompt, tokenizer, apply_chat_template) for prompt in prompts]
    pad_id = _pad_token_id(target, tokenizer)
    eos_ids = _eos_token_ids(target, tokenizer, generate_kwargs.get("eos_token_id"))
    device = next(target.parameters()).device
    rows = []
    for start in tqdm(range(0, len(encoded), batch_size), desc="target-generated responses", disable=not show_progress):
        batch = encoded[start: start + batch_size]
        width = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, ids in enumerate(batch):  # left padding: generation continues every prompt at the right edge
            input_ids[i, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attention_mask[i, width - len(ids):] = 1
        output = target.generate(input_ids.to(device), attention_mask=attention_mask.to(device),
                                 max_new_tokens=max_new_tokens, pad_token_id=pad_id, **generate_kwargs)
        sequences = output.sequences if hasattr(output, "sequences") else output
        for ids, response in zip(batch, sequences[:, width:].tolist()):
            end = next((i + 1 for i, token in enumerate(response) if token in eos_ids), len(response))
            rows.append({INPUT_IDS: list(ids) + response[:end], PROMPT_LENGTH: len(ids)})
    return rows


def _encode_prompt(prompt, tokenizer, apply_chat_template: bool) -> list[int]:
    if not isinstance(prompt, str):
        ids = [int(token) for token in prompt]
        if not ids:
            raise ValueError("an empty prompt cannot be continued")
        return ids
    if tokenizer is None:
        raise ValueError("string prompts need a tokenizer (or pass token-id lists)")
    if apply_chat_template:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
    else:
        ids = tokenizer(prompt)["input_ids"]
    return list(ids)


def _pad_token_id(target, tokenizer) -> int:
    for source in (tokenizer, getattr(target, "generation_config", None), target.config):
        pad = getattr(source, "pad_token_id", None)
        if pad is not None:
            return int(pad)
    eos = _eos_token_ids(target, tokenizer)
    return min(eos) if eos else 0


def _eos_token_ids(target, tokenizer, eos=None) -> set[int]:
    if eos is None:
        eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(token) for token in eos}


# ----------------------------------------------------------------------------------------------
# Batch plumbing (plain torch)


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator):
    """Random block starts: distinct positions `a` whose next token `a + 1` is supervised.

    Args:
        loss_mask (`[B, T]` bool): supervised tokens.
        num_anchors: anchors per sequence (fewer when a sequence has fewer candidates).
        generator: CPU generator (reproducible, resumable anchor draws).

    Returns:
        `(anchors, valid)`, both `[B, min(num_anchors, T)]`, sorted by position; `anchors` is 0 where
        `valid` is False (padding anchors that are masked out of every loss).
    """
    B, T = loss_mask.shape
    candidates = torch.zeros_like(loss_mask)
    candidates[:, :-1] = loss_mask[:, 1:]
    scores = torch.rand(B, T, generator=generator).to(loss_mask.device).masked_fill(~candidates, -1.0)  # [B, T]
    top_scores, anchors = scores.topk(min(num_anchors, T), dim=1)  # [B, A]; a random subset of candidates
    valid = top_scores >= 0
    anchors = anchors.masked_fill(~valid, T)  # invalid ones sort last
    anchors, order = anchors.sort(dim=1)
    valid = valid.gather(1, order)
    return anchors.masked_fill(~valid, 0), valid


def block_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
                 depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels `x_{a+k}`, k = 1..depth, of every block, `[B, A, depth]`, and which of them are supervised."""
    B, T = input_ids.shape
    positions = anchors[..., None] + torch.arange(1, depth + 1, device=anchors.device)  # [B, A, depth]
    inside = positions < T
    flat = positions.clamp(max=T - 1).reshape(B, -1)  # [B, A * depth]
    labels = input_ids.gather(1, flat).view_as(positions)
    supervised = loss_mask.gather(1, flat).view_as(positions) & inside & valid[..., None]
    return labels, supervised


def block_attention_mask(anchors: torch.Tensor, seq_len: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Float additive mask of the drafter's shared forward: `[B, 1, A*L, T + A*L]`.

    Keys are the T context rows followed by the A blocks of L rows. Block `a` sees the context strictly
    before its anchor and all of its own rows (bidirectional), nothing of the other blocks.
    """
    B, A = anchors.shape
    device = anchors.device
    row_anchor = anchors.repeat_interleave(block_size, dim=1)  # [B, A*L]
    sees_context = torch.arange(seq_len, device=device) < row_anchor[..., None]  # [B, A*L, T]
    block_of_row = torch.arange(A * block_size, device=device) // block_size  # [A*L]
    sees_block = (block_of_row[:, None] == block_of_row[None, :]).expand(B, -1, -1)  # [B, A*L, A*L]
    visible = torch.cat([sees_context, sees_block], dim=-1)
    return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(~visible, torch.finfo(dtype).min)[:, None]


def tree_batch_inputs(trees: Sequence[DraftTree], owners: Sequence[int], anchors: Sequence[int], batch_size: int,
                      seq_len: int, dtype: torch.dtype):
    """Inputs of ONE target forward that scores every tree against the cached context of its sequence.

    Tree `i` belongs to sequence `owners[i]` and hangs at anchor position `anchors[i]`: its root holds `x_a`
    at position `a`, node `v` sits at `a + depth(v)`, and it sees cache positions `< a` plus its own
    ancestors. Trees of one sequence are concatenated; sequences are right-padded to the longest (padding
    rows see cache position 0 only and are never read).

    Returns:
        `tokens` `[B, M]`, `position_ids` `[B, M]`, `attention_mask` `[B, 1, M, T + M]` (float additive),
        and `offsets` (first row of every tree in its sequence's row block).
    """
    device = trees[0].tokens.device
    per_sequence = [[] for _ in range(batch_size)]
    offsets = []
    for i, owner in enumerate(owners):
        offsets.append(sum(trees[j].num_nodes for j in per_sequence[owner]))
        per_sequence[owner].append(i)
    width = max(sum(trees[j].num_nodes for j in members) for members in per_sequence)
    tokens = torch.zeros(batch_size, width, dtype=torch.long, device=device)
    positions = torch.zeros(batch_size, width, dtype=torch.long, device=device)
    visible = torch.zeros(batch_size, width, seq_len + width, dtype=torch.bool, device=device)
    visible[:, :, 0] = True  # padding rows; real rows overwrite it below
    for b, members in enumerate(per_sequence):
        if not members:
            continue
        n = sum(trees[j].num_nodes for j in members)
        row_anchor = torch.cat([torch.full((trees[j].num_nodes,), anchors[j], device=device) for j in members])  # [n]
        tokens[b, :n] = torch.cat([trees[j].tokens for j in members])
        positions[b, :n] = row_anchor + torch.cat([trees[j].depths for j in members])
        visible[b, :n, :seq_len] = torch.arange(seq_len, device=device) < row_anchor[:, None]
        visible[b, :n, seq_len: seq_len + n] = torch.block_diag(*[trees[j].visibility for j in members])
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(~visible, torch.finfo(dtype).min)
    return tokens, positions, mask[:, None], offsets


def _pad_stack(tensors: Sequence[torch.Tensor], value=0) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(list(tensors), batch_first=True, padding_value=value)


# ----------------------------------------------------------------------------------------------
# Trainer


class ExitTrainer(Trainer):
    """Trains a DFlash drafter against a frozen target with the standard, prefix-weighted or exit-weighted
    objective (SPEC section 6; the objective and every knob are in [`ExitTrainingArguments`]).

    Args:
        model ([`DFlashDraftModel`]): the drafter, the only trained (and saved) model.
        target_model ([`~transformers.PreTrainedModel`]): the frozen target. It stays on the trainer:
            `requires_grad_(False)`, `eval()`, never optimised, saved or wrapped by DDP; its `embed_tokens`
            and `lm_head` are used by the drafter at run time without becoming drafter submodules.
        args ([`ExitTrainingArguments`], *optional*): defaults to `ExitTrainingArguments("tmp_trainer")`.
        train_dataset / eval_dataset: rows with an `input_ids` column and optionally `prompt_length` or
            `loss_mask` (see [`ExitDataCollator`], [`generate_training_data`]); a list or `datasets.Dataset`.
        data_collator (*optional*): defaults to `ExitDataCollator(pad_token_id, args.max_length)`.
        processing_class (*optional*): a tokenizer saved next to the drafter.
        callbacks, optimizers, **kwargs: as for [`~transformers.Trainer`].

    Logged per step (averaged over the logging window, across processes): `loss_dflash` (standard
    objective), `loss_tree` and `expected_block_length` (mean `1 + C` of the training trees, the training-
    time view of tau) for the tree objectives.

    Multi-process: launch the same script with `accelerate launch` or `torchrun` (DDP on the drafter; every
    process keeps its own target). On CPU pass `use_cpu=True, ddp_backend="gloo"`.
    """

    # compute_loss returns a per-batch mean; Trainer divides it by the accumulation steps.
    loss_is_scaled_for_ga = False

    def __init__(self, model: DFlashDraftModel, target_model: PreTrainedModel, args: ExitTrainingArguments | None = None,
                 train_dataset=None, eval_dataset=None, data_collator=None, processing_class=None, callbacks=None,
                 optimizers=(None, None), **kwargs):
        if not isinstance(model, DFlashDraftModel):
            raise TypeError(f"model must be a hf_tev.DFlashDraftModel (the drafter), got {type(model).__name__}")
        if not isinstance(target_model, PreTrainedModel) or target_model.get_output_embeddings() is None:
            raise TypeError("target_model must be a transformers causal LM with an LM head, got "
                            f"{type(target_model).__name__}")
        model.check_target(target_model)
        if args is None:
            args = ExitTrainingArguments(output_dir="tmp_trainer")
        if not isinstance(args, ExitTrainingArguments):
            raise TypeError(f"args must be ExitTrainingArguments, got {type(args).__name__}")
        check_dataset(train_dataset, "train_dataset")
        if isinstance(eval_dataset, Mapping):
            for split, dataset in eval_dataset.items():
                check_dataset(dataset, f"eval_dataset[{split!r}]")
        else:
            check_dataset(eval_dataset, "eval_dataset")
        if data_collator is None:
            data_collator = ExitDataCollator(pad_token_id=_pad_token_id(target_model, processing_class),
                                             max_length=args.max_length)

        super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers, **kwargs)
        self.model_accepts_loss_kwargs = False  # the drafter's forward takes **kwargs but computes no loss
        target_model.requires_grad_(False).eval()
        if getattr(target_model, "hf_device_map", None) is None:  # a device-mapped target stays where it is
            target_model.to(self.args.device)
        self.target_model = target_model
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._anchor_draw = (None, 0)  # ((mode, global_step), draws at that step) for the anchor seeds

    # -- loss ---------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args = self.args
        mode = "train" if model.training else "eval"
        drafter = self.accelerator.unwrap_model(model)
        if "input_ids" not in inputs or "loss_mask" not in inputs:
            raise ValueError(f"ExitTrainer batches need 'input_ids' and 'loss_mask' (ExitDataCollator builds them), "
                             f"got {sorted(inputs)}")
        input_ids, loss_mask = inputs["input_ids"], inputs["loss_mask"].bool()  # [B, T]
        anchors, valid = sample_anchors(loss_mask, args.anchors_per_sequence, self._anchor_generator(mode))  # [B, A]
        with_trees = args.objective != "dflash"

        # 1. Context features (and, for the trees, the context K/V) from the frozen target.
        with torch.no_grad():
            context = self.target_model(input_ids, output_hidden_states=drafter.target_hidden_indices,
                                        use_cache=with_trees, logits_to_keep=1)
        features = drafter.context_features(context.hidden_states)  # [B, T, k*H]

        # 2.-3. All blocks of a sequence in one drafter forward; the standard objective.
        draft_logits = self._draft_blocks(model, drafter, input_ids, features, anchors)  # [B, A, D, V]
        labels, supervised = block_labels(input_ids, loss_mask, anchors, valid, draft_logits.shape[2])
        standard = dflash_loss(draft_logits, labels, supervised, args.gamma)
        loss = args.ce_weight * standard
        metrics = {"loss_dflash": standard}

        # 4. Inference-time trees scored by the target.
        if with_trees:
            tree_part, block_length = self._tree_loss(draft_logits, input_ids, anchors, valid, context.cache)
            loss = loss + args.tree_weight * tree_part
            metrics.update(loss_tree=tree_part, expected_block_length=block_length)
        self._record(mode, metrics)
        return (loss, {"draft_logits": draft_logits}) if return_outputs else loss

    def _draft_blocks(self, model, drafter, input_ids, features, anchors) -> torch.Tensor:
        """Drafter logits `[B, A, D, V]` of the blocks `[x_a, MASK, ...]` at every anchor (one forward)."""
        B, T = input_ids.shape
        A = anchors.shape[1]
        L = drafter.config.block_size
        block_ids = torch.full((B, A, L), drafter.config.mask_token_id, dtype=torch.long, device=input_ids.device)
        block_ids[:, :, 0] = input_ids.gather(1, anchors)
        noise_embeds = self.target_model.get_input_embeddings()(block_ids.view(B, A * L)).to(drafter.dtype)
        block_positions = (anchors[..., None] + torch.arange(L, device=anchors.device)).view(B, A * L)
        position_ids = torch.cat([torch.arange(T, device=anchors.device).expand(B, T), block_positions], dim=1)
        mask = block_attention_mask(anchors, T, L, drafter.dtype)
        # The DDP-wrapped model is called, so gradient synchronisation sees this forward.
        hidden = model(noise_embeds=noise_embeds, context_hidden_states=features.to(drafter.dtype),
                       position_ids=position_ids, attention_mask=mask).last_hidden_state  # [B, A*L, H]
        hidden = hidden.view(B, A, L, -1)[:, :, 1:]  # block positions 1..D
        lm_head = self.target_model.get_output_embeddings()
        return lm_head(hidden.to(lm_head.weight.dtype))

    def _tree_loss(self, draft_logits, input_ids, anchors, valid, cache):
        """Tree loss of the inference-time trees and their mean `1 + C` (NaN when the batch has no anchor)."""
        args = self.args
        B, T = input_ids.shape
        # One host sync: the builder works anchor by anchor on the host anyway.
        anchor_list = torch.cat([valid.nonzero(), anchors[valid][:, None]], dim=1).tolist()  # [(b, slot, a)]
        if not anchor_list:
            return draft_logits.sum() * 0.0, draft_logits.new_tensor(float("nan"), dtype=torch.float32)
        draft_logprobs = draft_logits.detach().float().log_softmax(-1)  # [B, A, D, V]
        trees = [build_tree(draft_logprobs[b, slot], args.tree_budget, input_ids[b, a]) for b, slot, a in anchor_list]
        owners = [b for b, _, _ in anchor_list]
        tokens, positions, mask, offsets = tree_batch_inputs(
            trees, owners, [a for _, _, a in anchor_list], B, T, self.target_model.dtype)
        with torch.no_grad():
            node_logits = self.target_model(tokens, position_ids=positions, attention_mask=mask, cache=cache).logits
        weights, block_lengths = [], []
        for tree, owner, offset in zip(trees, owners, offsets):
            probs = node_logits[owner, offset: offset + tree.num_nodes].float().softmax(-1)  # [N, V]
            weights.append(node_weights(tree, probs, args.objective, args.alpha))
            block_lengths.append(expected_block_length(tree, probs))
        blocks = draft_logits[[b for b, _, _ in anchor_list], [slot for _, slot, _ in anchor_list]]  # [K, D, V]
        loss = tree_loss(blocks, _pad_stack([t.depths for t in trees]), _pad_stack([t.tokens for t in trees]),
                         _pad_stack(weights))
        return loss, torch.stack(block_lengths).mean()

    def _anchor_generator(self, mode: str) -> torch.Generator:
        """A generator seeded by (seed, mode, step, draw within the step, process): anchors are reproducible,
        and a run resumed from a checkpoint draws exactly the anchors of an uninterrupted one."""
        key = (mode, self.state.global_step)
        draws = self._anchor_draw[1] + 1 if self._anchor_draw[0] == key else 0
        self._anchor_draw = (key, draws)
        text = f"{self.args.seed}/{mode}/{self.state.global_step}/{draws}/{self.args.process_index}"
        return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little"))

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation = the training loss under no_grad (with its metrics); no logits are gathered."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    # -- metrics --------------------------------------------------------------------------------

    def _record(self, mode: str, metrics: dict[str, torch.Tensor]) -> None:
        # One small all-gather per step (every process records the same names); no host sync here.
        values = torch.stack([value.detach().float().reshape(()) for value in metrics.values()])  # [m]
        values = self.accelerator.gather(values).view(-1, len(metrics)).nanmean(0)
        for name, value in zip(metrics, values):
            self._metrics[mode][name].append(value)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        averaged = {name: torch.stack(values).nanmean().item() for name, values in self._metrics[mode].items() if values}
        if mode == "eval":
            averaged = {f"eval_{name}": value for name, value in averaged.items()}
        logs.update(averaged)  # in place: evaluate() returns this dict
        super().log(logs, start_time)
        self._metrics[mode].clear()

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

    def create_model_card(self, repo_id: str | None = None, target_model_id: str | None = None,
                          dataset_description: str | None = None,
                          measured_tau: Mapping[Any, float] | None = None, **_unused) -> str:
        """Write `README.md` into `args.output_dir` from `model_cards/exittrain_drafter.md` and return its text.

        Args:
            repo_id: Hub id the drafter is published under (used in the usage snippet).
            target_model_id: the target's Hub id; defaults to the target's `name_or_path`.
            dataset_description: free text on the training data (prompts, how responses were generated).
            measured_tau: mean tau measured with this drafter, e.g. `{64: 6.1}` (budget -> tau) or
                `{"HumanEval, budget 64, T=0": 6.1}`; omitted from the card when not given.
        """
        text = render_model_card(self, repo_id=repo_id, target_model_id=target_model_id,
                                 dataset_description=dataset_description, measured_tau=measured_tau)
        if self.is_world_process_zero():
            os.makedirs(self.args.output_dir, exist_ok=True)
            Path(self.args.output_dir, "README.md").write_text(text, encoding="utf-8")
        return text

    def _hub_api(self, token: str | None) -> HfApi:
        from . import __version__

        return HfApi(token=token if token is not None else self.args.hub_token, library_name="hf_tev",
                     library_version=__version__)

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """Create (or reuse) the Hub repo `args.hub_model_id` (default: the output folder's name)."""
        if not self.is_world_process_zero():
            return
        repo_id = self.args.hub_model_id or Path(self.args.output_dir).absolute().name
        private = private if private is not None else self.args.hub_private_repo
        self.hub_model_id = self._hub_api(token).create_repo(repo_id, private=private, exist_ok=True).repo_id
        self.push_in_progress = None

    def push_to_hub(self, repo_id: str | None = None, commit_message: str | None = "End of training",
                    blocking: bool = True, token: str | None = None, revision: str | None = None,
                    private: bool | None = None, target_model_id: str | None = None,
                    dataset_description: str | None = None, measured_tau: Mapping[Any, float] | None = None,
                    **_unused):
        """Upload the drafter (published layout: `config.json` + safetensors) and a filled model card.

        Uses `huggingface_hub.HfApi` (`create_repo` + `upload_folder`) on `args.output_dir`; checkpoints,
        `training_args.bin` and `_*` files stay local. `repo_id` defaults to `args.hub_model_id`, then the
        output folder's name. See `create_model_card` for the card fields. Returns the `upload_folder` result
        (a future when `blocking=False`); None on processes other than the main one.
        """
        if repo_id is not None:
            self.args.hub_model_id = repo_id
            self.hub_model_id = None
        if getattr(self, "hub_model_id", None) is None:
            self.init_hf_repo(token=token, private=private)
        self.save_model(_internal_call=True)  # every process: some engines gather weights collectively
        if not self.is_world_process_zero():
            return None
        self.create_model_card(repo_id=self.hub_model_id, target_model_id=target_model_id,
                               dataset_description=dataset_description, measured_tau=measured_tau)
        self._finish_current_push()
        return self._hub_api(token).upload_folder(
            repo_id=self.hub_model_id, folder_path=self.args.output_dir, commit_message=commit_message,
            revision=revision if revision is not None else self.args.hub_revision, run_as_future=not blocking,
            ignore_patterns=["_*", "checkpoint-*", TRAINING_ARGS_NAME],
        )


def render_model_card(trainer: ExitTrainer, repo_id: str | None = None, target_model_id: str | None = None,
                      dataset_description: str | None = None, measured_tau: Mapping[Any, float] | None = None) -> str:
    """Fill `model_cards/exittrain_drafter.md` with the drafter, the target and every training knob."""
    from . import __version__

    if not MODEL_CARD_TEMPLATE.is_file():
        raise FileNotFoundError(f"model card template not found at {MODEL_CARD_TEMPLATE}")
    args = trainer.args
    drafter = trainer.accelerator.unwrap_model(trainer.model)
    config = drafter.config
    target_model_id = target_model_id or getattr(trainer.target_model, "name_or_path", "") or "<target model id>"
    repo_id = repo_id or args.hub_model_id or Path(args.output_dir).absolute().name
    effective_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * max(args.world_size, 1)
    fields = {
        "model_name": repo_id.split("/")[-1],
        "repo_id": repo_id,
        "target_model_id": target_model_id,
        "objective": args.objective,
        "objective_title": {"exit": "ExitTrain, exit-weighted tree loss", "prefix": "prefix-weighted tree loss",
                            "dflash": "standard DFlash objective"}[args.objective],
        "objective_description": OBJECTIVE_DESCRIPTIONS[args.objective],
        "block_size": config.block_size,
        "draft_depth": config.block_size - 1,
        "num_draft_layers": config.num_hidden_layers,
        "target_layer_ids": list(config.target_layer_ids),
        "mask_token_id": config.mask_token_id,
        "init_from": f"`{drafter.name_or_path}`" if getattr(drafter, "name_or_path", "") else "a freshly built drafter",
        "tree_budget": args.tree_budget if args.objective != "dflash" else f"{args.tree_budget} (unused)",
        "ce_weight": args.ce_weight,
        "tree_weight": args.tree_weight if args.objective != "dflash" else f"{args.tree_weight} (unused)",
        "alpha": args.alpha,
        "gamma": args.gamma,
        "anchors_per_sequence": args.anchors_per_sequence,
        "max_length": args.max_length,
        "learning_rate": args.learning_rate,
        "lr_scheduler_type": getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type),
        "warmup": args.warmup_steps,
        "weight_decay": args.weight_decay,
        # epochs actually trained (max_steps overrides num_train_epochs)
        "num_train_epochs": round(trainer.state.epoch or 0.0, 2),
        "global_step": trainer.state.global_step,
        "effective_batch_size": effective_batch,
        "precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
        "seed": args.seed,
        "data_description": _data_description(trainer, dataset_description),
        "measured_tau": _tau_table(measured_tau),
        "hf_tev_version": __version__,
    }
    return Template(MODEL_CARD_TEMPLATE.read_text(encoding="utf-8")).substitute(fields)


def _data_description(trainer: ExitTrainer, description: str | None) -> str:
    parts = [description.strip()] if description else ["Not described by the uploader."]
    dataset = trainer.train_dataset
    if dataset is not None and hasattr(dataset, "__len__"):
        parts.append(f"{len(dataset)} training sequences.")
    return " ".join(parts)


def _tau_table(measured_tau: Mapping[Any, float] | None) -> str:
    if not measured_tau:
        return "Not measured for this upload."
    lines = ["| setting | mean tau |", "|---|---|"]
    for setting, tau in measured_tau.items():
        label = f"budget {setting}" if isinstance(setting, int) else str(setting)
        lines.append(f"| {label} | {float(tau):.3f} |")
    return "\n".join(lines)
