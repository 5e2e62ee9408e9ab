"""The in-process simulation engine: one backbone in memory, clients trained one after another.

The loop is Flower's, in one process: select clients -> ``strategy.configure_train`` ->
``method.fit`` per client -> ``strategy.aggregate_train`` -> evaluate. Everything a client keeps
between rounds is its partition; the trainable state lives in the server's state dict and is
loaded into the shared model in place for each client.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np

from fedslice import progress as progress_display
from fedslice.config import ExperimentConfig
from fedslice.data.federated import FederatedData
from fedslice.errors import ConfigError, DataError
from fedslice.fl.clock import SimClock, client_seconds, measure_host_gflops, settle_round
from fedslice.fl.devices import Population, population
from fedslice.fl.faults import corrupt, missed_deadline, plan_faults
from fedslice.methods.plan_records import eligible, sitting_out, too_few_eligible
from fedslice.methods.probe import probe_loss
from fedslice.run.predicted import RoundPrediction, fit_round, past_deadline, predict_round
from fedslice.run.runner import ClientRunner
from fedslice.run.session import Rounds
from fedslice.fl.selection import make_selector
from fedslice.methods import Method
from fedslice.fl.strategy import Payload, Reply, RoundResult, State, host_state, on_host
from fedslice.fl.wire import received, to_wire, upload_dtype_of
from fedslice.fl.workers import WorkerLost
from fedslice.heap import trim_heap
from fedslice.measure import ClientCost


log = logging.getLogger(__name__)

def client_seed(seed: int, server_round: int, client: int) -> int:
    """Independent, reproducible seed of one client's local training in one round."""
    return int(np.random.SeedSequence([seed, server_round, client]).generate_state(1)[0])


def _rss_mb() -> float | None:
    """This process's resident memory (MiB), recorded with every round."""
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except Exception:  # noqa: BLE001 - psutil missing or refused
        return None


def _max(values) -> float | None:
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


def _mean(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(vals)) if vals else None


def round_record(server_round: int, clients: list[int], replies: dict[int, Reply],
                 result: RoundResult) -> dict[str, Any]:
    """The metrics record of one round: selection, exclusions, per-client metrics (``used``:
    whether the reply went into the aggregation; a reply that failed validation is listed
    without what it reported) and mean costs over the used replies."""
    client_metrics = [{"client": c, "num_examples": r.num_examples, **r.metrics,
                       "used": c in result.used} if c not in result.invalid else
                      {"client": c, "used": False, "rejected": True}  # what it sent is not trusted
                      for c, r in replies.items()]
    used = [m for m in client_metrics if m["used"]]
    return {
        "round": server_round, "clients": clients, "excluded": result.excluded,
        "skipped": result.skipped, "rejected": result.rejected,
        "train_loss": _mean([m["loss"] for m in used]),
        "examples_used": sum(m["num_examples"] for m in used),
        **{f"{k}_mean": _mean([m.get(k) for m in used]) for k in ClientCost.ROUND_MEANS},
        **{f"{k}_max": _max(m.get(k) for m in used) for k in ClientCost.PEAKS},
        "client_metrics": client_metrics,
        **result.metrics,
    }


def wasted(replies: dict[int, Reply], dropped) -> dict[str, float]:
    """The measured FLOPs of the replies in ``dropped`` (trained, then not used) and their
    share of the round's."""
    flops = {c: float(r.metrics.get("flops_measured") or 0.0) for c, r in replies.items()}
    lost = sum(flops[c] for c in dropped if c in flops)
    total = sum(flops.values())
    return {"wasted_flops": lost, "round_flops": total}


