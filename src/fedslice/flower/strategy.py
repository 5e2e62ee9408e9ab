"""A Flower strategy that delegates to a fedslice :class:`~fedslice.fl.strategy.Strategy`.

``configure_train`` selects clients with the in-process engine's seeded selector among the
partitions whose SuperNode is connected, asks our strategy for one payload per client and wraps
each in a Message to that client's node. ``aggregate_train`` maps replies back to client ids
(replies of failed nodes are Flower errors, missing ones never came back within the round's
timeout; a reply that does not decode is rejected and counted, never raised), then calls our
strategy's ``aggregate_train``: the same pure function, on the same inputs in the same order as
``fedslice run``, hence the same global weights.

Evaluation is central (the ServerApp evaluates on dev), so ``configure_evaluate`` sends nothing.

With ``dp.enabled`` the adapter runs inside Flower's own central-DP wrapper
(:class:`CentralDP`, a ``DifferentialPrivacyServerSideFixedClipping``): each reply, validated and
turned into the method's update of the global state, is clipped by Flower, our strategy takes the
fixed-denominator mean and accounts, and Flower adds the Gaussian noise.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping
from flwr.supercore.differential_privacy import compute_clip_model_update
from flwr.serverapp.strategy import Strategy as FlowerStrategy

from fedslice.config import ExperimentConfig
from fedslice.data.federated import FederatedData
from fedslice.run.engine import round_record
from fedslice.errors import ConfigError
from fedslice.fl.rules import DPFedAvg, find_rule
from fedslice.fl.selection import make_selector
from fedslice.fl.strategy import Payload, Reply, RoundResult, State
from fedslice.fl.strategy import Strategy as FedsliceStrategy
from fedslice.fl.wire import upload_dtype_of
from fedslice.flower.codec import (ARRAYS, decode_reply, encode_payload, error_reason,
                                   record_to_state, state_to_record)
from fedslice.measure import tensor_bytes
from fedslice.slicing.aggregate import client_delta
from fedslice.flower.discovery import PartitionMap
from fedslice.methods.base import Method
from fedslice.methods.plan_records import eligible

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
                 partitions: PartitionMap, round_timeout: float, offset: int = 0):
        self.cfg, self.method, self.data, self.partitions = cfg, method, data, partitions
        self.inner: FedsliceStrategy = method.strategy
        self.round_timeout = round_timeout
        self.selector = make_selector(cfg.federation.selection, cfg.federation.clients_per_round,
                                      cfg.seed)
        if cfg.federation.selection == "loss_gap" and cfg.federation.cold_start == "probe":
            raise ConfigError("federation.cold_start='probe' runs in the in-process simulation "
                              "only (fedslice run); on Flower use 'unseen_first'")
        self.experiment = cfg.model_dump(mode="json")
        #: the metrics record of the last round aggregated (finished by the ServerApp's evaluation)
        self.record: dict[str, Any] | None = None
        self._round: _Round | None = None
        self.offset = offset  # rounds done before this start (a resumed run): Flower counts from 1
        #: id of the message a reply answers -> why a wrapper (CentralDP) dropped that reply
        self.dropped: dict[str, str] = {}
        #: under Flower's DP wrapper (dp.enabled): replies reach aggregate_train validated, as
        #: clipped updates of the global state (CentralDP, global_update)
        self.global_replies = cfg.dp.enabled

    def candidates(self, grid: Grid) -> list[int]:
        """Clients with a connected SuperNode and a non-empty partition, in id order, less
        those whose plan sits out every round (never selected)."""
        connected = self.partitions.refresh(grid, self.round_timeout)
        return eligible([c for c in connected if len(self.data.partitions[c]) > 0], self.method.plans)

    # -- train -----------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        server_round += self.offset
        state = record_to_state(arrays)
        candidates = self.candidates(grid)
        clients = self.selector.select(server_round, candidates)
        payloads = self.inner.configure_train(server_round, state, clients, len(candidates))
        messages = {c: Message(encode_payload(payloads[c], self.experiment),
                               dst_node_id=self.partitions.nodes[c], message_type=MessageType.TRAIN,
                               group_id=str(server_round),
                               ttl=self.round_timeout + TTL_MARGIN_S)
                    for c in clients}
        self._round = _Round(server_round, state, clients, payloads, messages)
        log.info("round %d: training clients %s", server_round, clients)
        return list(messages.values())

    def _collect(self, sent: _Round, replies: Iterable[Message]
                 ) -> tuple[dict[int, Reply], list[dict[str, Any]], int]:
        """Replies by client id, the clients that failed (error reply, no reply, a reply that
        does not decode) and how many of those were malformed replies (counted as rejected)."""
        by_id = {m.metadata.message_id: c for c, m in sent.messages.items()}
        received: dict[int, Reply] = {}
        failed: dict[int, str] = {}
        malformed = 0
        for msg in replies:
            c = by_id.get(msg.metadata.reply_to_message_id)
            if c is None or c in received or c in failed:
                continue  # a stale reply of an earlier round, or a second one
            if msg.metadata.reply_to_message_id in self.dropped:
                failed[c] = self.dropped.pop(msg.metadata.reply_to_message_id)
                malformed += failed[c].startswith("update rejected")
            elif msg.has_error():
                failed[c] = f"node {sent.messages[c].metadata.dst_node_id} failed: {error_reason(msg)}"
            else:
                try:
                    received[c] = decode_reply(msg.content, self.max_reply_bytes(sent.payloads[c]),
                                               upload_dtype_of(sent.payloads[c].config,
                                                               self.cfg.federation.upload_dtype))
                except Exception as e:  # noqa: BLE001 - no reply crashes the server
                    failed[c] = f"update rejected: malformed reply: {e}"
                    malformed += 1
        for c in sent.clients:
            if c not in received and c not in failed:
                failed[c] = (f"no reply within the {self.round_timeout:g} s round deadline "
                             "(federation.round_deadline_s)"
                             if self.cfg.federation.round_policy == "deadline" else
                             f"no reply within {self.round_timeout:g} s")
        for c, reason in sorted(failed.items()):
            log.warning("round %d: client %d excluded: %s", sent.number, c, reason)
        return received, [{"client": c, "reason": r} for c, r in sorted(failed.items())], malformed

    @staticmethod
    def max_reply_bytes(payload: Payload) -> int:
        """The most tensor bytes a reply to ``payload`` may hold before it is decoded: twice
        what was sent, plus 1 MiB (masks, reports); anything larger is malformed."""
        return 2 * (tensor_bytes(payload.arrays) + tensor_bytes(payload.model)) + (1 << 20)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        server_round += self.offset
        sent, self._round = self._round, None
        assert sent is not None and sent.number == server_round, "aggregate without configure"
        received, failures, malformed = self._collect(sent, replies)
        payloads = {c: sent.payloads[c] for c in received}
        if self.global_replies:
            result = self._aggregate_global(server_round, sent.state, received)
        else:
            result = self.inner.aggregate_train(server_round, sent.state, payloads, received)
        if result.skipped:
            log.warning("round %d: only %d valid replies (< federation.min_replies=%d): global "
                        "state unchanged", server_round, len(result.used), self.cfg.federation.min_replies)
        new_state, server_metrics = self.method.on_round_end(
            server_round, result.state, {c: received[c] for c in result.used})
        self._record(sent, received, failures, result, server_metrics, malformed)
        metrics = {"num-replies": len(received), "num-failed": len(failures)}
        if self.record["train_loss"] is not None:
            metrics["train-loss"] = self.record["train_loss"]
        return state_to_record(new_state), MetricRecord(metrics)

    # -- under Flower's DP wrapper ----------------------------------------------------------
    @property
    def round_state(self) -> State:
        """The global state the round being trained was sent."""
        return self._round.state

    def global_update(self, msg: Message) -> State | None:
        """A reply of the round as the method's update of the global state (full shape, global
        names: FedOT's sub-model scattered, FedPFT's proxy left out), or None after recording
        why it is rejected (it fails validation, or does not decode)."""
        sent = self._round
        by_id = {m.metadata.message_id: c for c, m in sent.messages.items()}
        c = by_id.get(msg.metadata.reply_to_message_id)
        if c is None or msg.has_error():
            return None
        payload = sent.payloads[c]
        try:
            reply = decode_reply(msg.content, self.max_reply_bytes(payload),
                                 upload_dtype_of(payload.config, self.cfg.federation.upload_dtype))
        except Exception as e:  # noqa: BLE001 - no reply crashes the server
            reason = f"malformed reply: {e}"
        else:
            reason = self.inner.absent(payload) or self.inner.validate(sent.state, payload, reply)
        if reason is None:
            deltas, _ = self.inner.client_updates(sent.number, sent.state, {c: payload}, {c: reply})
            return deltas[0]
        self.dropped[msg.metadata.reply_to_message_id] = f"update rejected: {reason}"
        return None

    def _aggregate_global(self, server_round: int, state: State, received: dict[int, Reply]) -> RoundResult:
        """DP-FedAvg's mean of clipped global-state updates (Flower clipped them and adds the
        noise: ``Privacy.external_noise``), with the accounting; min_replies as always."""
        for c in self.inner.sent:
            if c not in received:
                self.inner.forget(c)
        clients = sorted(received)
        if len(clients) < self.inner.min_valid():
            return RoundResult(state, clients, [], skipped=True)
        deltas = [client_delta(state, received[c].arrays) for c in clients]
        privacy = find_rule(self.inner, DPFedAvg).privacy
        new, metrics = privacy.aggregate(server_round, state, deltas, self.cfg.federation.server_lr,
                                         self.inner.population)
        return RoundResult(new, clients, [], metrics=metrics)

    def skip_round(self, server_round: int, replies: Iterable[Message], reason: str) -> None:
        """Record a round that a wrapper (Flower's DP) did not aggregate: state unchanged."""
        sent, self._round = self._round, None
        received, failures, malformed = self._collect(sent, replies)
        log.warning("round %d skipped: %s", sent.number, reason)
        excluded = [{"client": c, "reason": reason} for c in sorted(received)]
        self._record(sent, received, failures, RoundResult(sent.state, [], excluded, skipped=True),
                     {}, malformed)

    def _record(self, sent: _Round, received: dict[int, Reply], failures: list[dict[str, Any]],
                result: RoundResult, server_metrics: dict[str, Any], malformed: int = 0) -> None:
        record = {**round_record(sent.number, sent.clients, received, result), **server_metrics}
        record["excluded"] = sorted(failures + record["excluded"], key=lambda e: e["client"])
        record["rejected"] += malformed
        record["failed_nodes"] = len(failures) - malformed
        record["round_time_s"] = time.perf_counter() - sent.started
        self.record = record

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

    Each reply is validated by the method's strategy and turned into its update of the global
    state (``FlowerAdapter.global_update``: full shape and global names, so FedPFT's replies,
    whose global state also holds the server's proxy, and FedOT's, which name the sub-model, are
    clipped like FedAvg's: as a whole update of what the client trains). Flower's FlatClip
    (``compute_clip_model_update``) clips it to L2 norm ``dp.clip_norm`` (an update of norm 0 is
    left as it is: Flower 1.41 would divide by it), the adapter takes our fixed-denominator mean
    over ``clients_per_round`` with validation and the RDP accountant's step (``Privacy.
    external_noise``: no noise of ours), and Flower adds Gaussian noise of std ``z * eta * C / n``
    (``eta`` = ``server_lr``) to the tensors the clients update, from numpy's global RNG (the
    ServerApp seeds it with the run's seed); tensors no client updates (FedPFT's proxy) are not
    released and stay as they are, as in the simulation. A reply that fails validation is
    rejected and counted; a round with an error reply is skipped, as Flower's wrapper does, and
    recorded."""

    def __init__(self, adapter: FlowerAdapter, z: float, clip_norm: float, clients_per_round: int):
        eta = adapter.cfg.federation.server_lr
        super().__init__(adapter, z * eta, clip_norm, clients_per_round)
        self.adapter = adapter

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        event = self._pop_pending_event(server_round)
        if any(m.has_error() for m in replies):
            self.adapter.skip_round(server_round, replies, "a node failed: Flower's DP wrapper "
                                    "skips rounds with error replies")
            return self.current_arrays, None  # unchanged (Flower's result keeps the last arrays)
        state = self.adapter.round_state
        released: set[str] = set()
        for m in replies:
            update = self.adapter.global_update(m)
            if update is None:
                continue  # rejected: the adapter records why
            keys = [k for k in state if k in update]
            current = [state[k].numpy() for k in keys]
            ours = [(state[k] + update[k].to(state[k].dtype)).numpy() for k in keys]
            if any(bool(update[k].any()) for k in keys):  # Flower's clip divides by the norm
                compute_clip_model_update(param1=ours, param2=current, clipping_norm=self.clipping_norm)
            m.content[ARRAYS] = ArrayRecord({k: Array(np.asarray(v)) for k, v in zip(keys, ours)})
            released.update(keys)
        arrays, metrics = self.strategy.aggregate_train(server_round, replies)
        if arrays is not None and released and not self.adapter.record["skipped"]:
            noised = self._add_noise_to_aggregated_arrays(
                ArrayRecord({k: arrays[k] for k in arrays.keys() if k in released}))
            arrays = ArrayRecord({k: noised[k] if k in released else arrays[k] for k in arrays.keys()})
            self._compose_release(event)
        return arrays, metrics
