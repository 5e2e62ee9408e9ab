"""Tables as users have them: one file (TSV/CSV with or without a header line, JSONL) read
into a :class:`RawTable` -- every column's cells in row order and the file line of each row, for
messages -- and rows with a missing value dropped or refused (:func:`drop_incomplete`).

Every problem raises :class:`~fedslice.errors.DataError` naming the file, line, column and value.
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from fedslice.errors import ConfigError, DataError
from fedslice.output import read_jsonl


log = logging.getLogger(__name__)


FileFormat = Literal["auto", "tsv", "csv", "jsonl", "parquet"]


#: File extensions looked for, in this order, when ``file_format="auto"``.
EXTENSIONS: tuple[str, ...] = ("tsv", "csv", "jsonl", "parquet")


@dataclass
class RawTable:
    """One split as read from a file or the hub, before any task-specific parsing.

    Attributes:
        columns: every column's cells in row order. TSV/CSV cells are strings; JSONL and hub
            cells are kept as read (a JSONL row lacking a key holds ``None``).
        lines: the file line (1-based; hub: row number) where each row starts.
        source: the file path or ``hub-id:split``, plus how the rows were chosen if carved.
        unit: ``"line"`` for files, ``"row"`` for hub datasets (used in messages).
        class_names: class names of integer-coded columns, when the source declares them
            (hub ``ClassLabel`` features).
        skipped: lines of rows skipped while reading (wrong number of fields), not yet logged.
    """

    columns: dict[str, list[Any]]
    lines: list[int]
    source: str
    unit: str = "line"
    class_names: dict[str, list[str]] = field(default_factory=dict)
    skipped: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.lines)

    def where(self, row: int) -> str:
        """``"file, line N"`` of row index ``row``, for messages."""
        return f"{self.source}, {self.unit} {self.lines[row]}"

    def refuse_row(self, row: int, error: Exception, skip: bool, bad: list) -> None:
        """A row a task cannot read: a DataError naming it, or under ``data.bad_rows = "skip"``
        its (line, reason) appended to ``bad`` (the caller skips it and says the count once)."""
        if not skip:
            raise DataError(f"{self.where(row)}: {error} (set data.bad_rows = \"skip\" to skip "
                            "such rows)") from None
        bad.append((self.lines[row], str(error)))

    def column(self, name: str, field: str = "data.text_columns") -> list[Any]:
        """The cells of column ``name``; a DataError naming it, the config ``field`` that asked
        for it and the columns found if the table has no such column."""
        if name not in self.columns:
            raise DataError(f"{self.source}: missing column(s) [{name!r}] (set by {field}); "
                            f"columns found: {list(self.columns)}")
        return self.columns[name]

    def text_column(self, name: str, field: str = "data.text_columns") -> list[str]:
        """The cells of column ``name``, checked to be non-blank text."""
        cells = self.column(name, field)
        for i, value in enumerate(cells):
            if type(value) is str and value and not value.isspace():
                continue
            if not isinstance(value, str):
                raise DataError(f"{self.where(i)}: column {name!r} must be text, got {value!r}")
            raise DataError(f"{self.where(i)}: column {name!r} is empty")
        return cells

    def select(self, rows: Sequence[int] | np.ndarray, source: str | None = None) -> RawTable:
        """The table of rows ``rows`` (in that order)."""
        rows = [int(r) for r in rows]
        return RawTable({k: [v[r] for r in rows] for k, v in self.columns.items()},
                        [self.lines[r] for r in rows], source or self.source, self.unit,
                        dict(self.class_names), list(self.skipped))


def _is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def drop_incomplete(table: RawTable, required: Sequence[tuple[str, str]], *,
                    skip: bool) -> tuple[RawTable, int]:
    """Check that the table has every required ``(column, config field)`` and that no row has
    a missing or blank cell in one; such a row is an error naming file, line and column, or
    (``skip``) is dropped. Returns the table and the number of rows dropped."""
    cells = [(name, table.column(name, fld)) for name, fld in required]
    bad: list[int] = []
    earlier = table.skipped
    for i in range(len(table)):
        for name, values in cells:
            if _is_missing(values[i]):
                if not skip:
                    what = "has no field" if values[i] is None else "has an empty field"
                    raise DataError(f"{table.where(i)}: row {what} {name!r} (set data.bad_rows = "
                                    f"\"skip\" to skip such rows)")
                bad.append(i)
                break
    if not bad and not earlier:
        return table, 0
    lines = sorted(earlier + [table.lines[i] for i in bad])
    shown = ", ".join(map(str, lines[:10])) + (", ..." if len(lines) > 10 else "")
    log.warning("%s: skipped %d row(s) with a missing or empty field (%s %s)", table.source,
                len(lines), "lines" if table.unit == "line" else "rows", shown)
    bad_set = set(bad)
    out = table.select([i for i in range(len(table)) if i not in bad_set])
    out.skipped = []
    return out, len(lines)


def _open_text(path: Path):
    return path.open("r", encoding="utf-8-sig", newline="")


def infer_format(path: Path, fmt: str = "auto", delimiter: str | None = None) -> str:
    """``tsv``, ``csv`` or ``jsonl``: ``fmt`` if given, else from the file extension."""
    if fmt not in ("auto", *EXTENSIONS):
        raise ConfigError(f"data.format must be one of auto, tsv, csv, jsonl, parquet; got {fmt!r}")
    if fmt != "auto":
        return fmt
    ext = path.suffix.lower().lstrip(".")
    if ext in EXTENSIONS:
        return ext
    if ext == "json":
        return "jsonl"
    if delimiter is not None:
        return "tsv" if delimiter == "\t" else "csv"
    raise ConfigError(f"{path}: cannot tell the format from the extension {path.suffix!r}; "
                      f"set data.format (tsv, csv, jsonl or parquet) or data.delimiter")


def read_table(path: Path, *, fmt: str = "auto", header: bool = True,
               columns: Sequence[str] | None = None, delimiter: str | None = None,
               quotes: bool | None = None, skip_bad_rows: bool = False) -> RawTable:
    """Read one TSV/CSV/JSONL file into a table.

    TSV/CSV: the first line names the columns (``header``), or ``columns`` does, or they are
    named ``'0'``, ``'1'``, ... . The delimiter is a tab for TSV and a comma for CSV unless given;
    ``quotes`` (default: CSV yes, TSV no: SST-2 sentences hold unbalanced quotes) turns on
    double-quoted fields. A row with the wrong number of fields is an error naming the file and
    line, or is skipped (``skip_bad_rows``, counted in the log).

    Raises:
        DataError: unreadable, undecodable, empty or malformed file.
    """
    path = Path(path)
    fmt = infer_format(path, fmt, delimiter)
    try:
        if fmt == "jsonl":
            return _read_jsonl(path)
        if fmt == "parquet":
            return _read_parquet(path)
        sep = delimiter or ("\t" if fmt == "tsv" else ",")
        quoted = (fmt == "csv") if quotes is None else quotes
        return _read_delimited(path, sep, quoted, header, columns, skip_bad_rows)
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not valid UTF-8 text ({err.reason} at byte {err.start})") from None
    except csv.Error as err:
        raise DataError(f"{path}: malformed {fmt.upper()} file ({err})") from None
    except OSError as err:
        raise DataError(f"{path}: cannot read ({err.strerror or err})") from None


#: the largest csv.field_size_limit a C long holds everywhere
_FIELD_LIMIT_MAX = 2**31 - 1


def _allow_fields_of(path: Path) -> None:
    """No field of ``path`` is longer than the file: raise the csv module's limit (131,072
    characters by default) to the file's size, so a long field reads as it does from JSONL."""
    size = min(path.stat().st_size + 1, _FIELD_LIMIT_MAX)
    if size > csv.field_size_limit():
        csv.field_size_limit(size)


