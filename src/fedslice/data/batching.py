"""Tokenize a split once, then build right-padded batches on demand.

Tokenization is the expensive step, so it happens once per split (one batched call of a fast
tokenizer, no padding) and its result is shared: :class:`TokenizedSplit.subset` gives clients
views of it, and :class:`TokenCache` lets several runs in one process reuse it. Padding happens
per batch, to the longest sequence in that batch, in :func:`collate`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from fedslice.data.labels import RawSplit
from fedslice.data.packing import pack_classification
from fedslice.errors import ConfigError, ModelError

logger = logging.getLogger(__name__)

Indices = Union[Sequence[int], np.ndarray, torch.Tensor]


class Rows(Sequence[torch.Tensor]):
    """Variable-length rows of token ids as views of one flat tensor: ``rows[i]`` is a 1-D
    view, ``take(idx)`` a subset sharing the flat tensor. Building one is O(1) in Python objects
    (a list of 67k tensors costs seconds to create; these are created as rows are read)."""

    __slots__ = ("flat", "starts", "lens")

    def __init__(self, flat: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor):
        self.flat, self.starts, self.lens = flat, starts, lens

    @classmethod
    def from_lengths(cls, flat: torch.Tensor, lens: torch.Tensor) -> Rows:
        lens = lens.to(torch.int64)
        return cls(flat, torch.cumsum(lens, 0) - lens, lens)

    def __len__(self) -> int:
        return int(self.lens.shape[0])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.take(torch.arange(len(self))[i])
        s = int(self.starts[i])
        return self.flat[s:s + int(self.lens[i])]

    def __iter__(self):
        flat = self.flat
        for s, n in zip(self.starts.tolist(), self.lens.tolist()):
            yield flat[s:s + n]

    def take(self, idx: list[int] | torch.Tensor) -> Rows:
        idx = torch.as_tensor(idx, dtype=torch.int64)
        return Rows(self.flat, self.starts[idx], self.lens[idx])

    def packed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(flat ids, lengths)`` of these rows in order, contiguous."""
        n = int(self.lens.sum())
        if len(self) and int(self.starts[0]) == 0 and \
                bool((self.starts[1:] == (self.starts + self.lens)[:-1]).all()):
            return self.flat[:n], self.lens
        return (torch.cat(list(self)) if len(self) else self.flat[:0]), self.lens


@dataclass
class TokenizedSplit:
    """A tokenized split: unpadded token ids per example plus labels.

    Attributes:
        input_ids: one int64 1-D tensor per example, already truncated.
        token_type_ids: same shapes as ``input_ids``, or ``None`` if the tokenizer has none.
        labels: int64 tensor of shape ``(N,)``.
        pad_token_id: id used to pad ``input_ids`` in :func:`collate`.
    """

    input_ids: Sequence[torch.Tensor]  # a list, or Rows (views of one flat tensor)
    token_type_ids: Sequence[torch.Tensor] | None
    labels: torch.Tensor
    pad_token_id: int

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def lengths(self) -> torch.Tensor:
        """int64 tensor ``(N,)`` of sequence lengths."""
        if isinstance(self.input_ids, Rows):
            return self.input_ids.lens
        return torch.tensor([len(ids) for ids in self.input_ids], dtype=torch.int64)

    def collate(self, indices: Indices) -> dict[str, torch.Tensor]:
        return collate(self, indices)

    def collate_packed(self, indices: Indices) -> dict[str, torch.Tensor]:
        """The examples at ``indices`` packed into rows (:mod:`fedslice.data.packing`)."""
        idx = as_index_list(indices, len(self))
        if not idx:
            raise ValueError("cannot collate an empty batch")
        sub = self.subset(idx)
        ids, lens = _flat(sub.input_ids)
        types = None if sub.token_type_ids is None else _flat(sub.token_type_ids)[0]
        return pack_classification(ids, types, lens, sub.labels, self.pad_token_id)

    def subset(self, indices: Indices) -> TokenizedSplit:
        """The examples at ``indices``, sharing the underlying tensors (no copy of tokens)."""
        idx = as_index_list(indices, len(self))

        def pick(rows):
            return rows.take(idx) if isinstance(rows, Rows) else [rows[i] for i in idx]

        return TokenizedSplit(
            input_ids=pick(self.input_ids),
            token_type_ids=None if self.token_type_ids is None else pick(self.token_type_ids),
            labels=self.labels[torch.as_tensor(idx, dtype=torch.int64)],
            pad_token_id=self.pad_token_id,
        )


