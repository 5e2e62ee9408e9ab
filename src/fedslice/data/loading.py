"""Load labelled text-classification splits from local files or the Hugging Face Hub.

A split is returned as a :class:`RawSplit`: plain Python lists of texts and integer labels,
validated once at load time so that every later stage (tokenization, partitioning, training)
can trust it. Every problem with the data raises :class:`~fedslice.errors.DataError` with a
message naming the file, column, line and value involved.
"""

from __future__ import annotations

import csv
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fedslice.errors import ConfigError, DataError

FileFormat = Literal["auto", "tsv", "csv", "jsonl"]

#: File extensions looked for, in this order, when ``file_format="auto"``.
EXTENSIONS: tuple[str, ...] = ("tsv", "csv", "jsonl")

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


@dataclass
class RawSplit:
    """One labelled split, before tokenization.

    Attributes:
        texts: one tuple per example: ``(sentence,)`` or ``(sentence_a, sentence_b)``.
        labels: one integer class id (``>= 0``) per example.
        source: where the split came from (file path or ``hub-id:split``), for messages.
    """

    texts: list[tuple[str, ...]]
    labels: list[int]
    source: str

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def is_pair(self) -> bool:
        """Whether the examples are sentence pairs."""
        return bool(self.texts) and len(self.texts[0]) == 2


# --------------------------------------------------------------------------- validation


def _check_text_columns(text_columns: Sequence[str]) -> list[str]:
    columns = list(text_columns)
    if len(columns) not in (1, 2) or not all(isinstance(c, str) and c for c in columns):
        raise ConfigError(
            f"text_columns must name 1 column (single sentence) or 2 columns (sentence pair), "
            f"got {columns!r}"
        )
    return columns


def _where(source: str, line: int) -> str:
    return f"{source}, line {line}"


def _parse_label(value: Any, source: str, line: int) -> int:
    """Convert a raw label cell to an int >= 0, or raise a DataError naming file and line."""
    if type(value) is str and value.isascii() and value.isdigit():
        return int(value)  # fast path: the common case of a TSV/CSV cell like "1"
    where = _where(source, line)
    if isinstance(value, bool) or value is None:
        raise DataError(f"{where}: label {value!r} is not an integer")
    if isinstance(value, int):
        label = value
    elif isinstance(value, float) and value.is_integer():
        label = int(value)
    else:
        text = str(value).strip()
        if not re.fullmatch(r"[+-]?\d+", text):
            raise DataError(f"{where}: label {value!r} is not an integer")
        label = int(text)
    if label < 0:
        hint = " (GLUE test splits are unlabelled (-1); evaluate on the validation split)"
        raise DataError(f"{where}: label {label} is negative; labels must be >= 0" + hint)
    return label


def _parse_text(value: Any, column: str, source: str, line: int) -> str:
    """Return ``value`` if it is a non-blank string, else raise a DataError naming the cell."""
    if type(value) is str and value and not value.isspace():
        return value
    where = _where(source, line)
    if not isinstance(value, str):
        raise DataError(f"{where}: column {column!r} must be text, got {value!r}")
    if not value.strip():
        raise DataError(f"{where}: column {column!r} is empty")
    return value


def _missing_columns_error(source: str, missing: list[str], found: Iterable[str]) -> DataError:
    return DataError(
        f"{source}: missing column(s) {missing}; columns found: {list(found)}"
    )


# --------------------------------------------------------------------------- file readers


def _open_text(path: Path):
    return path.open("r", encoding="utf-8-sig", newline="")


def _iter_delimited(
    path: Path, delimiter: str, required: list[str]
) -> Iterator[tuple[int, dict[str, str]]]:
    """Yield ``(line_number, row_dict)`` of a TSV/CSV file whose header names ``required``."""
    quoting = csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL
    with _open_text(path) as handle:
        reader = csv.reader(handle, delimiter=delimiter, quoting=quoting)
        header = next(reader, None)
        if header is None:
            raise DataError(f"{path}: file is empty (expected a header line and data rows)")
        header = [name.strip() for name in header]
        missing = [c for c in required if c not in header]
        if missing:
            raise _missing_columns_error(str(path), missing, header)
        for row in reader:
            if not row:
                continue
            if len(row) != len(header):
                raise DataError(
                    f"{path}, line {reader.line_num}: expected {len(header)} fields "
                    f"({header}), found {len(row)}"
                )
            yield reader.line_num, dict(zip(header, row))


