"""Image classification data: read images as users keep them, preprocess them once with the
backbone's image processor, and batch them.

Sources (``data.path``), told apart by their layout:

* **IDX files** (the MNIST family: MNIST, Fashion-MNIST, KMNIST): ``train-images-idx3-ubyte``
  and ``train-labels-idx1-ubyte`` (``.gz`` or not; ``train-images.idx3-ubyte`` too), ``t10k-*``
  for test. ``fashion_mnist`` finds ``../shared/data/fashion_mnist`` or Debian's
  ``/usr/share/datasets/fashion-mnist`` (package ``dataset-fashion-mnist``).
* **an image folder**: ``train/``, ``dev/`` (``validation/``, ``val/``) and ``test/``, each with one
  sub-folder per class (torchvision's ``ImageFolder`` layout, per split), or the class
  sub-folders directly (one split). The class of an image is its folder's name.
* **split files** (``train.csv``, ``dev.jsonl``, ...) or one file, read like text data: the image
  is ``data.image_column`` (a path, relative to the data folder), the class ``data.label_column``.
* **a Hugging Face dataset** with an image feature in ``data.image_column``: a hub id, or a folder
  written by ``Dataset(Dict).save_to_disk``.

Missing dev/test splits are carved off train, labels may be names (``data.labels`` fixes their
order) and ``data.server_holdout`` keeps training images on the server, as for text data
(:func:`~fedslice.data.loading.check_and_carve`).

Preprocessing runs the backbone's image processor for the geometry (resize, centre crop: mixed
sizes and aspect ratios all come out S x S) on decoded images (grayscale images stay one channel
and are replicated to the model's channels when batched; other modes become RGB as the
processor's ``convert_rgb`` does) and keeps the result as uint8; a batch is rescaled and
normalised with the processor's constants (:class:`ImageSplit`): the same numbers as the
processor's full output (tested), at a quarter of the memory (a twelfth for grayscale). Each
source table (an IDX file, a folder, a split file: the rows *before* carving, so every seed shares
it) is preprocessed once per processor setting and cached, in the process and on disk
(``$FEDSLICE_CACHE_DIR``, default ``~/.cache/fedslice``, ``images/``): deterministic, keyed by the
source's files (names, sizes, modification times) or pixels, and the processor's settings.

An image that cannot be decoded (missing file, not an image, truncated) stops the run naming the
file, or with ``data.bad_rows = "skip"`` is skipped and counted in the log.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedslice.data.loading import (SPLIT_NAMES, RawTable, by_split_column, check_and_carve,
                                   data_search_dirs, find_split_files, hub_split_map, hub_table,
                                   label_ids, load_hub_tables, read_table, resolve_source)
from fedslice.data.partition import sample_rows
from fedslice.errors import ConfigError, DataError
from fedslice.paths import cache_root

if TYPE_CHECKING:
    from fedslice.config import DataConfig

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm",
                  ".pgm", ".pbm")
#: IDX file stems of each split (MNIST's names): train -> train, test -> t10k.
IDX_STEMS = {"train": "train", "test": "t10k"}
ROW = "__fedslice_row__"  # a table's own row numbers, kept through carving
CACHE_VERSION = 1
_CHUNK = 512


# --------------------------------------------------------------------------- IDX files


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (gzip or not) as a uint8 array: (N,) labels or (N, rows, cols) images.

    Raises DataError naming the file when it is not an unsigned-byte IDX file or is truncated."""
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: cannot read ({e})") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise DataError(f"{path}: not an IDX file (magic number {data[:4].hex() or 'missing'})")
    kind, ndim = data[2], data[3]
    if kind != 0x08:
        raise DataError(f"{path}: IDX type 0x{kind:02x} is not unsigned bytes (0x08)")
    head = 4 + 4 * ndim
    if len(data) < head:
        raise DataError(f"{path}: truncated IDX header")
    dims = struct.unpack(f">{ndim}I", data[4:head])
    size = int(np.prod(dims)) if dims else 0
    if len(data) - head != size:
        raise DataError(f"{path}: IDX header says {'x'.join(map(str, dims))} = {size} bytes, the "
                        f"file holds {len(data) - head}")
    return np.frombuffer(data, dtype=np.uint8, offset=head).reshape(dims)


