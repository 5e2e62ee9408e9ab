"""Benchmark: memory budgets that hold on any data (issue 61, part 2 and its targets).

Short planned runs on real data of different length profiles, each with one memory tier, and the
planner's predicted peak memory, GFLOPs per round and upload against what its clients measured
(``summary.json`` ``plans``):

  sst2      SST-2, MiniLM-L6: short sentences (median 10 tokens, none at max_length 64)
  ag_news   AG News, 9,000 train texts (bench/data/ag_news.py), MiniLM-L6: issue 61's case
            (median 51 tokens, 18% at max_length 64)
  wikitext  WikiText-2 50-word chunks, random 4 labels (bench/data/wikitext_chunks.py), MiniLM-L6:
            the long-text profile (median 62 tokens, 43% at max_length 64)
  e2e       E2E NLG, SmolLM2-135M: configs/e2e_smollm2.toml's lengths (prompt 64, target 64),
            batch 8

The classifiers take the issue's shape: LoRA r16 on q/v (the planner may lower it: lora.ranks
4, 8, 16), batch 32, 6 local steps, max_length 64, 100 clients, one round of ``--clients``
clients, tier ``memory_mb = 450`` (MiniLM). E2E: the config's LoRA, 20 clients, 6 steps of 8
examples, a tier at ``--e2e-share`` (default 0.7) of the planner's predicted peak of a dense
fedpetuning client (so the planner has to choose). Each data set runs ``fedpetuning`` and
``raffm+heads``, packing on (the default) and off, and each with ``budgets.enforce_memory`` on
(the default: memory held as the client trains) and off (the planner's prediction alone).

Row columns: plan; predicted / measured peak MiB (``memory_mb_max``, the largest client) and
their ratio; GFLOPs per client-round predicted / measured and ratio; upload MB; steps run as
micro-batches (``plan_downgrades``); whether the measured peak is within the budget and the
prediction within 10% of the measurement. Writes ``<out>/<case>.json`` (the summary's plans and
the config's essentials) and ``<out>/results.md``. No wall times (shared machine).

    OMP_NUM_THREADS=1 .venv/bin/python bench/budget_predictions.py --data sst2 ag_news wikitext e2e
    OMP_NUM_THREADS=1 .venv/bin/python bench/budget_predictions.py --data ag_news --methods fedpetuning --pack on --enforce on
    # before the fix (issue 61's commit d8cac35 has no budgets.enforce_memory: --enforce on only)
    cd ../wt-before && PYTHONPATH=src python ../wt-bench61/bench/budget_predictions.py --enforce on --out ../wt-bench61/bench/results/budget_predictions_before
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from fedslice.api import run_experiment
from fedslice.experiment import load_config, validate_config

ROOT = Path(__file__).resolve().parents[1]
DATA_OUT = ROOT / "bench/data/out"

#: per data set: its data section, model, batch and the tier's memory_mb (None: a share of the
#: dense client's predicted peak, ``--e2e-share``)
DATASETS = {
    "sst2": {"data": {"path": "sst2", "max_length": 64}, "model": "minilm", "memory_mb": 450.0},
    "ag_news": {"data": {"path": str(DATA_OUT / "ag_news"), "max_length": 64}, "model": "minilm",
                "memory_mb": 450.0, "builder": "bench/data/ag_news.py"},
    "wikitext": {"data": {"path": str(DATA_OUT / "wikitext_chunks"), "max_length": 64}, "model": "minilm",
                 "memory_mb": 450.0, "builder": "bench/data/wikitext_chunks.py"},
    "e2e": {"model": "smollm2", "memory_mb": None},
}


def classifier_config(ds: str, args) -> dict:
    return {
        "seed": 0, "threads": args.threads,
        "data": {**DATASETS[ds]["data"], "max_dev_examples": 64, "max_test_examples": 64},
        "model": {"name": DATASETS[ds]["model"]},
        "lora": {"r": 16, "alpha": 32, "targets": ["q", "v"], "ranks": [4, 8, 16]},
        "federation": {"num_clients": 100, "clients_per_round": args.clients, "rounds": args.rounds,
                       "local_steps": 6, "batch_size": 32, "lr": 1e-3},
        "compute": {"workers": 1},
        "evaluation": {"every": args.rounds, "batch_size": 64},
        "output": {"progress": False, "plots": False, "save_weights": False},
    }


def e2e_config(args) -> dict:
    """configs/e2e_smollm2.toml (its lengths, LoRA, batch 8, 6 local steps), one short round."""
    cfg = load_config(ROOT / "configs/e2e_smollm2.toml").model_dump(mode="json")
    cfg.update(seed=0, threads=args.threads)
    cfg["lora"]["ranks"] = [4, 8, 16]
    cfg["federation"].update(rounds=args.rounds, clients_per_round=args.clients)
    cfg["data"].update(max_dev_examples=16, max_test_examples=8)
    cfg["task"]["max_new_tokens"] = 8
    cfg["evaluation"].update(every=args.rounds, dev_generations=2, batch_size=16)
    cfg["compute"]["workers"] = 1
    cfg["output"].update(progress=False, plots=False, save_weights=False)
    return cfg


def config(ds: str, method: str, pack: bool, enforce: bool, memory_mb: float, args) -> dict:
    cfg = e2e_config(args) if ds == "e2e" else classifier_config(ds, args)
    cfg["name"] = case_name(ds, method, pack, enforce)
    cfg["federation"]["pack"] = pack
    cfg["method"] = {"name": method, **({"importance_max_examples": 32} if "heads" in method else {})}
    if "raffm" in method and ds == "e2e":
        cfg["method"]["elastic_sizes"] = [1.0]  # one generation pass after training, not one per size
    cfg["budgets"] = {"tiers": [{"name": f"{memory_mb:g}MiB", "share": 1.0, "memory_mb": memory_mb}],
                      # only when off: a commit before issue 61 (d8cac35) has no such field
                      **({} if enforce else {"enforce_memory": False})}
    return cfg


def case_name(ds: str, method: str, pack: bool, enforce: bool) -> str:
    return f"{ds}-{method.replace('+', '_')}-pack{'on' if pack else 'off'}-{'held' if enforce else 'pred'}"


def dense_memory(ds: str, args) -> float:
    """The planner's predicted peak memory of a dense fedpetuning client (no budget binds)."""
    from fedslice.run.setup import load_inputs

    cfg = validate_config(config(ds, "fedpetuning", True, True, 1e6, args))
    method = load_inputs(cfg, "both", weights="random").method(cfg, "both")
    return next(iter(method.plans.values())).memory_mb


