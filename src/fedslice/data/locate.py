"""From a data config to the train/dev/test tables (:func:`load_tables`): a folder of split files,
one file with a split column, a train file alone (dev/test are then carved off train by a seeded
fraction: :func:`carve`), or a hub dataset; relative paths are looked up in
:func:`data_search_dirs`. A missing column names the config field that asked for it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedslice.data.tables import EXTENSIONS, FileFormat, RawTable, drop_incomplete, read_table
from fedslice.errors import ConfigError, DataError
from fedslice.paths import cache_root

if TYPE_CHECKING:
    from fedslice.config import DataConfig


log = logging.getLogger(__name__)

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


#: Where a system keeps data sets its package manager installed (Debian: dataset-fashion-mnist
#: installs /usr/share/datasets/fashion-mnist/), looked at last.
SYSTEM_DATA_DIRS: tuple[Path, ...] = (Path("/usr/share/datasets"),)


def data_search_dirs() -> list[Path]:
    """Where relative data paths are looked up: $FEDSLICE_DATA_DIR, ., ../shared/data,
    ../shared/data beside the source checkout, the cache's ``data`` folder (where the builders
    under bench/data write what they fetch: ~/.cache/fedslice/data), then the system's data
    folders (:data:`SYSTEM_DATA_DIRS`)."""
    dirs = [Path(os.environ["FEDSLICE_DATA_DIR"])] if os.environ.get("FEDSLICE_DATA_DIR") else []
    repo = Path(__file__).resolve().parents[3]
    cache = cache_root()
    return dirs + [Path.cwd(), Path.cwd().parent / "shared" / "data", repo.parent / "shared" / "data",
                   *([cache / "data"] if cache is not None else []), *SYSTEM_DATA_DIRS]


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


def missing_split_error(folder: Path, split: str, file_format: FileFormat) -> DataError:
    extensions = EXTENSIONS if file_format == "auto" else (file_format,)
    expected = " or ".join(f"{split}.{ext}" for ext in extensions)
    present = sorted(p.name for p in folder.iterdir() if p.is_file())
    return DataError(f"{folder}: no file for split {split!r} (expected {expected}); "
                     f"files found: {present or 'none'}")


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


#: The text column used when ``data.text_columns`` is unset, in order of preference.
DEFAULT_TEXT_COLUMNS = ("sentence", "text")


def default_text_columns(d: DataConfig, columns: Sequence[str], source: str) -> list[str]:
    """``data.text_columns``, or when unset the column to read: ``sentence`` if the data has it,
    else ``text``, else its one column besides the label, split, group and client columns. Ambiguous
    (several other columns) or none: a ConfigError listing the columns."""
    if d.text_columns is not None:
        return list(d.text_columns)
    for name in DEFAULT_TEXT_COLUMNS:
        if name in columns:
            return [name]
    taken = {d.label_column, d.split_column, d.group_column, d.client_column}
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
            raise missing_split_error(source, "train", d.format)
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
