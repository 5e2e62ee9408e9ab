"""Image classification data as users keep it, read into labelled splits of image references
(:func:`load_image_splits`): IDX files, image folders, split files of paths, Hugging Face
datasets; missing dev/test carved off train. See :mod:`fedslice.data.images`.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedslice.data.labels import label_ids
from fedslice.data.locate import (SPLIT_NAMES, by_split_column, check_and_carve, data_search_dirs,
                                  find_split_files, hub_split_map, hub_table, load_hub_tables,
                                  resolve_source)
from fedslice.data.tables import RawTable, read_table
from fedslice.errors import DataError

if TYPE_CHECKING:
    from fedslice.config import DataConfig


log = logging.getLogger(__name__)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm",
                  ".pgm", ".pbm")


#: IDX file stems of each split (MNIST's names): train -> train, test -> t10k.
IDX_STEMS = {"train": "train", "test": "t10k"}
ROW = "__fedslice_row__"  # a table's own row numbers, kept through carving


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