def row(case: str, budget: float, g: dict) -> dict:
    p, m = g["predicted"], g["measured"]
    mem, flops = m["memory_mb_max"], m["gflops_per_round_mean"]
    return {"case": case, "budget_mb": budget, "clients": len(g["clients"]), "plan": g["plan"], "why": g["why"],
            "predicted_mb": p["memory_mb"], "measured_mb": mem,
            "memory_ratio": mem / p["memory_mb"] if mem else None,
            "predicted_gflops": p["gflops_per_round"], "measured_gflops": flops,
            "gflops_ratio": flops / p["gflops_per_round"] if flops else None,
            "predicted_upload_mb": p["upload_mb"], "measured_upload_mb": m["upload_mb_mean"],
            "plan_downgrades": m.get("plan_downgrades"), "memory_skipped": m.get("memory_skipped"),
            "client_rounds": m["client_rounds"],
            "within_budget": mem is not None and mem <= budget,
            # the issue's target: the prediction within 10% of the measurement
            "prediction_within_10pct": bool(mem) and abs(p["memory_mb"] - mem) <= 0.1 * mem,
            "flops_within_10pct": bool(flops) and abs(p["gflops_per_round"] - flops) <= 0.1 * flops}


def plan_text(plan: dict) -> str:
    keys = ("width", "rank", "sparsity", "micro_batches", "checkpointing", "precision")
    return ", ".join(f"{k} {plan[k]:g}" if isinstance(plan[k], float) else f"{k} {plan[k]}"
                     for k in keys if plan.get(k) is not None)


