"""Test helpers over the data layer: classification splits straight from a folder of split files
or from hub splits, without a data config (the library reads data through a config:
:func:`fedslice.data.sources.load_raw_splits`). Thin compositions of the library's own readers,
so the reading, validation and messages tested are the library's."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from fedslice.data.labels import RawSplit, check_text_columns, tables_to_splits
from fedslice.data.locate import find_split_files, load_hub_tables, missing_split_error
from fedslice.data.tables import EXTENSIONS, FileFormat, drop_incomplete, read_table
from fedslice.errors import ConfigError, DataError


def load_local_splits(
    folder: Path,
    *,
    text_columns: Sequence[str],
    label_column: str,
    splits: Sequence[str] = ("train", "dev", "test"),
    file_format: FileFormat = "auto",
) -> dict[str, RawSplit]:
    """Load ``{split}.tsv|.csv|.jsonl`` files (with header lines) from ``folder``.

    TSV files are read without quote handling (SST-2 sentences contain unbalanced quotes);
    CSV files use standard CSV quoting. For headerless files, carving and the other options of
    a data config, use :func:`load_tables` and :func:`tables_to_splits`.

    Raises:
        DataError: missing folder or file, missing column, bad label, empty text or file.
    """
    columns = check_text_columns(text_columns)
    if file_format not in ("auto", *EXTENSIONS):
        raise ConfigError(f"file_format must be one of auto, tsv, csv, jsonl; got {file_format!r}")
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"data folder {folder} does not exist or is not a directory")
    files = find_split_files(folder, file_format, splits)
    tables = {}
    for split in splits:
        if split not in files:
            raise missing_split_error(folder, split, file_format)
        table = read_table(files[split], fmt=file_format)
        if not len(table):
            raise DataError(f"{table.source}: no data rows")
        required = [(c, "data.text_columns") for c in columns] + [(label_column, "data.label_column")]
        tables[split], _ = drop_incomplete(table, required, skip=False)
    return tables_to_splits(tables, text_columns=columns, label_column=label_column)



def load_hub_splits(
    dataset_id: str,
    *,
    subset: str | None,
    text_columns: Sequence[str],
    label_column: str,
    split_map: Mapping[str, str],
) -> dict[str, RawSplit]:
    """Load splits with :func:`datasets.load_dataset` (needs network or a warm HF cache).

    Example: ``load_hub_splits("glue", subset="sst2", text_columns=["sentence"],
    label_column="label", split_map={"train": "train", "dev": "validation",
    "test": "validation"})``. A hub split used for several of our splits is downloaded once.

    Raises:
        DataError: the hub cannot be reached, or the data lacks a column / has bad labels.
    """
    columns = check_text_columns(text_columns)
    tables = load_hub_tables(dataset_id, subset=subset, split_map=split_map)
    return tables_to_splits(tables, text_columns=columns, label_column=label_column)
