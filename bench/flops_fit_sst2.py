"""FLOPs budgets on one-step rounds, SST-2 / MiniLM: measured FLOPs over the client's budget per
client-round, without and with budgets.fit_rounds (issue 58's budgets that hold; last note's
one-step overshoot). python bench/flops_fit_sst2.py"""
import json
import numpy as np
import torch
from fedslice.api import setup
from fedslice.experiment import validate_config
from fedslice.run.engine import Simulation

torch.set_num_threads(1)
GF = {}
def tier(share):
    return {"memory_mb": 1e5} if share is None else {"gflops_per_round": round(share * GF["dense"], 6)}
def cfg(fit, share):
    return validate_config({
        "name": "flopsfit", "seed": 0, "threads": 1,
        "data": {"path": "sst2", "partition": "iid", "max_length": 64, "max_test_examples": 16, "max_dev_examples": 16},
        "model": {"name": "minilm"}, "lora": {"r": 16, "alpha": 32, "targets": ["q", "v"], "ranks": [16, 8, 4]},
        "method": {"name": "fedpetuning"},
        "federation": {"num_clients": 20, "clients_per_round": 5, "rounds": 8, "local_steps": 1,
                       "batch_size": 8, "lr": 3e-3, "pack": False},
        "budgets": {"tiers": [{"share": 1.0, **tier(share)}], "micro_batches": [1],
                    "checkpointing": False, "fit_rounds": fit},
        "evaluation": {"every": 10 ** 6}, "output": {"progress": False, "plots": False}})
probe = cfg(False, None)
GF["dense"] = next(iter(setup(probe)[0].plans.values())).gflops_per_round
print("dense plan GFLOPs per round", GF["dense"])
out = {}
for share in (1.0, 0.6):
    for fit in (False, True):
        c = cfg(fit, share)
        method, data = setup(c)
        _, records, _ = Simulation(c, method, data).run()
        r = [m["flops_measured"] / method.plans[m["client"]].flops_budget
             for rec in records for m in rec["client_metrics"]]
        fitted = sum(len(rec.get("rounds_fitted", [])) for rec in records)
        ex = [m.get("examples_trained") or 0 for rec in records for m in rec["client_metrics"]]
        key = f"flops_share {share}, fit_rounds {fit}"
        out[key] = {"client_rounds": len(r), "over_budget": int(sum(x > 1 + 1e-9 for x in r)),
                    "measured_over_budget_max": max(r), "median": float(np.median(r)),
                    "rounds_fitted": fitted, "examples_mean": float(np.mean(ex))}
        print(key, out[key], flush=True)
json.dump(out, open("bench/results/flops_fit_sst2.json", "w"), indent=1)