def as_index_list(indices: Indices, size: int) -> list[int]:
    """Convert indices to a list of ints and check they are within ``[0, size)``."""
    if isinstance(indices, torch.Tensor):
        idx = indices.tolist()
    else:
        idx = np.asarray(indices, dtype=np.int64).tolist()
    if idx and (min(idx) < 0 or max(idx) >= size):
        raise IndexError(f"indices must lie in [0, {size}); got range [{min(idx)}, {max(idx)}]")
    return idx


def pad_token_id_of(tokenizer: Any) -> int:
    """The tokenizer's pad id, falling back to its end-of-sequence id (GPT-style models)."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    raise ModelError(
        f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} defines neither a pad "
        f"nor an end-of-sequence token, so batches cannot be padded"
    )


def _split_flat(rows: list[list[int]]) -> Rows:
    """Lists of ints as :class:`Rows` over one flat int64 tensor."""
    flat = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=torch.int64)
    return Rows.from_lengths(flat, torch.tensor([len(r) for r in rows], dtype=torch.int64))


def tokenize_split(raw: RawSplit, tokenizer: Any, max_length: int) -> TokenizedSplit:
    """Tokenize a whole split with one batched call: no padding, truncation to ``max_length``.

    Sentence pairs are truncated longest-first. Use a fast (Rust) tokenizer: a slow one works
    but is much slower on large splits.
    """
    if not isinstance(max_length, int) or max_length < 2:
        raise ConfigError(f"max_length must be an integer >= 2, got {max_length!r}")
    columns = list(zip(*raw.texts)) if raw.texts else [()]
    encoding = tokenizer(
        *[list(col) for col in columns],
        truncation=True,
        max_length=max_length,
        padding=False,
        return_attention_mask=False,
    )
    type_ids = encoding.get("token_type_ids")
    return TokenizedSplit(
        input_ids=_split_flat(encoding["input_ids"]),
        token_type_ids=None if type_ids is None else _split_flat(type_ids),
        labels=torch.tensor(raw.labels, dtype=torch.int64),
        pad_token_id=pad_token_id_of(tokenizer),
    )


def collate(split: TokenizedSplit, indices: Indices) -> dict[str, torch.Tensor]:
    """Build one right-padded batch of the examples at ``indices``.

    Returns ``input_ids`` ``(B, T)`` padded with ``split.pad_token_id`` to the longest example,
    ``attention_mask`` ``(B, T)`` (1 on real tokens), ``token_type_ids`` ``(B, T)`` padded with
    0 when the split has them, and ``labels`` ``(B,)``; all int64.
    """
    idx = as_index_list(indices, len(split))
    if not idx:
        raise ValueError("cannot collate an empty batch")
    ids = [split.input_ids[i] for i in idx]
    input_ids = pad_sequence(ids, batch_first=True, padding_value=split.pad_token_id)
    lengths = torch.tensor([len(t) for t in ids], dtype=torch.int64)
    positions = torch.arange(input_ids.shape[1], dtype=torch.int64)
    batch = {
        "input_ids": input_ids,
        "attention_mask": (positions[None, :] < lengths[:, None]).to(torch.int64),
    }
    if split.token_type_ids is not None:
        types = [split.token_type_ids[i] for i in idx]
        batch["token_type_ids"] = pad_sequence(types, batch_first=True, padding_value=0)
    batch["labels"] = split.labels[torch.as_tensor(idx, dtype=torch.int64)]
    return batch


#: What right-pads each key of a collated batch when batches of several lengths are stacked
#: (``None``: the split's pad token id). Keys not listed must have equal shapes past the batch.
PAD_VALUES: dict[str, int | None] = {
    "input_ids": None, "decoder_input_ids": None, "attention_mask": 0,
    "decoder_attention_mask": 0, "token_type_ids": 0, "labels": -100,
    # a preference pair's rejected response (fedslice.tasks.preference)
    "rejected_input_ids": None, "rejected_attention_mask": 0, "rejected_labels": -100}


def stack_batches(batches: Sequence[dict[str, torch.Tensor]], pad_token_id: int
                  ) -> tuple[dict[str, torch.Tensor], list[tuple[int, int]]]:
    """Several collated batches as one ``(sum B, max T)`` batch, each right-padded to the
    longest (as :func:`collate` pads one batch), and the ``(start, stop)`` rows of each.

    Extra right padding changes no real position's output: attention masks hide it from
    encoders, causal decoders never look ahead, and labels there are ignored (-100)."""
    rows, start = [], 0
    for b in batches:
        n = int(next(iter(b.values())).shape[0])
        rows.append((start, start + n))
        start += n
    out = {}
    for key in batches[0]:
        parts = [b[key] for b in batches]
        if parts[0].dim() >= 2 and len({p.shape[1] for p in parts}) > 1:
            if key not in PAD_VALUES:
                raise ValueError(f"cannot stack batches: {key!r} has lengths "
                                 f"{sorted({p.shape[1] for p in parts})} and no pad value")
            value = pad_token_id if PAD_VALUES[key] is None else PAD_VALUES[key]
            width = max(p.shape[1] for p in parts)
            parts = [torch.nn.functional.pad(p, (0, width - p.shape[1]), value=value)
                     if p.dim() == 2 else _pad_dim1(p, width, value) for p in parts]
        out[key] = torch.cat(parts, 0)
    return out, rows


def _pad_dim1(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[1] = width - shape[1]
    return torch.cat([t, t.new_full(shape, value)], 1)


def num_batches(num_examples: int, batch_size: int, drop_last: bool = False) -> int:
    """How many batches :func:`iter_batches` yields for ``num_examples`` examples."""
    if drop_last:
        return num_examples // batch_size
    return -(-num_examples // batch_size)


def iter_batches(
    split: TokenizedSplit,
    indices: Indices,
    batch_size: int,
    *,
    shuffle: bool,
    generator: torch.Generator | None,
    drop_last: bool = False,
    group_by_length: bool = False,
    pack: bool = False,
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield collated batches over ``indices`` (rows of ``split``).

    With ``shuffle=True`` the order is a permutation drawn from ``generator``, so the same
    generator state gives the same batches. ``drop_last`` drops a final short batch.
    ``group_by_length`` (with ``shuffle``) batches examples of similar length together.
    ``pack``: the same batches packed into rows (``split.collate_packed``), not padded.
    """
    collate = split.collate_packed if pack else split.collate
    for rows in batch_indices(split, indices, batch_size, shuffle=shuffle, generator=generator,
                              drop_last=drop_last, group_by_length=group_by_length):
        yield collate(rows)


