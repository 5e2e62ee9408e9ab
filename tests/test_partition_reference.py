"""fedslice's partitioners equal flwr-datasets' (the run no longer imports it): same seed, same
partitions, for every scheme over label layouts that stress each algorithm."""

import warnings

import numpy as np
import pytest

from fedslice.data.partition import partition_indices
from fedslice.errors import DataError


def _flwr(labels, scheme, num_partitions, seed, alpha=0.5, shards=2, min_size=0):
    import datasets
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner, ShardPartitioner

    order = np.arange(len(labels), dtype=np.int64)
    if scheme == "iid":
        order = np.random.default_rng(seed).permutation(order)
        p = IidPartitioner(num_partitions=num_partitions)
    elif scheme == "dirichlet":
        p = DirichletPartitioner(num_partitions=num_partitions, partition_by="label", alpha=alpha,
                                 min_partition_size=min_size, self_balancing=False, seed=seed)
    else:
        p = ShardPartitioner(num_partitions=num_partitions, partition_by="label",
                             num_shards_per_partition=shards, seed=seed)
    p.dataset = datasets.Dataset.from_dict({"label": labels[order], "_idx": order})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [np.sort(p.load_partition(i).with_format("arrow")["_idx"].to_numpy()) for i in range(num_partitions)]


LAYOUTS = {
    "sorted-2": np.repeat([0, 1], [130, 77]),
    "random-5": np.random.default_rng(3).integers(0, 5, 411),
    "missing-class": np.random.default_rng(4).choice([0, 2, 7], 300),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scheme,kw", [("iid", {}), ("dirichlet", {"alpha": 0.3}),
                                       ("dirichlet", {"alpha": 5.0, "min_size": 3}),
                                       ("shards", {"shards": 2}), ("shards", {"shards": 3})])
@pytest.mark.parametrize("seed", [0, 7])
def test_same_partitions_as_flwr_datasets(layout, scheme, kw, seed):
    labels = LAYOUTS[layout]
    ours = partition_indices(labels, num_partitions=9, scheme=scheme, seed=seed,
                             alpha=kw.get("alpha", 0.5), shards_per_partition=kw.get("shards", 2),
                             min_partition_size=kw.get("min_size", 0))
    theirs = _flwr(labels, scheme, 9, seed, **kw)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert np.array_equal(a, b)


def test_dirichlet_redraws_like_flwr_then_gives_up():
    labels = LAYOUTS["random-5"]
    ours = partition_indices(labels, num_partitions=20, scheme="dirichlet", seed=1, alpha=0.5,
                             min_partition_size=5)
    theirs = _flwr(labels, "dirichlet", 20, 1, alpha=0.5, min_size=5)
    assert all(np.array_equal(a, b) for a, b in zip(ours, theirs))
    with pytest.raises(DataError, match="11 draws"):
        partition_indices(labels, num_partitions=40, scheme="dirichlet", seed=1, alpha=0.05,
                          min_partition_size=10)


NATURAL = {
    "names": np.random.default_rng(5).choice(["zoe", "al", "bea", "Cy", "dan", "al2"], 257).tolist(),
    "ints": np.random.default_rng(6).integers(0, 40, 300).tolist(),
    "one-each": [f"user{i}" for i in range(30)][::-1],
}


@pytest.mark.parametrize("layout", NATURAL)
def test_natural_partitions_equal_flwr_datasets_natural_id_partitioner(layout):
    import datasets
    from flwr_datasets.partitioner import NaturalIdPartitioner

    from fedslice.data.partition import natural_partitions

    values = NATURAL[layout]
    ours, ids, left = natural_partitions(values)
    p = NaturalIdPartitioner(partition_by="user")
    p.dataset = datasets.Dataset.from_dict({"user": values, "_idx": list(range(len(values)))})
    assert p.num_partitions == len(ours) and left == {"clients": 0, "rows": 0}
    for pid, part in enumerate(ours):
        theirs = p.load_partition(pid)
        assert np.array_equal(part, np.asarray(theirs["_idx"]))
        assert p.partition_id_to_natural_id[pid] == ids[pid]


def test_natural_partitions_leave_out_clients_below_min_partition_size():
    from fedslice.data.partition import natural_partitions

    values = ["a"] * 5 + ["b"] * 2 + ["c"] * 3 + ["a"]
    parts, ids, left = natural_partitions(values, min_partition_size=3)
    assert ids == ["a", "c"] and left == {"clients": 1, "rows": 2}
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3, 4, 10], [7, 8, 9]]
    with pytest.raises(DataError, match="none of the 3 clients.*largest has 6"):
        natural_partitions(values, min_partition_size=7)
