"""Data: load labelled text splits, partition them among clients, tokenize and batch them.

Reading (:mod:`.tables`: one file into a table; :mod:`.locate`: a data config into the
train/dev/test tables; :mod:`.labels`: tables into labelled splits; :mod:`.images`: image
sources), then :mod:`.batching` (tokenize once, batch) and :mod:`.partition`. Typical flow::

    tables = load_tables(cfg.data, seed)                    # train/dev/test RawTable (files or hub)
    splits = tables_to_splits(tables, text_columns=["sentence"], label_column="label")
    rows = sample_rows(len(splits["train"]), max_rows, seed)  # optional quick-run subset
    parts = partition_indices(train_labels, num_partitions=10, scheme="dirichlet", seed=0)
    train = cache.get(splits["train"], "train", tokenizer, max_length=128)
    for batch in iter_batches(train, parts[client], 32, shuffle=True, generator=g): ...
"""

from fedslice.data.batching import (
    TokenCache,
    TokenizedSplit,
    collate,
    data_sources,
    iter_batches,
    num_batches,
    tokenize_split,
)
from fedslice.data.labels import RawSplit, num_labels, tables_to_splits
from fedslice.data.locate import load_tables, resolve_source
from fedslice.data.tables import RawTable, read_table
from fedslice.data.partition import (
    SCHEMES,
    partition_indices,
    partition_report,
    sample_rows,
)

__all__ = [
    "data_sources",
    "SCHEMES",
    "RawSplit",
    "RawTable",
    "TokenCache",
    "TokenizedSplit",
    "collate",
    "iter_batches",
    "load_tables",
    "num_batches",
    "num_labels",
    "partition_indices",
    "partition_report",
    "read_table",
    "resolve_source",
    "sample_rows",
    "tables_to_splits",
    "tokenize_split",
]