def _csv_rows(reader, path: Path, skip_bad_rows: bool, bad: list[int]):
    """``(first line, row)`` of each row; a row the csv module cannot parse is an error naming
    its line, or (``skip_bad_rows``) is recorded in ``bad`` and skipped."""
    previous = 0
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as err:
            if not skip_bad_rows:
                raise DataError(f"{path}, line {previous + 1}: malformed row ({err}); set "
                                f"data.bad_rows = \"skip\" to skip such rows") from None
            bad.append(previous + 1)
            previous = reader.line_num
            continue
        start, previous = previous + 1, reader.line_num
        yield start, row


def _read_delimited(path: Path, sep: str, quoted: bool, header: bool,
                    columns: Sequence[str] | None, skip_bad_rows: bool) -> RawTable:
    quoting = csv.QUOTE_MINIMAL if quoted else csv.QUOTE_NONE
    _allow_fields_of(path)
    with _open_text(path) as handle:
        reader = csv.reader(handle, delimiter=sep, quoting=quoting)
        rows: list[list[str]] = []
        lines: list[int] = []
        names: list[str] | None = None
        bad: list[int] = []
        for start, row in _csv_rows(reader, path, skip_bad_rows, bad):
            if not row:
                continue
            if names is None:
                if header:
                    names = [name.strip() for name in row]
                    repeated = sorted({n for i, n in enumerate(names) if n in names[:i]})
                    if repeated:
                        raise DataError(f"{path}, line {start}: header repeats column(s) "
                                        f"{repeated}: {names}")
                    continue
                names = list(columns) if columns else [str(i) for i in range(len(row))]
            if len(row) != len(names):
                if not skip_bad_rows:
                    raise DataError(f"{path}, line {start}: expected {len(names)} fields "
                                    f"({names}), found {len(row)}" + _bad_rows_hint(row, sep))
                bad.append(start)
                continue
            rows.append(row)
            lines.append(start)
    if names is None:
        what = "a header line and data rows" if header else "data rows"
        raise DataError(f"{path}: file is empty (expected {what})")
    cells = {name: [row[i] for row in rows] for i, name in enumerate(names)}
    return RawTable(cells, lines, str(path), skipped=bad)


def _bad_rows_hint(row: list[str], sep: str) -> str:
    if len(row) == 1 and sep not in row[0] and ("\t" in row[0] or "," in row[0]):
        other = "tab" if "\t" in row[0] else "comma"
        return f"; the line holds a {other}: set data.delimiter or data.format?"
    return ""


def _read_jsonl(path: Path) -> RawTable:
    records: list[dict[str, Any]] = []
    lines: list[int] = []
    for line_number, record in read_jsonl(path, DataError):
        records.append(record)
        lines.append(line_number)
    names: dict[str, None] = {}
    for record in records:
        names.update(dict.fromkeys(record))
    return RawTable({n: [r.get(n) for r in records] for n in names}, lines, str(path))


def _read_parquet(path: Path) -> RawTable:
    """A Parquet file's rows (cells as Python values: a list column stays a list); row numbers
    (1-based) name rows in messages."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, ValueError) as err:
        raise DataError(f"{path}: not a readable Parquet file ({err})") from None
    columns = {name: table.column(name).to_pylist() for name in table.column_names}
    return RawTable(columns, list(range(1, table.num_rows + 1)), str(path), unit="row")
