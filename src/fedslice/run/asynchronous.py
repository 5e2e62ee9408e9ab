"""Asynchronous buffered aggregation on the simulated clock (``federation.round_policy =
'async'``): FedBuff (Nguyen et al., "Federated Learning with Buffered Asynchronous
Aggregation", AISTATS 2022).

The server keeps ``concurrency`` clients training. A client starts from the global model of
the moment (its *base version*), trains, and its reply arrives after its client-round on its
device (:meth:`fedslice.fl.devices.Device.seconds`). Every ``buffer_size`` replies the server
aggregates them into a new version (one "round" of ``federation.rounds``), each update taken
against its own base and scaled by s(τ) = (1 + τ)^-a, a = ``federation.staleness_exponent``
(FedBuff's 0.5 by default), τ = the versions published since its base
(:func:`fedslice.fl.clock.staleness_weight`); the method's weights are unchanged, so the server
step shrinks with staleness as in FedBuff's Algorithm 1. A client is busy from its
start until its reply is aggregated (or lost: offline before it arrives, by the trace).

The simulation trains a client when it starts (from the model it would download then), so
its measured FLOPs give its arrival time; replies in flight are kept (with their payloads and
base versions) in every checkpoint, so a run resumes bit-identically.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedslice import progress as progress_display
from fedslice.config import ExperimentConfig
from fedslice.data.federated import FederatedData
from fedslice.fl.clock import SimClock, client_seconds, staleness_weight
from fedslice.fl.strategy import Payload, Reply, State, Strategy, Wrapper, host_state, on_host
from fedslice.fl.wire import received, to_wire, upload_dtype_of
from fedslice.fl.workers import WorkerLost
from fedslice.methods import Method
from fedslice.run.engine import (Simulation, _rss_mb, client_seed, finalize, finish_round,
                                 round_record)
from fedslice.run.session import Rounds


@dataclass
class Job:
    """One client's work in flight: trained from version ``base`` at ``start``, its reply
    arriving at ``arrival`` (simulated seconds); ``seq``: the dispatch's number (the order of
    ties, the client's training seed); ``predicted``: the planner's seconds for it, predicted
    before it was sent from its own batches (:mod:`fedslice.run.predicted`; None without a
    plan)."""

    client: int
    seq: int
    base: int
    start: float
    arrival: float
    payload: Payload
    reply: Reply
    predicted: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"client": self.client, "seq": self.seq, "base": self.base, "start": self.start,
                "arrival": self.arrival,
                "payload": {"arrays": self.payload.arrays, "config": self.payload.config},
                "reply": {"arrays": self.reply.arrays, "num_examples": self.reply.num_examples,
                          "metrics": self.reply.metrics}, "predicted": self.predicted}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Job:
        p, r = d["payload"], d["reply"]
        return cls(int(d["client"]), int(d["seq"]), int(d["base"]), float(d["start"]),
                   float(d["arrival"]), Payload(dict(p["arrays"]), dict(p["config"])),
                   Reply(dict(r["arrays"]), int(r["num_examples"]), dict(r["metrics"])),
                   None if d.get("predicted") is None else float(d["predicted"]))


class Buffer:
    """What the asynchronous server holds between aggregations: the clock, the clients in
    flight, the global states they started from, the dispatch count and the selection RNG.
    The run's checkpoints keep it (``state_dict``)."""

    def __init__(self, seed: int, clock: SimClock):
        self.clock = clock
        self.inflight: list[Job] = []
        self.bases: dict[int, State] = {}
        self.seq = 0
        self.rng = np.random.default_rng([seed, 0xA5C])
        #: client -> base version of the replies being aggregated (read by :class:`Staleness`)
        self.base_of: dict[int, int] = {}
        self.version = 0  # the version the aggregation in progress publishes, minus one

    def prune(self, current: int) -> None:
        """Forget the states no job in flight started from."""
        keep = {j.base for j in self.inflight} | {current}
        self.bases = {v: s for v, s in self.bases.items() if v in keep}

    def state_dict(self) -> dict[str, Any]:
        return {"clock": self.clock.state_dict(), "seq": self.seq,
                "rng": self.rng.bit_generator.state,
                "inflight": [j.to_dict() for j in self.inflight],
                "bases": {str(v): s for v, s in self.bases.items()
                          if any(j.base == v for j in self.inflight)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clock.load_state_dict(state["clock"])
        self.seq = int(state["seq"])
        self.rng.bit_generator.state = state["rng"]
        self.inflight = [Job.from_dict(j) for j in state["inflight"]]
        self.bases = {int(v): dict(s) for v, s in state["bases"].items()}


class Staleness(Wrapper):
    """The method's strategy (and its rules) aggregating a buffer of replies trained from
    different versions: each reply's update is taken against the state it started from
    (``buffer.bases``) by the method's own :meth:`client_updates`, then scaled by
    :func:`staleness_weight`; the weights stay the method's. A buffer of fresh replies is
    aggregated exactly as a synchronous round."""

    def __init__(self, inner: Strategy, buffer: Buffer, exponent: float = 0.5):
        super().__init__(inner)
        self.buffer = buffer
        self.exponent = exponent  # federation.staleness_exponent

    def client_updates(self, server_round: int, state: State, payloads: dict[int, Payload],
                       replies: dict[int, Reply]) -> tuple[list[State], list]:
        b = self.buffer
        if all(b.base_of[c] == b.version for c in replies):
            return self.inner.client_updates(server_round, state, payloads, replies)
        out: dict[int, tuple[State, Any]] = {}
        for v in sorted({b.base_of[c] for c in replies}):
            group = sorted(c for c in replies if b.base_of[c] == v)
            deltas, weights = self.inner.client_updates(
                server_round, b.bases[v], {c: payloads[c] for c in group},
                {c: replies[c] for c in group})
            s = staleness_weight(b.version - v, self.exponent)
            for c, d, w in zip(group, deltas, weights):
                out[c] = ({k: t * s for k, t in d.items()} if s != 1.0 else d, w)
        clients = sorted(replies)
        return [out[c][0] for c in clients], [out[c][1] for c in clients]


class AsyncSimulation(Simulation):
    """The in-process engine under ``federation.round_policy = 'async'``: each of
    ``federation.rounds`` is one aggregation of ``buffer_size`` replies."""

    def __init__(self, cfg: ExperimentConfig, method: Method, data: FederatedData):
        super().__init__(cfg, method, data)
        self.concurrency, self.buffer_size = cfg.federation.async_sizes()
        self.buffer = Buffer(cfg.seed, self.clock)
        self.aggregator = Staleness(method.strategy, self.buffer,
                                    cfg.federation.staleness_exponent)

    # -- dispatch ----------------------------------------------------------------------------
    def dispatch(self, version: int, state: State, busy: set[int]) -> list[tuple[int, str]]:
        """Start idle online clients until ``concurrency`` train, each from ``state`` (version
        ``version - 1``), trained now; returns the clients lost while training."""
        b, now = self.buffer, self.clock.now
        free = self.concurrency - len(b.inflight)
        idle = [c for c in self.candidates
                if c not in busy and self.population.online(c, version, now)]
        if free <= 0 or not idle:
            return []
        pick = sorted(int(c) for c in b.rng.choice(np.asarray(idle), size=min(free, len(idle)),
                                                   replace=False))
        strategy, fed = self.method.strategy, self.cfg.federation
        payloads = strategy.configure_train(version, state, pick, len(self.candidates))
        seqs = {c: b.seq + i for i, c in enumerate(pick)}
        b.seq += len(pick)
        seeds = {c: client_seed(self.cfg.seed, seqs[c], c) for c in pick}
        predicted = self.predict(payloads, pick, seeds)
        lost: list[tuple[int, str]] = []
        host = self.clock.host_gflops_per_s

        def on_reply(c: int, reply: Reply | WorkerLost) -> None:
            if isinstance(reply, WorkerLost):
                lost.append((c, reply.reason))
                return
            wire = upload_dtype_of(payloads[c].config, fed.upload_dtype)
            reply = received(to_wire(on_host(reply), wire), wire)
            secs = client_seconds(self.population.devices[c], reply.metrics, host)
            p = payloads[c]
            b.inflight.append(Job(c, seqs[c], version - 1, now, now + secs,
                                  Payload(p.arrays, p.config), reply,
                                  predicted[c].seconds if c in predicted else None))

        self.runner.fit(self.method, pick, payloads, self.data.client, seeds, on_reply)
        for c, _ in lost:
            strategy.forget(c)
        return lost

    def next_arrival(self) -> Job:
        b = self.buffer
        job = min(b.inflight, key=lambda j: (j.arrival, j.seq))
        b.inflight.remove(job)
        return job

    # -- one aggregation ---------------------------------------------------------------------
    def run_version(self, version: int, state: State) -> tuple[State, dict[str, Any]]:
        t_wall = time.perf_counter()
        b, clock = self.buffer, self.clock
        start = clock.now
        b.bases[version - 1] = state
        buffered: list[Job] = []
        dropped: list[tuple[Job | int, str]] = []
        while len(buffered) < self.buffer_size:
            busy = {j.client for j in b.inflight} | {j.client for j in buffered}
            dropped += self.dispatch(version, state, busy)
            if not b.inflight:
                nxt = self.population.next_online(clock.now)
                if nxt is None:
                    break  # nobody online to train: aggregate what arrived
                clock.now = nxt
                continue
            job = self.next_arrival()
            clock.now = max(clock.now, job.arrival)
            until = self.population.online_until(job.client, job.start)
            if until < job.arrival:
                self.method.strategy.forget(job.client)
                dropped.append((job, f"went offline at {until:.3g} s, before its reply at "
                                     f"{job.arrival:.3g} s (simulated clock)"))
                continue
            buffered.append(job)
        return self.aggregate(version, state, buffered, dropped, start, t_wall)

    def aggregate(self, version: int, state: State, buffered: list[Job], dropped: list,
                  start: float, t_wall: float) -> tuple[State, dict[str, Any]]:
        b, method = self.buffer, self.method
        replies = {j.client: j.reply for j in sorted(buffered, key=lambda j: j.client)}
        payloads = {j.client: j.payload for j in buffered}
        b.base_of, b.version = {j.client: j.base for j in buffered}, version - 1
        result = self.aggregator.aggregate_train(version, state, payloads, replies)
        new_state, server_metrics = method.on_round_end(version, result.state,
                                                        {c: replies[c] for c in result.used})
        new_state = host_state(new_state)
        record = {**round_record(version, sorted(replies), replies, result), **server_metrics}
        plans = method.plans or {}
        for m in record["client_metrics"]:
            j = next(j for j in buffered if j.client == m["client"])
            m.update(sim_s=j.arrival - j.start, base_version=j.base, staleness=version - 1 - j.base)
            if j.predicted is not None:  # as the synchronous engine records it
                m["sim_s_predicted"] = j.predicted
            if (plan := plans.get(j.client)) is not None and plan.seconds is not None:
                m["sim_s_planned"] = plan.seconds  # a mean round's
        gone = [{"client": j if isinstance(j, int) else j.client, "reason": why} for j, why in dropped]
        if gone:
            record["excluded"] = sorted(record["excluded"] + gone, key=lambda e: e["client"])
        lost_flops = sum(float(j.reply.metrics.get("flops_measured") or 0.0)
                         for j, _ in dropped if not isinstance(j, int))
        used_flops = sum(float(r.metrics.get("flops_measured") or 0.0) for r in replies.values())
        stale = [version - 1 - j.base for j in buffered]
        record.update(dropped=len(dropped), late=0, attackers=[], client_mode="async",
                      sim_round_s=self.clock.now - start, sim_time_s=self.clock.now,
                      sim_dropped=len(dropped), wasted_flops=lost_flops,
                      round_flops=used_flops + lost_flops, in_flight=len(b.inflight),
                      staleness_mean=float(np.mean(stale)) if stale else None,
                      staleness_max=max(stale) if stale else None,
                      round_time_s=time.perf_counter() - t_wall, process_rss_mb=_rss_mb())
        b.prune(version)
        return new_state, record

    def run(self, rounds: Rounds | None = None) -> tuple[State, list[dict[str, Any]], dict[str, Any]]:
        rounds = rounds or Rounds(self.cfg, self.method)
        state = rounds.initial_state(self.selector, self.buffer)
        for v in range(rounds.done + 1, self.cfg.federation.rounds + 1):
            state, record = self.run_version(v, state)
            finish_round(self.cfg, self.method, self.data, self.selector, v, state, record)
            self.buffer.bases[v] = state  # the next dispatches start from it
            rounds.round_done(v, state, record, self.selector, self.buffer)
            progress_display.round_done(record)
        return state, rounds.records, finalize(self.cfg, self.method, self.data, state,
                                               rounds.records, rounds.t_start)


def simulation_for(cfg: ExperimentConfig, method: Method, data: FederatedData) -> Simulation:
    """The in-process engine for ``cfg``'s round policy."""
    cls = AsyncSimulation if cfg.federation.round_policy == "async" else Simulation
    return cls(cfg, method, data)
