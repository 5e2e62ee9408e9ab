"""Benchmark: the stages composed (issue 34) against each stage alone, on SST-2 with MiniLM-L6.

Every run: 100 IID clients, LoRA r=16 on q/v, the same partition, seed and client sampling; two
device tiers of 50% each. Rows:

  fedpetuning   every client trains the full model (the dense reference);
  heads         every client trains its most important half of the heads of the full model;
  raffm         tier 1 trains the RaFFM sub-model at half the full model's training FLOPs;
  raffm+heads   that sub-model, and inside it only its most important half of the heads.

Columns: test accuracy, measured training FLOPs per client-round (the importance pass of the
head stage counted apart and in total), upload and download per client-round, client memory
(model + activations + optimizer, ``memory_mb``), wall time. Writes ``<out>/<row>/`` run folders
and ``<out>/results.md``. Accuracy runs may share the machine; the wall times are then indicative.

    .venv/bin/python bench/compose_sst2.py --rounds 10 --clients-per-round 4 --local-steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from fedslice.api import run_experiment
from fedslice.experiment import validate_config

TIERS = [{"share": 0.5, "flops": 0.5}, {"share": 0.5, "flops": 1.0}]
HEADS = {"sparsity": 0.5, "importance_max_examples": 64}
ROWS = {
    "fedpetuning": {"name": "fedpetuning"},
    "heads": {"name": "heads", **HEADS},
    "raffm": {"name": "raffm", "tiers": TIERS, "width_steps": 12},
    "raffm+heads": {"name": "raffm+heads", "tiers": TIERS, "width_steps": 12, **HEADS},
}


def config(row: str, args) -> dict:
    return {
        "name": row.replace("+", "-"), "seed": args.seed, "threads": args.threads,
        "data": {"path": "sst2", "max_length": 64, "partition": "iid",
                 "max_dev_examples": 256, "max_test_examples": args.test_examples},
        "model": {"name": "minilm"},
        "lora": {"r": 16, "alpha": 32, "targets": ["q", "v"]},
        "federation": {"num_clients": 100, "clients_per_round": args.clients_per_round,
                       "rounds": args.rounds, "local_steps": args.local_steps, "batch_size": 32,
                       "lr": 1e-3},
        "compute": {"workers": 1},
        "method": ROWS[row],
        "evaluation": {"every": args.rounds, "batch_size": 128},
        "output": {"progress": False, "plots": False},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--clients-per-round", type=int, default=4)
    ap.add_argument("--local-steps", type=int, default=8)
    ap.add_argument("--test-examples", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows", nargs="*", default=list(ROWS))
    ap.add_argument("--out", type=Path, default=Path("bench/results/compose_sst2"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()[0]
    for row in args.rows:
        t0 = time.time()
        run = run_experiment(validate_config(config(row, args)), args.out, progress=False)
        s = json.loads((run / "summary.json").read_text())
        s["bench_wall_s"] = time.time() - t0
        (args.out / f"{row.replace('+', '-')}.json").write_text(json.dumps(s, indent=1))
        print(row, s.get("test_accuracy"), s.get("flops_measured_mean"), s.get("bytes_up_mean"),
              flush=True)
    write_table(args, load0, os.getloadavg()[0])


def write_table(args, load0: float, load1: float) -> None:
    rows = {r: json.loads((args.out / f"{r.replace('+', '-')}.json").read_text())
            for r in ROWS if (args.out / f"{r.replace('+', '-')}.json").is_file()}
    dense = rows.get("fedpetuning", {})
    lines = [f"Rounds {args.rounds}, {args.clients_per_round} clients/round, {args.local_steps} local "
             f"steps x 32, seed {args.seed}, threads {args.threads}; load {load0:.1f} -> {load1:.1f}.", "",
             "| row | test acc | Δ vs dense (pt) | train GFLOPs / client-round | + importance | "
             "× dense (total) | up MB | down MB (trained) | memory MB (max) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r, s in rows.items():
        acc = s.get("test_accuracy") or float("nan")
        fl = (s.get("flops_measured_mean") or 0) / 1e9
        imp = (s.get("flops_importance_mean") or 0) / 1e9
        dfl = (dense.get("flops_measured_mean") or float("nan")) / 1e9
        lines.append(f"| {r} | {100 * acc:.2f} | {100 * (acc - dense.get('test_accuracy', float('nan'))):+.2f} | "
                     f"{fl:.1f} | {imp:.1f} | {(fl + imp) / dfl:.2f} | "
                     f"{(s.get('bytes_up_mean') or 0) / 1e6:.2f} | {(s.get('bytes_down_mean') or 0) / 1e6:.2f} | "
                     f"{s.get('memory_mb_max') or float('nan'):.0f} |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
