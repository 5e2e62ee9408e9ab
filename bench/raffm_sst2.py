"""Benchmark: RaFFM with device tiers vs homogeneous FedPETuning vs everyone-on-the-smallest-tier.

MiniLM-L6 on SST-2, 100 clients (IID), 10 per round, LoRA r=16 on q/v for all three runs:

  (a) ``fedpetuning``  everyone trains the full model (upper bound);
  (b) ``smallest``     raffm with one tier: everyone trains the smallest tier's sub-model;
  (c) ``raffm``        raffm with 4 tiers, 25% each at 0.25 / 0.5 / 0.75 / 1.0 of the full
                       model's training FLOPs.

Same partition, seed, client sampling and rounds for the three. ``--minutes`` is a wall-clock
budget for the whole benchmark, split evenly: a run stops after the round that crosses its share
(all runs then get the same number of rounds as the first, so the comparison stays fair). Writes
``<out>/<run>/{summary.json,metrics.jsonl}``, ``<out>/raffm.png`` (accuracy per round and elastic
accuracy vs size / FLOPs) and ``<out>/results.md`` (the tables for BENCHMARKS.md).

    .venv/bin/python bench/raffm_sst2.py --minutes 45
    .venv/bin/python bench/raffm_sst2.py --rounds 30 --local-steps 8      # no time limit
    .venv/bin/python bench/raffm_sst2.py --runs raffm --rounds 10 --local-steps 12 --salience activation \
        --threads 1 --out bench/results/raffm-sst2-act                    # issue 35 part 4
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from fedslice.experiment import validate_config
from fedslice.api import setup
from fedslice.run.engine import Simulation, summarize
from fedslice.output import write_json_atomic
from fedslice.methods.raffm import plot_elastic

TIERS = (0.25, 0.5, 0.75, 1.0)


def config(kind: str, args) -> dict:
    raffm = {"name": "raffm", "tuning": "lora", "width_steps": args.width_steps,
             "elastic_sizes": list(TIERS), "size_weight": args.size_weight,
             "salience": args.salience}
    method = {"fedpetuning": {"name": "fedpetuning"},
              "smallest": {**raffm, "tiers": [{"share": 1.0, "flops": TIERS[0]}]},
              "raffm": {**raffm, "tiers": [{"share": 0.25, "flops": f} for f in TIERS]}}[kind]
    return {
        "name": kind, "seed": args.seed, "threads": args.threads,
        "data": {"path": "sst2", "max_length": 64, "partition": "iid",
                 "max_dev_examples": args.dev_examples},
        "model": {"name": "minilm"},
        "lora": {"r": 16, "alpha": 32, "targets": ["q", "v"]},
        "federation": {"num_clients": 100, "clients_per_round": 10, "rounds": args.rounds,
                       "local_steps": args.local_steps, "batch_size": 32, "lr": args.lr},
        "method": method,
        "evaluation": {"every": args.eval_every, "batch_size": 128},
        "output": {"progress": False},
    }


def run(kind: str, args, rounds: int, deadline: float | None) -> tuple[dict, list[dict]]:
    """The engine's loop with a deadline (a run stops after the round that crosses it)."""
    cfg = validate_config(config(kind, args) | {})
    cfg.federation.rounds = rounds
    method, data = setup(cfg)
    sim = Simulation(cfg, method, data)
    state, records, t0 = method.initial_state(), [], time.perf_counter()
    for rnd in range(1, rounds + 1):
        state, rec = sim.run_round(rnd, state)
        rec["dev_accuracy"] = rec["dev_loss"] = None
        last = rnd == rounds or (deadline is not None and time.time() > deadline)
        if rnd % cfg.evaluation.every == 0 or last:
            ev = method.evaluate(state, data.dev, cfg.evaluation.batch_size)
            rec["dev_accuracy"], rec["dev_loss"] = ev["accuracy"], ev["loss"]
        rec["elapsed_s"] = time.perf_counter() - t0
        records.append(rec)
        print(f"[{kind}] round {rnd}: loss {rec['train_loss']:.3f} dev {rec['dev_accuracy']} "
              f"({rec['elapsed_s']:.0f} s)", flush=True)
        if last:
            break
    cfg.federation.rounds = len(records)
    test = method.evaluate(state, data.test, cfg.evaluation.batch_size)
    summary = summarize(cfg, records, test, time.perf_counter() - t0, data)
    summary.update(method.final_metrics(state, data, records, cfg.evaluation.batch_size))
    params = {id(p): p for p in method.model.parameters()}.values()
    model_mb = sum(p.numel() * p.element_size() for p in params) / 2**20
    ran = [m for r in records for m in r["client_metrics"] if not m.get("sat_out")]
    summary.setdefault("memory_mb_mean", sum(model_mb + m["activation_mb"] for m in ran) / len(ran))
    folder = args.out / kind
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(folder / "summary.json", summary)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return summary, records


def memory_mean(folder: Path, records: list[dict]) -> float:
    """Mean client memory (model MiB + activation peak) of a run folder written by run_experiment."""
    from fedslice.models.loading import load_model
    cfg = validate_config(json.loads((folder / "config.json").read_text()))
    model = load_model(cfg.model, 2, cfg.seed).model
    model_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    ran = [m for r in records for m in r["client_metrics"] if not m.get("sat_out")]
    return sum(model_mb + m["activation_mb"] for m in ran) / len(ran)


def _g(x, scale=1e9, fmt=".1f"):
    return "—" if x is None else format(x / scale, fmt)


