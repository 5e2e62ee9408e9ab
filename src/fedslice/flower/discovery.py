"""Which SuperNode holds which partition: one query message to each connected node.

The ServerApp waits (at most ``timeout`` seconds) until ``num_clients`` SuperNodes have answered,
then goes on with the partitions it has: client ``c`` of the experiment is the SuperNode that
answered ``partition-id=c``. A node whose partition is invalid (out of range, a different
``num-partitions``, claimed by another node) fails the run with that node's message, since its
experiment would silently differ from ``fedslice run``'s.
"""

from __future__ import annotations

import logging
import time

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from fedslice.flower.nodes import PARTITION_ID, DeploymentError
from fedslice.flower.strategy import error_reason

log = logging.getLogger(__name__)

#: Seconds between two looks for new SuperNodes (Flower's nodes poll every few seconds anyway).
POLL_S = 1.0
#: The longest wait for the answers to one batch of queries.
QUERY_TIMEOUT_S = 60.0

_FATAL = (ErrorCode.CLIENT_APP_RAISED_EXCEPTION, ErrorCode.LOAD_CLIENT_APP_EXCEPTION)


def _query(grid: Grid, node_ids: list[int], num_clients: int, timeout: float) -> dict[int, int]:
    """Ask ``node_ids`` for their partition; node id -> partition id of those that answered."""
    content = RecordDict({"fedslice": ConfigRecord({"num_clients": num_clients})})
    messages = {nid: Message(content, dst_node_id=nid, message_type=MessageType.QUERY, ttl=timeout)
                for nid in node_ids}
    replies = grid.send_and_receive(list(messages.values()), timeout=timeout)
    node_of = {m.metadata.message_id: nid for nid, m in messages.items()}
    found: dict[int, int] = {}
    for reply in replies:
        nid = node_of.get(reply.metadata.reply_to_message_id)
        if nid is None:
            continue
        if reply.has_error():
            if reply.error.code in _FATAL:
                raise DeploymentError(f"SuperNode {nid}: {error_reason(reply)}")
            log.warning("SuperNode %d did not answer: %s", nid, error_reason(reply))
            continue
        found[nid] = int(reply.content["fedslice"][PARTITION_ID])
    return found


def _check_unique(partitions: dict[int, int]) -> dict[int, int]:
    """node -> partition as client -> node; two nodes with one partition is an error."""
    clients: dict[int, int] = {}
    for nid, pid in sorted(partitions.items()):
        if pid in clients:
            raise DeploymentError(f"SuperNodes {clients[pid]} and {nid} both hold partition-id="
                                  f"{pid}: give each SuperNode its own partition-id")
        clients[pid] = nid
    return clients


def discover_partitions(grid: Grid, num_clients: int, timeout: float) -> dict[int, int]:
    """Client (partition) id -> node id of the connected SuperNodes, waiting at most ``timeout``
    seconds for all ``num_clients`` of them."""
    deadline = time.monotonic() + timeout
    partitions: dict[int, int] = {}
    asked: set[int] = set()
    while True:
        new = sorted(set(grid.get_node_ids()) - asked)
        if new:
            wait = max(1.0, min(QUERY_TIMEOUT_S, deadline - time.monotonic()))
            found = _query(grid, new, num_clients, wait)
            partitions.update(found)
            asked.update(found)  # nodes that did not answer are asked again
            clients = _check_unique(partitions)
            log.info("SuperNodes: %d of %d partitions connected", len(clients), num_clients)
        if len(partitions) >= num_clients or time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    clients = _check_unique(partitions)
    if not clients:
        raise DeploymentError(f"no SuperNode answered within {timeout:g} s: start SuperNodes with "
                              "--node-config \"partition-id=N num-partitions=M\" (run config "
                              "connect-timeout sets the wait)")
    missing = sorted(set(range(num_clients)) - set(clients))
    if missing:
        log.warning("no SuperNode holds partitions %s after %g s: training without them",
                    missing[:20], timeout)
    return clients
