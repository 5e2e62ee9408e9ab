"""Time as a budget (docs/time.md): devices on the simulated clock, round policies (all,
deadline, async/FedBuff), staleness weights, bad input, resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from fedslice.api import setup
from fedslice.errors import ConfigError
from fedslice.experiment import validate_config
from fedslice.fl.clock import settle_round, staleness_weight
from fedslice.fl.devices import Device, Population, population, read_trace
from fedslice.run.asynchronous import AsyncSimulation, simulation_for
from fedslice.run.engine import Simulation

#: two tiers 10x apart in speed, links slow enough to count
DEVICES = {"tiers": [{"share": 0.5, "gflops_per_s": 0.02, "upload_mb_per_s": 1.0,
                      "download_mb_per_s": 2.0},
                     {"share": 0.5, "gflops_per_s": 0.002, "upload_mb_per_s": 0.1,
                      "download_mb_per_s": 0.2}]}


def _run(cfg_dict):
    cfg = validate_config(cfg_dict)
    method, data = setup(cfg)
    sim = simulation_for(cfg, method, data)
    state, records, summary = sim.run()
    return sim, state, records, summary


def test_smoke(tiny_cfg_dict):
    for policy in ("all", "deadline", "async"):
        d = json.loads(json.dumps(tiny_cfg_dict))
        d["devices"] = DEVICES
        d["federation"]["round_policy"] = policy
        if policy == "deadline":
            d["federation"]["round_deadline_s"] = 5.0
        sim, state, records, summary = _run(d)
        print(policy, [(r["clients"], r.get("sim_round_s"), r.get("sim_time_s"), r["excluded"],
                        [m.get("sim_s") for m in r["client_metrics"]]) for r in records],
              {k: v for k, v in summary.items() if k.startswith(("sim", "wasted"))})
