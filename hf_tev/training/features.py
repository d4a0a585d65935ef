"""Feature cache of ExitTrain: the target features a DFlash drafter reads, computed once and memory-mapped.

A drafter's context rows are the target's hidden states after its `target_layer_ids`, concatenated
(`DFlashDraftModel.context_features`). The target is frozen, so for the standard objective
(`objective="dflash"`) these features are all a training step needs from it: computed once per training
row and stored on disk, they let every later epoch skip the target forward.

```python
from hf_tev.training import CachedFeatureDataset, FeatureCache

cache = FeatureCache("feature_cache", target, drafter)  # or the layer ids: [1, 3, 5]
cache.update(rows)                                      # computes rows not yet cached (batched), appends them
trainer = ExitTrainer(model=drafter, target_model=target, args=args,  # objective="dflash"
                      train_dataset=CachedFeatureDataset(rows, cache))
```

A cache folder holds
    features.bin  the features of every cached row, one after another: a raw row-major
                  `[num_tokens, len(layer_ids) * hidden]` array (`numpy.memmap`), appended to by `update`;
    index.json    what they were computed with (the target's name, fingerprint and dtype, the layer ids, the
                  storage dtype, `max_length`) and, per row, `[offset, length]` under a hash of its token ids.
A row is found by its token ids, so datasets can be reordered, concatenated or grown: `update` computes only
the rows it does not hold. A cache opened with a different target (config or weights), layer ids, storage
dtype or `max_length` is refused. Features are appended before the index names them, so an interrupted
`update` loses at most the rows of its last flush. Updates of one folder from several processes take turns
(`filelock`, on every OS); a reader sees the rows that were cached when it opened the cache or last updated it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from filelock import FileLock
from torch.nn.utils.rnn import pad_sequence

from .rows import CONTEXT_FEATURES, INPUT_IDS, LOSS_MASK, row_tensors

FEATURES_NAME = "features.bin"
INDEX_NAME = "index.json"
LOCK_NAME = "update.lock"
# 2: the target fingerprint hashes every parameter byte (1 hashed the first 256 entries of each).
FINGERPRINT_FORMAT = 2
CACHE_FORMAT = FINGERPRINT_FORMAT
# Storage dtypes: torch dtype -> the numpy dtype of its bytes (bfloat16 is kept as raw 16-bit words).
STORAGE_DTYPES = {torch.float16: np.float16, torch.bfloat16: np.int16, torch.float32: np.float32}
# Architecture fields of the target's config that change its hidden states.
_CONFIG_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "sliding_window",
    "layer_types",
    "attention_bias",
)


_DAMAGED = "delete the cache folder (or move it away) and compute the features again"


def _row_end(span) -> int | None:
    """`offset + length` of an index entry `[offset, length]`, None when it is not two ints >= 0."""
    if not isinstance(span, list) or len(span) != 2 or not all(isinstance(v, int) and v >= 0 for v in span):
        return None
    return span[0] + span[1]


def row_key(input_ids) -> str:
    """The cache key of a row: a hash of its token ids."""
    ids = np.asarray(torch.as_tensor(input_ids).reshape(-1).tolist(), dtype="<i8")
    return hashlib.blake2b(ids.tobytes(), digest_size=16).hexdigest()


def target_fingerprint(target) -> str:
    """A SHA-256 of the target's architecture fields, its dtype and every byte of every parameter (with its name,
    dtype and shape): two targets with equal fingerprints give the same features.

    The parameters are hashed in threads (`hashlib` releases the GIL), each copied to the CPU in turn: about 1 GB/s
    per core, a second or two for a 4B-parameter bfloat16 target on a 16-core machine.
    """
    text_config = target.config.get_text_config().to_dict()
    digest = hashlib.sha256(
        json.dumps({k: text_config.get(k) for k in _CONFIG_FIELDS}, sort_keys=True, default=str).encode()
    )
    digest.update(str(target.dtype).encode())
    parameters = list(target.named_parameters())
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        digests = pool.map(_tensor_digest, [parameter for _, parameter in parameters])
        for (name, parameter), tensor_digest in zip(parameters, digests, strict=True):
            digest.update(f"{name}:{parameter.dtype}:{tuple(parameter.shape)}".encode())
            digest.update(tensor_digest)
    return digest.hexdigest()


def _tensor_digest(tensor: torch.Tensor) -> bytes:
    """The SHA-256 of a tensor's raw bytes (a CPU copy of it, row-major)."""
    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).digest()


