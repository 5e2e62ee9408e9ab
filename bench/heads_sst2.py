"""Benchmark: attention-head pruning (``heads``) on SST-2 with MiniLM-L6 (6 layers x 12 heads).

Reproduces the *shape* of the heads paper's Table 1 and Fig. 4 (there: T5-small on MultiNLI,
100 clients, 2 per round, 100 rounds, on a GPU), scaled down for a shared CPU:

* ``table1``: B1 FedPETuning dense, B2 random pruning 90% + FedAvg, ours importance pruning 90%
  + head-weighted aggregation; each with random and loss-gap client selection (6 runs);
* ``sweep``: ours with loss-gap selection at sparsity 0/50/70/90/95% (Fig. 4; 90% is shared
  with table1 when both run);
* ``ablation``: random vs importance pruning crossed with FedAvg vs Eq. 8 aggregation (not in the
  paper, whose B2 and ours change both at once).

Run folders that already exist under ``--out`` are reused (resume), unless ``--rerun``.

All runs use the same partition and seed. Records test accuracy (GLUE validation), rounds to a
target dev accuracy, measured/analytic training FLOPs, the importance pass's FLOPs, the paper's
Table 6 OPs, and bytes up/down per client per round. Writes run folders, ``results.md``,
``table1.png`` (accuracy curves) and ``sweep.png`` under ``--out``.

The CPU is slow and shared: ``--budget-min`` caps the total wall time. A two-round pilot of the
dense run measures the time per round and the number of rounds is lowered to fit the budget
(never raised above ``--rounds``)::

    .venv/bin/python bench/heads_sst2.py --budget-min 60
    .venv/bin/python bench/heads_sst2.py --groups sweep --rounds 20 --local-steps 5
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

from fedslice.api import run_experiment
from fedslice.experiment import validate_config
from fedslice.api import setup
from fedslice.run.engine import Simulation
from fedslice.report import figure, plot_compare, save_figure

VARIANTS = {  # name -> method options
    "B1-dense": {"pruning": "none", "aggregation": "fedavg", "sparsity": 0.0},
    "B2-random90": {"pruning": "random", "aggregation": "fedavg", "sparsity": 0.9},
    "ours90": {"pruning": "importance", "aggregation": "head_weighted", "sparsity": 0.9},
}
SWEEP = (0.0, 0.5, 0.7, 0.9, 0.95)
ABLATION = {  # which of importance pruning and Eq. 8 matters (random selection)
    "B1-dense-random": VARIANTS["B1-dense"],
    "B2-random90-random": VARIANTS["B2-random90"],
    "rand90-eq8-random": {"pruning": "random", "aggregation": "head_weighted", "sparsity": 0.9},
    "imp90-fedavg-random": {"pruning": "importance", "aggregation": "fedavg", "sparsity": 0.9},
    "ours90-random": VARIANTS["ours90"],
}


def config(name: str, method: dict, selection: str, args, rounds: int) -> dict:
    return {
        "name": name, "seed": args.seed, "threads": args.threads,
        "data": {"path": "sst2", "max_length": 64, "partition": "iid",
                 "max_dev_examples": args.dev_examples},
        "model": {"name": "minilm"},
        "lora": {"r": 16, "alpha": 32, "targets": ["q", "v"]},
        "federation": {"num_clients": 100, "clients_per_round": args.clients_per_round,
                       "rounds": rounds, "local_steps": args.local_steps, "batch_size": 32,
                       "lr": args.lr, "selection": selection},
        "method": {"name": "heads", "importance_max_examples": args.importance_examples,
                   "importance_batch_size": 32,
                   "plot_rounds": 10, **method},
        "evaluation": {"every": args.eval_every, "target_accuracy": args.target,
                       "track_test": args.track_test, "batch_size": 256},
        "output": {"dir": str(args.out), "progress": False, "save_weights": False},
    }


def planned_runs(args) -> list[tuple[str, dict, str]]:
    runs = []
    if "table1" in args.groups:
        for v, opts in VARIANTS.items():
            for sel in ("random", "loss_gap"):
                runs.append((f"{v}-{sel}", opts, sel))
    if "ablation" in args.groups:
        for name in ABLATION:
            if all(r[0] != name for r in runs):
                runs.append((name, ABLATION[name], "random"))
    if "sweep" in args.groups:
        for s in SWEEP:
            name = _sweep_name(s)
            if all(r[0] != name for r in runs):
                opts = {"pruning": "importance" if s else "none", "aggregation": "head_weighted",
                        "sparsity": s}
                runs.append((name, opts, "loss_gap"))
    return runs


def pilot(args) -> tuple[float, float]:
    """(seconds per round, fixed seconds per run) of the dense run, from a 2-round pilot: the
    per-run part is a second (cached) setup plus the final test evaluation."""
    cfg = validate_config(config("pilot", VARIANTS["B1-dense"], "random", args, 2))
    setup(cfg)  # tokenizes the data once per process (cached for the runs)
    t0 = time.perf_counter()
    method, data = setup(cfg)
    t_setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    _, records, _ = Simulation(cfg, method, data).run()
    wall = time.perf_counter() - t0
    per_round = records[1]["elapsed_s"] - records[0]["elapsed_s"]
    return per_round, t_setup + wall - records[-1]["elapsed_s"]


def client_totals(run: Path) -> dict[str, float]:
    """Sums over all client-rounds of the per-client metrics (for per-token ratios)."""
    keys = ("tokens", "flops_measured", "flops_analytic", "flops_importance", "paper_ops",
            "paper_ops_dense", "bytes_up", "bytes_down")
    tot = dict.fromkeys(keys, 0.0)
    for line in (run / "metrics.jsonl").read_text().splitlines():
        for m in json.loads(line)["client_metrics"]:
            for k in keys:
                tot[k] += m.get(k) or 0.0
    return tot


def row(name: str, selection: str, run: Path, dense_run: Path | None) -> dict:
    """One table row. Compute is per padded token (clients differ in sentence lengths, so per
    client-round FLOPs mix pruning with which clients were picked); ratios are to the dense run."""
    s = json.loads((run / "summary.json").read_text())
    t = client_totals(run)
    g = lambda k: s.get(k) or 0.0  # noqa: E731
    per_tok = lambda k, tot=t: tot[k] / max(tot["tokens"], 1) / 1e6  # noqa: E731  MFLOPs/token
    out = {
        "run": name, "CS": "Loss" if selection == "loss_gap" else "Rand",
        "test acc": f"{100 * s['test_accuracy']:.2f}%",
        "best dev acc": f"{100 * max((r.get('dev_accuracy') or 0) for r in _records(run)):.1f}%",
        "rounds→target": str(s["rounds_to_target"]) if s["rounds_to_target"] else f">{s['rounds']}",
        "sparsity": f"{100 * g('sparsity_mean'):.0f}%",
        "train MFLOPs/token meas. (analytic)": f"{per_tok('flops_measured'):.1f} ({per_tok('flops_analytic'):.1f})",
        "+ importance MFLOPs/token": f"{per_tok('flops_importance'):.1f}",
        "paper MOPs/token (T=512 G-OPs/seq)": f"{per_tok('paper_ops'):.1f} ({g('paper_ops_T512') / 1e9:.0f})",
        "MB up (down) /client/round": f"{g('bytes_up_mean') / 1e6:.3f} ({g('bytes_down_mean') / 1e6:.3f})",
    }
    if dense_run is not None:
        d = client_totals(dense_run)
        r = lambda k: per_tok(k, d) / max(per_tok(k), 1e-12)  # noqa: E731
        ds = json.loads((dense_run / "summary.json").read_text())
        out["dense/this: FLOPs, OPs, OPs T=512, up"] = (
            f"{r('flops_measured'):.2f}, {r('paper_ops'):.2f}, "
            f"{ds['paper_ops_T512'] / g('paper_ops_T512'):.2f}, {ds['bytes_up_mean'] / g('bytes_up_mean'):.2f}")
    return out


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def markdown(rows: list[dict]) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def plot_sweep(points: list[tuple[float, Path]], path: Path) -> None:
    """Fig. 4 shape: test accuracy, MB up per client-round and training FLOPs per token (measured,
    analytic, and the paper's Table 6 OPs at T=512, relative to dense) against sparsity."""
    fig, axes = figure(ncols=3, width=4.0, height=3.2)
    xs = [100 * s for s, _ in points]
    sums = [json.loads((r / "summary.json").read_text()) for _, r in points]
    tots = [client_totals(r) for _, r in points]
    axes[0].plot(xs, [s["test_accuracy"] for s in sums], marker="o")
    axes[0].set_ylabel("test accuracy")
    axes[1].plot(xs, [s["bytes_up_mean"] / 1e6 for s in sums], marker="o", label="up")
    axes[1].plot(xs, [s["bytes_down_mean"] / 1e6 for s in sums], "--", label="down")
    axes[1].set_ylabel("MB / client / round")
    rel = lambda vals: [v / vals[0] for v in vals]  # noqa: E731
    for key, style, label in (("flops_measured", "-o", "measured FLOPs"),
                              ("flops_analytic", "--", "analytic FLOPs"),
                              ("paper_ops", ":x", "paper OPs (our T)")):
        axes[2].plot(xs, rel([t[key] / max(t["tokens"], 1) for t in tots]), style, label=label)
    axes[2].plot(xs, rel([s["paper_ops_T512"] for s in sums]), ":s", label="paper OPs (T=512)")
    axes[2].set_ylabel("training compute per token (÷ first)")
    for ax in axes:
        ax.set_xlabel("sparsity %")
        ax.grid(True, alpha=0.3)
    for ax in axes[1:]:
        ax.legend(loc="best", fontsize="small")
    save_figure(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", nargs="+", default=["table1", "sweep"],
                   choices=["table1", "sweep", "ablation"])
    p.add_argument("--rerun", action="store_true", help="run again runs whose folder exists")
    p.add_argument("--only", nargs="*", help="run only these run names")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--budget-min", type=float, default=None, help="total wall-time budget")
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--clients-per-round", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=1)
    p.add_argument("--dev-examples", type=int, default=256)
    p.add_argument("--importance-examples", type=int, default=128)
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument("--track-test", action="store_true", help="test accuracy every evaluation")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench/results/heads"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = [r for r in planned_runs(args) if not args.only or r[0] in args.only]
    done: dict[str, tuple[Path, str]] = {}
    if not args.rerun:  # resume: reuse finished run folders of the same name
        done = {n: (args.out / n, sel) for n, _, sel in runs if (args.out / n / "summary.json").is_file()}
        runs = [r for r in runs if r[0] not in done]
    rounds = args.rounds
    if args.budget_min and runs:
        per_round, per_run = pilot(args)
        left = args.budget_min * 60 / len(runs) - per_run
        rounds = max(1, min(rounds, math.floor(left / (per_round * 1.1))))
        print(f"pilot: {per_round:.1f} s/round + {per_run:.0f} s/run -> {rounds} rounds x "
              f"{len(runs)} runs", flush=True)
    header = [f"Command: `python bench/heads_sst2.py {' '.join(sys.argv[1:])}` ({rounds} rounds)  ",
              f"Machine: {platform.machine()}, {args.threads} torch thread(s), torch "
              f"{torch.__version__}; date {time.strftime('%Y-%m-%d')}", ""]
    for name, opts, sel in runs:
        t0 = time.perf_counter()
        done[name] = (run_experiment(validate_config(config(name, opts, sel, args, rounds))), sel)
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
        write_report(args, header, done)
    write_report(args, header, done)


def write_report(args, header: list[str], done: dict[str, tuple[Path, str]]) -> None:
    summaries = {n: json.loads((r / "summary.json").read_text()) for n, (r, _) in done.items()}
    dense = {sel: done[f"B1-dense-{sel}"][0] if f"B1-dense-{sel}" in done else None
             for sel in ("random", "loss_gap")}
    report = list(header)
    t1 = [n for n in done if not n.startswith("ours") or n.startswith("ours90")]
    if t1 and "table1" in args.groups:
        report += ["### Table 1 shape", "", markdown([row(n, done[n][1], done[n][0], dense[done[n][1]])
                                                      for n in t1]), ""]
        plot_compare([done[n][0] for n in t1], args.out / "table1.png")
    sweep = [(s, summaries[_sweep_name(s)]) for s in SWEEP if _sweep_name(s) in summaries]
    if sweep and "sweep" in args.groups:
        base = done[_sweep_name(0.0)][0] if _sweep_name(0.0) in done else None
        report += ["### Sparsity sweep (loss-gap selection)", "",
                   markdown([row(f"ours{round(s * 100)}", "loss_gap", done[_sweep_name(s)][0], base)
                             for s, _ in sweep]), ""]
        plot_sweep([(s, done[_sweep_name(s)][0]) for s, _ in sweep], args.out / "sweep.png")
    ablation = [n for n in ABLATION if n in done]
    if "ablation" in args.groups and ablation:
        report += ["### Ablation: pruning rule x aggregation (random selection, 90%)", "",
                   markdown([row(n, "random", done[n][0], dense["random"]) for n in ablation]), ""]
    name = "results.md" if args.groups == ["table1", "sweep"] else f"results-{'-'.join(args.groups)}.md"
    (args.out / name).write_text("\n".join(report) + "\n")


def _sweep_name(s: float) -> str:
    return f"ours{round(s * 100)}-loss_gap"


if __name__ == "__main__":
    main()