def batch_indices(
    split: TokenizedSplit,
    indices: Indices,
    batch_size: int,
    *,
    shuffle: bool,
    generator: torch.Generator | None,
    drop_last: bool = False,
    group_by_length: bool = False,
) -> Iterator[torch.Tensor]:
    """The rows of ``split`` in each batch :func:`iter_batches` yields (int64 tensors), with
    the same draws from ``generator``, without collating them."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
    order = torch.as_tensor(as_index_list(indices, len(split)), dtype=torch.int64)
    if shuffle:
        order = order[torch.randperm(len(order), generator=generator)]
    starts = range(0, num_batches(len(order), batch_size, drop_last) * batch_size, batch_size)
    if group_by_length and shuffle:
        order, starts = _group_by_length(split, order, batch_size, starts, generator)
    for start in starts:
        yield order[start : start + batch_size]


def _group_by_length(split: TokenizedSplit, order: torch.Tensor, batch_size: int, starts,
                     generator: torch.Generator | None, window: int = 16):
    """Sort each window of ``window`` shuffled batches by length, then shuffle the batch order.

    Batches then hold examples of similar length, so per-batch padding (and compute) shrinks,
    while which examples share an epoch and the batch order stay random (like HF's
    ``group_by_length``). The batch boundaries ``starts`` are unchanged.
    """
    lengths = split.lengths[order]
    chunk = window * batch_size
    parts = []
    for lo in range(0, len(order), chunk):
        seg = order[lo : lo + chunk]
        parts.append(seg[torch.argsort(lengths[lo : lo + chunk], stable=True, descending=True)])
    order = torch.cat(parts) if parts else order
    starts = list(starts)
    return order, [starts[i] for i in torch.randperm(len(starts), generator=generator).tolist()]


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """What decides a tokenizer's output: its class, its full serialized definition (a fast
    tokenizer's vocabulary, normalizer, pre-tokenizer and post-processor) and special tokens."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # without the per-call truncation/padding state it carries
        spec = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("truncation", "padding")}
        h.update(json.dumps(spec, sort_keys=True).encode())
    else:  # a slow tokenizer: its vocabulary and settings
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
        h.update(repr(sorted(getattr(tokenizer, "init_kwargs", {}).items())).encode())
    h.update(repr(sorted(getattr(tokenizer, "special_tokens_map", {}).items())).encode())
    return h.hexdigest()


def _hash_content(h, raw: RawSplit) -> None:
    """A text split's content, as the token cache keys it: every text and label."""
    h.update("\x1e".join("\x1f".join(t) for t in raw.texts).encode("utf-8", "surrogatepass"))
    h.update(np.asarray(raw.labels, dtype=np.int64).tobytes())


def split_fingerprint(split: Any) -> str:
    """The content key of a raw split: for a text split the token cache's (every text and
    label); a table (generation): every column; an image split: its image bank's fingerprint,
    rows and labels."""
    h = hashlib.sha256()
    if hasattr(split, "texts"):
        _hash_content(h, split)
    elif hasattr(split, "bank"):
        h.update(split.bank.fingerprint().encode())
        h.update(np.asarray(split.rows, dtype=np.int64).tobytes())
        h.update(np.asarray(split.labels, dtype=np.int64).tobytes())
    else:
        h.update(json.dumps(split.columns, sort_keys=True, default=str,
                            ensure_ascii=False).encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:40]