def _idx_file(folder: Path, stem: str, what: str, ndim: int) -> Path | None:
    names = [f"{stem}-{what}-idx{ndim}-ubyte", f"{stem}-{what}.idx{ndim}-ubyte"]
    found = [folder / f"{n}{gz}" for n in names for gz in ("", ".gz") if (folder / f"{n}{gz}").is_file()]
    if len(found) > 1:
        raise DataError(f"{folder}: several IDX files for {stem} {what} "
                        f"({', '.join(p.name for p in found)}): keep one")
    return found[0] if found else None


def idx_tables(folder: Path, d: DataConfig) -> dict[str, RawTable] | None:
    """The IDX splits of ``folder`` (train, and test from ``t10k-*``), or None if it holds none."""
    out = {}
    for split, stem in IDX_STEMS.items():
        images, labels = _idx_file(folder, stem, "images", 3), _idx_file(folder, stem, "labels", 1)
        if images is None and labels is None:
            continue
        if images is None or labels is None:
            have = images or labels
            raise DataError(f"{folder}: {have.name} has no matching {stem} "
                            f"{'labels' if labels is None else 'images'} IDX file")
        x, y = read_idx(images), read_idx(labels)
        if x.ndim != 3 or y.ndim != 1:
            raise DataError(f"{images}: expected (N, rows, cols) images and (N,) labels, got "
                            f"{x.shape} and {y.shape} ({labels.name})")
        if len(x) != len(y):
            raise DataError(f"{images}: {len(x)} images but {labels.name} has {len(y)} labels")
        out[split] = RawTable({d.image_column: list(x), d.label_column: y.tolist()},
                              list(range(1, len(x) + 1)), str(images), unit="image")
    if not out:
        return None
    if "train" not in out:
        raise DataError(f"{folder}: IDX files for test only; the train files "
                        f"(train-images-idx3-ubyte, train-labels-idx1-ubyte) are missing")
    return out


# --------------------------------------------------------------------------- image folders


