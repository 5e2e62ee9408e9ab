"""Preprocessed images as a split that batches (:class:`ImageSplit`: rescaled and normalised
with the processor's constants per batch) and the encoding of a run's splits
(:func:`encode_images`). See :mod:`fedslice.data.images`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedslice.data.images.preprocess import Preprocessor, processed
from fedslice.data.images.sources import RawImageSplit
from fedslice.data.partition import sample_rows
from fedslice.errors import DataError
from fedslice.paths import cache_root

log = logging.getLogger(__name__)


@dataclass
class ImageSplit:
    """Preprocessed images and labels, batched on demand (the interface of
    :class:`~fedslice.data.batching.TokenizedSplit`: ``len``, ``labels``, ``lengths``,
    ``subset``, ``collate``).

    ``pixels`` (M, C, S, S) uint8 is shared by every subset; ``rows`` (N,) picks this split's
    images. A batch is ``pixel_values`` (B, channels, S, S) float32 (rescaled, normalised, a
    grayscale image replicated to the model's channels), ``attention_mask`` (B, T) of ones (T =
    ``tokens``: every patch and prefix token is real; what the cost measures count) and
    ``labels`` (B,)."""

    pixels: torch.Tensor
    rows: torch.Tensor
    labels: torch.Tensor
    scale: float
    mean: torch.Tensor  # (channels, 1, 1)
    std: torch.Tensor
    tokens: int

    def __len__(self) -> int:
        return len(self.rows)

    #: image batches need no padding (every image has the same tokens); kept for the batched
    #: pass, which stacks batches of several clients
    pad_token_id = 0

    @property
    def channels(self) -> int:
        return self.mean.shape[0]

    @property
    def image_size(self) -> tuple[int, int]:
        return tuple(self.pixels.shape[2:])

    @property
    def lengths(self) -> torch.Tensor:
        """Tokens per example (all equal)."""
        return torch.full((len(self),), self.tokens, dtype=torch.int64)

    def subset(self, indices) -> ImageSplit:
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64) if not isinstance(indices, torch.Tensor)
                              else indices, dtype=torch.int64)
        if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= len(self)):
            raise IndexError(f"indices must lie in [0, {len(self)}); got range "
                             f"[{int(idx.min())}, {int(idx.max())}]")
        return ImageSplit(self.pixels, self.rows[idx], self.labels[idx], self.scale, self.mean,
                          self.std, self.tokens)

    def collate(self, indices) -> dict[str, torch.Tensor]:
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64) if not isinstance(indices, torch.Tensor)
                              else indices, dtype=torch.int64)
        if not len(idx):
            raise ValueError("cannot collate an empty batch")
        x = self.pixels[self.rows[idx]].to(torch.float32)  # (B, c, S, S)
        if x.shape[1] != self.channels:
            x = x.expand(-1, self.channels, -1, -1)  # grayscale -> the model's channels
        x = (x * self.scale - self.mean) / self.std
        return {"pixel_values": x, "attention_mask": torch.ones(len(idx), self.tokens, dtype=torch.int64),
                "labels": self.labels[idx]}


def encode_images(raw: dict[str, RawImageSplit], prep: Preprocessor, tokens_for, *,
                  skip_bad: bool, cache_dir: Path | None,
                  limits: dict[str, int | None] | None = None, seed: int = 0) -> dict[str, ImageSplit]:
    """Preprocess every split (each bank once over the rows the splits use); ``tokens_for(h, w)``:
    tokens the model reads per image. ``limits[split]``: a seeded subset of that many examples
    (the one :meth:`Task.limit` would take). Undecodable images: DataError naming the first, or
    (``skip_bad``) dropped and counted in the log."""
    limits = limits or {}
    chosen = {s: r if limits.get(s) is None or limits[s] >= len(r) else r.select(sample_rows(len(r), limits[s], seed))
              for s, r in raw.items()}
    by_bank: dict[int, list[str]] = {}
    for s, r in chosen.items():
        by_bank.setdefault(id(r.bank), []).append(s)
    out = {}
    for splits in by_bank.values():
        bank = chosen[splits[0]].bank
        rows = np.unique(np.concatenate([chosen[s].rows for s in splits]))
        proc, order = processed(bank, rows, prep, cache_dir)
        position = {int(r): i for i, r in enumerate(order)}
        scale, mean, std = prep.constants()
        tokens = tokens_for(*proc.pixels.shape[2:])
        for s in splits:
            r = chosen[s]
            at = np.array([position[int(x)] for x in r.rows], dtype=np.int64)
            bad = [i for i, p in enumerate(at) if int(p) in proc.bad]
            if bad and not skip_bad:
                i = bad[0]
                raise DataError(f"{bank.where(int(r.rows[i]))}: cannot decode the image "
                                f"({proc.bad[int(at[i])]}); set data.bad_rows = \"skip\" to skip such "
                                f"images")
            if bad:
                shown = ", ".join(bank.where(int(r.rows[i])) for i in bad[:5])
                log.warning("%s: skipped %d image(s) that cannot be decoded (%s%s)", r.source,
                            len(bad), shown, ", ..." if len(bad) > 5 else "")
                good = np.setdiff1d(np.arange(len(r)), bad)
                at = at[good]
                labels = [r.labels[i] for i in good]
            else:
                labels = r.labels
            if not len(at):
                raise DataError(f"{r.source}: no image of the {s} split could be decoded")
            out[s] = ImageSplit(proc.pixels, torch.from_numpy(at), torch.tensor(labels, dtype=torch.int64),
                                scale, mean, std, tokens)
    return out


def image_cache_dir() -> Path | None:
    """Where preprocessed images are cached (``$FEDSLICE_CACHE_DIR`` or ~/.cache/fedslice;
    ``FEDSLICE_CACHE_DIR=''`` disables it)."""
    return cache_root("" if os.environ.get("FEDSLICE_CACHE_DIR") == "" else None)
