"""Benchmark (issue 16): accuracy under injected dropout, under attack with robust aggregation,
and with central DP-FedAvg at several epsilons. MiniLM-L6 + LoRA (FedPETuning) on SST-2.

Setting: 20 IID clients, 5 per round, ``--rounds`` rounds of ``--local-steps`` steps of 32
sentences, 4000 training sentences, dev = 256 held-out, test = the 872 GLUE validation
sentences; the same partition, seed and client sampling in every run. Every comparison is against
the clean run of the same invocation.

    .venv/bin/python bench/reliability_sst2.py                    # all groups
    .venv/bin/python bench/reliability_sst2.py --groups dropout attack
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from fedslice.api import run_experiment
from fedslice.experiment import validate_config

ATTACKS = {"sign_flip": 10.0, "gaussian": 1.0}  # attack -> scale (multiplier / noise std)
RULES = {"mean": {}, "median": {}, "trimmed_mean": {"trim_fraction": 0.2},
         "krum": {"byzantine": 1}, "multi_krum": {"byzantine": 1, "multi_krum_keep": 3}}


def config(name: str, args, **sections) -> dict:
    cfg = {
        "name": name, "seed": args.seed, "threads": args.threads,
        "data": {"path": "sst2", "max_length": 64, "max_train_examples": 4000, "max_dev_examples": 256},
        "model": {"name": "minilm"},
        "lora": {"r": 16, "alpha": 32, "targets": ["q", "v"]},
        "federation": {"num_clients": 20, "clients_per_round": 5, "rounds": args.rounds,
                       "local_steps": args.local_steps, "batch_size": 32, "lr": 1e-3},
        "method": {"name": "fedpetuning"},
        "evaluation": {"every": 4, "batch_size": 256},
        "output": {"dir": str(args.out), "progress": False, "save_weights": False, "plots": False},
    }
    cfg.update(sections)
    return cfg


def runs(args) -> list[tuple[str, str, dict]]:
    """(group, name, config sections) in the order they run."""
    out = [] if args.clean_from else [("clean", "clean", {})]
    if "dropout" in args.groups:
        out.append(("dropout", "dropout-0.3", {"faults": {"dropout": 0.3}}))
    if "attack" in args.groups:
        for attack in args.attacks:
            scale = ATTACKS[attack]
            for rule in args.rules:
                opts = RULES[rule]
                out.append(("attack", f"{attack}-{rule}", {
                    "faults": {"attack": attack, "attackers": 0.2, "attack_scale": scale},
                    "aggregation": {"rule": rule, **opts}}))
    if "dp" in args.groups:
        for eps in args.epsilons:
            out.append(("dp", f"dp-eps{eps:g}", {"dp": {"enabled": True, "clip_norm": args.clip,
                                                         "target_epsilon": eps, "delta": 1e-5}}))
    return out


def row(group: str, name: str, run: Path, clean: dict | None) -> dict:
    s = json.loads((run / "summary.json").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    eps = records[-1].get("dp_epsilon")
    return {"group": group, "run": name, "test_accuracy": s["test_accuracy"],
            "vs_clean_pt": None if clean is None else 100 * (s["test_accuracy"] - clean["test_accuracy"]),
            "final_dev_accuracy": s["final_dev_accuracy"], "dropped": sum(r.get("dropped", 0) for r in records),
            "skipped_rounds": s.get("skipped_rounds"), "examples_used": s.get("examples_used"),
            "dp_epsilon": eps, "dp_noise_multiplier": records[-1].get("dp_noise_multiplier"),
            "wall_min": s["wall_time_s"] / 60}


def table(rows: list[dict]) -> str:
    lines = ["| group | run | test acc | vs clean (pt) | dev acc | dropped client-rounds | examples used | epsilon (z) | wall min |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        vs = "" if r["vs_clean_pt"] is None else f"{r['vs_clean_pt']:+.1f}"
        eps = "" if r["dp_epsilon"] is None else f"{r['dp_epsilon']:.2f} ({r['dp_noise_multiplier']:.2f})"
        lines.append(f"| {r['group']} | {r['run']} | {r['test_accuracy']:.4f} | {vs} | "
                     f"{r['final_dev_accuracy']:.4f} | {r['dropped']} | {r['examples_used']} | {eps} | "
                     f"{r['wall_min']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", nargs="+", default=["dropout", "attack", "dp"],
                   choices=["dropout", "attack", "dp"])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 4.0, 8.0])
    p.add_argument("--clip", type=float, default=0.5, help="DP clipping norm C")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=list(ATTACKS))
    p.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES))
    p.add_argument("--clean-from", type=Path, help="the clean run folder of another invocation "
                   "with the same settings (read when the table is made) instead of a clean run")
    p.add_argument("--out", type=Path, default=Path("bench/results/reliability"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    head = [f"Command: `python bench/reliability_sst2.py {' '.join(sys.argv[1:])}`  ",
            f"Machine: {platform.machine()}, {args.threads} thread(s), torch {torch.__version__}; "
            f"date {time.strftime('%Y-%m-%d')}", ""]
    done: list[tuple[str, str, Path]] = []
    for group, name, sections in runs(args):
        done.append((group, name, run_experiment(validate_config(config(name, args, **sections)))))
        clean_dir = args.clean_from or done[0][2]
        clean = json.loads((clean_dir / "summary.json").read_text()) if (clean_dir / "summary.json").is_file() else None
        rows = [row(g, n, r, clean) for g, n, r in done]
        print(f"{name}: test {rows[-1]['test_accuracy']:.4f}", flush=True)
        (args.out / "results.md").write_text("\n".join(head + [table(rows)]) + "\n")
        (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(head + [table(rows)]))


if __name__ == "__main__":
    main()
