"""Benchmark: the budget planner's predictions against what clients measure (issue 34, part 2).

For MiniLM-L6 on SST-2 and SmolLM2-135M on E2E NLG: the planner's predicted peak memory of a
dense client (fedpetuning, LoRA r16 q/v) sets three tiers at 100%, 50% and 30% of it; a
``raffm+heads`` run plans every client and trains one round with every client; each tier's
predicted peak memory, GFLOPs and upload per round against the measured ones (``summary.json``
``plans``). Peak memory is predicted on the longest example's batch, so a client whose data has
no batch that long measures less: the ratio says by how much. Accuracy is not the point (one
round).

    .venv/bin/python bench/planner_prediction.py --models minilm smollm2
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from fedslice.api import run_experiment
from fedslice.experiment import validate_config
from fedslice.run.setup import load_inputs

SETUPS = {
    "minilm": {
        "data": {"path": "sst2", "max_length": 64, "max_dev_examples": 64, "max_test_examples": 64},
        "model": {"name": "minilm"},
        "federation": {"batch_size": 32},
    },
    "smollm2": {
        "data": {"path": "e2e_nlg", "max_length": 64, "holdout_fraction": 0.1, "group_column": "mr",
                 "max_dev_examples": 16, "max_test_examples": 8},
        "model": {"name": "smollm2"},
        "task": {"kind": "generation", "prompt": "Describe the restaurant: {mr}\n", "target": "{ref}",
                 "max_target_length": 64, "max_new_tokens": 8},
        "federation": {"batch_size": 8},
    },
}


def config(model: str, method: str, budgets: dict | None, clients: int, steps: int) -> dict:
    s = SETUPS[model]
    return {
        "name": f"{model}-{method}", "seed": 0, "threads": 1, **{k: v for k, v in s.items() if k != "federation"},
        "lora": {"r": 16, "alpha": 32, "targets": ["q", "v"]},
        "federation": {"num_clients": clients, "clients_per_round": clients, "rounds": 1,
                       "local_steps": steps, "lr": 1e-3, **s["federation"]},
        "compute": {"workers": 1},
        "method": {"name": method, **({"importance_max_examples": 32} if "heads" in method else {})},
        "evaluation": {"every": 1, "batch_size": 16, "dev_generations": 2},
        "output": {"progress": False, "plots": False},
        **({"budgets": budgets} if budgets else {}),
    }


def dense_memory(model: str, clients: int, steps: int) -> float:
    """The planner's predicted peak memory of a dense fedpetuning client."""
    cfg = validate_config(config(model, "fedpetuning", {"tiers": [{"share": 1.0, "memory_mb": 1e6}]},
                                 clients, steps))
    method = load_inputs(cfg, "both", weights="random").method(cfg, "both")
    return next(iter(method.plans.values())).memory_mb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=list(SETUPS))
    ap.add_argument("--method", default="raffm+heads")
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--local-steps", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("bench/results/planner_prediction"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()[0]
    lines = ["| model | tier | plan | memory MiB pred / meas (ratio) | GFLOPs/round pred / meas (ratio) | "
             "up MB pred / meas |", "|---|---|---|---|---|---|"]
    for model in args.models:
        dense = dense_memory(model, args.clients, args.local_steps)
        tiers = [{"name": f"{f:.0%}", "share": 1 / 3, "memory_mb": round(f * dense, 1)} for f in (1.0, 0.5, 0.3)]
        tiers[-1]["share"] = 1 - 2 / 3
        t0 = time.time()
        run = run_experiment(validate_config(config(model, args.method, {"tiers": tiers}, args.clients,
                                                    args.local_steps)), args.out / "runs", progress=False)
        plans = json.loads((run / "summary.json").read_text())["plans"]
        (args.out / f"{model}.json").write_text(json.dumps({"dense_memory_mb": dense, "plans": plans,
                                                            "wall_s": time.time() - t0}, indent=1))
        for g in plans:
            p, m = g["predicted"], g["measured"]
            plan = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
                             for k, v in g["plan"].items() if v is not None and k != "layers")
            lines.append(f"| {model} | {g['budget_name']} ({g['budget']['memory_mb']:g} MiB) | {plan} | "
                         f"{p['memory_mb']:.1f} / {m['memory_mb_max']:.1f} ({m['memory_mb_max'] / p['memory_mb']:.3f}) | "
                         f"{p['gflops_per_round']:.2f} / {m['gflops_per_round_mean']:.2f} "
                         f"({m['gflops_per_round_mean'] / p['gflops_per_round']:.2f}) | "
                         f"{p['upload_mb']:.3f} / {m['upload_mb_mean']:.3f} |")
        print("\n".join(lines), flush=True)
    lines.insert(0, f"One round, every client, {args.local_steps} local steps, method {args.method}; "
                    f"load {load0:.1f} -> {os.getloadavg()[0]:.1f}.\n")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
