"""Concurrent clients on the CPU (``compute.workers``): forked worker processes give the same
replies as the sequential path, lose only the client of a worker that dies, and leave no
process behind."""

import os
import signal

import psutil
import pytest
import torch

from fedslice.api import setup
from fedslice.experiment import validate_config
from fedslice.run.engine import Simulation
from fedslice.fl.workers import WorkerError, WorkerLost, run_forked
from tests.conftest import method_options


def _run(cfg_dict, workers, **compute):
    cfg_dict = {**cfg_dict, "compute": {"workers": workers, **compute}}
    cfg = validate_config(cfg_dict)
    method, data = setup(cfg)
    state, records, _ = Simulation(cfg, method, data).run()
    return method, state, records


def _children() -> list[int]:
    return [p.pid for p in psutil.Process().children(recursive=True)]


def _square(x):
    return x * x


def test_run_forked_returns_every_result_and_reaps_workers():
    before = _children()
    seen = []
    out = run_forked(_square, list(range(7)), 3, on_result=lambda j, r: seen.append(j))
    assert out == {j: j * j for j in range(7)}
    assert sorted(seen) == list(range(7))
    assert _children() == before


def test_workers_fork_from_a_frozen_heap_and_leave_it_unfrozen():
    """Objects alive at the fork are frozen for the workers (no copy-on-write by their
    collections) and handed back to the collector afterwards, even when a job fails."""
    import gc

    def frozen(_):
        return gc.get_freeze_count()

    assert gc.get_freeze_count() == 0
    out = run_forked(frozen, [0, 1], 2)
    assert min(out.values()) > 1000  # the worker saw the parent's objects frozen
    assert gc.get_freeze_count() == 0
    with pytest.raises(WorkerError):
        run_forked(_fail, [0], 1)
    assert gc.get_freeze_count() == 0


def _fail(_):
    raise ValueError("boom")


def test_a_dead_worker_loses_only_its_job_and_is_replaced():
    def task(x):
        if x == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return x + 100

    before = _children()
    out = run_forked(task, [0, 1, 2, 3, 4], 2)
    assert isinstance(out[2], WorkerLost) and "SIGKILL" in out[2].reason
    assert {j: r for j, r in out.items() if j != 2} == {0: 100, 1: 101, 3: 103, 4: 104}
    assert _children() == before


def test_an_exception_in_a_worker_is_raised_here():
    def task(x):
        raise ValueError(f"bad client {x}")

    before = _children()
    with pytest.raises(WorkerError, match="bad client"):
        run_forked(task, [0, 1], 2)
    assert _children() == before


@pytest.mark.parametrize("method", ["fedpetuning", "heads", "raffm", "fedot"])
def test_workers_give_the_sequential_weights(tiny_cfg_dict, tmp_path, method):
    """Same seed, one thread per client: identical final tensors and per-client losses, whatever
    worker trained which client in which order."""
    tiny_cfg_dict["method"] = {"name": method, **method_options(method, tmp_path)}
    tiny_cfg_dict["federation"].update(clients_per_round=3, num_clients=4)
    _, s1, r1 = _run(tiny_cfg_dict, 1)
    _, s2, r2 = _run(tiny_cfg_dict, 2)
    assert [r["client_mode"] for r in r1] == ["sequential"] * 2
    assert [r["client_mode"] for r in r2] == ["workers"] * 2
    assert s1.keys() == s2.keys()
    for k in s1:
        assert torch.equal(s1[k], s2[k]), k
    loss = lambda rs: [[(m["client"], m["loss"]) for m in r["client_metrics"]] for r in rs]
    assert loss(r1) == loss(r2)


