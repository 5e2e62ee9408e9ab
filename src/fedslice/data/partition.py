"""Split a training set among federated clients with Flower Datasets partitioners.

:func:`partition_indices` runs a ``flwr_datasets`` partitioner (IID, Dirichlet label skew, or
label shards) over the labels only and returns, per client, the sorted row indices into the
split. All schemes are deterministic given ``seed``. :func:`partition_report` summarises the
result (sizes, empty clients, label histograms) for logs and run records.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from fedslice.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

Scheme = Literal["iid", "dirichlet", "shards"]
SCHEMES: tuple[str, ...] = ("iid", "dirichlet", "shards")


def _check_arguments(
    scheme: str, num_partitions: int, alpha: float, shards_per_partition: int, min_size: int
) -> None:
    if scheme not in SCHEMES:
        raise ConfigError(f"partition scheme must be one of {list(SCHEMES)}, got {scheme!r}")
    if not isinstance(num_partitions, int) or num_partitions < 1:
        raise ConfigError(f"num_partitions must be a positive integer, got {num_partitions!r}")
    if scheme == "dirichlet" and not alpha > 0:
        raise ConfigError(f"dirichlet alpha must be > 0, got {alpha!r}")
    if scheme == "shards" and (
        not isinstance(shards_per_partition, int) or shards_per_partition < 1
    ):
        raise ConfigError(
            f"shards_per_partition must be a positive integer, got {shards_per_partition!r}"
        )
    if not isinstance(min_size, int) or min_size < 0:
        raise ConfigError(f"min_partition_size must be an integer >= 0, got {min_size!r}")


def _labels_array(labels: Sequence[int]) -> np.ndarray:
    array = np.asarray(labels)
    if array.ndim != 1 or array.size == 0:
        raise DataError("cannot partition: the label list is empty")
    if not np.issubdtype(array.dtype, np.integer) or array.min() < 0:
        raise DataError("cannot partition: labels must be integers >= 0")
    return array.astype(np.int64)


def _check_feasible(scheme: str, n_rows: int, num_partitions: int, shards: int) -> None:
    if num_partitions > n_rows:
        raise DataError(
            f"cannot split {n_rows} rows into {num_partitions} partitions: "
            f"use at most {n_rows} partitions"
        )
    if scheme == "shards" and num_partitions * shards > n_rows:
        raise DataError(
            f"cannot cut {n_rows} rows into {num_partitions} partitions x {shards} shards: "
            f"reduce num_partitions or shards_per_partition"
        )


def _make_partitioner(
    scheme: str, num_partitions: int, seed: int, alpha: float, shards: int, min_size: int
) -> Any:
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner, ShardPartitioner

    if scheme == "iid":
        return IidPartitioner(num_partitions=num_partitions)
    if scheme == "dirichlet":
        return DirichletPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            alpha=float(alpha),
            min_partition_size=min_size,
            self_balancing=False,
            seed=seed,
        )
    return ShardPartitioner(
        num_partitions=num_partitions,
        partition_by="label",
        num_shards_per_partition=shards,
        seed=seed,
    )


def _label_dataset(labels: np.ndarray, scheme: str, seed: int) -> Any:
    """A ``datasets.Dataset`` with columns ``label`` and ``_idx`` (the original row index).

    IidPartitioner cuts contiguous blocks without shuffling, and data files are often sorted
    by label, so for IID the rows are permuted with ``seed`` first.
    """
    import datasets

    order = np.arange(len(labels), dtype=np.int64)
    if scheme == "iid":
        order = np.random.default_rng(seed).permutation(order)
    return datasets.Dataset.from_dict({"label": labels[order], "_idx": order})


def _load_all(partitioner: Any, num_partitions: int) -> list[np.ndarray]:
    parts = []
    for pid in range(num_partitions):
        rows = partitioner.load_partition(pid).with_format("arrow")["_idx"]
        parts.append(np.sort(rows.to_numpy().astype(np.int64)))
    return parts


def _run_partitioner(partitioner: Any, num_partitions: int, alpha: float, min_size: int):
    """Load every partition, turning flwr-datasets' failures into DataErrors."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            parts = _load_all(partitioner, num_partitions)
        except ValueError as err:
            if "max number of attempts" in str(err):
                raise DataError(
                    f"dirichlet partitioning (alpha={alpha}) could not give every one of the "
                    f"{num_partitions} partitions at least min_partition_size={min_size} rows "
                    f"in 11 draws; use a larger alpha, fewer partitions or a smaller "
                    f"min_partition_size"
                ) from None
            raise DataError(f"partitioning failed: {err}") from err
    retries = sum("min_partition_size" in str(w.message) for w in caught)
    if retries:
        logger.info("dirichlet partitioning needed %d redraw(s) to meet min size", retries)
    return parts


