"""A Flower strategy that delegates to a fedslice :class:`~fedslice.fl.strategy.Strategy`.

``configure_train`` selects clients with the in-process engine's seeded selector among the
partitions whose SuperNode is connected, asks our strategy for one payload per client and wraps
each in a Message to that client's node. ``aggregate_train`` maps replies back to client ids
(replies of failed nodes are Flower errors, missing ones never came back within the round's
timeout), then calls our strategy's ``aggregate_train``: the same pure function, on the same
inputs in the same order as ``fedslice run``, hence the same global weights.

Evaluation is central (the ServerApp evaluates on dev), so ``configure_evaluate`` sends nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy as FlowerStrategy

from fedslice.config import ExperimentConfig
from fedslice.fl.engine import FederatedData, round_record
from fedslice.errors import ConfigError
from fedslice.fl.selection import make_selector
from fedslice.fl.strategy import Payload, Reply, State
from fedslice.fl.strategy import Strategy as FedsliceStrategy
from fedslice.flower.codec import (decode_reply, encode_payload, error_reason, record_to_state,
                                   state_to_record)
from fedslice.flower.discovery import PartitionMap
from fedslice.methods.base import Method

log = logging.getLogger(__name__)

#: A train message outlives the round's wait by this much, so that a reply still missing at the
#: end of the wait is reported as missing, not as a message the SuperLink has expired.
TTL_MARGIN_S = 30.0


@dataclass
class _Round:
    """What the server sent in the round being trained (to match the replies)."""

    number: int
    state: State
    clients: list[int]
    payloads: dict[int, Payload]
    messages: dict[int, Message]
    started: float = field(default_factory=time.perf_counter)


class FlowerAdapter(FlowerStrategy):
    """Flower's Strategy interface over our strategy, selector and client -> node map."""

    def __init__(self, cfg: ExperimentConfig, method: Method, data: FederatedData,
                 partitions: PartitionMap, round_timeout: float):
        self.cfg, self.method, self.data, self.partitions = cfg, method, data, partitions
        self.inner: FedsliceStrategy = method.strategy
        self.round_timeout = round_timeout
        self.selector = make_selector(cfg.federation.selection, cfg.federation.clients_per_round,
                                      cfg.seed)
        if cfg.federation.selection == "loss_gap" and cfg.federation.cold_start == "probe":
            raise ConfigError("federation.cold_start='probe' runs in the in-process simulation "
                              "only (fedslice run); on Flower use 'unseen_first'")
        self.experiment = cfg.model_dump(mode="json")
        self.records: list[dict[str, Any]] = []
        self._round: _Round | None = None
        self.inner.client_sizes = {c: len(p) for c, p in enumerate(data.partitions)}
        self.offset = 0  # rounds done before this start (a resumed run): Flower counts from 1

    def candidates(self, grid: Grid) -> list[int]:
        """Clients with a connected SuperNode and a non-empty partition, in id order."""
        connected = self.partitions.refresh(grid, self.round_timeout)
        return [c for c in connected if len(self.data.partitions[c]) > 0]

    # -- train -----------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        server_round += self.offset
        state = record_to_state(arrays)
        clients = self.selector.select(server_round, self.candidates(grid))
        payloads = self.inner.configure_train(server_round, state, clients)
        messages = {c: Message(encode_payload(payloads[c], self.experiment),
                               dst_node_id=self.partitions.nodes[c], message_type=MessageType.TRAIN,
                               group_id=str(server_round),
                               ttl=self.round_timeout + TTL_MARGIN_S)
                    for c in clients}
        self._round = _Round(server_round, state, clients, payloads, messages)
        log.info("round %d: training clients %s", server_round, clients)
        return list(messages.values())

    def _collect(self, sent: _Round, replies: Iterable[Message]
                 ) -> tuple[dict[int, Reply], list[dict[str, Any]]]:
        """Replies by client id, and the clients that failed (error reply or no reply)."""
        by_id = {m.metadata.message_id: c for c, m in sent.messages.items()}
        received: dict[int, Reply] = {}
        failed: dict[int, str] = {}
        for msg in replies:
            c = by_id.get(msg.metadata.reply_to_message_id)
            if c is None:
                continue  # a stale reply of an earlier round
            if msg.has_error():
                failed[c] = f"node {sent.messages[c].metadata.dst_node_id} failed: {error_reason(msg)}"
            else:
                received[c] = decode_reply(msg.content)
        for c in sent.clients:
            if c not in received and c not in failed:
                failed[c] = f"no reply within {self.round_timeout:g} s"
        for c, reason in sorted(failed.items()):
            log.warning("round %d: client %d excluded: %s", sent.number, c, reason)
        return received, [{"client": c, "reason": r} for c, r in sorted(failed.items())]

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        server_round += self.offset
        sent, self._round = self._round, None
        assert sent is not None and sent.number == server_round, "aggregate without configure"
        received, failures = self._collect(sent, replies)
        payloads = {c: sent.payloads[c] for c in received}
        result = self.inner.aggregate_train(server_round, sent.state, payloads, received)
        if result.skipped:
            log.warning("round %d: only %d valid replies (< federation.min_replies=%d): global "
                        "state unchanged", server_round, len(result.used), self.cfg.federation.min_replies)
        new_state, server_metrics = self.method.on_round_end(
            server_round, result.state, {c: received[c] for c in result.used})
        record = {**round_record(server_round, sent.clients, received, result), **server_metrics}
        record["excluded"] = sorted(failures + record["excluded"], key=lambda e: e["client"])
        record["failed_nodes"] = len(failures)
        record["round_time_s"] = time.perf_counter() - sent.started
        self.records.append(record)
        metrics = {"num-replies": len(received), "num-failed": len(failures)}
        if record["train_loss"] is not None:
            metrics["train-loss"] = record["train_loss"]
        return state_to_record(new_state), MetricRecord(metrics)

    # -- evaluate (central, on the server) -----------------------------------------------------
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    def summary(self) -> None:
        nodes = self.partitions.nodes
        log.info("fedslice %s strategy over %d SuperNodes (clients %s), %d per round",
                 self.cfg.method.name, len(nodes), sorted(nodes),
                 self.cfg.federation.clients_per_round)
