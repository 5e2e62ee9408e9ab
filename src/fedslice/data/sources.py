"""An experiment's classification data from its data config: tables read by
:func:`~fedslice.data.locate.load_tables` (local files or the hub, dev/test carved off train
when missing), turned into labelled splits with string labels mapped to ids."""

from __future__ import annotations

from fedslice.config import DataConfig
from fedslice.data.labels import RawSplit, num_labels, tables_to_splits
from fedslice.data.locate import HUB_ALIASES, data_search_dirs, load_tables, resolve_text_columns
from fedslice.errors import DataError

__all__ = ["HUB_ALIASES", "data_search_dirs", "load_raw_splits"]


def load_raw_splits(d: DataConfig, seed: int = 0, carve_missing: bool = True) -> dict[str, RawSplit]:
    """The train/dev/test classification splits of a data config (``seed`` carves missing
    dev/test splits off train). Label names, if any, are on every split's ``label_names``; the
    text columns read (``data.text_columns``, or the default one) on its ``text_columns``."""
    tables = load_tables(d, seed, carve_missing=carve_missing)
    first = next(iter(tables.values()))  # train (or the first split the data has)
    d = resolve_text_columns(d, list(first.columns), first.source)
    splits = tables_to_splits(tables, text_columns=d.text_columns, label_column=d.label_column,
                              labels=d.labels)
    if carve_missing and num_labels(splits) < 2:
        train = splits["train"]
        only = train.label_names[0] if train.label_names else train.labels[0]
        raise DataError(f"{train.source}: every label is {only!r} ({d.label_column!r}, set by "
                        f"data.label_column): a classifier needs at least two classes")
    return splits