def table(rows: list[dict]) -> list[str]:
    lines = ["| case | budget MiB | plan | peak MiB pred / meas (meas/pred) | GFLOPs/round pred / meas "
             "(meas/pred) | up MB pred / meas | micro-batched steps | meas <= budget | pred within 10% |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['case']} | {r['budget_mb']:g} | {r['error']} | | | | | | |")
            continue
        lines.append(
            f"| {r['case']} | {r['budget_mb']:g} | {plan_text(r['plan'])} | {r['predicted_mb']:.1f} / "
            f"{r['measured_mb']:.1f} ({r['memory_ratio']:.3f}) | {r['predicted_gflops']:.1f} / "
            f"{r['measured_gflops']:.1f} ({r['gflops_ratio']:.3f}) | {r['predicted_upload_mb']:.3f} / "
            f"{r['measured_upload_mb']:.3f} | {r['plan_downgrades'] if r['plan_downgrades'] is not None else '-'}"
            f"{' (skipped %d)' % r['memory_skipped'] if r['memory_skipped'] else ''} | "
            f"{'yes' if r['within_budget'] else '**no**'} | {'yes' if r['prediction_within_10pct'] else '**no**'} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", nargs="*", default=list(DATASETS), choices=list(DATASETS))
    ap.add_argument("--methods", nargs="*", default=["fedpetuning", "raffm+heads"])
    ap.add_argument("--pack", nargs="*", default=["on", "off"], choices=["on", "off"])
    ap.add_argument("--enforce", nargs="*", default=["on", "off"], choices=["on", "off"],
                    help="budgets.enforce_memory (on: held as clients train; off: the prediction alone)")
    ap.add_argument("--clients", type=int, default=3, help="clients per round")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--memory-mb", type=float, default=None, help="the MiniLM tier (default 450)")
    ap.add_argument("--e2e-share", type=float, default=0.7,
                    help="E2E's tier: this share of a dense fedpetuning client's predicted peak")
    ap.add_argument("--e2e-budget", type=float, default=None,
                    help="E2E's tier in MiB (instead of --e2e-share: skips the dense planning pass)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/budget_predictions")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = args.out / "runs"  # bench/results/*/*/ is ignored: the run folders stay out of git
    load = lambda: Path("/proc/loadavg").read_text().split()[:3]  # noqa: E731
    load0 = load()
    for ds in args.data:
        budget = DATASETS[ds]["memory_mb"] if ds == "e2e" or args.memory_mb is None else args.memory_mb
        dense = None
        if budget is None and args.e2e_budget is not None:
            budget = args.e2e_budget
        if budget is None:
            dense = dense_memory(ds, args)
            budget = round(args.e2e_share * dense, 1)
        for method in args.methods:
            for pack in (p == "on" for p in args.pack):
                for enforce in (e == "on" for e in args.enforce):
                    case = case_name(ds, method, pack, enforce)
                    cfg = config(ds, method, pack, enforce, budget, args)
                    before = load()
                    try:
                        run = run_experiment(validate_config(cfg), runs, progress=False)
                    except Exception as e:  # noqa: BLE001 — a case no plan fits is a result, said
                        rows, groups, mmax = [{"case": case, "budget_mb": budget,
                                               "error": f"{type(e).__name__}: {e}"}], None, None
                    else:
                        summary = json.loads((run / "summary.json").read_text())
                        groups, mmax = summary["plans"], summary.get("memory_mb_max")
                        rows = [row(case, budget, g) for g in groups]
                        shutil.rmtree(run, ignore_errors=True)
                    (args.out / f"{case}.json").write_text(json.dumps(
                        {"case": case, "argv": sys.argv[1:], "load_before": before, "load_after": load(),
                         "dense_predicted_mb": dense, "rows": rows, "config": cfg, "plans": groups,
                         "memory_mb_max": mmax}, indent=1) + "\n")
                    print("\n".join(table(rows)[2:]), flush=True)
    # the table over every case recorded in --out (this invocation's and earlier ones')
    order = {case_name(d, m, p, e): i for i, (d, m, p, e) in enumerate(
        (d, m, p, e) for d in DATASETS for m in ("fedpetuning", "raffm+heads")
        for p in (True, False) for e in (True, False))}
    cases = sorted((json.loads(f.read_text()) for f in args.out.glob("*.json") if f.stem in order),
                   key=lambda c: order[c["case"]])
    rows = [r for c in cases for r in c["rows"]]
    head = (f"`{' '.join(['bench/budget_predictions.py'] + sys.argv[1:])}` (last invocation); "
            f"{args.rounds} round(s) of {args.clients} clients, threads {args.threads}; "
            f"load {' '.join(load0)} -> {' '.join(load())}.\n")
    (args.out / "results.md").write_text(head + "\n" + "\n".join(table(rows)) + "\n")
    print(head + "\n".join(table(rows)))

if __name__ == "__main__":
    main()
