"""Read users' data as they have it: TSV/CSV (with or without a header line), JSONL, or a hub
dataset, into tables; turn tables into labelled classification splits.

Two layers:

* :class:`RawTable` is one split as read: every column's cells in row order and the file line
  (or hub row) of each row, for messages. :func:`load_tables` returns the train/dev/test tables
  of a :class:`~fedslice.config.DataConfig`: a folder of split files, one file with a split
  column, or a train file alone (dev/test are then carved off train by a seeded fraction).
* :class:`RawSplit` is a classification split: text tuples and integer label ids. Labels may be
  ids (``0``, ``1``, ...) or names (``World``, ``Sports``): names are mapped to ids in sorted
  order of the train split, or in the order of ``data.labels``.

Every problem with the data raises :class:`~fedslice.errors.DataError` naming the file, line,
column and value involved; a missing column also names the config field that asked for it.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from fedslice.errors import ConfigError, DataError

if TYPE_CHECKING:
    from fedslice.config import DataConfig

log = logging.getLogger(__name__)

FileFormat = Literal["auto", "tsv", "csv", "jsonl"]

#: File extensions looked for, in this order, when ``file_format="auto"``.
EXTENSIONS: tuple[str, ...] = ("tsv", "csv", "jsonl")

#: Split names, and the file stems / split-column values accepted for each.
SPLIT_NAMES: dict[str, tuple[str, ...]] = {
    "train": ("train",),
    "dev": ("dev", "validation", "valid", "val"),
    "test": ("test",),
}

#: Hub ids for short dataset names when no local folder of that name exists. GLUE's SST-2 test
#: split has no labels: its validation split is our test, and dev is carved off train (a dev
#: equal to test would tune on the test set).
HUB_ALIASES = {"sst2": ("glue", "sst2", {"train": "train", "test": "validation"})}

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?")


#: Where a system keeps data sets its package manager installed (Debian: dataset-fashion-mnist
#: installs /usr/share/datasets/fashion-mnist/), looked at last.
SYSTEM_DATA_DIRS: tuple[Path, ...] = (Path("/usr/share/datasets"),)


def data_search_dirs() -> list[Path]:
    """Where relative data paths are looked up: $FEDSLICE_DATA_DIR, ., ../shared/data,
    ../shared/data beside the source checkout, then the system's data folders
    (:data:`SYSTEM_DATA_DIRS`)."""
    dirs = [Path(os.environ["FEDSLICE_DATA_DIR"])] if os.environ.get("FEDSLICE_DATA_DIR") else []
    repo = Path(__file__).resolve().parents[3]
    return dirs + [Path.cwd(), Path.cwd().parent / "shared" / "data", repo.parent / "shared" / "data",
                   *SYSTEM_DATA_DIRS]


# --------------------------------------------------------------------------- tables


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


# --------------------------------------------------------------------------- file readers


def _open_text(path: Path):
    return path.open("r", encoding="utf-8-sig", newline="")


def infer_format(path: Path, fmt: str = "auto", delimiter: str | None = None) -> str:
    """``tsv``, ``csv`` or ``jsonl``: ``fmt`` if given, else from the file extension."""
    if fmt not in ("auto", *EXTENSIONS):
        raise ConfigError(f"data.format must be one of auto, tsv, csv, jsonl; got {fmt!r}")
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
                      f"set data.format (tsv, csv or jsonl) or data.delimiter")


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
        sep = delimiter or ("\t" if fmt == "tsv" else ",")
        quoted = (fmt == "csv") if quotes is None else quotes
        return _read_delimited(path, sep, quoted, header, columns, skip_bad_rows)
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not valid UTF-8 text ({err.reason} at byte {err.start})") from None
    except csv.Error as err:
        raise DataError(f"{path}: malformed {fmt.upper()} file ({err})") from None
    except OSError as err:
        raise DataError(f"{path}: cannot read ({err.strerror or err})") from None


def _read_delimited(path: Path, sep: str, quoted: bool, header: bool,
                    columns: Sequence[str] | None, skip_bad_rows: bool) -> RawTable:
    quoting = csv.QUOTE_MINIMAL if quoted else csv.QUOTE_NONE
    with _open_text(path) as handle:
        reader = csv.reader(handle, delimiter=sep, quoting=quoting)
        rows: list[list[str]] = []
        lines: list[int] = []
        names: list[str] | None = None
        bad: list[int] = []
        previous = 0
        for row in reader:
            start, previous = previous + 1, reader.line_num
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
            records.append(record)
            lines.append(line_number)
    names: dict[str, None] = {}
    for record in records:
        names.update(dict.fromkeys(record))
    return RawTable({n: [r.get(n) for r in records] for n in names}, lines, str(path))


# --------------------------------------------------------------------------- sources


def _looks_like_path(text: str) -> bool:
    return (
        text.startswith((".", "~", "/"))
        or "\\" in text
        or text.count("/") > 1
        or (os.sep != "/" and os.sep in text)
    )


def resolve_source(path_or_id: str, base_dirs: Sequence[Path], *,
                   allow_file: bool = False) -> Path | str:
    """Decide whether a data reference is a local folder (or file) or a Hugging Face Hub id.

    An existing folder wins: absolute paths are used as they are, relative ones are tried
    against each of ``base_dirs`` in order (the current directory if none are given).
    Otherwise ``"name"`` or ``"name/subset"`` (e.g. ``"glue/sst2"``) is returned unchanged
    as a hub id. With ``allow_file`` an existing file is returned too.

    Raises:
        DataError: the string looks like a path but no such folder exists, it names a file
            (without ``allow_file``), or it is neither a path nor a valid hub id.
    """
    text = str(path_or_id).strip()
    if not text:
        raise DataError("data source is empty: give a local folder or a hub id like 'glue/sst2'")
    candidates = _candidate_paths(text, base_dirs)
    for candidate in candidates:
        if candidate.is_dir() or (allow_file and candidate.is_file()):
            return candidate.resolve()
        if candidate.exists():
            raise DataError(
                f"data path {candidate} is a file; give the folder holding train/dev/test files"
            )
    names_a_file = allow_file and Path(text).suffix.lower().lstrip(".") in (*EXTENSIONS, "json", "txt")
    if _looks_like_path(text) or not _HUB_ID.match(text) or names_a_file:
        looked = ", ".join(str(c) for c in candidates)
        raise DataError(f"data path {text!r} does not exist (looked at: {looked})")
    return text


def _candidate_paths(text: str, base_dirs: Sequence[Path]) -> list[Path]:
    path = Path(text).expanduser()
    if path.is_absolute():
        return [path]
    bases = list(base_dirs) or [Path.cwd()]
    names = [path]
    if len(path.parts) == 1 and ("_" in text or "-" in text):  # fashion_mnist ~ fashion-mnist
        names += [Path(text.replace("_", "-")), Path(text.replace("-", "_"))]
    return list(dict.fromkeys(Path(base) / name for base in bases for name in names))


def find_split_files(folder: Path, file_format: FileFormat = "auto",
                     splits: Sequence[str] = ("train", "dev", "test")) -> dict[str, Path]:
    """The file of each split present in ``folder`` (``train.tsv``, ``dev.csv``,
    ``validation.jsonl``, ...); a split with several candidate files is an error."""
    extensions = EXTENSIONS if file_format == "auto" else (file_format,)
    found: dict[str, Path] = {}
    for split in splits:
        stems = SPLIT_NAMES.get(split, (split,))
        candidates = [folder / f"{stem}.{ext}" for stem in stems for ext in extensions]
        present = [p for p in candidates if p.is_file()]
        if len(present) > 1:
            names = ", ".join(p.name for p in present)
            raise DataError(f"{folder}: several files for split {split!r} ({names}); "
                            f"keep one or set the file format")
        if present:
            found[split] = present[0]
    return found


def _missing_split_error(folder: Path, split: str, file_format: FileFormat) -> DataError:
    extensions = EXTENSIONS if file_format == "auto" else (file_format,)
    expected = " or ".join(f"{split}.{ext}" for ext in extensions)
    present = sorted(p.name for p in folder.iterdir() if p.is_file())
    return DataError(f"{folder}: no file for split {split!r} (expected {expected}); "
                     f"files found: {present or 'none'}")


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


def hub_table(dataset: Any, source: str) -> RawTable:
    data = dataset.to_dict()
    n = len(dataset)
    names: dict[str, list[str]] = {}
    for name, feature in getattr(dataset, "features", {}).items():
        if hasattr(feature, "names") and hasattr(feature, "str2int"):  # datasets.ClassLabel
            names[name] = list(feature.names)
    return RawTable({c: list(v) for c, v in data.items()}, list(range(n)), source, "row", names)


def hub_split_map(source: str, subset: str | None) -> tuple[str, str | None, dict[str, str]]:
    """``(dataset id, subset, {our split: hub split})`` of a hub reference."""
    if source in HUB_ALIASES:
        return HUB_ALIASES[source]
    dataset_id, _, rest = source.partition("/")
    return dataset_id, subset or rest or None, {"train": "train", "dev": "validation",
                                               "test": "test"}


def load_hub_tables(dataset_id: str, *, subset: str | None,
                    split_map: Mapping[str, str]) -> dict[str, RawTable]:
    """Tables of hub splits (``{our split: hub split}``; a hub split used twice is loaded once)."""
    loaded: dict[str, RawTable] = {}
    result: dict[str, RawTable] = {}
    for ours, theirs in split_map.items():
        if theirs not in loaded:
            dataset = _load_hub_split(dataset_id, subset, theirs)
            loaded[theirs] = hub_table(dataset, f"{dataset_id}{'/' + subset if subset else ''}"
                                                 f":{theirs}")
        result[ours] = loaded[theirs]
    return result


# --------------------------------------------------------------------------- carving


def carve(table: RawTable, counts: Mapping[str, float], seed: int,
          group_column: str | None = None) -> dict[str, RawTable]:
    """Split ``table`` into ``{"train": rest, name: about fraction * len rows, ...}`` by a seeded
    permutation of its rows (or of its groups: rows sharing a ``group_column`` value stay
    together). Each part keeps the file order of its rows."""
    n = len(table)
    if group_column is not None:
        keys = table.column(group_column, "data.group_column")
        index: dict[Any, int] = {}
        groups = np.array([index.setdefault(_hashable(k), len(index)) for k in keys], dtype=np.int64)
        num_groups = len(index)
    else:
        groups, num_groups = np.arange(n, dtype=np.int64), n
    if num_groups < len(counts) + 1:
        what = f"groups of {group_column!r}" if group_column else "rows"
        raise DataError(f"{table.source}: {num_groups} {what} cannot be split into train and "
                        f"{'/'.join(counts)}; give dev/test files")
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5EED]))
    sizes = np.bincount(groups, minlength=num_groups)
    assign = np.full(num_groups, -1, dtype=np.int64)  # -1: train
    order = iter(rng.permutation(num_groups).tolist())
    left = num_groups
    for part, fraction in enumerate(counts.values()):
        target, taken = max(1, round(fraction * n)), 0
        # Whole groups in permuted order until the part has its share (>= 1 group; train keeps
        # at least one group per part still to fill, plus one).
        while (taken < target or taken == 0) and left > len(counts) - part:
            g = next(order)
            assign[g], taken, left = part, taken + int(sizes[g]), left - 1
    row_part = assign[groups]
    out = {"train": table.select(np.flatnonzero(row_part == -1))}
    for part, name in enumerate(counts):
        out[name] = table.select(np.flatnonzero(row_part == part),
                                 f"{table.source} [{name}: carved off, seed {seed}]")
    return out


def _hashable(value: Any) -> Any:
    return json.dumps(value, sort_keys=True) if isinstance(value, (list, dict)) else value


# --------------------------------------------------------------------------- data config -> tables


#: The text column used when ``data.text_columns`` is unset, in order of preference.
DEFAULT_TEXT_COLUMNS = ("sentence", "text")


def default_text_columns(d: DataConfig, columns: Sequence[str], source: str) -> list[str]:
    """``data.text_columns``, or when unset the column to read: ``sentence`` if the data has it,
    else ``text``, else its one column besides the label, split and group columns. Ambiguous
    (several other columns) or none: a ConfigError listing the columns."""
    if d.text_columns is not None:
        return list(d.text_columns)
    for name in DEFAULT_TEXT_COLUMNS:
        if name in columns:
            return [name]
    taken = {d.label_column, d.split_column, d.group_column}
    rest = [c for c in columns if c not in taken]
    if len(rest) == 1:
        return rest
    why = "several columns could be the text" if rest else "no column is left for the text"
    raise ConfigError(f"data.text_columns is not set and {source} has no 'sentence' or 'text' "
                      f"column; {why} (columns: {list(columns)}, label column "
                      f"{d.label_column!r}): set data.text_columns, e.g. text_columns = "
                      f"[{(rest or list(columns) or ['...'])[0]!r}]")


def resolve_text_columns(d: DataConfig, columns: Sequence[str], source: str) -> DataConfig:
    """``d`` with ``text_columns`` set (:func:`default_text_columns`; logged when chosen)."""
    if d.text_columns is not None:
        return d
    chosen = default_text_columns(d, columns, source)
    log.info("data: text column %r (data.text_columns is not set; columns of %s: %s)",
             chosen[0], source, list(columns))
    return d.model_copy(update={"text_columns": chosen})


def load_tables(d: DataConfig, seed: int = 0,
                required: Sequence[tuple[str, str]] | None = None,
                carve_missing: bool = True) -> dict[str, RawTable]:
    """The train/dev/test tables of a data config.

    ``d.path`` is a folder (``train``/``dev``/``test`` files; ``validation``/``valid``/``val``
    also name dev), one file (with ``d.split_column``, or train alone), or a hub id. Missing dev
    and/or test splits are carved off train, each ``d.holdout_fraction`` of its rows, seeded by
    ``seed`` (grouped by ``d.group_column`` if set); the log says so, with counts.

    ``required`` lists ``(column, config field)`` pairs every split must have, with no missing
    or blank cells (rows with one are errors, or skipped with ``d.bad_rows = "skip"``); default:
    the text and label columns. ``carve_missing=False``: only the splits the data has (one file without
    ``split_column``: its rows as ``train``), nothing carved.
    """
    source = resolve_source(d.path, data_search_dirs(), allow_file=True)
    read = dict(fmt=d.format, header=d.header, columns=d.columns, delimiter=d.delimiter,
                quotes=d.quotes, skip_bad_rows=d.bad_rows == "skip")
    if isinstance(source, str):
        dataset_id, subset, split_map = hub_split_map(source, d.hub_subset)
        if source in HUB_ALIASES:
            log.warning("data: %r is not a local folder: using the hub dataset %s/%s (needs "
                        "network), its %s", source, dataset_id, subset, ", ".join(
                            f"{hub} split as {ours}" for ours, hub in split_map.items()))
        tables = load_hub_tables(dataset_id, subset=subset, split_map=split_map)
    elif source.is_file():
        table = read_table(source, **read)
        if d.split_column is not None:
            table, _ = drop_incomplete(table, [(d.split_column, "data.split_column")],
                                       skip=d.bad_rows == "skip")
            tables = by_split_column(table, d.split_column)
        else:
            tables = {"train": table}
    else:
        if d.split_column is not None:
            raise ConfigError(f"data.split_column = {d.split_column!r} needs data.path to be one "
                              f"file, but {source} is a folder")
        files = find_split_files(source, d.format)
        if "train" not in files:
            raise _missing_split_error(source, "train", d.format)
        tables = {split: read_table(path, **read) for split, path in files.items()}
    if required is None:
        first = tables["train"] if "train" in tables else next(iter(tables.values()))
        cols = default_text_columns(d, list(first.columns), first.source)
        required = [(c, "data.text_columns") for c in cols]
        required.append((d.label_column, "data.label_column"))
    required = list(required)
    if d.group_column is not None:
        required.append((d.group_column, "data.group_column"))
    return check_and_carve(tables, d, seed, required, source, carve_missing)


def check_and_carve(tables: Mapping[str, RawTable], d: DataConfig, seed: int,
                    required: Sequence[tuple[str, str]], source: Path | str,
                    carve_missing: bool = True) -> dict[str, RawTable]:
    """Check every split (not empty; ``required`` columns present and filled, per
    ``d.bad_rows``) and carve the missing dev/test splits off train (see :func:`load_tables`;
    ``carve_missing=False``: only the splits the data has)."""
    checked: dict[str, RawTable] = {}
    for split, table in tables.items():
        if not len(table):
            raise DataError(f"{table.source}: no data rows")
        checked[split], _ = drop_incomplete(table, required, skip=d.bad_rows == "skip")
        if not len(checked[split]):
            raise DataError(f"{table.source}: no complete data rows (every row was skipped)")
    missing = [s for s in ("dev", "test") if s not in checked]
    if not carve_missing:
        return {s: checked[s] for s in ("train", "dev", "test") if s in checked}
    if missing:
        train = checked["train"]
        parts = carve(train, {s: d.holdout_fraction for s in missing}, seed, d.group_column)
        checked.update(parts)
        carved = ", ".join(f"{s} ({len(parts[s])} rows)" for s in missing)
        grouped = f", rows sharing {d.group_column!r} kept together" if d.group_column else ""
        log.info("data: no %s split in %s: carved %s off train (data.holdout_fraction = %g each, "
                 "seed %d%s); train keeps %d of %d rows", "/".join(missing), source, carved,
                 d.holdout_fraction, seed, grouped, len(parts["train"]), len(train))
    return {s: checked[s] for s in ("train", "dev", "test")}


def by_split_column(table: RawTable, column: str) -> dict[str, RawTable]:
    values = table.column(column, "data.split_column")
    ours = {alias: split for split, aliases in SPLIT_NAMES.items() for alias in aliases}
    rows: dict[str, list[int]] = {}
    for i, value in enumerate(values):
        split = ours.get(str(value).strip().lower())
        if split is None:
            raise DataError(f"{table.where(i)}: split {value!r} in column {column!r} (set by "
                            f"data.split_column) is not one of {sorted(ours)}")
        rows.setdefault(split, []).append(i)
    if "train" not in rows:
        raise DataError(f"{table.source}: no row has split 'train' in column {column!r}")
    return {split: table.select(idx, f"{table.source} [{split}]") for split, idx in rows.items()}


# --------------------------------------------------------------------------- classification


@dataclass
class RawSplit:
    """One labelled split, before tokenization.

    Attributes:
        texts: one tuple per example: ``(sentence,)`` or ``(sentence_a, sentence_b)``.
        labels: one integer class id (``>= 0``) per example.
        source: where the split came from (file path or ``hub-id:split``), for messages.
        label_names: the name of each class id, when the data has names.
    """

    texts: list[tuple[str, ...]]
    labels: list[int]
    source: str
    label_names: list[str] | None = None
    #: the columns ``texts`` were read from
    text_columns: list[str] | None = None

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def is_pair(self) -> bool:
        """Whether the examples are sentence pairs."""
        return bool(self.texts) and len(self.texts[0]) == 2


def _check_text_columns(text_columns: Sequence[str]) -> list[str]:
    columns = list(text_columns)
    if len(columns) not in (1, 2) or not all(isinstance(c, str) and c for c in columns):
        raise ConfigError(
            f"text_columns must name 1 column (single sentence) or 2 columns (sentence pair), "
            f"got {columns!r}"
        )
    return columns


def _label_kind(value: Any) -> str:
    """``int`` (a class id, maybe negative), ``float`` (a non-integer number), ``name`` or
    ``bad`` (booleans, nulls, lists)."""
    if isinstance(value, bool) or value is None or isinstance(value, (list, dict)):
        return "bad"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "int" if value.is_integer() else "float"
    text = str(value).strip()
    if _INT.fullmatch(text):
        return "int"
    return "float" if _FLOAT.fullmatch(text) else "name"


_NEGATIVE_HINT = " (GLUE test splits are unlabelled (-1); evaluate on the validation split)"


def label_ids(tables: Mapping[str, RawTable], label_column: str,
              labels: Sequence[str] | None = None) -> tuple[dict[str, list[int]], list[str] | None]:
    """Map the label cells of each table to class ids; return ``({split: ids}, names)``.

    * ``labels`` given: cells are class names looked up there (or, if every cell is an integer
      and no name is, ids into it).
    * integer cells (``0``, ``"3"``) everywhere: they are the ids; names from the source if it
      declares them (hub ``ClassLabel``), else ``None``.
    * names: ids in sorted order of the names in the ``train`` table; a dev/test name that train
      lacks is an error naming it and its row.
    """
    cells = {s: t.column(label_column, "data.label_column") for s, t in tables.items()}
    kinds = {s: [_label_kind(v) for v in c] for s, c in cells.items()}
    for s, ks in kinds.items():
        if "bad" in ks:
            i = ks.index("bad")
            raise DataError(f"{tables[s].where(i)}: label {cells[s][i]!r} is not an integer "
                            f"or a class name")
    if labels is not None:
        names = [str(x) for x in labels]
        if any(_INT.fullmatch(n.strip()) for n in names) or not all(
                k == "int" for ks in kinds.values() for k in ks):
            index = {n.strip(): i for i, n in enumerate(names)}
            return {s: _lookup(tables[s], c, index, f"is not one of data.labels = {names}")
                    for s, c in cells.items()}, names
        ids = {s: _int_ids(tables[s], c) for s, c in cells.items()}
        for s, values in ids.items():
            for i, v in enumerate(values):
                if v >= len(names):
                    raise DataError(f"{tables[s].where(i)}: label {v} is not an id into "
                                    f"data.labels = {names} ({len(names)} classes)")
        return ids, names
    first = "train" if "train" in tables else next(iter(tables))
    all_int = all(k == "int" for ks in kinds.values() for k in ks)
    if all_int:
        ids = {s: _int_ids(tables[s], c) for s, c in cells.items()}
        declared = tables[first].class_names.get(label_column)
        return ids, (list(declared) if declared else None)
    for s, ks in kinds.items():
        if "float" in ks:
            i = ks.index("float")
            raise DataError(f"{tables[s].where(i)}: label {cells[s][i]!r} is a number but not an "
                            f"integer class id (regression targets are not supported; list the "
                            f"class names in data.labels to use such values as names)")
    train_kinds = kinds[first]
    if "int" in train_kinds and "name" in train_kinds:
        i, j = train_kinds.index("name"), train_kinds.index("int")
        raise DataError(f"{tables[first].where(i)}: label {cells[first][i]!r} is not an integer "
                        f"like label {cells[first][j]!r} at {tables[first].unit} "
                        f"{tables[first].lines[j]}; to use every label as a class name, list "
                        f"them in data.labels")
    names = sorted({str(v).strip() for v in cells[first]})
    index = {n: i for i, n in enumerate(names)}
    return {s: _lookup(tables[s], c, index, f"does not occur in the train split "
                                            f"(train labels: {names}); list every class in "
                                            f"data.labels")
            for s, c in cells.items()}, names


def _lookup(table: RawTable, cells: list[Any], index: Mapping[str, int], why: str) -> list[int]:
    out = []
    for i, value in enumerate(cells):
        found = index.get(str(value).strip())
        if found is None:
            raise DataError(f"{table.where(i)}: label {value!r} {why}")
        out.append(found)
    return out


def _int_ids(table: RawTable, cells: list[Any]) -> list[int]:
    out = []
    for i, value in enumerate(cells):
        label = int(value) if not isinstance(value, str) else int(value.strip())
        if label < 0:
            raise DataError(f"{table.where(i)}: label {label} is negative; labels must be >= 0"
                            + _NEGATIVE_HINT)
        out.append(label)
    return out


def tables_to_splits(tables: Mapping[str, RawTable], *, text_columns: Sequence[str],
                     label_column: str, labels: Sequence[str] | None = None) -> dict[str, RawSplit]:
    """Classification splits of tables: text tuples from ``text_columns`` (one, or two for
    sentence pairs) and class ids from ``label_column`` (see :func:`label_ids`)."""
    columns = _check_text_columns(text_columns)
    for table in tables.values():
        for c in columns:
            table.column(c, "data.text_columns")
        table.column(label_column, "data.label_column")
    ids, names = label_ids(tables, label_column, labels)
    out = {}
    for split, table in tables.items():
        texts = list(zip(*[table.text_column(c) for c in columns]))
        out[split] = RawSplit(texts=texts, labels=ids[split], source=table.source,
                              label_names=names, text_columns=columns)
    return out


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
    columns = _check_text_columns(text_columns)
    if file_format not in ("auto", *EXTENSIONS):
        raise ConfigError(f"file_format must be one of auto, tsv, csv, jsonl; got {file_format!r}")
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"data folder {folder} does not exist or is not a directory")
    files = find_split_files(folder, file_format, splits)
    tables = {}
    for split in splits:
        if split not in files:
            raise _missing_split_error(folder, split, file_format)
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
    columns = _check_text_columns(text_columns)
    tables = load_hub_tables(dataset_id, subset=subset, split_map=split_map)
    return tables_to_splits(tables, text_columns=columns, label_column=label_column)


def num_labels(splits: Mapping[str, RawSplit] | Iterable[RawSplit]) -> int:
    """Number of classes: the number of label names if the splits have them, else the largest
    label across all splits, plus one."""
    values = list(splits.values() if isinstance(splits, Mapping) else splits)
    highest = max((max(s.labels) for s in values if s.labels), default=None)
    if highest is None:
        raise DataError("cannot count labels: all splits are empty")
    names = next((s.label_names for s in values if s.label_names), None)
    return max(len(names), highest + 1) if names else highest + 1