def partition_indices(
    labels: Sequence[int],
    *,
    num_partitions: int,
    scheme: Scheme,
    seed: int,
    alpha: float = 0.5,
    shards_per_partition: int = 2,
    min_partition_size: int = 0,
) -> list[np.ndarray]:
    """Split rows ``0..len(labels)-1`` among ``num_partitions`` clients.

    Schemes (all via ``flwr_datasets.partitioner``):

    * ``"iid"``: rows shuffled with ``seed``, then cut into near-equal blocks.
    * ``"dirichlet"``: per label, client shares drawn from Dir(``alpha``); small alpha means
      strong label skew. Redrawn (up to 10 times) until every client has at least
      ``min_partition_size`` rows. Clients may be empty when ``min_partition_size`` is 0.
    * ``"shards"``: rows sorted by label, cut into ``num_partitions * shards_per_partition``
      equal shards, ``shards_per_partition`` random shards per client. The remainder of
      ``len(labels)`` divided by the number of shards is left unassigned.

    Returns:
        One sorted int64 array of row indices per partition; the arrays are disjoint.

    Raises:
        ConfigError: an invalid argument (unknown scheme, alpha <= 0, ...).
        DataError: the data cannot be split as asked (too few rows, min size unreachable,
            or some partition smaller than ``min_partition_size`` for iid/shards).
    """
    _check_arguments(scheme, num_partitions, alpha, shards_per_partition, min_partition_size)
    array = _labels_array(labels)
    _check_feasible(scheme, len(array), num_partitions, shards_per_partition)
    partitioner = _make_partitioner(
        scheme, num_partitions, seed, alpha, shards_per_partition, min_partition_size
    )
    partitioner.dataset = _label_dataset(array, scheme, seed)
    parts = _run_partitioner(partitioner, num_partitions, alpha, min_partition_size)
    _check_min_size(parts, min_partition_size, scheme)
    return parts


def _check_min_size(parts: list[np.ndarray], min_size: int, scheme: str) -> None:
    small = [pid for pid, part in enumerate(parts) if len(part) < min_size]
    if small:
        raise DataError(
            f"{scheme} partitioning left {len(small)} partition(s) with fewer than "
            f"min_partition_size={min_size} rows (ids {small[:10]}); use fewer partitions "
            f"or a smaller min_partition_size"
        )


def partition_report(parts: Sequence[np.ndarray], labels: Sequence[int]) -> dict[str, Any]:
    """Summarise a partitioning (JSON-serialisable).

    Keys: ``num_partitions``, ``num_rows`` (rows in the split), ``num_assigned``,
    ``num_unassigned``, ``sizes`` (``min``/``median``/``max``), ``partition_sizes``,
    ``empty_partitions`` (ids; logged as a warning, not an error) and ``label_histograms``
    (per partition, counts for labels ``0..max label``).
    """
    array = np.asarray(labels, dtype=np.int64)
    n_labels = int(array.max()) + 1 if array.size else 0
    sizes = [int(len(part)) for part in parts]
    empty = [pid for pid, size in enumerate(sizes) if size == 0]
    if empty:
        logger.warning(
            "%d of %d partitions are empty (ids %s); those clients have no training data",
            len(empty), len(parts), empty[:20],
        )
    histograms = [
        np.bincount(array[np.asarray(part, dtype=np.int64)], minlength=n_labels).tolist()
        for part in parts
    ]
    return {
        "num_partitions": len(parts),
        "num_rows": int(array.size),
        "num_assigned": sum(sizes),
        "num_unassigned": int(array.size) - sum(sizes),
        "sizes": _size_stats(sizes),
        "partition_sizes": sizes,
        "empty_partitions": empty,
        "label_histograms": histograms,
    }


def _size_stats(sizes: list[int]) -> dict[str, float]:
    if not sizes:
        return {"min": 0, "median": 0.0, "max": 0}
    return {"min": min(sizes), "median": float(np.median(sizes)), "max": max(sizes)}


def sample_rows(n_rows: int, max_rows: int | None, seed: int) -> np.ndarray:
    """Sorted indices of a seeded random subset of ``max_rows`` out of ``n_rows`` rows.

    Returns all rows (``0..n_rows-1``) when ``max_rows`` is ``None`` or ``>= n_rows``.
    """
    if max_rows is not None and (not isinstance(max_rows, int) or max_rows < 1):
        raise ConfigError(f"max_rows must be a positive integer or None, got {max_rows!r}")
    if max_rows is None or max_rows >= n_rows:
        return np.arange(n_rows, dtype=np.int64)
    chosen = np.random.default_rng(seed).choice(n_rows, size=max_rows, replace=False)
    return np.sort(chosen).astype(np.int64)