def tables(results: dict[str, tuple[dict, list]]) -> list[str]:
    a = results["fedpetuning"][0]
    lines = ["| run | rounds | test acc (full model) | Δ vs (a) pt | client GFLOPs/round mean | × (a) | "
             "down MB/round | up MB/round | client memory MiB mean |", "|" + "---|" * 9]
    for kind, (s, _) in results.items():
        ratio = s["flops_measured_mean"] / a["flops_measured_mean"]
        lines.append(f"| {kind} | {s['rounds']} | {s['test_accuracy']:.4f} | "
                     f"{100 * (s['test_accuracy'] - a['test_accuracy']):+.1f} | "
                     f"{_g(s['flops_measured_mean'])} | {ratio:.2f} | {_g(s['bytes_down_mean'], 1e6, '.3f')} | "
                     f"{_g(s['bytes_up_mean'], 1e6, '.3f')} | {s['memory_mb_mean']:.0f} |")
    for kind in ("raffm", "smallest"):
        if kind not in results:
            continue
        s = results[kind][0]
        lines += ["", f"Per tier, {kind}:", "",
                  "| tier budget | heads/layer | FFN/layer | planned FLOPs × full | client-rounds | "
                  "GFLOPs/round mean | down MB (trained) | frozen sub-model MB | memory MiB mean | planned memory MiB |",
                  "|" + "---|" * 10]
        for t in s["tiers"]:
            spec, plan = t.get("spec", {}), t.get("planned", {})
            lines.append(f"| {t['budget']} | {spec.get('heads', ['—'])[0]} | {spec.get('ffn', ['—'])[0]} | "
                         f"{plan.get('flops_ratio', float('nan')):.3f} | {t['client_rounds']} | "
                         f"{_g(t['flops_measured_mean'])} | {_g(t['bytes_down_mean'], 1e6, '.3f')} | "
                         f"{_g(t['bytes_down_frozen_mean'], 1e6, '.1f')} | {_g(t['memory_mb_mean'], 1, '.0f')} | "
                         f"{plan.get('memory_mb', float('nan')):.0f} |")
        lines += ["", f"Elastic inference, {kind} (global model evaluated at each size):", "",
                  "| size | heads/layer | FFN/layer | params (M) | forward GFLOPs/example | test acc | dev acc |",
                  "|---|---|---|---|---|---|---|"]
        for e in s["elastic"]:
            lines.append(f"| {e['size']} | {e['heads'][0]} | {e['ffn'][0]} | {e['params'] / 1e6:.1f} | "
                         f"{e['forward_gflops_per_example']:.2f} | {e['test_accuracy']:.4f} | {e['dev_accuracy']:.4f} |")
    return lines


def plot(results, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(15, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax_round, ax_size, ax_flops = (fig.add_subplot(1, 3, i) for i in (1, 2, 3))
    for kind, (s, records) in results.items():
        pts = [(r["round"], r["dev_accuracy"]) for r in records if r["dev_accuracy"] is not None]
        ax_round.plot(*zip(*pts), "-o", markersize=3, label=kind)
        if s.get("elastic"):
            plot_elastic(s["elastic"], path, series=kind, fig_axes=(fig, (ax_size, ax_flops)))
        else:
            ax_size.axhline(s["test_accuracy"], linestyle="--", color="grey", linewidth=1)
            ax_flops.axhline(s["test_accuracy"], linestyle="--", color="grey", linewidth=1,
                             label=f"{kind} (full model)")
    ax_round.set_xlabel("round")
    ax_round.set_ylabel("dev accuracy")
    ax_round.grid(True, alpha=0.3)
    ax_round.legend(loc="lower right")
    ax_flops.legend(loc="lower right")
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", nargs="+", default=["fedpetuning", "smallest", "raffm"])
    p.add_argument("--reuse", nargs="*", default=[], help="runs to read instead of running them "
                   "again (same settings): RUN reads <out>/RUN, RUN=FOLDER any run folder (e.g. "
                   "fedpetuning=<the baselines' fedpetuning-iid run>, the same experiment)")
    p.add_argument("--minutes", type=float, default=None, help="wall-clock budget for all runs")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--local-steps", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--dev-examples", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--width-steps", type=int, default=24)
    p.add_argument("--size-weight", type=float, default=0.0, help="method.size_weight of raffm: "
                   "aggregation weight examples x (sub-model FLOPs fraction)^p")
    p.add_argument("--salience", default="l1", choices=["l1", "l2", "activation"],
                   help="method.salience of the raffm runs (issue 35 part 4)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench/results/raffm"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    start, results, rounds = time.time(), {}, args.rounds
    reused = {}
    for item in args.reuse:  # "kind" (from <out>/kind) or "kind=FOLDER" (any run folder)
        kind, _, folder = item.partition("=")
        reused[kind] = Path(folder) if folder else args.out / kind
    for kind, folder in reused.items():
        records = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((folder / "summary.json").read_text())
        if "memory_mb_mean" not in summary:  # a run folder of `fedslice run`: add what run() adds
            summary["memory_mb_mean"] = memory_mean(folder, records)
        results[kind] = summary, records
        rounds = summary["rounds"]
    for i, kind in enumerate(k for k in args.runs if k not in reused):
        deadline = None
        if args.minutes and i == 0 and not args.reuse:  # the first run sets the round count
            deadline = start + 60 * args.minutes / len(args.runs)
        results[kind] = run(kind, args, rounds, deadline)
        rounds = results[kind][0]["rounds"]
    lines = [f"Command: `python bench/raffm_sst2.py {' '.join(sys.argv[1:])}`  ",
             f"Machine: {platform.machine()}, {torch.get_num_threads()} threads (shared CPU), "
             f"torch {torch.__version__}; {time.strftime('%Y-%m-%d')}; wall {(time.time() - start) / 60:.0f} min", ""]
    results = {k: results[k] for k in args.runs if k in results}
    if "fedpetuning" in results:
        lines += tables(results)
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    plot(results, args.out / "raffm.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