@torch.no_grad()
def compute_context_features(
    target, layer_ids: Sequence[int], sequences: Sequence[Sequence[int]], pad_token_id: int = 0
) -> list[torch.Tensor]:
    """The drafter's context features of several sequences from ONE target forward.

    Sequences are right-padded with an attention mask (causal attention: a real token never sees padding,
    so every row equals its own single-sequence forward up to float rounding).

    Args:
        target: the frozen target causal LM.
        layer_ids: target layers whose outputs are read (hidden-state index `l + 1`), the drafter's
            `config.target_layer_ids`.
        sequences: token-id lists (or 1-D tensors).

    Returns:
        One `[len(sequence), len(layer_ids) * hidden]` tensor per sequence, in the target's dtype, on the CPU.
    """
    ids = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in sequences]
    device = next(target.parameters()).device
    input_ids = pad_sequence(ids, batch_first=True, padding_value=pad_token_id)
    attention_mask = pad_sequence([torch.ones_like(s) for s in ids], batch_first=True)
    indices = [int(layer) + 1 for layer in layer_ids]
    out = target(
        input_ids.to(device),
        attention_mask=attention_mask.to(device),
        output_hidden_states=indices,
        use_cache=False,
        logits_to_keep=1,
    )
    features = torch.cat([out.hidden_states[i] for i in indices], dim=-1).cpu()  # [B, T, k*H]
    return [features[i, : len(s)] for i, s in enumerate(ids)]