def data_sources(raw: dict[str, Any]) -> dict[str, dict[str, str]]:
    """``{split: {"source": where it was read, "fingerprint": its content key}}`` of the raw
    splits a run reads (what its checkpoints record, so a resume can tell changed data)."""
    return {name: {"source": str(getattr(split, "source", "")),
                   "fingerprint": split_fingerprint(split)} for name, split in raw.items()}


class TokenCache:
    """Cache of tokenized splits: in the process, and on disk across runs.

    Keyed by the split's content (every text and label), the tokenizer's definition
    (:func:`tokenizer_fingerprint`) and ``max_length``, so a split is tokenized once per process
    even when several runs (e.g. ``fedslice compare``) ask for it, and once per machine when
    ``disk`` is a folder (a later run reads the token ids in a fraction of a second instead of
    re-tokenizing: the largest part of a cold start). Cache full splits and take subsets with
    :meth:`TokenizedSplit.subset`. A damaged or unwritable disk entry is ignored (tokenized anew).
    """

    def __init__(self, disk: Path | None = None) -> None:
        self._store: dict[tuple[Any, ...], TokenizedSplit] = {}
        self.disk = disk
        self.hits = 0
        self.misses = 0
        self.disk_hits = 0

    @staticmethod
    def key(raw: RawSplit, split_name: str, tokenizer: Any, max_length: int) -> tuple[Any, ...]:
        """The cache key of a request."""
        name = getattr(tokenizer, "name_or_path", None) or repr(type(tokenizer))
        # The content, not just the source: splits carved off one file by different seeds, or
        # labels mapped in another order, share source and length.
        content = hash((tuple(raw.texts), tuple(raw.labels)))
        return (raw.source, split_name, str(name), max_length, len(raw), content)

    def get(
        self, raw: RawSplit, split_name: str, tokenizer: Any, max_length: int
    ) -> TokenizedSplit:
        """Return the cached tokenization of ``raw``, tokenizing it on first request."""
        key = self.key(raw, split_name, tokenizer, max_length)
        cached = self._store.get(key)
        if cached is not None:
            self.hits += 1
            return cached
        self.misses += 1
        path = self._disk_path(raw, tokenizer, max_length)
        tokenized = _read_tokens(path) if path is not None else None
        if tokenized is not None:
            self.disk_hits += 1
        else:
            tokenized = tokenize_split(raw, tokenizer, max_length)
            if path is not None:
                _write_tokens(path, tokenized)
        self._store[key] = tokenized
        return tokenized

    def _disk_path(self, raw: RawSplit, tokenizer: Any, max_length: int) -> Path | None:
        if self.disk is None:
            return None
        h = hashlib.sha256(f"v1|{max_length}|{tokenizer_fingerprint(tokenizer)}".encode())
        _hash_content(h, raw)
        return self.disk / f"{h.hexdigest()[:40]}.pt"

    def __len__(self) -> int:
        return len(self._store)

    def clear(self) -> None:
        """Drop every cached split."""
        self._store.clear()
        self.hits = self.misses = 0


def _flat(rows) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(rows, Rows):
        return rows.packed()
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    return (torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)), lengths


def _write_tokens(path: Path, split: TokenizedSplit) -> None:
    """Save a tokenized split as flat tensors (atomically; failures only logged)."""
    ids, lengths = _flat(split.input_ids)
    types = _flat(split.token_type_ids)[0] if split.token_type_ids is not None else None
    blob = {"input_ids": ids, "lengths": lengths, "token_type_ids": types,
            "labels": split.labels, "pad_token_id": torch.tensor(split.pad_token_id)}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(blob, tmp)
        os.replace(tmp, path)
    except OSError as e:
        logger.debug("token cache: cannot write %s: %s", path, e)
        tmp.unlink(missing_ok=True)


def _read_tokens(path: Path) -> TokenizedSplit | None:
    if not path.is_file():
        return None
    try:
        blob = torch.load(path, weights_only=True)
        lens = blob["lengths"]
        types = blob["token_type_ids"]
        return TokenizedSplit(
            input_ids=Rows.from_lengths(blob["input_ids"], lens),
            token_type_ids=None if types is None else Rows.from_lengths(types, lens),
            labels=blob["labels"], pad_token_id=int(blob["pad_token_id"]))
    except Exception as e:  # noqa: BLE001 - a damaged entry is re-tokenized
        logger.warning("token cache: ignoring unreadable %s (%s)", path, e)
        return None