def _iter_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_number, object)`` for each non-blank line of a JSON-lines file."""
    with _open_text(path) as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}, line {line_number}: invalid JSON ({err.msg})") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}, line {line_number}: expected a JSON object per line")
            yield line_number, record


def _iter_records(
    path: Path, file_format: str, required: list[str]
) -> Iterator[tuple[int, Mapping[str, Any]]]:
    if file_format == "jsonl":
        return _iter_jsonl(path)
    return _iter_delimited(path, "\t" if file_format == "tsv" else ",", required)


def _build_split(
    records: Iterable[tuple[int, Mapping[str, Any]]],
    *,
    source: str,
    text_columns: list[str],
    label_column: str,
) -> RawSplit:
    """Validate records and collect them into a RawSplit."""
    wanted = [*text_columns, label_column]
    texts: list[tuple[str, ...]] = []
    labels: list[int] = []
    for line, record in records:
        try:
            cells = [record[c] for c in text_columns]
            label = record[label_column]
        except KeyError:
            missing = [c for c in wanted if c not in record]
            raise _missing_columns_error(_where(source, line), missing, record.keys()) from None
        texts.append(tuple([_parse_text(v, c, source, line) for v, c in zip(cells, text_columns)]))
        labels.append(_parse_label(label, source, line))
    if not labels:
        raise DataError(f"{source}: no data rows")
    return RawSplit(texts=texts, labels=labels, source=source)


# --------------------------------------------------------------------------- local folders


def _find_split_file(folder: Path, split: str, file_format: FileFormat) -> tuple[Path, str]:
    """Return ``(path, format)`` of the file holding ``split`` in ``folder``."""
    extensions = EXTENSIONS if file_format == "auto" else (file_format,)
    candidates = [folder / f"{split}.{ext}" for ext in extensions]
    found = [p for p in candidates if p.is_file()]
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise DataError(
            f"{folder}: several files for split {split!r} ({names}); "
            f"keep one or set the file format"
        )
    if not found:
        expected = " or ".join(p.name for p in candidates)
        present = sorted(p.name for p in folder.iterdir() if p.is_file())
        raise DataError(
            f"{folder}: no file for split {split!r} (expected {expected}); "
            f"files found: {present or 'none'}"
        )
    return found[0], found[0].suffix[1:]


def load_local_splits(
    folder: Path,
    *,
    text_columns: Sequence[str],
    label_column: str,
    splits: Sequence[str] = ("train", "dev", "test"),
    file_format: FileFormat = "auto",
) -> dict[str, RawSplit]:
    """Load ``{split}.tsv|.csv|.jsonl`` files from ``folder``.

    TSV files are read without quote handling (SST-2 sentences contain unbalanced quotes);
    CSV files use standard CSV quoting. TSV/CSV files need a header line naming the columns.

    Args:
        folder: directory holding one file per split.
        text_columns: one column (single sentence) or two (sentence pair).
        label_column: column of integer class ids ``>= 0``.
        splits: split names; each must have a file named after it.
        file_format: ``"auto"`` picks the format from the file extension.

    Returns:
        ``{split name: RawSplit}`` in the order of ``splits``.

    Raises:
        DataError: missing folder or file, missing column, bad label, empty text or file.
    """
    columns = _check_text_columns(text_columns)
    if file_format not in ("auto", *EXTENSIONS):
        raise ConfigError(f"file_format must be one of auto, tsv, csv, jsonl; got {file_format!r}")
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"data folder {folder} does not exist or is not a directory")
    result: dict[str, RawSplit] = {}
    for split in splits:
        path, fmt = _find_split_file(folder, split, file_format)
        result[split] = _load_file(path, fmt, columns, label_column)
    return result


def _load_file(path: Path, fmt: str, text_columns: list[str], label_column: str) -> RawSplit:
    """Read and validate one split file, reporting undecodable or malformed files."""
    try:
        return _build_split(
            _iter_records(path, fmt, [*text_columns, label_column]),
            source=str(path),
            text_columns=text_columns,
            label_column=label_column,
        )
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not valid UTF-8 text ({err.reason} at byte {err.start})") from None
    except csv.Error as err:
        raise DataError(f"{path}: malformed {fmt.upper()} file ({err})") from None


# --------------------------------------------------------------------------- hub


def _hub_error(dataset_id: str, subset: str | None, split: str, err: Exception) -> DataError:
    name = dataset_id + (f" (subset {subset!r})" if subset else "")
    return DataError(
        f"could not load split {split!r} of {name} from the Hugging Face Hub: "
        f"{type(err).__name__}: {err}. The hub may be unreachable (no network?) or the id wrong; "
        f"download the data and point the config at a local folder with "
        f"train/dev/test .tsv, .csv or .jsonl files instead."
    )


def _load_hub_split(dataset_id: str, subset: str | None, split: str) -> Any:
    import datasets  # lazy: importing `datasets` is slow and only needed for hub sources

    try:
        return datasets.load_dataset(dataset_id, subset, split=split)
    except Exception as err:  # noqa: BLE001 - any failure means "cannot get the data"
        raise _hub_error(dataset_id, subset, split, err) from err


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
    columns = _check_text_columns(text_columns)
    loaded: dict[str, Any] = {}
    result: dict[str, RawSplit] = {}
    for ours, theirs in split_map.items():
        if theirs not in loaded:
            loaded[theirs] = _load_hub_split(dataset_id, subset, theirs)
        result[ours] = _hub_dataset_to_split(
            loaded[theirs], f"{dataset_id}{'/' + subset if subset else ''}:{theirs}",
            columns, label_column,
        )
    return result


def _hub_dataset_to_split(
    dataset: Any, source: str, text_columns: list[str], label_column: str
) -> RawSplit:
    found = list(dataset.column_names)
    missing = [c for c in [*text_columns, label_column] if c not in found]
    if missing:
        raise _missing_columns_error(source, missing, found)
    data = dataset.select_columns([*text_columns, label_column]).to_dict()
    rows = (
        (i, {c: data[c][i] for c in data}) for i in range(len(data[label_column]))
    )
    return _build_split(rows, source=source, text_columns=text_columns, label_column=label_column)


# --------------------------------------------------------------------------- sources


def _looks_like_path(text: str) -> bool:
    return (
        text.startswith((".", "~", "/"))
        or "\\" in text
        or text.count("/") > 1
        or (os.sep != "/" and os.sep in text)
    )


def resolve_source(path_or_id: str, base_dirs: Sequence[Path]) -> Path | str:
    """Decide whether a data reference is a local folder or a Hugging Face Hub id.

    An existing folder wins: absolute paths are used as they are, relative ones are tried
    against each of ``base_dirs`` in order (the current directory if none are given).
    Otherwise ``"name"`` or ``"name/subset"`` (e.g. ``"glue/sst2"``) is returned unchanged
    as a hub id.

    Raises:
        DataError: the string looks like a path but no such folder exists, it names a file
            rather than a folder, or it is neither a path nor a valid hub id.
    """
    text = str(path_or_id).strip()
    if not text:
        raise DataError("data source is empty: give a local folder or a hub id like 'glue/sst2'")
    candidates = _candidate_paths(text, base_dirs)
    for candidate in candidates:
        if candidate.is_dir():
            return candidate.resolve()
        if candidate.exists():
            raise DataError(
                f"data path {candidate} is a file; give the folder holding train/dev/test files"
            )
    if _looks_like_path(text) or not _HUB_ID.match(text):
        looked = ", ".join(str(c) for c in candidates)
        raise DataError(f"data path {text!r} does not exist (looked at: {looked})")
    return text


def _candidate_paths(text: str, base_dirs: Sequence[Path]) -> list[Path]:
    path = Path(text).expanduser()
    if path.is_absolute():
        return [path]
    bases = list(base_dirs) or [Path.cwd()]
    return [Path(base) / path for base in bases]


def num_labels(splits: Mapping[str, RawSplit] | Iterable[RawSplit]) -> int:
    """Number of classes: the largest label across all splits, plus one."""
    values = splits.values() if isinstance(splits, Mapping) else splits
    highest = max((max(s.labels) for s in values if s.labels), default=None)
    if highest is None:
        raise DataError("cannot count labels: all splits are empty")
    return highest + 1
