"""Where an experiment's data comes from: relative paths are looked up in a few folders, short
names of public datasets map to hub ids."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from fedslice.config import DataConfig
from fedslice.errors import DataError
from fedslice.data.loading import RawSplit, load_hub_splits, load_local_splits, resolve_source

#: Hub ids for short dataset names when no local folder of that name exists.
HUB_ALIASES = {"sst2": ("glue", "sst2", {"train": "train", "dev": "validation", "test": "validation"})}


def data_search_dirs() -> list[Path]:
    """Where relative data paths are looked up: $FEDSLICE_DATA_DIR, ., ../shared/data, and
    ../shared/data beside the source checkout."""
    dirs = [Path(os.environ["FEDSLICE_DATA_DIR"])] if os.environ.get("FEDSLICE_DATA_DIR") else []
    repo = Path(__file__).resolve().parents[3]
    return dirs + [Path.cwd(), Path.cwd().parent / "shared" / "data", repo.parent / "shared" / "data"]


def load_raw_splits(d: DataConfig) -> dict[str, RawSplit]:
    """The train/dev/test splits of a data config, from a local folder or the hub."""
    source = resolve_source(d.path, data_search_dirs())
    if isinstance(source, Path):
        return load_local_splits(source, text_columns=d.text_columns, label_column=d.label_column,
                                 file_format=d.format)
    dataset_id, subset, split_map = HUB_ALIASES.get(
        source, (source.split("/")[0], d.hub_subset or (source.split("/", 1) + [None])[1],
                 {"train": "train", "dev": "validation", "test": "test"}))
    return load_hub_splits(dataset_id, subset=subset, text_columns=d.text_columns,
                           label_column=d.label_column, split_map=split_map)


@dataclass
class RawTable:
    """One split as read from a file: every column's cells (row order kept)."""

    columns: dict[str, list[str]]
    source: str

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()), []))


def load_tables(d: DataConfig, seed: int) -> dict[str, RawTable]:
    """train/dev/test tables of a local folder with a header row (every column kept)."""
    from fedslice.data.loading import _find_split_file, _iter_records

    folder = resolve_source(d.path, data_search_dirs())
    if not isinstance(folder, Path):
        raise DataError(f"data.path {d.path!r}: generation tasks read local folders")
    out = {}
    for split in ("train", "dev", "test"):
        path, fmt = _find_split_file(folder, split, d.format)
        columns: dict[str, list[str]] = {}
        for _, row in _iter_records(path, fmt, []):
            for k, v in row.items():
                columns.setdefault(k, []).append("" if v is None else str(v))
        if not columns:
            raise DataError(f"{path}: no data rows")
        out[split] = RawTable(columns, str(path))
    return out
