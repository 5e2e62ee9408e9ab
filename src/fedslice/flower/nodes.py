"""Which partition a SuperNode holds, and the error type of deployments.

In a deployment every SuperNode holds ONE partition of the experiment's train split, given when it
starts: ``flower-supernode ... --node-config "partition-id=N num-partitions=M"``. The partitions
are the ones the in-process engine makes (``federation.num_clients`` of them, from the config's
seed), so partition ``N`` of a SuperNode is client ``N`` of ``fedslice run``. ``num-partitions``
is optional; when given it must equal ``federation.num_clients``. Flower's simulation engine sets
both keys for each virtual SuperNode.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedslice.errors import FedsliceError

PARTITION_ID, NUM_PARTITIONS = "partition-id", "num-partitions"
#: The query the ServerApp sends every node when its run is over (the node removes its files)
END_RUN = "end-run"


class DeploymentError(FedsliceError):
    """A deployment is set up wrongly: a node's partition, a missing node, an unreachable link."""


def _int_value(node_config: Mapping[str, Any], key: str) -> int | None:
    value = node_config.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise DeploymentError(f"node config {key}={value!r} is not an integer "
                              f"(start the SuperNode with --node-config \"{key}=0 ...\")")
    return value


def node_partition(node_config: Mapping[str, Any], num_clients: int) -> int:
    """The partition id of a SuperNode, checked against ``federation.num_clients``."""
    pid = _int_value(node_config, PARTITION_ID)
    if pid is None:
        raise DeploymentError(
            f"this SuperNode has no {PARTITION_ID}: start it with "
            f"--node-config \"{PARTITION_ID}=N {NUM_PARTITIONS}={num_clients}\" (0 <= N < {num_clients})")
    if not 0 <= pid < num_clients:
        raise DeploymentError(
            f"{PARTITION_ID}={pid} is out of range: the experiment has federation.num_clients="
            f"{num_clients} partitions (ids 0..{num_clients - 1})")
    parts = _int_value(node_config, NUM_PARTITIONS)
    if parts is not None and parts != num_clients:
        raise DeploymentError(
            f"{NUM_PARTITIONS}={parts} differs from federation.num_clients={num_clients}: in a "
            "deployment each SuperNode holds one partition, so set federation.num_clients to the "
            "number of partitions")
    return pid
