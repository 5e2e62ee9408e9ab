"""Benchmark (issue 59, part 4, first version): time to accuracy on a simulated clock.

SST-2 with MiniLM-L6 + LoRA, dense clients (fedpetuning), a population whose training speeds
are log-normal (``--speed-sigma`` 0.9: the 5th-95th percentile spread is 19x) and which is
online ``--availability`` (0.7) of the rounds; the same federation and seed under the round
policies:

* ``all``: every selected client, ``--rounds`` rounds; its simulated time T and its final dev
  accuracy (the target) set the budget and the bar;
* ``deadline``: the round deadline at the ``--deadline-quantile`` (0.7) of the client-round
  times ``all`` measured, 30% over-selection;
* ``async``: FedBuff, ``concurrency`` = 2 x clients per round, ``buffer_size`` = clients per
  round.

``deadline`` and ``async`` run up to ``--cap`` x ``--rounds`` rounds and are cut at T. For each
policy and seed: simulated time to ``all``'s final dev accuracy (cost to target), dev accuracy
at T/2 and T (quality under budget), wasted client FLOPs, upload. The planner fitted to the
deadline (part 3) is not in this version.

Each (seed, policy) run is one resumable piece (its records in ``--out``; an existing file is
reused), so a shared machine can run them one at a time::

    flock /tmp/fedslice-heavy.lock .venv/bin/python bench/time_to_accuracy.py --seeds 0 --policies all
    .venv/bin/python bench/time_to_accuracy.py --seeds 0 1 2 --report bench/notes/time12.md
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from fedslice.api import setup
from fedslice.experiment import validate_config
from fedslice.run.asynchronous import simulation_for

POLICIES = ("all", "deadline", "async")


def base_config(args, seed: int) -> dict:
    return {
        "name": "time-to-accuracy", "seed": seed, "threads": args.threads,
        "data": {"path": "sst2", "max_length": args.max_length, "partition": "iid",
                 "max_dev_examples": args.dev_examples, "max_test_examples": 64},
        "model": {"name": "minilm"},
        "lora": {"r": 16, "alpha": 32, "targets": ["q", "v"]},
        "method": {"name": "fedpetuning"},
        "federation": {"num_clients": args.clients, "clients_per_round": args.per_round,
                       "rounds": args.rounds, "local_steps": args.local_steps,
                       "batch_size": args.batch_size, "lr": args.lr},
        "devices": {"distribution": "lognormal", "gflops_per_s": args.gflops,
                    "upload_mb_per_s": args.upload, "download_mb_per_s": args.download,
                    "availability": args.availability, "speed_sigma": args.speed_sigma},
        "evaluation": {"every": 1, "batch_size": 64},
        "output": {"progress": False, "plots": False},
    }


def run_piece(args, seed: int, policy: str) -> list[dict]:
    """The records of one run (cached as JSON in --out)."""
    path = args.out / f"seed{seed}-{policy}.json"
    if path.is_file():
        return json.loads(path.read_text())
    d = base_config(args, seed)
    fed = d["federation"]
    if policy == "deadline":
        ref = run_piece(args, seed, "all")
        secs = [m["sim_s"] for r in ref for m in r["client_metrics"]]
        fed.update(round_policy="deadline", overselect=0.3, rounds=args.cap * args.rounds,
                   round_deadline_s=float(np.quantile(secs, args.deadline_quantile)))
    elif policy == "async":
        fed.update(round_policy="async", concurrency=min(2 * args.per_round, args.clients),
                   buffer_size=args.per_round, rounds=args.cap * args.rounds)
    cfg = validate_config(d)
    method, data = setup(cfg)
    _, records, _ = simulation_for(cfg, method, data).run()
    slim = [{k: r.get(k) for k in ("round", "sim_time_s", "sim_round_s", "dev_accuracy",
                                   "wasted_flops", "round_flops", "staleness_mean",
                                   "examples_used")}
            | {"bytes_up": sum(m.get("bytes_up") or 0 for m in r["client_metrics"]),
               "client_metrics": [{"client": m["client"], "sim_s": m.get("sim_s"),
                                   "used": m["used"]} for m in r["client_metrics"]]}
            for r in records]
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(slim))
    return slim


def at_time(records: list[dict], t: float) -> float | None:
    """Dev accuracy of the last round finished by simulated time ``t`` (None: the run ended
    before ``t``, or had no evaluation by then)."""
    if not records or records[-1]["sim_time_s"] < t - 1e-9:
        return None
    done = [r for r in records if r["sim_time_s"] <= t + 1e-9 and r["dev_accuracy"] is not None]
    return done[-1]["dev_accuracy"] if done else None


def time_to(records: list[dict], target: float) -> float | None:
    hit = [r["sim_time_s"] for r in records if (r["dev_accuracy"] or 0) >= target - 1e-12]
    return hit[0] if hit else None


def summarize(args) -> str:
    rows, ratios = [], {p: [] for p in POLICIES}
    for seed in args.seeds:
        runs = {p: json.loads((args.out / f"seed{seed}-{p}.json").read_text())
                for p in POLICIES if (args.out / f"seed{seed}-{p}.json").is_file()}
        if "all" not in runs:
            continue
        T = runs["all"][-1]["sim_time_s"]
        target = runs["all"][-1]["dev_accuracy"]
        t_all = time_to(runs["all"], target)
        for p, recs in runs.items():
            recs = [r for r in recs if r["sim_time_s"] <= T + 1e-9]  # within all's budget
            tt = time_to(recs, target)
            wasted = sum(r["wasted_flops"] or 0 for r in recs)
            total = sum(r["round_flops"] or 0 for r in recs)
            up = sum(r["bytes_up"] for r in recs) / 1e6
            ratios[p].append(tt / t_all if tt is not None else math.inf)
            last = recs[-1]
            rows.append(f"| {seed} | {p} | {len(recs)} | {last['sim_time_s']:.0f} | "
                        f"{_f(last['dev_accuracy'])} | {target:.4f} | "
                        f"{'-' if tt is None else f'{tt:.0f} ({tt / t_all:.2f}x)'} | "
                        f"{_f(at_time(recs, T / 2))} | {_f(at_time(recs, T))} | "
                        f"{wasted / total if total else 0:.1%} | {up:.1f} |")
    head = ("| seed | policy | rounds (within T) | sim s at its last round | dev acc there | "
            "target = all's final dev acc | sim s to target (x all's) | dev acc at T/2 | "
            "dev acc at T | wasted FLOPs | upload MB |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    med = "\n".join(f"- {p}: median (over {len(v)} seed(s)) simulated time to the target / "
                    f"all's: {np.median(v):.2f}" for p, v in ratios.items() if v)
    return head + "\n" + "\n".join(rows) + "\n\n" + med + "\n"


def plot(args, path: Path) -> Path:
    """Dev accuracy against simulated time, one panel per seed, a line per policy."""
    from matplotlib.ticker import AutoLocator

    from fedslice.report import figure, save_figure

    seeds = [s for s in args.seeds if (args.out / f"seed{s}-all.json").is_file()]
    fig, axes = figure(ncols=max(1, len(seeds)), width=4.5, height=3.5)
    for ax, seed in zip(axes, seeds):
        T = json.loads((args.out / f"seed{seed}-all.json").read_text())[-1]["sim_time_s"]
        for p in POLICIES:
            f = args.out / f"seed{seed}-{p}.json"
            if f.is_file():
                recs = [r for r in json.loads(f.read_text()) if r["dev_accuracy"] is not None]
                ax.plot([r["sim_time_s"] for r in recs], [r["dev_accuracy"] for r in recs],
                        marker=".", label=p)
        ax.axvline(T, color="grey", lw=0.8, ls=":")
        ax.xaxis.set_major_locator(AutoLocator())
        ax.set(title=f"seed {seed}", xlabel="simulated seconds", ylabel="dev accuracy")
        ax.legend()
    return save_figure(fig, path)


def _f(x):
    return "-" if x is None else f"{x:.4f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results/time_to_accuracy"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--cap", type=int, default=2, help="deadline/async run up to cap x rounds")
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--per-round", type=int, default=5)
    ap.add_argument("--local-steps", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--dev-examples", type=int, default=256)
    ap.add_argument("--gflops", type=float, default=20.0, help="median training GFLOP/s")
    ap.add_argument("--speed-sigma", type=float, default=0.9)
    ap.add_argument("--upload", type=float, default=1.0, help="median MB/s up")
    ap.add_argument("--download", type=float, default=5.0, help="median MB/s down")
    ap.add_argument("--availability", type=float, default=0.7)
    ap.add_argument("--deadline-quantile", type=float, default=0.7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--report", type=Path, help="write the table (markdown) here too, and the "
                    "accuracy-against-simulated-time plot beside it (.png)")
    args = ap.parse_args(argv)
    for seed in args.seeds:
        for p in args.policies:
            run_piece(args, seed, p)
            print(f"seed {seed} {p}: done", flush=True)
    table = summarize(args)
    print(table)
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(table)
        print("plot:", plot(args, args.report.with_suffix(".png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
