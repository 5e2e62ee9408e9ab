"""``federation.round_policy = 'async'`` on Flower: FedBuff over the Message API, per node
rather than per round.

The ServerApp keeps ``concurrency`` clients training: it pushes one train message per idle
connected client (``grid.push_messages``), pulls whatever replies have come in
(``grid.pull_messages``), and every ``buffer_size`` replies aggregates them with the in-process
engine's :class:`~fedslice.run.asynchronous.Staleness` (each update against the version its
client started from, scaled by 1/sqrt(1 + staleness)) into a new version: one of
``federation.rounds``, evaluated and recorded as a round. Replies arrive in real time, so which
replies share a buffer depends on the nodes' speed (a throttled node's replies come in stale),
not on a simulated clock; a message without a reply within the run config's ``round-timeout``
is dropped, said why, and its client is free again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Message, MessageType

from fedslice.fl.clock import SimClock
from fedslice.fl.selection import make_selector
from fedslice.fl.strategy import Payload, Reply, State, host_state
from fedslice.fl.wire import upload_dtype_of
from fedslice.flower.codec import decode_reply, encode_payload, error_reason
from fedslice.methods.plan_records import eligible
from fedslice.run.asynchronous import Buffer, Staleness
from fedslice.run.engine import finish_round, round_record

log = logging.getLogger(__name__)

#: seconds between two pulls while replies are awaited
POLL_S = 0.05
#: a train message outlives its wait by this much (its reply is reported missing, not expired)
TTL_MARGIN_S = 30.0


@dataclass
class Sent:
    """A train message in flight: its client, the version it was sent, the payload."""

    client: int
    base: int
    payload: Payload
    sent_at: float


class AsyncServer:
    """The asynchronous rounds of one Flower run (the ServerApp's ``train`` under 'async')."""

    def __init__(self, cfg, method, data, partitions, round_timeout: float, offset: int = 0):
        self.cfg, self.method, self.data, self.partitions = cfg, method, data, partitions
        self.round_timeout, self.offset = round_timeout, offset
        self.concurrency, self.buffer_size = cfg.federation.async_sizes()
        self.buffer = Buffer(cfg.seed, SimClock())
        self.aggregator = Staleness(method.strategy, self.buffer,
                                    cfg.federation.staleness_exponent)
        self.experiment = cfg.model_dump(mode="json")
        self.inflight: dict[str, Sent] = {}  # message id -> what it carries
        #: replies pulled past a full buffer: the next version's first
        self.waiting: list[tuple[Sent, Reply]] = []
        #: the session's selector (checkpoints keep one); selection here is the buffer's RNG
        self.selector = make_selector("uniform", cfg.federation.clients_per_round, cfg.seed)
        self.t0 = time.monotonic()

    # -- messages ----------------------------------------------------------------------------
    def dispatch(self, grid, version: int, state: State, busy: set[int]) -> None:
        """Push one train message per idle connected client until ``concurrency`` train."""
        free = self.concurrency - len(self.inflight)
        connected = self.partitions.refresh(grid, self.round_timeout)
        idle = eligible([c for c in connected if c not in busy and len(self.data.partitions[c]) > 0],
                        self.method.plans)  # less the clients that sit out every round
        if free <= 0 or not idle:
            return
        pick = sorted(int(c) for c in self.buffer.rng.choice(np.asarray(idle),
                                                             size=min(free, len(idle)), replace=False))
        payloads = self.method.strategy.configure_train(version, state, pick, len(connected))
        msgs = {c: Message(encode_payload(payloads[c], self.experiment),
                           dst_node_id=self.partitions.nodes[c], message_type=MessageType.TRAIN,
                           group_id=str(version), ttl=self.round_timeout + TTL_MARGIN_S)
                for c in pick}
        ids = list(grid.push_messages(list(msgs.values())))
        now = time.monotonic()
        for c, mid in zip(pick, ids):
            p = payloads[c]
            self.inflight[mid] = Sent(c, version - 1, Payload(p.arrays, p.config), now)
        log.info("version %d: training clients %s (%d in flight)", version, pick, len(self.inflight))

    def collect(self, grid) -> tuple[list[tuple[Sent, Reply]], list[dict[str, Any]]]:
        """The replies that have come in (decoded) and the messages that failed or timed out."""
        got, failed = [], []
        for msg in grid.pull_messages(list(self.inflight)):
            sent = self.inflight.pop(msg.metadata.reply_to_message_id, None)
            if sent is None:
                continue
            if msg.has_error():
                failed.append({"client": sent.client, "reason": f"node failed: {error_reason(msg)}"})
                continue
            try:
                reply = decode_reply(msg.content, 2 * _bytes(sent.payload) + (1 << 20),
                                     upload_dtype_of(sent.payload.config, self.cfg.federation.upload_dtype))
            except Exception as e:  # noqa: BLE001 - no reply crashes the server
                failed.append({"client": sent.client, "reason": f"update rejected: malformed reply: {e}"})
                continue
            got.append((sent, reply))
        now = time.monotonic()
        for mid, sent in list(self.inflight.items()):
            if now - sent.sent_at > self.round_timeout:
                del self.inflight[mid]
                failed.append({"client": sent.client,
                               "reason": f"no reply within {self.round_timeout:g} s"})
        for f in failed:
            self.method.strategy.forget(f["client"])
            log.warning("client %d excluded: %s", f["client"], f["reason"])
        return got, failed

    # -- one version -------------------------------------------------------------------------
    def run_version(self, grid, version: int, state: State) -> tuple[State, dict[str, Any]]:
        t_wall = time.perf_counter()
        b = self.buffer
        b.bases[version - 1] = state
        buffered, self.waiting = self.waiting, []
        failures: list[dict[str, Any]] = []
        while len(buffered) < self.buffer_size:
            busy = {s.client for s in self.inflight.values()} | \
                {s.client for s, _ in buffered + self.waiting}
            self.dispatch(grid, version, state, busy)
            if not self.inflight:
                break  # no node to train
            got, failed = self.collect(grid)
            buffered += got
            failures += failed
            if not got:
                time.sleep(POLL_S)
        buffered, self.waiting = buffered[:self.buffer_size], buffered[self.buffer_size:]
        replies = {s.client: r for s, r in sorted(buffered, key=lambda sr: sr[0].client)}
        payloads = {s.client: s.payload for s, _ in buffered}
        b.base_of, b.version = {s.client: s.base for s, _ in buffered}, version - 1
        result = self.aggregator.aggregate_train(version, state, payloads, replies)
        new_state, server_metrics = self.method.on_round_end(version, result.state,
                                                             {c: replies[c] for c in result.used})
        record = {**round_record(version, sorted(replies), replies, result), **server_metrics}
        for m in record["client_metrics"]:
            m.update(base_version=b.base_of[m["client"]],
                     staleness=version - 1 - b.base_of[m["client"]])
        record["excluded"] = sorted(failures + record["excluded"], key=lambda e: e["client"])
        stale = [version - 1 - s.base for s, _ in buffered]
        record.update(failed_nodes=len(failures), in_flight=len(self.inflight),
                      staleness_mean=float(np.mean(stale)) if stale else None,
                      staleness_max=max(stale) if stale else None,
                      wall_elapsed_s=time.monotonic() - self.t0,
                      round_time_s=time.perf_counter() - t_wall)
        keep = {s.base for s in self.inflight.values()} | {s.base for s, _ in self.waiting} | {version}
        b.bases = {v: s for v, s in b.bases.items() if v in keep}
        return host_state(new_state), record

    def run(self, grid, session, state: State) -> State:
        """``federation.rounds`` versions (after a resumed run's), each evaluated and recorded
        by the run session as a round."""
        for v in range(self.offset + 1, self.cfg.federation.rounds + 1):
            state, record = self.run_version(grid, v, state)
            finish_round(self.cfg, self.method, self.data, self.selector, v, state, record)
            self.buffer.bases[v] = state
            session.round_done(v, state, record, self.selector)
            log.info("version %d: train loss %s, staleness max %s", v, record["train_loss"],
                     record["staleness_max"])
        return state


def _bytes(payload: Payload) -> int:
    from fedslice.measure import tensor_bytes
    return tensor_bytes(payload.arrays) + tensor_bytes(payload.model)