def images_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def _class_folders(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def folder_table(folder: Path, d: DataConfig) -> RawTable:
    """One split of an image folder: every image under each class sub-folder (sorted)."""
    paths, labels = [], []
    for cls in _class_folders(folder):
        found = images_in(cls)
        paths += [str(p) for p in found]
        labels += [cls.name] * len(found)
    if not paths:
        raise DataError(f"{folder}: no images in class sub-folders (expected <class>/<image> with "
                        f"one of {', '.join(IMAGE_SUFFIXES)})")
    return RawTable({d.image_column: paths, d.label_column: labels}, list(range(1, len(paths) + 1)),
                    str(folder), unit="image")


def image_folder_tables(folder: Path, d: DataConfig) -> dict[str, RawTable] | None:
    """``train/`` (+ ``dev/``, ``test/``) of class sub-folders, or class sub-folders directly."""
    splits = {}
    for split, names in SPLIT_NAMES.items():
        present = [folder / n for n in names if (folder / n).is_dir()]
        if len(present) > 1:
            raise DataError(f"{folder}: several folders for split {split!r} "
                            f"({', '.join(p.name for p in present)}): keep one")
        if present:
            splits[split] = present[0]
    if splits:
        if "train" not in splits:
            raise DataError(f"{folder}: split folders {sorted(p.name for p in splits.values())} but "
                            "no train/ folder")
        return {s: folder_table(p, d) for s, p in splits.items()}
    if any(images_in(c)[:1] for c in _class_folders(folder)):
        return {"train": folder_table(folder, d)}
    return None


# --------------------------------------------------------------------------- HF datasets


def _saved_dataset_tables(folder: Path, d: DataConfig) -> dict[str, RawTable] | None:
    """A dataset written by ``save_to_disk`` (a DatasetDict: splits train/validation/test)."""
    if not ((folder / "dataset_dict.json").is_file() or (folder / "dataset_info.json").is_file()):
        return None
    import datasets

    try:
        loaded = datasets.load_from_disk(str(folder))
    except Exception as e:  # noqa: BLE001 - any failure: the folder is not a readable dataset
        raise DataError(f"{folder}: not a readable saved dataset ({type(e).__name__}: {e})") from None
    if isinstance(loaded, datasets.Dataset):
        return {"train": hub_table(loaded, f"{folder}")}
    ours = {alias: split for split, aliases in SPLIT_NAMES.items() for alias in aliases}
    out = {}
    for name, part in loaded.items():
        if name in ours:
            out[ours[name]] = hub_table(part, f"{folder}:{name}")
    if "train" not in out:
        raise DataError(f"{folder}: saved dataset without a train split (splits: {list(loaded)})")
    return out


def _hub_image_tables(source: str, d: DataConfig) -> dict[str, RawTable]:
    """A hub dataset's train split, and its validation/test splits where it has them (image
    datasets often have none: CIFAR-10 has train and test); missing ones are carved off train."""
    dataset_id, subset, split_map = hub_split_map(source, d.hub_subset)
    out = load_hub_tables(dataset_id, subset=subset, split_map={"train": split_map["train"]})
    for ours in ("dev", "test"):
        try:
            out.update(load_hub_tables(dataset_id, subset=subset, split_map={ours: split_map[ours]}))
        except DataError as e:
            log.info("data: %s has no %r split (%s): it is carved off train", source, split_map[ours],
                     str(e).split(":", 1)[0])
    return out


# --------------------------------------------------------------------------- tables -> splits


@dataclass
class ImageBank:
    """The images of one source table as read (before carving): what is preprocessed and cached
    as a whole. ``cells[i]`` is a path (relative paths start at ``base``), an array, a PIL image
    or a hub image dict."""

    cells: list[Any]
    base: Path
    source: str
    unit: str
    lines: list[int]

    def where(self, row: int) -> str:
        cell = self.cells[row]
        if isinstance(cell, (str, os.PathLike)):
            return str(self.path(cell))
        return f"{self.source}, {self.unit} {self.lines[row]}"

    def path(self, cell) -> Path:
        p = Path(cell).expanduser()
        return p if p.is_absolute() else self.base / p

    def fingerprint(self) -> str:
        """Identity of the bank's images for the cache: each path's size and modification time,
        or the bytes of in-memory images."""
        h = hashlib.sha256(f"{self.source}:{len(self.cells)}".encode())
        for cell in self.cells:
            if isinstance(cell, (str, os.PathLike)):
                p = self.path(cell)
                try:
                    st = p.stat()
                    h.update(f"{p}:{st.st_size}:{st.st_mtime_ns}".encode())
                except OSError:
                    h.update(f"{p}:missing".encode())
            elif isinstance(cell, np.ndarray):
                h.update(f"{cell.shape}:{cell.dtype}".encode())
                h.update(np.ascontiguousarray(cell).tobytes())
            elif isinstance(cell, dict):
                h.update(cell.get("bytes") or str(cell.get("path")).encode())
            elif hasattr(cell, "tobytes"):  # a PIL image
                h.update(f"{cell.mode}:{cell.size}".encode())
                h.update(cell.tobytes())
            else:
                h.update(repr(cell).encode())
        return h.hexdigest()[:24]


@dataclass
class RawImageSplit:
    """One labelled split of images, before preprocessing: rows of one :class:`ImageBank`."""

    bank: ImageBank
    rows: np.ndarray  # (N,) rows of the bank
    labels: list[int]
    source: str
    label_names: list[str] | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def select(self, idx: Sequence[int] | np.ndarray) -> RawImageSplit:
        idx = np.asarray(idx, dtype=np.int64)
        return RawImageSplit(self.bank, self.rows[idx], [self.labels[i] for i in idx], self.source,
                             self.label_names)


def load_image_tables(d: DataConfig, seed: int = 0, carve_missing: bool = True
                      ) -> tuple[dict[str, RawTable], dict[str, ImageBank]]:
    """The train/dev/test tables of an image data config (see the module doc) and the bank of
    each table; rows keep their bank row in the column ``ROW``. ``carve_missing=False``: only
    the splits the data has."""
    source = resolve_source(d.path, data_search_dirs(), allow_file=True)
    required = [(d.image_column, "data.image_column"), (d.label_column, "data.label_column")]
    if d.group_column is not None:
        required.append((d.group_column, "data.group_column"))
    base = Path.cwd() if isinstance(source, str) else source if source.is_dir() else source.parent
    tables: dict[str, RawTable] | None = None
    if isinstance(source, str):
        tables = _hub_image_tables(source, d)
    elif source.is_dir():
        for reader in (_saved_dataset_tables, idx_tables):
            tables = reader(source, d)
            if tables is not None:
                break
        if tables is None and find_split_files(source, d.format):
            tables = _split_file_tables(source, d)
        if tables is None:
            tables = image_folder_tables(source, d)
        if tables is None:
            raise DataError(f"{source}: no images found: expected IDX files (train-images-idx3-ubyte"
                            f"[.gz], ...), class sub-folders of images (optionally under train/, "
                            f"dev/, test/), train/dev/test .csv/.jsonl/.tsv files with columns "
                            f"{d.image_column!r} and {d.label_column!r}, or a saved HF dataset")
    else:
        tables = _split_file_tables(source, d)
    banks = {}
    for split, t in tables.items():
        if d.image_column not in t.columns:
            raise DataError(f"{t.source}: no image column {d.image_column!r} (set by data.image_column);"
                            f" columns found: {list(t.columns)}")
        banks[split] = ImageBank(list(t.columns[d.image_column]), base, t.source, t.unit, list(t.lines))
        t.columns[ROW] = [(split, i) for i in range(len(t))]
    return check_and_carve(tables, d, seed, required, source, carve_missing), banks


def _split_file_tables(source: Path, d: DataConfig) -> dict[str, RawTable]:
    """Split files (or one file) read like text data: the image column holds paths."""
    read = dict(fmt=d.format, header=d.header, columns=d.columns, delimiter=d.delimiter,
                quotes=d.quotes, skip_bad_rows=d.bad_rows == "skip")
    if source.is_file():
        table = read_table(source, **read)
        if d.split_column is None:
            return {"train": table}
        return by_split_column(table, d.split_column)
    files = find_split_files(source, d.format)
    if "train" not in files:
        raise DataError(f"{source}: split files {sorted(p.name for p in files.values())} but no "
                        "train file")
    return {split: read_table(path, **read) for split, path in files.items()}


def load_image_splits(d: DataConfig, seed: int = 0, carve_missing: bool = True
                      ) -> dict[str, RawImageSplit]:
    """Labelled image splits (train/dev/test, and ``server`` with ``d.server_holdout``).
    ``carve_missing=False`` (evaluating on other data): the splits the data has, nothing carved
    off and nothing held apart."""
    tables, banks = load_image_tables(d, seed, carve_missing)
    ids, names = label_ids(tables, d.label_column, d.labels)
    out = {}
    for split, table in tables.items():
        where = table.columns[ROW]
        bank_split = where[0][0] if where else split
        if any(w[0] != bank_split for w in where):
            raise AssertionError("a split mixes rows of several source tables")
        rows = np.array([w[1] for w in where], dtype=np.int64)
        out[split] = RawImageSplit(banks[bank_split], rows, ids[split], table.source, names)
    classes = len(names) if names else 1 + max(max(s.labels, default=0) for s in out.values())
    if classes < 2:
        raise DataError(f"{next(iter(out.values())).source}: every label is the same ({d.label_column!r}, set by "
                        "data.label_column): a classifier needs at least two classes")
    if d.server_holdout > 0 and carve_missing:
        out.update(hold_out(out["train"], d.server_holdout, seed))
    return out


def hold_out(train: RawImageSplit, fraction: float, seed: int) -> dict[str, RawImageSplit]:
    """``train`` without a seeded ``fraction`` of its rows, and those rows as ``server``."""
    n = len(train)
    k = max(1, round(fraction * n))
    if k >= n:
        raise DataError(f"{train.source}: data.server_holdout = {fraction} leaves no training image")
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5E2FE2]))
    held = np.sort(rng.permutation(n)[:k])
    keep = np.setdiff1d(np.arange(n), held)
    log.info("data: the server keeps %d of %d training images apart (data.server_holdout = %g)",
             k, n, fraction)
    return {"train": train.select(keep), "server": train.select(held)}


# --------------------------------------------------------------------------- decoding


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


# --------------------------------------------------------------------------- preprocessing


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


# --------------------------------------------------------------------------- batches


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