class Simulation:
    """Runs an experiment in-process; ``on_round`` receives each round's metrics record."""

    def __init__(self, cfg: ExperimentConfig, method: Method, data: FederatedData):
        self.cfg, self.method, self.data = cfg, method, data
        fed = cfg.federation
        if fed.round_policy == "async" and type(self) is Simulation:
            raise TypeError("federation.round_policy = 'async' runs in "
                            "fedslice.run.asynchronous.AsyncSimulation (simulation_for picks it)")
        k = fed.clients_per_round
        if fed.round_policy == "deadline":  # over-selection: the first k replies are used
            k = min(math.ceil(k * (1 + fed.overselect) - 1e-9), fed.num_clients)
        self.selector = make_selector(fed.selection, k, cfg.seed)
        #: the clients' devices and the simulated clock (None: no [devices], no simulated time)
        self.population: Population | None = population(cfg, len(data.partitions))
        if self.population is None and fed.round_policy != "all":
            raise ConfigError(f"federation.round_policy = {fed.round_policy!r} needs devices on "
                              "the simulated clock in the in-process engine: a [devices] section "
                              "or device fields (gflops_per_s, ...) in budgets.tiers (on Flower, "
                              "the deadline is real time)")
        self.clock: SimClock | None = None
        if self.population is not None:
            host = cfg.devices.host_gflops_per_s if cfg.devices is not None else None
            if host is None and self.population.uses_speed_factors:
                host = measure_host_gflops()  # replaced by the checkpoint's on resume
            self.clock = SimClock(0.0, host)
        # a client whose plan sits out every round is never selected (as an offline device)
        if note := too_few_eligible(method.plans, fed.clients_per_round):
            log.warning("%s", note)
        self.candidates = eligible([c for c, p in enumerate(data.partitions) if len(p) > 0],
                                   method.plans)
        empty = data.report.get("empty_partitions", [])
        if empty:
            log.warning("%d client(s) have no training data and are never selected: %s",
                        len(empty), empty[:20])
        if not self.candidates:
            raise DataError("every client partition is empty: reduce federation.num_clients")
        self.runner = ClientRunner(method.compute)

    def cold_start_probe(self, state: State) -> dict[str, Any]:
        """``federation.cold_start='probe'``: the global model's loss on a few examples of every
        client the selector has no loss for (forward only; its FLOPs are in the round record)."""
        fed = self.cfg.federation
        unknown = self.selector.unknown(self.candidates) if fed.cold_start == "probe" else []
        if not unknown:
            return {}
        losses, flops = {}, 0.0
        for c in unknown:
            losses[c], f = probe_loss(self.method, state, self.data.client(c), fed.probe_examples,
                                                  client_seed(self.cfg.seed, 0, c))
            flops += f
        self.selector.observe_probe(losses)
        return {"probe_clients": len(unknown), "probe_flops": flops}

    def online(self, server_round: int) -> list[int]:
        """The candidates online at the clock's time (every candidate without devices); with
        a trace and none online, the clock first moves to when one comes online."""
        if self.population is None:
            return self.candidates
        while True:
            now = self.clock.now
            on = [c for c in self.candidates if self.population.online(c, server_round, now)]
            nxt = None if on else self.population.next_online(now)
            if nxt is None:
                return on
            self.clock.now = nxt

    def client_seconds(self, replies: dict[int, Reply], late: dict[int, float]) -> dict[int, float]:
        """Each reply's client-round in simulated seconds (+ an injected straggler's delay)."""
        host = self.clock.host_gflops_per_s
        return {c: client_seconds(self.population.devices[c], r.metrics, host) + late.get(c, 0.0)
                for c, r in replies.items()}

    def run_round(self, server_round: int, state: State) -> tuple[State, dict[str, Any]]:
        t0 = time.perf_counter()
        strategy, method, f = self.method.strategy, self.method, self.cfg.faults
        fed = self.cfg.federation
        probe = self.cold_start_probe(state)
        clients = self.selector.select(server_round, self.online(server_round))
        faults = plan_faults(f, self.cfg.seed, server_round, clients)
        payloads = strategy.configure_train(server_round, state, clients, len(self.candidates))
        replies: dict[int, Reply] = {}
        lost: dict[int, str] = {}
        todo = [c for c in clients if c not in faults.dropped]
        seeds = {c: client_seed(self.cfg.seed, server_round, c) for c in todo}
        predicted = self.predict(payloads, todo, seeds)
        fitted = self.fit_rounds(payloads, predicted, todo, seeds)
        sat_out = past_deadline(predicted, fed.round_deadline_s) if fed.round_policy == "deadline" else {}
        todo = [c for c in todo if c not in sat_out]
        with progress_display.task(f"round {server_round}: clients", len(clients)) as advance:
            advance(len(clients) - len(todo))

            def on_reply(c: int, reply: Reply | WorkerLost) -> None:
                if isinstance(reply, WorkerLost):
                    lost[c] = reply.reason
                else:
                    # as it travels: sent in its upload dtype, restored to fp32
                    wire = upload_dtype_of(payloads[c].config, fed.upload_dtype)
                    reply = received(to_wire(on_host(reply), wire), wire)
                    if kind := faults.kind(c):
                        sent = strategy.expected_update(state, payloads[c], reply)
                        reply = corrupt(f, kind, reply, sent, self.cfg.seed, server_round, c)
                    replies[c] = reply
                advance()

            mode = self.runner.fit(method, todo, payloads, self.data.client, seeds, on_reply)
        replies = {c: replies[c] for c in clients if c in replies}  # selection order, as they ran
        late = missed_deadline(f, faults)
        arrived = {c: r for c, r in replies.items() if c not in late}
        timed = self.settle(server_round, replies, faults.late) if self.clock is not None else None
        if timed is not None:
            arrived = {c: r for c, r in arrived.items() if c not in timed[0].dropped}
        result = strategy.aggregate_train(server_round, state, payloads, arrived)
        if result.skipped:
            log.warning("round %d: only %d valid replies (< federation.min_replies=%d): skipped, "
                        "global state unchanged", server_round, len(result.used), self.cfg.federation.min_replies)
        new_state, server_metrics = method.on_round_end(server_round, result.state,
                                                        {c: replies[c] for c in result.used})
        new_state = host_state(new_state)
        record = {**round_record(server_round, clients, replies, result), **server_metrics, **probe}
        gone = [{"client": c, "reason": "dropped out (injected)"} for c in sorted(faults.dropped)]
        gone += [{"client": c, "reason": f"{why}: dropped this round"} for c, why in sorted(lost.items())]
        gone += [{"client": c, "reason": f"reply {d:g} s after the round started, past the "
                  f"{f.deadline_s:g} s deadline (injected straggler)"} for c, d in sorted(late.items())]
        gone += [{"client": c, "reason": why} for c, why in sat_out.items()]
        if gone:
            record["excluded"] = sorted(record["excluded"] + gone, key=lambda e: e["client"])
        record.update(dropped=len(faults.dropped) + len(lost), late=len(late),
                      attackers=sorted(faults.attackers), client_mode=mode)
        if timed is not None:
            self.clock_record(record, replies, *timed, predicted)
            record["sat_out"] = len(sat_out)
        if fitted:
            record["rounds_fitted"] = [{"client": c, "batch_size": b} for c, b in sorted(fitted.items())]
        record["round_time_s"] = time.perf_counter() - t0
        record["process_rss_mb"] = _rss_mb()
        return new_state, record

    def settle(self, server_round: int, replies: dict[int, Reply], delays: dict[int, float]):
        """The round on the simulated clock: (what the policy keeps, each reply's seconds).
        The clock moves to the round's end."""
        fed, now = self.cfg.federation, self.clock.now
        secs = self.client_seconds(replies, delays)
        offline = {c: self.population.online_until(c, now) - now for c in replies}
        settled = settle_round(fed.round_policy, secs, deadline_s=fed.round_deadline_s,
                               needed=fed.clients_per_round if fed.round_policy == "deadline" else None,
                               offline_at={c: t for c, t in offline.items() if math.isfinite(t)})
        self.clock.now = now + settled.seconds
        return settled, secs

    def predict(self, payloads: dict[int, Payload], todo: list[int], seeds: dict[int, int]
                ) -> dict[int, RoundPrediction]:
        """The planner's prediction of each client-round of ``todo`` from its own batches
        (:mod:`fedslice.run.predicted`); empty without plans or devices."""
        plans = getattr(self.method, "plans", None) or {}
        if self.clock is None or not plans:
            return {}
        out = {}
        for c in todo:
            if c in plans:
                p = predict_round(self.method, plans[c], payloads[c], self.data.client(c), seeds[c],
                                  self.population.devices[c], self.clock.host_gflops_per_s)
                if p is not None:
                    out[c] = p
        return out

    def fit_rounds(self, payloads: dict[int, Payload], predicted: dict[int, RoundPrediction],
                   todo: list[int], seeds: dict[int, int]) -> dict[int, int]:
        """``budgets.fit_rounds``: each client-round of ``todo`` its guard would cut, that would
        reply past its time limit, or whose first step alone passes its FLOPs budget, sent with
        the examples per step that train the most within them
        (:func:`fedslice.run.predicted.fit_round`); ``payloads`` and ``predicted`` are updated
        in place. Returns client -> the round's examples per step."""
        budgets = self.cfg.budgets
        plans = getattr(self.method, "plans", None) or {}
        if budgets is None or not budgets.fit_rounds or not plans:
            return {}
        fitted = {}
        host = self.clock.host_gflops_per_s if self.clock is not None else None
        for c in todo:
            if c not in plans:
                continue
            limit = plans[c].budget.seconds_per_round if c in predicted else None
            device = self.population.devices[c] if limit is not None else None
            got = fit_round(self.method, plans[c], payloads[c], self.data.client(c), seeds[c],
                            device, host, limit)
            if got is not None:
                payloads[c] = got[0]
                if got[1] is not None:
                    predicted[c] = got[1]
                fitted[c] = payloads[c].orders.batch_size
        return fitted

    def clock_record(self, record: dict[str, Any], replies: dict[int, Reply], settled, secs,
                     predicted: dict[int, RoundPrediction]) -> None:
        """Simulated time next to wall time: the round's and the run's seconds, each client's
        (and the planner's prediction of it, from its round's own batches), and the work of the
        replies the policy dropped (wasted)."""
        plans = getattr(self.method, "plans", None) or {}
        for m in record["client_metrics"]:
            if m["client"] in secs:
                m["sim_s"] = secs[m["client"]]
                planned = plans.get(m["client"])
                if m["client"] in predicted:
                    m["sim_s_predicted"] = predicted[m["client"]].seconds
                if planned is not None and planned.seconds is not None:  # a mean round's
                    m["sim_s_planned"] = planned.seconds
        gone = [{"client": c, "reason": why} for c, why in sorted(settled.dropped.items())]
        if gone:
            record["excluded"] = sorted(record["excluded"] + gone, key=lambda e: e["client"])
        record.update(sim_round_s=settled.seconds, sim_time_s=self.clock.now,
                      sim_dropped=len(settled.dropped), **wasted(replies, settled.dropped))

    def run(self, rounds: Rounds | None = None) -> tuple[State, list[dict[str, Any]], dict[str, Any]]:
        """The rounds of ``rounds`` (default: a fresh run kept in memory; a
        :class:`~fedslice.run.session.RunSession` records them in its run folder, and a resumed
        one starts after its checkpoint). Returns the final state, every round's record and the
        summary."""
        rounds = rounds or Rounds(self.cfg, self.method)
        state = rounds.initial_state(self.selector, self.clock)
        for rnd in range(rounds.done + 1, self.cfg.federation.rounds + 1):
            state, record = self.run_round(rnd, state)
            finish_round(self.cfg, self.method, self.data, self.selector, rnd, state, record)
            rounds.round_done(rnd, state, record, self.selector, self.clock)
            progress_display.round_done(record)
        return state, rounds.records, finalize(self.cfg, self.method, self.data, state,
                                               rounds.records, rounds.t_start)