def test_a_killed_worker_drops_its_client_for_the_round(tiny_cfg_dict, tmp_path):
    """The worker training client c dies: c is excluded (reason recorded) and counted as
    dropped; the other replies are aggregated and the run goes on."""
    tiny_cfg_dict["federation"].update(clients_per_round=3, num_clients=4, rounds=2)
    cfg = validate_config({**tiny_cfg_dict, "compute": {"workers": 2}})
    method, data = setup(cfg)
    real_fit = method.fit
    mark = tmp_path / "victim"

    def fit(payload, d, seed):  # runs in a worker: the first client of round 1 kills its worker
        if payload.config["round"] == 1:
            try:
                fd = os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                os.write(fd, str(payload.config["client"]).encode())
                os.close(fd)
                os.kill(os.getpid(), signal.SIGKILL)
        return real_fit(payload, d, seed)

    method.fit = fit
    before = _children()
    state, records, _ = Simulation(cfg, method, data).run()
    r1, victim = records[0], {"c": int(mark.read_text())}
    gone = [e for e in r1["excluded"] if e["client"] == victim["c"]]
    assert len(gone) == 1 and "SIGKILL" in gone[0]["reason"]
    assert r1["dropped"] == 1
    assert sorted(m["client"] for m in r1["client_metrics"]) == sorted(set(r1["clients"]) - {victim["c"]})
    assert all(m["used"] for m in r1["client_metrics"])
    assert len(records) == 2 and records[1]["dropped"] == 0
    assert _children() == before


def test_fedpft_trains_in_process(tiny_cfg_dict, tmp_path):
    """FedPFT's clients update the one proxy this process holds: never forked."""
    tiny_cfg_dict["method"] = {"name": "fedpft", **method_options("fedpft", tmp_path)}
    tiny_cfg_dict["federation"]["rounds"] = 1
    _, _, records = _run(tiny_cfg_dict, 2)
    assert records[0]["client_mode"] == "sequential"


def test_an_interrupted_round_leaves_no_worker():
    """Ctrl-C (any exception in the main process) while workers train: they are killed and reaped."""
    import time

    def task(x):
        time.sleep(0.05 if x == 0 else 30)
        return x

    def on_result(job, result):
        raise KeyboardInterrupt

    before = _children()
    with pytest.raises(KeyboardInterrupt):
        run_forked(task, [0, 1, 2], 3, on_result=on_result)
    assert _children() == before


@pytest.mark.parametrize("pack,group", [(False, False), (True, True)])
def test_planned_tokens_are_the_tokens_a_client_trains(tiny_cfg_dict, pack, group):
    """What the workers' hand-out order is sorted by: the tokens of the batches the client's
    seed draws, equal to what its training reports (without changing its draws)."""
    from fedslice.fl.client import planned_tokens
    from fedslice.run.engine import client_seed

    tiny_cfg_dict["federation"].update(pack=pack, group_by_length=group)
    cfg = validate_config(tiny_cfg_dict)
    method, data = setup(cfg)
    state = method.initial_state()
    payloads = method.strategy.configure_train(1, state, [0, 1, 2], 4)
    for c, payload in payloads.items():
        seed = client_seed(cfg.seed, 1, c)
        planned = planned_tokens(data.client(c), payload.config, seed)
        reply = method.train_client(payload, data.client(c), seed)
        assert planned == reply.metrics["tokens_real"] > 0


def test_workers_take_the_longest_clients_first(tiny_cfg_dict, monkeypatch):
    """The clients go to the workers most tokens first (ties in selection order); the round's
    replies and records stay in selection order."""
    from fedslice.run import runner

    handed = []
    real = runner.run_forked
    monkeypatch.setattr(runner, "run_forked",
                        lambda task, jobs, *a, **k: handed.append(list(jobs)) or real(task, jobs, *a, **k))
    tiny_cfg_dict["federation"].update(clients_per_round=3, rounds=1)
    _, _, records = _run(tiny_cfg_dict, 2)
    clients = records[0]["clients"]
    tokens = {m["client"]: m["tokens_real"] for m in records[0]["client_metrics"]}
    assert handed == [sorted(clients, key=lambda c: -tokens[c])]
    assert [m["client"] for m in records[0]["client_metrics"]] == clients
