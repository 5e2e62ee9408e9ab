"""Split a training set among federated clients as Flower Datasets' partitioners do.

:func:`partition_indices` runs the algorithm of a ``flwr_datasets`` partitioner (IID, Dirichlet
label skew, or label shards; re-implemented here and tested to give identical partitions) over
the labels only and returns, per client, the sorted row indices into the
split. All schemes are deterministic given ``seed``. :func:`partition_report` summarises the
result (sizes, empty clients, label histograms) for logs and run records.
"""

from __future__ import annotations

import logging
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


def _iid(labels: np.ndarray, num_partitions: int, seed: int) -> list[np.ndarray]:
    """flwr-datasets' ``IidPartitioner`` over the rows permuted with ``seed`` (it cuts contiguous
    blocks, the first ``n % P`` one row longer, like ``datasets.Dataset.shard``)."""
    order = np.random.default_rng(seed).permutation(len(labels)).astype(np.int64)
    div, mod = divmod(len(labels), num_partitions)
    parts = []
    for pid in range(num_partitions):
        start = div * pid + min(pid, mod)
        parts.append(order[start:start + div + (1 if pid < mod else 0)])
    return parts


def _dirichlet(labels: np.ndarray, num_partitions: int, seed: int, alpha: float,
               min_size: int) -> list[np.ndarray]:
    """flwr-datasets' ``DirichletPartitioner`` (``self_balancing=False``): per class in sorted
    order, client shares from Dir(alpha) cut the class's rows; the whole draw is repeated (up
    to 11 draws from the same generator) until every partition has ``min_size`` rows."""
    rng = np.random.default_rng(seed)
    alphas = np.full(num_partitions, float(alpha))
    classes = np.unique(labels)
    for attempt in range(11):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_partitions)]
        for k in classes:
            rows = np.nonzero(labels == k)[0]
            cuts = (np.cumsum(rng.dirichlet(alphas)) * len(rows)).astype(int)[:-1]
            for pid, chunk in enumerate(np.split(rows, cuts)):
                parts[pid].append(chunk)
        out = [np.concatenate(p).astype(np.int64) for p in parts]
        if min(len(p) for p in out) >= min_size:
            if attempt:
                logger.info("dirichlet partitioning needed %d redraw(s) to meet min size", attempt)
            return out
    raise DataError(
        f"dirichlet partitioning (alpha={alpha}) could not give every one of the "
        f"{num_partitions} partitions at least min_partition_size={min_size} rows "
        f"in 11 draws; use a larger alpha, fewer partitions or a smaller "
        f"min_partition_size"
    )


def _shards(labels: np.ndarray, num_partitions: int, seed: int, shards: int) -> list[np.ndarray]:
    """flwr-datasets' ``ShardPartitioner``: rows sorted (stably) by label, cut into shards of
    ``int(n / (P * shards))`` rows (an incomplete last shard dropped), ``shards`` random shards
    per partition."""
    n = len(labels)
    order = np.argsort(labels, kind="stable").astype(np.int64)
    used = num_partitions * shards
    size = int(n / used)
    usable = n // size
    if usable < num_partitions:
        raise DataError(f"cannot cut {n} rows into {num_partitions} partitions x {shards} shards: "
                        f"reduce num_partitions or shards_per_partition")
    chosen = np.random.default_rng(seed).permutation(usable)[:used]
    parts = []
    for pid in range(num_partitions):
        rows = [np.arange(s * size, min((s + 1) * size, n)) for s in chosen[pid * shards:(pid + 1) * shards]]
        parts.append(order[np.concatenate(rows)] if rows else np.zeros(0, dtype=np.int64))
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

    Schemes (flwr-datasets' partitioners, re-implemented in numpy so a run does not import
    ``datasets``/``flwr``: the same seed gives the same partitions, tested against them):

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
    if scheme == "iid":
        parts = _iid(array, num_partitions, seed)
    elif scheme == "dirichlet":
        parts = _dirichlet(array, num_partitions, seed, alpha, min_partition_size)
    else:
        parts = _shards(array, num_partitions, seed, shards_per_partition)
    parts = [np.sort(p) for p in parts]
    _check_min_size(parts, min_partition_size, scheme)
    return parts


def natural_order(values: Sequence[Any]) -> list[Any]:
    """The distinct client values in partition-id order: sorted, as Flower Datasets'
    ``NaturalIdPartitioner`` numbers them (numbers numerically; any other mix as text)."""
    distinct = set(values)
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in distinct):
        return sorted(distinct)
    if all(isinstance(v, str) for v in distinct):
        return sorted(distinct)
    return sorted(distinct, key=str)


def natural_partitions(values: Sequence[Any], min_partition_size: int = 0
                       ) -> tuple[list[np.ndarray], list[Any], dict[str, int]]:
    """One partition per distinct value of ``values`` (each row's client: a user, a category),
    numbered as :func:`natural_order`; clients with fewer than ``min_partition_size`` rows are
    left out (their rows unassigned). Returns ``(parts, natural ids of the parts, left out:
    {"clients", "rows"})``."""
    if not values:
        raise DataError("cannot partition: the split has no rows")
    if not isinstance(min_partition_size, int) or min_partition_size < 0:
        raise ConfigError(f"min_partition_size must be an integer >= 0, got {min_partition_size!r}")
    rows: dict[Any, list[int]] = {}
    for i, v in enumerate(values):
        rows.setdefault(v, []).append(i)
    ids = [v for v in natural_order(values) if len(rows[v]) >= min_partition_size]
    left = [v for v in rows if len(rows[v]) < min_partition_size]
    if not ids:
        raise DataError(f"natural partitioning: none of the {len(rows)} clients has "
                        f"min_partition_size={min_partition_size} rows (the largest has "
                        f"{max(len(r) for r in rows.values())}): lower data.min_partition_size")
    if left:
        logger.warning("natural partitioning: left out %d of %d clients with fewer than "
                       "min_partition_size=%d rows (%d rows)", len(left), len(rows),
                       min_partition_size, sum(len(rows[v]) for v in left))
    parts = [np.asarray(rows[v], dtype=np.int64) for v in ids]
    return parts, ids, {"clients": len(left), "rows": sum(len(rows[v]) for v in left)}


def size_spread(sizes: Sequence[int]) -> dict[str, float]:
    """How client sizes spread: min, quartiles, max, mean and the coefficient of variation."""
    a = np.asarray(sizes, dtype=np.float64)
    if not a.size:
        return {}
    q = np.percentile(a, [0, 25, 50, 75, 100])
    mean = float(a.mean())
    return {"min": int(q[0]), "p25": float(q[1]), "median": float(q[2]), "p75": float(q[3]),
            "max": int(q[4]), "mean": mean, "cv": float(a.std() / mean) if mean else 0.0}


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