def finalize(cfg: ExperimentConfig, method: Method, data: FederatedData, state: State,
             records: list[dict[str, Any]], t_start: float) -> dict[str, Any]:
    """After the last round: test evaluation, the run's summary and the method's own results.
    Shared by the engine and the Flower ServerApp."""
    test = method.evaluate(state, data.test, cfg.evaluation.batch_size)
    summary = summarize(cfg, records, test, time.perf_counter() - t_start, data,
                        primary=method.task.primary_metric)
    if samples := getattr(method.task, "last_samples", None):  # generative tasks' first answers
        summary["samples"] = samples
    summary.update(method.final_metrics(state, data, records, cfg.evaluation.batch_size))
    if method.plans:  # [budgets]: each group's plan, its predicted and measured costs
        from fedslice.methods.plan_report import plan_report
        summary["plans"] = plan_report(method.plans, records)
        if out := sitting_out(method.plans):  # never selected: who and why
            summary["sat_out"] = {str(c): why for c, why in out.items()}
    return summary


def finish_round(cfg: ExperimentConfig, method: Method, data: FederatedData, selector,
                 server_round: int, state: State, record: dict[str, Any]) -> None:
    """After aggregation: evaluate on dev every E rounds (and test if tracked), then feed the
    clients' losses and the global dev loss to the selector. Shared by the engine and Flower."""
    record[f"dev_{method.task.primary_metric}"] = record["dev_loss"] = None
    ev_cfg = cfg.evaluation
    if server_round % ev_cfg.every == 0 or server_round == cfg.federation.rounds:
        ev = method.evaluate(state, data.dev, ev_cfg.batch_size, ev_cfg.dev_generations)
        record.update({f"dev_{k}": v for k, v in _scalars(ev).items()})
        if ev_cfg.track_test:
            ev = method.evaluate(state, data.test, ev_cfg.batch_size)
            record.update({f"test_{k}": v for k, v in _scalars(ev).items()})
        trim_heap()  # evaluation's large batches: give the freed heap back (workers fork from here)
    losses = {m["client"]: m["loss"] for m in record["client_metrics"] if m.get("used", True)}
    selector.observe(server_round, losses, record["dev_loss"])