class FeatureCache:
    """Context features of training rows on disk, for one target and one set of target layers.

    Args:
        path: the cache folder (created by the first `update`).
        target: the frozen target the features come from (its fingerprint is checked on open).
        layers: a `DFlashDraftModel` (its `config.target_layer_ids`) or the layer ids themselves.
        dtype (`torch.dtype`, defaults to `torch.float16`): storage dtype: `float16` (features that overflow it
            are refused), `bfloat16` or `float32`.
        max_length (`int`, *optional*): rows are cached up to this many tokens (the trainer's `max_length`);
            `CachedFeatureDataset` truncates its rows to match.

    Raises ValueError when the folder holds a cache made with another target, layers, dtype or `max_length`.
    """

    def __init__(self, path, target, layers, dtype: torch.dtype = torch.float16, max_length: int | None = None):
        if dtype not in STORAGE_DTYPES:
            raise ValueError(f"dtype must be one of {list(STORAGE_DTYPES)}, got {dtype}")
        config = getattr(layers, "config", None)
        self.layer_ids = [int(i) for i in (config.target_layer_ids if config is not None else layers)]
        self.path = Path(path)
        self.target = target
        self.dtype = dtype
        self.hidden_size = target.config.get_text_config().hidden_size
        self.width = len(self.layer_ids) * self.hidden_size
        self.max_length = max_length
        header = {
            "format": CACHE_FORMAT,
            "target_name": getattr(target, "name_or_path", None) or "",
            "target_fingerprint": target_fingerprint(target),
            "target_dtype": str(target.dtype),
            "layer_ids": self.layer_ids,
            "hidden_size": self.hidden_size,
            "dtype": str(dtype).removeprefix("torch."),
            "max_length": max_length,
        }
        self._header = header
        self._read_index()

    def _read_index(self) -> None:
        """Read `index.json` (if any): refused when it is damaged, made for another target or layout, or names
        more features than `features.bin` holds."""
        self.rows: dict[str, list[int]] = {}
        self.num_tokens = 0
        self._memmap = None
        index = self._load_index()
        if index is None:
            return
        # The name is informative only: the same weights may be loaded from another path.
        wrong = [
            f"{k}: cache {index.get(k)!r}, now {v!r}"
            for k, v in self._header.items()
            if k != "target_name" and index.get(k) != v
        ]
        if wrong:
            raise ValueError(
                f"{self.path} is a feature cache of another target or layout (made with target "
                f"{index.get('target_name')!r}, now {self._header['target_name']!r}; {'; '.join(wrong)}); use "
                "another folder or delete it"
            )
        self.rows, self.num_tokens = index["rows"], index["num_tokens"]
        self._check_features_file()

    def _load_index(self) -> dict | None:
        """The parsed `index.json`, None when there is none; ValueError naming the file when it is damaged."""
        index_file = self.path / INDEX_NAME
        if not index_file.is_file():
            return None
        try:
            index = json.loads(index_file.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as error:
            raise ValueError(f"{index_file} is not valid JSON (not UTF-8 at byte {error.start}); {_DAMAGED}") from None
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{index_file} is not valid JSON (line {error.lineno} column {error.colno}: {error.msg}); {_DAMAGED}"
            ) from None
        rows = index.get("rows") if isinstance(index, dict) else None
        num_tokens = index.get("num_tokens") if isinstance(index, dict) else None
        well_formed = isinstance(rows, dict) and isinstance(num_tokens, int) and num_tokens >= 0
        if well_formed:
            ends = [_row_end(span) for span in rows.values()]
            well_formed = all(end is not None for end in ends) and max(ends, default=0) <= num_tokens
        if not well_formed:
            raise ValueError(
                f"{index_file} is not a feature cache index (it needs 'num_tokens' and 'rows' of [offset, length] "
                f"inside num_tokens); {_DAMAGED}"
            )
        return index

    def _check_features_file(self) -> None:
        """`features.bin` must hold every feature the index names."""
        data_file = self.path / FEATURES_NAME
        needed = self.num_tokens * self.width * np.dtype(STORAGE_DTYPES[self.dtype]).itemsize
        if not data_file.is_file():
            if needed:
                raise ValueError(f"{data_file} is missing, its {INDEX_NAME} names {needed} bytes; {_DAMAGED}")
            return
        size = data_file.stat().st_size
        if size < needed:
            raise ValueError(
                f"{data_file} has {size} bytes, its {INDEX_NAME} names {needed} ({self.num_tokens} tokens of "
                f"{self.width} features): it was cut off; {_DAMAGED}"
            )

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, input_ids) -> bool:
        return row_key(self._cut(input_ids)) in self.rows

    def _cut(self, input_ids) -> torch.Tensor:
        ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
        return ids if self.max_length is None else ids[: self.max_length]

    # -- reading ----------------------------------------------------------------------------------

    def features(self, input_ids) -> torch.Tensor:
        """The cached features of a row, `[min(len, max_length), k * hidden]` in the storage dtype (a copy)."""
        key = row_key(self._cut(input_ids))
        if key not in self.rows:
            raise KeyError(
                f"row of {len(self._cut(input_ids))} tokens (key {key}) is not in the feature cache "
                f"{self.path}; run FeatureCache.update over the dataset first"
            )
        offset, length = self.rows[key]
        if self._memmap is None:
            self._memmap = np.memmap(
                self.path / FEATURES_NAME,
                dtype=STORAGE_DTYPES[self.dtype],
                mode="r",
                shape=(self.num_tokens, self.width),
            )
        features = torch.from_numpy(np.array(self._memmap[offset : offset + length]))
        return features.view(self.dtype) if self.dtype == torch.bfloat16 else features

    def check_target(self, target, name: str = "dataset") -> None:
        """Refuse `target` unless it is the target this cache was made with (the same object, or the same dtype and
        weights: `target_fingerprint`); `name` is the dataset the message names."""
        if target is self.target:
            return
        header = self._header
        fingerprint = target_fingerprint(target)
        if str(target.dtype) == header["target_dtype"] and fingerprint == header["target_fingerprint"]:
            return
        name_or_path = getattr(target, "name_or_path", None) or ""
        raise ValueError(
            f"{name} holds features of the feature cache {self.path}, made with target {header['target_name']!r} "
            f"({header['target_dtype']}, fingerprint {header['target_fingerprint'][:12]}); the trainer's target "
            f"{name_or_path!r} ({target.dtype}, fingerprint {fingerprint[:12]}) is another one: compute the features "
            "with the trainer's target (a FeatureCache of it, in another folder)"
        )

    def check_cached(self, rows, name: str = "dataset") -> None:
        """Raise ValueError naming the first of `rows` (dicts with `input_ids`) that is not in the cache."""
        for index, row in enumerate(rows):
            ids = self._cut(row[INPUT_IDS])
            if row_key(ids) not in self.rows:
                raise ValueError(
                    f"{name} row {index} ({len(ids)} tokens) is not in the feature cache {self.path}; run "
                    "FeatureCache.update over the dataset's rows first"
                )

    # -- writing ----------------------------------------------------------------------------------

    def update(
        self,
        rows: Sequence[Mapping[str, Any] | Sequence[int]],
        batch_size: int = 16,
        max_batch_tokens: int = 8192,
        flush_rows: int = 512,
        show_progress: bool = True,
    ) -> int:
        """Compute and append the features of every row not cached yet; returns how many rows were added.

        Rows (dicts with `input_ids`, or token-id lists) are sorted by length and run through the target
        `batch_size` at a time (fewer when a batch would exceed `max_batch_tokens` padded tokens). The index
        is rewritten every `flush_rows` new rows and at the end.
        """
        self.path.mkdir(parents=True, exist_ok=True)
        with FileLock(self.path / LOCK_NAME):
            self._read_index()  # another process may have appended rows since this cache was opened
            try:
                return self._append(rows, batch_size, max_batch_tokens, flush_rows, show_progress)
            except BaseException:
                self._read_index()  # back to what the index on disk holds
                raise

    def _pending(self, rows) -> list[tuple[str, list[int]]]:
        """The rows not in the cache yet, (key, ids), longest first: the widest batch (peak memory) comes first.
        Every row is checked first (`row_tensors`: tokens, ids inside the target's vocabulary), naming a wrong one."""
        vocab_size = self.target.get_input_embeddings().weight.shape[0]
        todo = {}
        for index, row in enumerate(rows):
            row = row if isinstance(row, Mapping) else {INPUT_IDS: row}
            ids, _ = row_tensors(row, vocab_size, self.max_length, where=f"row {index}")
            key = row_key(ids)
            if key not in self.rows and key not in todo:
                todo[key] = ids
        return sorted(todo.items(), key=lambda item: -len(item[1]))

    def _drop_unindexed_bytes(self, data_file) -> None:
        """Cut the features file to what the index holds (an interrupted update may have written past it)."""
        row_bytes = self.width * np.dtype(STORAGE_DTYPES[self.dtype]).itemsize
        with open(data_file, "ab") as f:
            if f.tell() < self.num_tokens * row_bytes:
                raise ValueError(
                    f"{data_file} is shorter than its index says ({f.tell()} bytes for "
                    f"{self.num_tokens} tokens of {row_bytes}); delete the cache folder"
                )
            f.truncate(self.num_tokens * row_bytes)

    def _append(self, rows, batch_size, max_batch_tokens, flush_rows, show_progress) -> int:
        from tqdm.auto import tqdm

        pending = self._pending(rows)
        if not pending:
            return 0
        data_file = self.path / FEATURES_NAME
        self._drop_unindexed_bytes(data_file)
        batches = _token_batches(pending, batch_size, max_batch_tokens)
        added = since_flush = 0
        progress = tqdm(total=len(pending), desc="target features", unit="row", disable=not show_progress)
        with open(data_file, "ab") as f:
            for batch in batches:
                features = compute_context_features(self.target, self.layer_ids, [ids for _, ids in batch])
                for (key, ids), row_features in zip(batch, features, strict=True):
                    stored = row_features.to(self.dtype)
                    if not torch.isfinite(stored).all():
                        raise ValueError(
                            f"target features overflow {self.dtype} (max |x| = "
                            f"{row_features.abs().max().item():.3g}); use dtype=torch.bfloat16 or float32"
                        )
                    array = stored.view(torch.int16) if self.dtype == torch.bfloat16 else stored
                    f.write(array.contiguous().numpy().tobytes())
                    self.rows[key] = [self.num_tokens, len(ids)]
                    self.num_tokens += len(ids)
                added += len(batch)
                since_flush += len(batch)
                progress.update(len(batch))
                if since_flush >= flush_rows:
                    f.flush()
                    os.fsync(f.fileno())
                    self._write_index()
                    since_flush = 0
            f.flush()
            os.fsync(f.fileno())
        self._write_index()
        progress.close()
        self._memmap = None  # the file grew: map it again on the next read
        return added

    def _write_index(self) -> None:
        index = {**self._header, "num_tokens": self.num_tokens, "rows": self.rows}
        tmp = self.path / (INDEX_NAME + ".tmp")
        tmp.write_text(json.dumps(index, sort_keys=True))
        os.replace(tmp, self.path / INDEX_NAME)


