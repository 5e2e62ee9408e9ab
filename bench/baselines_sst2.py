"""Benchmark: FedAvg (full fine-tuning) vs FedPETuning (LoRA) on SST-2 with MiniLM-L6.

100 clients, 10 per round, IID and Dirichlet(0.5) label skew, same partition and seed for both
methods of a setting. Test accuracy (872 GLUE validation sentences) is tracked every
``--eval-every`` rounds together with the wall-clock time, so the accuracy reached within a time
budget can be read off. Writes each run folder under ``--out`` and prints markdown tables for
BENCHMARKS.md (also saved as ``<out>/results.md``).

    .venv/bin/python bench/baselines_sst2.py                       # all four runs
    .venv/bin/python bench/baselines_sst2.py --methods fedpetuning --partitions iid --rounds 10
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from fedslice.api import run_experiment
from fedslice.experiment import validate_config
from fedslice.report import markdown_table, plot_compare, summary_row

LR = {"fedavg": 1e-4, "fedpetuning": 1e-3}


def config(method: str, partition: str, args) -> dict:
    return {
        "name": f"{method}-{partition}", "seed": args.seed, "threads": args.threads,
        "data": {"path": "sst2", "max_length": 64, "partition": partition, "alpha": 0.5,
                 "max_dev_examples": 256},
        "model": {"name": "minilm"},
        "lora": {"r": 16, "alpha": 32, "targets": ["q", "v"]},
        "federation": {"num_clients": 100, "clients_per_round": 10, "rounds": args.rounds,
                       "local_steps": args.local_steps, "batch_size": 32, "lr": LR[method]},
        "method": {"name": method},
        "evaluation": {"every": args.eval_every, "target_accuracy": 0.85, "track_test": True,
                       "batch_size": 256},
        "output": {"dir": str(args.out), "progress": False, "save_weights": False},
    }


def per_round_table(run: Path) -> str:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lines = ["| round | elapsed min | train loss | test acc | down MB | up MB | GFLOPs measured | GFLOPs analytic |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("test_accuracy") is None:
            continue
        lines.append(f"| {r['round']} | {r['elapsed_s'] / 60:.1f} | {r['train_loss']:.3f} | "
                     f"{r['test_accuracy']:.4f} | {r['bytes_down_mean'] / 1e6:.2f} | "
                     f"{r['bytes_up_mean'] / 1e6:.2f} | {r['flops_measured_mean'] / 1e9:.0f} | "
                     f"{r['flops_analytic_mean'] / 1e9:.0f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=["fedpetuning", "fedavg"])
    p.add_argument("--partitions", nargs="+", default=["iid", "dirichlet"])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--local-steps", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench/results/baselines"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report = [f"Command: `python bench/baselines_sst2.py {' '.join(__import__('sys').argv[1:])}`  ",
              f"Machine: {platform.machine()}, {args.threads} threads, torch {torch.__version__}; "
              f"date {time.strftime('%Y-%m-%d')}", ""]
    runs: dict[tuple[str, str], Path] = {}
    for method in args.methods:  # every method's runs first: the most important results land early
        for partition in args.partitions:
            cfg = validate_config(config(method, partition, args))
            runs[method, partition] = run_experiment(cfg)
            report += [f"### {method}, {partition}", "", per_round_table(runs[method, partition]), ""]
            (args.out / "results.md").write_text("\n".join(report) + "\n")
    for partition in args.partitions:
        done = [runs[m, partition] for m in args.methods]
        summaries = [json.loads((r / "summary.json").read_text()) for r in done]
        report += [f"### Summary, {partition}", "", markdown_table([summary_row(s) for s in summaries]), ""]
        plot_compare(done, args.out / f"compare-{partition}.png")
    (args.out / "results.md").write_text("\n".join(report) + "\n")
    print("\n".join(report))


if __name__ == "__main__":
    main()
