"""Profile one client's local training on the workload of bench/perf/minilm_sst2.toml (issue 36,
target 2): time per client (8 steps x 32) in one process at one thread, padded vs packed, and
optionally a cProfile of where the time goes (Python overhead per step).

    .venv/bin/python bench/perf/client_step.py                       # padded vs packed, 100 clients
    .venv/bin/python bench/perf/client_step.py --population 1000 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: time clients by the process's CPU seconds (``--cpu-time``: on a loaded machine, where wall
#: time mostly measures the other processes) instead of wall seconds
CPU_TIME = False


def build(population: int, sets: dict):
    import tomllib

    import torch

    from fedslice.api import setup
    from fedslice.experiment import validate_config

    torch.set_num_threads(1)
    cfg = tomllib.loads((ROOT / "bench/perf/minilm_sst2.toml").read_text())
    cfg["federation"]["num_clients"] = population
    cfg.setdefault("compute", {})["workers"] = 1
    cfg["threads"] = 1
    for key, value in sets.items():
        section, name = key.split(".")
        cfg.setdefault(section, {})[name] = value
    cfg = validate_config(cfg)
    method, data = setup(cfg)
    return cfg, method, data


def client_time(method, data, cfg, clients, pack: bool, profile: cProfile.Profile | None = None):
    """Seconds of each client's ``method.fit`` (padded or packed batches) and its replies' metrics."""
    from fedslice.fl.strategy import host_state

    state = host_state(method.initial_state())
    payloads = method.strategy.configure_train(1, state, clients, cfg.federation.num_clients)
    times, metrics = [], []
    for c in clients:
        payloads[c].config["pack"] = pack
        part = data.train.subset(data.partitions[c])
        t0 = time.process_time() if CPU_TIME else time.perf_counter()
        if profile:
            profile.enable()
        reply = method.fit(payloads[c], part, seed=c)
        if profile:
            profile.disable()
        times.append((time.process_time() if CPU_TIME else time.perf_counter()) - t0)
        metrics.append(reply.metrics)
    return times, metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--population", type=int, default=100)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--cpu-time", action="store_true", help="CPU seconds of this process, not wall")
    args = ap.parse_args()
    global CPU_TIME
    CPU_TIME = args.cpu_time
    cfg, method, data = build(args.population, {})
    clients = list(range(args.clients))
    client_time(method, data, cfg, clients[:1], True)  # warm-up
    clock = "CPU" if CPU_TIME else "wall"
    print(f"population {args.population}, {len(clients)} clients, 1 thread, {clock} seconds; "
          f"load {os.getloadavg()[0]:.2f}")
    t = {False: [], True: []}
    for c in clients:  # alternating, so a change in the machine's load hits both alike
        for pack in (False, True):
            s, m = client_time(method, data, cfg, [c], pack)
            t[pack] += s
            if c == clients[0]:
                print(f"pack={pack}: tokens {m[0]['tokens']} real {m[0]['tokens_real']}")
    for pack in (False, True):
        print(f"pack={pack}: median {statistics.median(t[pack]):.3f} s per client  {[round(x, 2) for x in t[pack]]}")
    ratio = statistics.median(a / b for a, b in zip(t[False], t[True]))
    print(f"padded / packed per client: median {ratio:.2f}x; load {os.getloadavg()[0]:.2f}")
    if args.profile:
        prof = cProfile.Profile()
        client_time(method, data, cfg, clients, True, prof)
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
