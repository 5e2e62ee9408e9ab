"""Benchmark (issue 23): the heads paper's Table 3 shape, adapter x head sparsity.

One experiment config (``bench/adapters/*.toml``) holds the base set-up and one ``[[variants]]``
table per adapter; this script runs every adapter at every ``--sparsities`` value with the
``heads`` method:

* sparsity 0: the paper's B1 (no pruning, FedAvg aggregation) = FedPETuning with that adapter;
* sparsity s > 0: importance pruning (Eq. 6-7), head-weighted aggregation (Eq. 8),
  ``prune = "parameters"`` (a pruned head's adapter entries are neither trained nor sent).

An adapter without per-head parameters (prompt tuning, P-tuning) runs at 0 and at the largest
sparsity only: nothing of it is pruned, and that run shows it (same bytes, same training).

Per run: the test metric (accuracy, or ROUGE-L for generation), upload bytes per client-round,
measured training FLOPs per client-round (``FlopCounterMode`` on the client's real steps), the
importance pass's FLOPs (counted apart), the analytic FLOPs, and ratios to the same adapter's
sparsity-0 run. Results accumulate in ``<out>/results.json`` (finished runs are skipped unless
``--rerun``; invocations may run side by side on one store); ``results.md`` is rewritten from it::

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python bench/adapters_table3.py \\
        bench/adapters/sst2_minilm.toml --out bench/results/adapters_sst2 [--only prompt ia3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from fedslice.api import run_experiment
from fedslice.config import read_config_file
from fedslice.experiment import load_variants
from fedslice.registry import ADAPTERS

PRUNED = {"pruning": "importance", "aggregation": "head_weighted", "prune": "parameters"}
DENSE = {"pruning": "none", "aggregation": "fedavg", "sparsity": 0.0}


def runs(config: Path, sparsities: list[float], only: list[str] | None):
    """(adapter variant, sparsity, validated config) of every run, in order."""
    raw = read_config_file(config)
    names = [v["name"] for v in raw["variants"]]
    for name in names:
        if only and name not in only:
            continue
        for s in sparsities:
            opts = DENSE if s == 0 else {**PRUNED, "sparsity": s}
            overrides = [f"method.{k}={json.dumps(v)}" for k, v in opts.items()]
            cfgs = {c.name: c for c in load_variants(config, overrides)}
            cfg = cfgs[name]
            if s not in (0, max(sparsities)) and not ADAPTERS.get(cfg.peft.method).adapter_cls.head_tied:
                continue  # nothing of it is pruned: the largest sparsity shows that
            yield name, s, cfg


def key(name: str, s: float) -> str:
    return f"{name}@{round(100 * s)}"


def run_one(cfg, out: Path, name: str, s: float) -> dict:
    cfg = cfg.model_copy(update={"name": key(name, s).replace("@", "-s")}, deep=True)
    t0 = time.perf_counter()
    path = run_experiment(cfg, out, progress=False)
    summary = json.loads((path / "summary.json").read_text())
    records = [json.loads(l) for l in (path / "metrics.jsonl").read_text().splitlines()]
    clients = [m for r in records for m in r["client_metrics"] if m.get("num_examples", 0) > 0]
    mean = lambda k: sum(m.get(k) or 0.0 for m in clients) / max(len(clients), 1)  # noqa: E731
    return {"adapter": name, "sparsity": s, "peft": cfg.peft.method, "run_dir": str(path),
            "test_accuracy": summary.get("test_accuracy"), "test_rougeL": summary.get("test_rougeL"),
            "test_bleu": summary.get("test_bleu"), "dev_accuracy": summary.get("final_dev_accuracy"),
            "dev_rougeL": summary.get("final_dev_rougeL"), "bytes_up": mean("bytes_up"),
            "bytes_down": mean("bytes_down"), "flops_measured": mean("flops_measured"),
            "flops_analytic": mean("flops_analytic"), "flops_importance": mean("flops_importance"),
            "tokens": mean("tokens"), "trainable_params": mean("trainable_params"),
            "heads_kept": mean("heads_kept"), "train_loss_last": records[-1].get("train_loss"),
            "paper_ops": mean("paper_ops"), "client_rounds": len(clients), "wall_s": time.perf_counter() - t0,
            "loadavg": os.getloadavg()[0], "lr": cfg.federation.lr}


def paper_ops(r: dict) -> float:
    """Mean per client-round of the heads paper's op count (Table 6, ``paper_ops``) of a run
    (None when neither the row nor the run folder has it)."""
    if r.get("paper_ops") is None:
        path = Path(r["run_dir"]) / "metrics.jsonl"
        if not path.exists():  # an old row (before the count was stored) whose folder is gone
            return None
        recs = [json.loads(l) for l in path.read_text().splitlines()]
        ops = [m.get("paper_ops") or 0.0 for x in recs for m in x["client_metrics"]
               if m.get("num_examples", 0) > 0]
        r["paper_ops"] = sum(ops) / max(len(ops), 1)
    return r["paper_ops"]


def markdown(results: dict, config: Path) -> str:
    gen = any(r.get("test_rougeL") is not None for r in results.values())
    metric = "ROUGE-L" if gen else "test acc"
    cols = ["adapter", "sparsity", metric, f"Δ {metric} vs s=0", "MB up / client-round",
            "up: s=0 ÷ this", "train GFLOPs / client-round (measured)", "FLOPs: s=0 ÷ this",
            "+ importance GFLOPs", "analytic GFLOPs", "paper OPs (Table 6): s=0 ÷ this", "lr"]
    lines = [f"`{config}`; per client-round means; ratios to the same adapter at sparsity 0.", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    val = lambda r: (r["test_rougeL"] if gen else 100 * (r["test_accuracy"] or 0))  # noqa: E731
    for k, r in results.items():
        base = results.get(key(r["adapter"], 0))
        ratio = lambda f: (f"{base[f] / r[f]:.2f}" if base and r[f] else "—")  # noqa: E731
        ops = f"{paper_ops(base) / paper_ops(r):.2f}" if base and paper_ops(base) and paper_ops(r) else "—"
        lines.append("| " + " | ".join([
            r["adapter"], f"{round(100 * r['sparsity'])}%", f"{val(r):.2f}",
            f"{val(r) - val(base):+.2f}" if base else "—", f"{r['bytes_up'] / 1e6:.3f}",
            ratio("bytes_up"), f"{r['flops_measured'] / 1e9:.1f}", ratio("flops_measured"),
            f"{r['flops_importance'] / 1e9:.1f}", f"{r['flops_analytic'] / 1e9:.1f}", ops, f"{r['lr']:g}"])
            + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--sparsities", type=float, nargs="+", default=[0.0, 0.5, 0.9])
    p.add_argument("--only", nargs="*", help="adapter variants (their [[variants]] names)")
    p.add_argument("--seed", type=int, default=None, help="the run's seed (default: the config's); "
                   "use an --out of its own per seed")
    p.add_argument("--rerun", action="store_true")
    p.add_argument("--table", action="store_true", help="only rewrite results.md from results.json")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    store = args.out / "results.json"
    if args.table:
        (args.out / "results.md").write_text(markdown(json.loads(store.read_text()), args.config))
        return
    for name, s, cfg in runs(args.config, args.sparsities, args.only):
        done = json.loads(store.read_text()) if store.exists() else {}
        if key(name, s) in done and not args.rerun:
            continue
        if args.seed is not None:  # partition, client sequence, initial adapter
            cfg = cfg.model_copy(update={"seed": args.seed})
        row = run_one(cfg, args.out, name, s)
        row["seed"] = cfg.seed
        row.update(machine=platform.machine(), threads=cfg.threads, date=time.strftime("%Y-%m-%d %H:%M"))
        done = json.loads(store.read_text()) if store.exists() else {}  # side-by-side runs
        done[key(name, s)] = row
        order = {k: done[k] for k in sorted(done, key=lambda k: (done[k]["adapter"], done[k]["sparsity"]))}
        store.write_text(json.dumps(order, indent=1))
        (args.out / "results.md").write_text(markdown(order, args.config))
        print(f"{key(name, s)}: {row['test_rougeL'] or row['test_accuracy']} "
              f"up {row['bytes_up'] / 1e6:.3f} MB, {row['flops_measured'] / 1e9:.1f} GFLOPs, "
              f"{row['wall_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
