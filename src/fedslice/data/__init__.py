"""Data: load labelled text splits, partition them among clients, tokenize and batch them.

Typical flow::

    source = resolve_source(cfg_path, base_dirs)            # Path (local) or "glue/sst2" (hub)
    splits = load_local_splits(source, text_columns=["sentence"], label_column="label")
    rows = sample_rows(len(splits["train"]), max_rows, seed)  # optional quick-run subset
    parts = partition_indices(train_labels, num_partitions=10, scheme="dirichlet", seed=0)
    train = cache.get(splits["train"], "train", tokenizer, max_length=128)
    for batch in iter_batches(train, parts[client], 32, shuffle=True, generator=g): ...
"""

from fedslice.data.batching import (
    TokenCache,
    TokenizedSplit,
    collate,
    iter_batches,
    num_batches,
    tokenize_split,
)
from fedslice.data.loading import (
    RawSplit,
    load_hub_splits,
    load_local_splits,
    num_labels,
    resolve_source,
)
from fedslice.data.partition import (
    SCHEMES,
    partition_indices,
    partition_report,
    sample_rows,
)

__all__ = [
    "SCHEMES",
    "RawSplit",
    "TokenCache",
    "TokenizedSplit",
    "collate",
    "iter_batches",
    "load_hub_splits",
    "load_local_splits",
    "num_batches",
    "num_labels",
    "partition_indices",
    "partition_report",
    "resolve_source",
    "sample_rows",
    "tokenize_split",
]
