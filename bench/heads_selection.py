"""Benchmark: the heads paper's Eq. 9 (loss-gap client selection) where it is active (issue 35, part 3).

With 100 clients and 2 per round Eq. 9's cold start (an unseen client's loss is +inf) keeps
selection uniform for the first 50 rounds, so no earlier run measured it. Here: SST-2, MiniLM-L6,
``heads`` at 90% sparsity (importance pruning + Eq. 8, ``prune = "parameters"``), **20 clients,
2 per round, Dirichlet 0.5 label skew**, so the cold start ends after round 10 and Eq. 9 ranks
the clients for the remaining rounds. Each seed runs both selections with the same partition and
LoRA init (the seed fixes both); only the client sequence differs.

Records per run: test accuracy (872 GLUE validation sentences), dev accuracy per evaluation,
the clients picked every round, how many distinct clients trained after the cold start and how
concentrated Eq. 9's picks are, and each selected client's label balance. Writes ``results.md``
and ``results.json`` under ``--out`` (run folders beside them are not committed). Finished runs are
reused unless ``--rerun``. Two processes side by side (one per selection) halve the wall time::

    OMP_NUM_THREADS=1 nice -n 10 python bench/heads_selection.py --selections uniform \\
        --seeds 0 1 2 --rounds 60 --local-steps 5 &
    OMP_NUM_THREADS=1 nice -n 10 python bench/heads_selection.py --selections loss_gap \\
        --seeds 0 1 2 --rounds 60 --local-steps 5
    python bench/heads_selection.py --report-only --seeds 0 1 2   # the table of both
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from heads_sst2 import _records, config as sst2_config, markdown  # noqa: E402

from fedslice.api import run_experiment  # noqa: E402
from fedslice.experiment import validate_config  # noqa: E402

SELECTIONS = ("uniform", "loss_gap")
HEADS90 = {"pruning": "importance", "aggregation": "head_weighted", "sparsity": 0.9,
           "prune": "parameters"}


def config(name: str, selection: str, args) -> dict:
    cfg = sst2_config(name, HEADS90, selection, args, args.rounds)
    cfg["data"].update(partition="dirichlet", alpha=args.alpha)
    cfg["federation"]["num_clients"] = args.clients
    cfg["federation"]["cold_start"] = args.cold_start
    cfg["compute"] = {"workers": args.workers}  # 1: one client after another, one thread in all
    return cfg


def figures(run: Path, cold_rounds: int) -> dict:
    s = json.loads((run / "summary.json").read_text())
    recs = _records(run)
    picks = [sorted(int(m["client"]) for m in r["client_metrics"]) for r in recs]
    after = [c for p in picks[cold_rounds:] for c in p]
    cnt = Counter(after)
    return {
        "test_accuracy": s["test_accuracy"], "rounds": s["rounds"],
        "dev": {r["round"]: r["dev_accuracy"] for r in recs if r.get("dev_accuracy") is not None},
        "picks": picks,
        "distinct_after_cold_start": len(cnt),
        "top2_share_after_cold_start": (sum(v for _, v in cnt.most_common(2)) / len(after)) if after else None,
        "train_loss_last": recs[-1].get("train_loss"),
        "wall_s": s.get("wall_time_s") or s.get("wall_s"),
    }


def report(args, res: dict) -> None:
    seeds = [s for s in args.seeds if all(s in res.get(sel, {}) for sel in SELECTIONS)]
    rows = []
    for sel in SELECTIONS:
        per = [res[sel][s] for s in args.seeds if s in res.get(sel, {})]
        if not per:
            continue
        accs = [f["test_accuracy"] for f in per]
        rows.append({
            "selection": {"uniform": "uniform (seeded, without feedback)",
                          "loss_gap": f"Eq. 9 loss gap (cold start {args.cold_start})"}[sel],
            "seeds": len(per),
            "test acc, median (per seed)": f"{100 * statistics.median(accs):.2f}% "
                                           f"({', '.join(f'{100 * a:.2f}' for a in accs)})",
            "mean ± sd": f"{100 * statistics.mean(accs):.2f} ± "
                         f"{100 * (statistics.stdev(accs) if len(accs) > 1 else 0):.2f}",
            "distinct clients after the cold start, median": statistics.median(
                f["distinct_after_cold_start"] for f in per),
            "share of picks on the 2 most picked, median": f"{statistics.median(f['top2_share_after_cold_start'] for f in per):.2f}",
        })
    diffs = [res["loss_gap"][s]["test_accuracy"] - res["uniform"][s]["test_accuracy"] for s in seeds]
    out = ["# heads 90%: Eq. 9 loss-gap selection vs uniform where Eq. 9 is active (issue 35, part 3)", "",
           f"Command: `python bench/heads_selection.py {' '.join(sys.argv[1:])}`  ",
           f"Machine: {platform.machine()}, {args.threads} torch thread(s), torch {torch.__version__}; "
           f"date {time.strftime('%Y-%m-%d')}  ",
           f"Setting: SST-2, MiniLM-L6, heads 90% (importance + Eq. 8, parameters), {args.clients} "
           f"clients, Dirichlet {args.alpha}, {args.clients_per_round} per round, {args.rounds} rounds x "
           f"{args.local_steps} local steps of 32, lr {args.lr:g}, max length 64, importance on "
           f"{args.importance_examples} sentences; cold start = {args.clients // args.clients_per_round} rounds", "",
           markdown(rows) if rows else "(no runs)", ""]
    if diffs:
        out += [f"Paired (same seed) Eq. 9 − uniform, pt: {', '.join(f'{100 * d:+.2f}' for d in diffs)}; "
                f"median {100 * statistics.median(diffs):+.2f}, mean {100 * statistics.mean(diffs):+.2f}", ""]
    (args.out / "results.md").write_text("\n".join(out) + "\n")
    (args.out / "results.json").write_text(json.dumps(
        {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
         "runs": {sel: {str(s): f for s, f in v.items()} for sel, v in res.items()}}, indent=1) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--selections", nargs="+", default=list(SELECTIONS), choices=SELECTIONS)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--clients-per-round", type=int, default=2)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--cold-start", default="unseen_first", choices=["unseen_first", "probe"])
    p.add_argument("--local-steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--dev-examples", type=int, default=256)
    p.add_argument("--importance-examples", type=int, default=128)
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--workers", type=int, default=1, help="compute.workers (1: one core per run)")
    p.add_argument("--rerun", action="store_true")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--out", type=Path, default=Path("bench/results/heads_selection"))
    args = p.parse_args()
    args.track_test = False
    args.out.mkdir(parents=True, exist_ok=True)
    cold = args.clients // args.clients_per_round
    res: dict = {}
    for seed in args.seeds:
        for sel in (SELECTIONS if args.report_only else args.selections):
            args.seed = seed
            name = f"heads90-{sel}-s{seed}"
            folder = args.out / name
            if not (folder / "summary.json").is_file() or args.rerun:
                if args.report_only:
                    continue
                t0 = time.perf_counter()
                folder = run_experiment(validate_config(config(name, sel, args)))
                print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
            f = figures(folder, cold)
            res.setdefault(sel, {})[seed] = f
            print(f"  {name} acc {f['test_accuracy']:.4f} distinct {f['distinct_after_cold_start']}", flush=True)
    if args.report_only:
        report(args, res)


if __name__ == "__main__":
    main()
