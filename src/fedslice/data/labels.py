"""Tables into labelled classification splits (:class:`RawSplit`: text tuples and integer label
ids). Labels may be ids (``0``, ``1``, ...) or names (``World``, ``Sports``): names are mapped to
ids in sorted order of the train split, or in the order of ``data.labels``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fedslice.data.tables import RawTable
from fedslice.errors import ConfigError, DataError

_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?")


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


def check_text_columns(text_columns: Sequence[str]) -> list[str]:
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
    columns = check_text_columns(text_columns)
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


def num_labels(splits: Mapping[str, RawSplit] | Iterable[RawSplit]) -> int:
    """Number of classes: the number of label names if the splits have them, else the largest
    label across all splits, plus one."""
    values = list(splits.values() if isinstance(splits, Mapping) else splits)
    highest = max((max(s.labels) for s in values if s.labels), default=None)
    if highest is None:
        raise DataError("cannot count labels: all splits are empty")
    names = next((s.label_names for s in values if s.label_names), None)
    return max(len(names), highest + 1) if names else highest + 1