def summarize(cfg: ExperimentConfig, records: list[dict], test: dict, wall: float,
              data: FederatedData, primary: str = "accuracy") -> dict[str, Any]:
    """The run's summary: every test metric (``test_<name>``), the primary metric's name, the
    final dev value and the round it reached its target, and the mean per-client costs."""
    ev = cfg.evaluation
    target = ev.target_accuracy if primary == "accuracy" else ev.target
    key = f"dev_{primary}"
    reached = [r["round"] for r in records
               if target is not None and (r.get(key) or 0) >= target]
    per_client = [m for r in records for m in r["client_metrics"] if m.get("used", True)]
    return {
        "name": cfg.run_name, "method": cfg.method.name, "seed": cfg.seed,
        "task": cfg.task.kind, "primary_metric": primary,
        **{f"test_{k}": v for k, v in _scalars(test).items()},
        f"final_dev_{primary}": records[-1].get(key) if records else None,
        "rounds": len(records), "target_accuracy": target,
        "rounds_to_target": reached[0] if reached else None,
        **{f"{k}_mean": _mean([m.get(k) for m in per_client]) for k in ClientCost.SUMMARY_MEANS},
        **{f"{k}_max": _max(m.get(k) for m in per_client) for k in ClientCost.PEAKS},
        "excluded_replies": sum(len(r["excluded"]) for r in records),
        "rejected_replies": sum(r.get("rejected", 0) for r in records),
        "examples_used": sum(r.get("examples_used", 0) for r in records),
        "skipped_rounds": sum(1 for r in records if r.get("skipped")),
        "empty_partitions": len(data.report.get("empty_partitions", [])),
        "wall_time_s": wall,
        **_per_class(test, data),
        **sim_summary(records, key, target),
    }


