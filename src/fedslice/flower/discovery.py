"""Which SuperNode holds which partition: one query message to each node the server sees.

At the start the ServerApp waits (at most ``connect-timeout`` seconds) until ``num_clients``
SuperNodes have answered, then goes on with the partitions it has: client ``c`` of the experiment
is the SuperNode that answered ``partition-id=c``. A node whose partition is invalid (out of
range, a different ``num-partitions``, claimed by another node) fails the run with that node's
message, since the experiment would silently differ from ``fedslice run``'s.

Before each round the map is refreshed: clients whose node is no longer connected are not
selected, and a node that joins later (e.g. a restarted SuperNode, which gets a new node id) is
asked for its partition and takes that client over.

The first queries may ask the nodes for more (``discover(..., ask=...)``: records added to each
query, e.g. secure aggregation's request of the first round's keys); the answers are kept in
``answers`` (node id -> the answer's content) for whoever asked.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from fedslice.flower.nodes import END_RUN, PARTITION_ID, DeploymentError
from fedslice.flower.codec import error_reason

log = logging.getLogger(__name__)

#: Seconds between two looks for new SuperNodes while waiting for them.
POLL_S = 1.0
#: The longest wait for the answers to one batch of queries.
QUERY_TIMEOUT_S = 60.0
#: The longest wait for the nodes' answers to the end of a run.
END_RUN_TIMEOUT_S = 30.0

_FATAL = (ErrorCode.CLIENT_APP_RAISED_EXCEPTION, ErrorCode.LOAD_CLIENT_APP_EXCEPTION)


class PartitionMap:
    """Client (partition) id <-> node id of the SuperNodes of a run."""

    def __init__(self, num_clients: int):
        self.num_clients = num_clients
        self.nodes: dict[int, int] = {}  # client -> node
        self.answers: dict[int, RecordDict] = {}  # node -> its answer to a query with ``ask``

    def _query(self, grid: Grid, node_ids: list[int], timeout: float, strict: bool,
               ask: Mapping[str, ConfigRecord] | None = None) -> dict[int, int]:
        """Ask ``node_ids`` for their partition (and ``ask``'s records); node id -> partition id
        of those that answered. A node's error is fatal when ``strict`` (at the start), a
        warning otherwise."""
        content = RecordDict({"fedslice": ConfigRecord({"num_clients": self.num_clients}),
                              **(ask or {})})
        messages = {nid: Message(content, dst_node_id=nid, message_type=MessageType.QUERY,
                                 ttl=timeout) for nid in node_ids}
        replies = grid.send_and_receive(list(messages.values()), timeout=timeout)
        node_of = {m.metadata.message_id: nid for nid, m in messages.items()}
        found: dict[int, int] = {}
        for reply in replies:
            nid = node_of.get(reply.metadata.reply_to_message_id)
            if nid is None:
                continue
            if reply.has_error():
                if strict and reply.error.code in _FATAL:
                    raise DeploymentError(f"SuperNode {nid}: {error_reason(reply)}")
                log.warning("SuperNode %d did not answer: %s", nid, error_reason(reply))
                continue
            try:
                pid = reply.content["fedslice"][PARTITION_ID]
                if isinstance(pid, bool) or not isinstance(pid, int):
                    raise TypeError(f"{PARTITION_ID}={pid!r} is not an integer")
            except Exception as e:  # noqa: BLE001 - a malformed answer: that node is left out
                if strict:
                    raise DeploymentError(f"SuperNode {nid} answered the partition query with a "
                                          f"malformed message ({type(e).__name__}: {e})") from None
                log.warning("SuperNode %d: malformed answer to the partition query (%s): not used",
                            nid, e)
                continue
            found[nid] = pid
            if ask:
                self.answers[nid] = reply.content
        return found

    def _add(self, found: dict[int, int], connected: set[int], strict: bool) -> None:
        for nid, pid in sorted(found.items()):
            old = self.nodes.get(pid)
            if old is not None and old != nid and old in connected:
                msg = (f"SuperNodes {old} and {nid} both hold partition-id={pid}: give each "
                       "SuperNode its own partition-id")
                if strict:
                    raise DeploymentError(msg)
                log.warning("%s (keeping %d)", msg, old)
                continue
            if old is not None and old != nid:
                log.info("partition %d moved from SuperNode %d to %d", pid, old, nid)
            self.nodes[pid] = nid

    def discover(self, grid: Grid, timeout: float,
                 ask: Mapping[str, ConfigRecord] | None = None) -> dict[int, int]:
        """Wait at most ``timeout`` s for the SuperNodes of all partitions; client -> node.
        ``ask``: records each query carries besides the partition's (answers: ``answers``)."""
        deadline = time.monotonic() + timeout
        while True:
            connected = set(grid.get_node_ids())
            new = sorted(connected - set(self.nodes.values()))
            if new:
                wait = max(1.0, min(QUERY_TIMEOUT_S, deadline - time.monotonic()))
                self._add(self._query(grid, new, wait, strict=True, ask=ask), connected, strict=True)
                log.info("SuperNodes: %d of %d partitions connected", len(self.nodes), self.num_clients)
            if len(self.nodes) >= self.num_clients or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        if not self.nodes:
            raise DeploymentError(
                f"no SuperNode answered within {timeout:g} s: start SuperNodes with --node-config "
                "\"partition-id=N num-partitions=M\" (the run config's connect-timeout sets the wait)")
        missing = sorted(set(range(self.num_clients)) - set(self.nodes))
        if missing:
            log.warning("no SuperNode holds partitions %s after %g s: training without them",
                        missing[:20], timeout)
        return dict(self.nodes)

    def refresh(self, grid: Grid, timeout: float) -> list[int]:
        """Before a round: ask nodes that joined for their partition; the connected clients."""
        connected = set(grid.get_node_ids())
        new = sorted(connected - set(self.nodes.values()))
        if new:
            self._add(self._query(grid, new, min(timeout, QUERY_TIMEOUT_S), strict=False),
                      connected, strict=False)
        lost = sorted(c for c, nid in self.nodes.items() if nid not in connected)
        if lost:
            log.warning("the SuperNodes of clients %s are not connected: not selected", lost)
        return sorted(c for c, nid in self.nodes.items() if nid in connected)


def end_run(grid: Grid, timeout: float = END_RUN_TIMEOUT_S) -> int:
    """Tell every connected SuperNode that the run is over, so that it removes the run's model
    files (:func:`fedslice.flower.client_app.end_run`); the number of nodes that did. Best
    effort: a node that does not answer within ``timeout`` is logged (its files go when it next
    keeps a model, ``state-max-runs``)."""
    try:
        nodes = sorted(grid.get_node_ids())
        if not nodes:
            return 0
        content = RecordDict({"fedslice": ConfigRecord({END_RUN: 1})})
        messages = [Message(content, dst_node_id=nid, message_type=MessageType.QUERY, ttl=timeout)
                    for nid in nodes]
        replies = list(grid.send_and_receive(messages, timeout=timeout))
    except Exception as e:  # noqa: BLE001 - the run's results are written: never fail it here
        log.warning("could not tell the SuperNodes that the run ended: %s", e)
        return 0
    done = sum(1 for r in replies if not r.has_error())
    if done < len(nodes):
        log.warning("%d of %d SuperNodes did not confirm the end of the run (their model files "
                    "are removed when they next keep one)", len(nodes) - done, len(nodes))
    return done
