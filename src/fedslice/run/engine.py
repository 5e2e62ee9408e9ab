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
from fedslice.errors import DataError
from fedslice.fl.faults import corrupt, missed_deadline, plan_faults
from fedslice.run.runner import ClientRunner
from fedslice.run.session import Rounds
from fedslice.fl.selection import make_selector
from fedslice.methods import Method
from fedslice.fl.strategy import Reply, RoundResult, State, host_state, on_host
from fedslice.fl.wire import received, to_wire
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


class Simulation:
    """Runs an experiment in-process; ``on_round`` receives each round's metrics record."""

    def __init__(self, cfg: ExperimentConfig, method: Method, data: FederatedData):
        self.cfg, self.method, self.data = cfg, method, data
        self.selector = make_selector(cfg.federation.selection, cfg.federation.clients_per_round,
                                      cfg.seed)
        self.candidates = [c for c, p in enumerate(data.partitions) if len(p) > 0]
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
            losses[c], f = self.method.probe_loss(state, self.data.client(c), fed.probe_examples,
                                                  client_seed(self.cfg.seed, 0, c))
            flops += f
        self.selector.observe_probe(losses)
        return {"probe_clients": len(unknown), "probe_flops": flops}

    def run_round(self, server_round: int, state: State) -> tuple[State, dict[str, Any]]:
        t0 = time.perf_counter()
        strategy, method, f = self.method.strategy, self.method, self.cfg.faults
        fed = self.cfg.federation
        probe = self.cold_start_probe(state)
        clients = self.selector.select(server_round, self.candidates)
        faults = plan_faults(f, self.cfg.seed, server_round, clients)
        payloads = strategy.configure_train(server_round, state, clients, len(self.candidates))
        replies: dict[int, Reply] = {}
        lost: dict[int, str] = {}
        todo = [c for c in clients if c not in faults.dropped]
        seeds = {c: client_seed(self.cfg.seed, server_round, c) for c in todo}
        with progress_display.task(f"round {server_round}: clients", len(clients)) as advance:
            advance(len(clients) - len(todo))

            def on_reply(c: int, reply: Reply | WorkerLost) -> None:
                if isinstance(reply, WorkerLost):
                    lost[c] = reply.reason
                else:
                    # as it travels: sent in federation.upload_dtype, restored to fp32
                    reply = received(to_wire(on_host(reply), fed.upload_dtype), fed.upload_dtype)
                    if kind := faults.kind(c):
                        sent = strategy.expected_update(state, payloads[c], reply)
                        reply = corrupt(f, kind, reply, sent, self.cfg.seed, server_round, c)
                    replies[c] = reply
                advance()

            mode = self.runner.fit(method, todo, payloads, self.data.client, seeds, on_reply)
        replies = {c: replies[c] for c in clients if c in replies}  # selection order, as they ran
        late = missed_deadline(f, faults)
        arrived = {c: r for c, r in replies.items() if c not in late}
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
        if gone:
            record["excluded"] = sorted(record["excluded"] + gone, key=lambda e: e["client"])
        record.update(dropped=len(faults.dropped) + len(lost), late=len(late),
                      attackers=sorted(faults.attackers), client_mode=mode)
        record["round_time_s"] = time.perf_counter() - t0
        record["process_rss_mb"] = _rss_mb()
        return new_state, record

    def run(self, rounds: Rounds | None = None) -> tuple[State, list[dict[str, Any]], dict[str, Any]]:
        """The rounds of ``rounds`` (default: a fresh run kept in memory; a
        :class:`~fedslice.run.session.RunSession` records them in its run folder, and a resumed
        one starts after its checkpoint). Returns the final state, every round's record and the
        summary."""
        rounds = rounds or Rounds(self.cfg, self.method)
        state = rounds.initial_state(self.selector)
        for rnd in range(rounds.done + 1, self.cfg.federation.rounds + 1):
            state, record = self.run_round(rnd, state)
            finish_round(self.cfg, self.method, self.data, self.selector, rnd, state, record)
            rounds.round_done(rnd, state, record, self.selector)
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
        from fedslice.methods.planner import plan_report
        summary["plans"] = plan_report(method.plans, records)
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
    }


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