class CachedFeatureDataset(torch.utils.data.Dataset):
    """Training rows with their cached target features: row `i` is `rows[i]` plus `context_features`
    (`[length, k * hidden]`, the cache's storage dtype), which `ExitDataCollator` pads into the batch and
    `ExitTrainer` then uses instead of a target forward (objective `"dflash"`).

    Rows are truncated to the cache's `max_length` (their `input_ids` and `loss_mask`), so ids and features
    always have the same length. Every row must be in the cache (`FeatureCache.update(rows)`).
    """

    def __init__(self, rows: Sequence[Mapping[str, Any]], cache: FeatureCache):
        self.rows = rows
        self.cache = cache

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = dict(self.rows[index])
        features = self.cache.features(row[INPUT_IDS])
        length = features.shape[0]
        row[INPUT_IDS] = row[INPUT_IDS][:length]
        if row.get(LOSS_MASK) is not None:
            row[LOSS_MASK] = row[LOSS_MASK][:length]
        row[CONTEXT_FEATURES] = features
        return row


def _token_batches(pending: list, batch_size: int, max_batch_tokens: int) -> list[list]:
    """`pending` rows (longest first) cut into batches of at most `batch_size` rows and `max_batch_tokens`
    tokens (at least one row each)."""
    batches, start = [], 0
    while start < len(pending):
        size = max(1, min(batch_size, max_batch_tokens // max(1, len(pending[start][1]))))
        batches.append(pending[start : start + size])
        start += size
    return batches