def sim_summary(records: list[dict], key: str, target: float | None) -> dict[str, Any]:
    """On the simulated clock (runs with devices): the run's simulated seconds, when it
    reached its target, and the client work the round policy wasted (FLOPs trained, not used)."""
    if not records or "sim_time_s" not in records[-1]:
        return {}
    reached = [r["sim_time_s"] for r in records if target is not None and (r.get(key) or 0) >= target]
    lost = sum(r.get("wasted_flops", 0.0) for r in records)
    total = sum(r.get("round_flops", 0.0) for r in records)
    return {"sim_time_s": records[-1]["sim_time_s"],
            "sim_time_to_target_s": reached[0] if reached else None,
            "wasted_flops": lost, "wasted_share": lost / total if total else 0.0,
            "sat_out": sum(r.get("sat_out", 0) for r in records)}


def _scalars(metrics: dict[str, Any]) -> dict[str, Any]:
    """The single-number metrics of an evaluation (per-class lists are reported apart)."""
    return {k: v for k, v in metrics.items() if not isinstance(v, (list, dict))}


def _per_class(test: dict, data: FederatedData) -> dict[str, Any]:
    """Test accuracy on each class's examples, keyed by the class name (or id)."""
    accs = test.get("per_class_accuracy")
    if accs is None:
        return {}
    names = data.label_names or [str(i) for i in range(len(accs))]
    return {"test_accuracy_per_class": {n: a for n, a in zip(names, accs)}}
