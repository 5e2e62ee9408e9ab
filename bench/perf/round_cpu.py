"""Rounds of the performance workload through the engine, each with its ``round_time_s`` and the
CPU seconds its forked workers used (user + system): a per-round figure that a loaded machine
inflates far less than wall time. Extra arguments are config overrides.

    PYTHONPATH=src .venv/bin/python bench/perf/round_cpu.py --set compute.linear_kernels='"torch"'
"""

from __future__ import annotations

import argparse
import os
import time

from fedslice.experiment import load_config
from fedslice.run.engine import Simulation, finish_round
from fedslice.run.setup import setup


def children_cpu() -> tuple[float, float]:
    t = os.times()
    return t.children_user + t.children_system, t.children_system


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="bench/perf/minilm_sst2.toml")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)
    method, data = setup(cfg)
    sim = Simulation(cfg, method, data)
    state = method.initial_state()
    for rnd in range(1, cfg.federation.rounds + 1):
        cpu0, sys0 = children_cpu()
        parent0 = time.process_time()
        state, record = sim.run_round(rnd, state)
        cpu1, sys1 = children_cpu()
        print(f"{args.tag} round {rnd}: round_time_s {record['round_time_s']:.2f} workers cpu "
              f"{cpu1 - cpu0:.2f} (sys {sys1 - sys0:.2f}) parent cpu {time.process_time() - parent0:.2f} "
              f"load {os.getloadavg()[0]:.2f} train_loss {record['train_loss']:.6f}", flush=True)
        finish_round(cfg, method, data, sim.selector, rnd, state, record)


if __name__ == "__main__":
    main()
