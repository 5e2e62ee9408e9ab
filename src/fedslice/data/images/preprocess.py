"""Decoding images and preprocessing them once with the backbone's image processor (geometry
only, kept as uint8), cached in the process and on disk. See :mod:`fedslice.data.images`.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedslice.data.images.sources import ImageBank
from fedslice.errors import ConfigError, DataError

log = logging.getLogger(__name__)
CACHE_VERSION = 1
_CHUNK = 512


class BadImage(Exception):
    """An image cell that cannot be decoded (the message says why)."""


def open_image(cell: Any, bank: ImageBank, row: int):
    """The PIL image of a cell (fully decoded); BadImage if it cannot be."""
    from PIL import Image, UnidentifiedImageError

    try:
        if isinstance(cell, Image.Image):
            cell.load()
            return cell
        if isinstance(cell, np.ndarray):
            return Image.fromarray(np.ascontiguousarray(cell))
        if isinstance(cell, dict) and (cell.get("bytes") or cell.get("path")):
            im = Image.open(io.BytesIO(cell["bytes"])) if cell.get("bytes") else Image.open(cell["path"])
        elif isinstance(cell, (str, os.PathLike)):
            im = Image.open(bank.path(cell))
        else:
            raise BadImage(f"not an image or a path: {type(cell).__name__}")
        im.load()
        return im
    except FileNotFoundError:
        raise BadImage("no such file") from None
    except UnidentifiedImageError:
        raise BadImage("not an image file PIL can read") from None
    except (OSError, ValueError, SyntaxError, TypeError) as e:  # truncated, corrupt, bad array
        raise BadImage(f"{type(e).__name__}: {e}") from None


def _eight_bit(im):
    """Bilevel and 16/32-bit or float grayscale images as 8-bit grayscale ('L')."""
    from PIL import Image

    if im.mode == "1":
        return im.convert("L")
    if im.mode.startswith("I") or im.mode == "F":
        a = np.asarray(im)
        a = a >> 8 if a.dtype == np.uint16 or im.mode.startswith("I;16") else np.clip(a, 0, 255)
        return Image.fromarray(a.astype(np.uint8), "L")
    return im


def _to_mode(images: list, channels: int) -> list:
    """Every image of a chunk grayscale: kept one channel (replicated when batched); else every
    image RGB (alpha composited on white, as the processors' ``convert_rgb``)."""
    from PIL import Image
    from transformers.image_transforms import convert_to_rgb

    images = [_eight_bit(im) for im in images]
    if channels == 1:
        return [im if im.mode == "L" else im.convert("L") for im in images]
    if all(im.mode == "L" for im in images):
        return images
    return [im if im.mode == "RGB" else Image.fromarray(convert_to_rgb(im, return_numpy=True))
            for im in images]


@dataclass(frozen=True)
class Preprocessor:
    """The image processor of a backbone as used here: its geometry (resize, crop; with
    ``size``: the shorter side to ``size``, then an S x S centre crop) on decoded images, and its
    rescale/normalisation constants applied per batch."""

    processor: Any
    size: int | None
    channels: int  # the model's input channels

    def geometry(self) -> dict[str, Any]:
        """Call arguments: no rescale/normalisation (kept for batches), the size override."""
        kw: dict[str, Any] = {"do_rescale": False, "do_normalize": False, "do_convert_rgb": False,
                              "return_tensors": "np"}
        if self.size is not None:
            s = int(self.size)
            if getattr(self.processor, "do_center_crop", False):
                kw.update(size={"shortest_edge": s}, crop_size={"height": s, "width": s})
            else:
                kw.update(size={"height": s, "width": s})
        return kw

    def settings(self) -> dict[str, Any]:
        """What the pixels depend on (cache keys)."""
        return {"processor": json.loads(self.processor.to_json_string()), "size": self.size,
                "channels": self.channels}

    def constants(self) -> tuple[float, torch.Tensor, torch.Tensor]:
        """(rescale factor, mean (C, 1, 1), std (C, 1, 1)) of the model's channels."""
        p = self.processor
        scale = float(p.rescale_factor) if getattr(p, "do_rescale", True) else 1.0
        if getattr(p, "do_normalize", True):
            mean, std = p.image_mean, p.image_std
        else:
            mean, std = 0.0, 1.0

        def per_channel(v) -> torch.Tensor:
            t = torch.as_tensor(v, dtype=torch.float32).flatten()
            t = t.expand(self.channels) if t.numel() == 1 else t
            if t.numel() != self.channels:
                raise ConfigError(f"the image processor normalises {t.numel()} channels; the model "
                                  f"reads {self.channels}")
            return t.view(-1, 1, 1)
        return scale, per_channel(mean), per_channel(std)

    def resize(self, images: list) -> np.ndarray:
        """(n, C, S, S) uint8 of decoded PIL images of one mode."""
        out = self.processor(images, **self.geometry())["pixel_values"]
        out = np.asarray(out)
        if out.dtype != np.uint8:
            out = np.clip(np.rint(out), 0, 255).astype(np.uint8)
        return out


@dataclass
class Processed:
    """A bank's preprocessed images: ``pixels`` (n, C, S, S) uint8 (C = 1: grayscale) and the
    rows that could not be decoded, with the reason."""

    pixels: torch.Tensor
    bad: dict[int, str] = field(default_factory=dict)


_PROCESSED: dict[str, Processed] = {}  # in-process cache: several runs (compare) share it


def processed(bank: ImageBank, rows: np.ndarray, prep: Preprocessor,
              cache_dir: Path | None) -> tuple[Processed, np.ndarray]:
    """The preprocessed ``rows`` of ``bank`` (a ``Processed`` over exactly these rows, in this
    order) from the in-process cache, the disk cache, or computed."""
    rows = np.asarray(rows, dtype=np.int64)
    key = hashlib.sha256(json.dumps({"version": CACHE_VERSION, "bank": bank.fingerprint(),
                                     "rows": hashlib.sha256(rows.tobytes()).hexdigest(),
                                     **prep.settings()}, sort_keys=True, default=str).encode()
                         ).hexdigest()[:32]
    if key in _PROCESSED:
        return _PROCESSED[key], rows
    path = cache_dir / "images" / f"{key}.pt" if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            saved = torch.load(path, weights_only=True)
            got = Processed(saved["pixels"], {int(k): v for k, v in json.loads(saved["bad"]).items()})
            _PROCESSED[key] = got
            return got, rows
        except Exception as e:  # noqa: BLE001 - a damaged cache entry is recomputed
            log.warning("ignoring the unreadable image cache entry %s (%s)", path, e)
    got = _preprocess(bank, rows, prep)
    _PROCESSED[key] = got
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        torch.save({"pixels": got.pixels, "bad": json.dumps({str(k): v for k, v in got.bad.items()})}, tmp)
        os.replace(tmp, path)
    return got, rows


def _preprocess(bank: ImageBank, rows: np.ndarray, prep: Preprocessor) -> Processed:
    """Decode and resize ``rows`` of ``bank`` in chunks; undecodable rows are recorded (their
    pixels stay 0)."""
    from fedslice import progress

    done: list[tuple[np.ndarray, np.ndarray]] = []  # (positions, (n, c, S, S) pixels)
    bad: dict[int, str] = {}
    with progress.task("preprocessing images", -(-len(rows) // _CHUNK)) as advance:
        for lo in range(0, len(rows), _CHUNK):
            advance()
            images, at = [], []
            for j, r in enumerate(rows[lo:lo + _CHUNK]):
                try:
                    images.append(open_image(bank.cells[r], bank, int(r)))
                    at.append(lo + j)
                except BadImage as e:
                    bad[lo + j] = str(e)
            if images:
                images = _to_mode(images, prep.channels)
                done.append((np.array(at), prep.resize(images)))
    if not done:
        first = f" (first: {bank.where(int(rows[0]))}: {bad.get(0)})" if len(rows) else ""
        raise DataError(f"{bank.source}: no image could be decoded{first}")
    shapes = {px.shape[2:] for _, px in done}
    if len(shapes) > 1:
        raise DataError(f"{bank.source}: the image processor gave images of several sizes "
                        f"{sorted(shapes)}: set task.image_size")
    c = max(px.shape[1] for _, px in done)
    out = np.zeros((len(rows), c, *shapes.pop()), np.uint8)  # (n, c, S, S)
    for at, px in done:
        out[at] = np.broadcast_to(px, (len(px), c, *px.shape[2:]))  # grayscale chunk -> c
    return Processed(torch.from_numpy(out), bad)
