"""A Flower strategy that delegates to a fedslice :class:`~fedslice.fl.strategy.Strategy`.

``configure_train`` selects clients with the in-process engine's seeded selector among the
partitions whose SuperNode is connected, asks our strategy for one payload per client and wraps
each in a Message to that client's node. ``aggregate_train`` maps replies back to client ids
(replies of failed nodes are Flower errors, missing ones never came back within the round's
timeout), then calls our strategy's ``aggregate_train``: the same pure function, on the same
inputs in the same order as ``fedslice run``, hence the same global weights.

Evaluation is central (the ServerApp evaluates on dev), so ``configure_evaluate`` sends nothing.

With ``dp.enabled`` the adapter runs inside Flower's own central-DP wrapper
(:class:`CentralDP`, a ``DifferentialPrivacyServerSideFixedClipping``): Flower clips every
reply and adds the Gaussian noise; our strategy takes the fixed-denominator mean and accounts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping
from flwr.serverapp.strategy import Strategy as FlowerStrategy

from fedslice.config import ExperimentConfig
from fedslice.fl.engine import FederatedData, round_record
from fedslice.errors import ConfigError
from fedslice.fl.selection import make_selector
from fedslice.fl.strategy import Payload, Reply, RoundResult, State
from fedslice.fl.strategy import Strategy as FedsliceStrategy
from fedslice.flower.codec import (ARRAYS, decode_reply, encode_payload, error_reason,
                                   record_to_state, state_to_record)
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
        self.offset = 0  # rounds done before this start (a resumed run): Flower counts from 1
        self.dropped: dict[str, str] = {}  # message id -> why a wrapper dropped that reply

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
            if msg.metadata.message_id in self.dropped:
                failed[c] = self.dropped.pop(msg.metadata.message_id)
            elif msg.has_error():
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
        self._record(sent, received, failures, result, server_metrics)
        metrics = {"num-replies": len(received), "num-failed": len(failures)}
        if self.records[-1]["train_loss"] is not None:
            metrics["train-loss"] = self.records[-1]["train_loss"]
        return state_to_record(new_state), MetricRecord(metrics)

    def skip_round(self, server_round: int, replies: Iterable[Message], reason: str) -> None:
        """Record a round that a wrapper (Flower's DP) did not aggregate: state unchanged."""
        sent, self._round = self._round, None
        received, failures = self._collect(sent, replies)
        log.warning("round %d skipped: %s", sent.number, reason)
        excluded = [{"client": c, "reason": reason} for c in sorted(received)]
        self._record(sent, received, failures, RoundResult(sent.state, [], excluded, skipped=True), {})

    def _record(self, sent: _Round, received: dict[int, Reply], failures: list[dict[str, Any]],
                result: RoundResult, server_metrics: dict[str, Any]) -> None:
        record = {**round_record(sent.number, sent.clients, received, result), **server_metrics}
        record["excluded"] = sorted(failures + record["excluded"], key=lambda e: e["client"])
        record["failed_nodes"] = len(failures)
        record["round_time_s"] = time.perf_counter() - sent.started
        self.records.append(record)

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


class CentralDP(DifferentialPrivacyServerSideFixedClipping):
    """Flower's central DP with server-side fixed clipping over the adapter (DP-FedAvg on Flower).

    Flower clips each reply's arrays to L2 norm ``dp.clip_norm`` against the global arrays
    (position by position), the adapter aggregates the clipped replies (our fixed-denominator
    mean over ``clients_per_round``, validation, the RDP accountant's step and its epsilon in
    the round's record; ``Privacy.external_noise``: no noise of ours), and Flower adds Gaussian
    noise of std ``z * eta * C / n`` to the aggregate from numpy's global RNG (the ServerApp
    seeds it with the run's seed; ``eta`` = ``server_lr``, so the noise is that of
    ``g + eta * (mean + N(0, (z C / n)^2))``, as in the simulation). Before Flower clips, a
    reply's arrays are put in the global arrays' order; a reply with other names is dropped and
    recorded as rejected. A round with an error reply is skipped, as Flower's wrapper does, and
    recorded."""

    def __init__(self, adapter: FlowerAdapter, z: float, clip_norm: float, clients_per_round: int):
        eta = adapter.cfg.federation.server_lr
        super().__init__(adapter, z * eta, clip_norm, clients_per_round)
        self.adapter = adapter

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        if any(m.has_error() for m in replies):
            self.adapter.skip_round(server_round, replies, "a node failed: Flower's DP wrapper "
                                    "skips rounds with error replies")
            return self.current_arrays, None  # unchanged (Flower's result keeps the last arrays)
        names = list(self.current_arrays.keys())
        kept = []
        for m in replies:
            record = m.content[ARRAYS]
            if sorted(record.keys()) != sorted(names):
                self.adapter.dropped[m.metadata.message_id] = (
                    "update rejected: its tensors are not the global state's (DP clips whole updates)")
                continue
            m.content[ARRAYS] = ArrayRecord({k: record[k] for k in names})
            kept.append(m)
        if not kept:
            self.adapter.skip_round(server_round, replies, "no update to aggregate")
            return self.current_arrays, None
        return super().aggregate_train(server_round, kept)
