"""Benchmark (issue 23, parts 3-5): LoRA aggregation rules and heterogeneous ranks.

Three experiments, one config each (their headers say what they set):

* ``sst2``  (``configs/lora_rules_sst2.toml``): MiniLM on SST-2 with Dirichlet(0.1) label skew,
  fedit vs ffa vs fedex vs flora vs svd vs fedsa after the same rounds;
* ``e2e``   (``configs/lora_rules_e2e.toml``): SmolLM2-135M on E2E NLG, the same six rules;
* ``e2e-long`` (``configs/lora_rules_e2e_long.toml``): the same with ~10x the training;
* ``ranks`` (``configs/lora_ranks_sst2.toml``): three device tiers whose budgets give r = 4 / 8 /
  16 (padding over holders, zero-padding, fedex, flora, svd) against every client at r16 and at r4.

Each run's figures go to ``bench/results/lora_rules/<experiment>--<variant>[@seed<n>].json`` (one
file per run, so invocations may run side by side; run folders under ``runs/``, not kept in git);
``results_<experiment>.md`` beside them is rewritten from all of them after every run. Columns: the test metric (fedsa: the global model's, then the mean
of the personalised models'), bytes down/up per client-round (down: of which the dense base
weights FedEx/FLoRA ship; FLoRA's stacked adapter for comparison), server seconds and measured
FLOPs per aggregation (svd: + the analytic SVD FLOPs torch does not count), client training
FLOPs, and the rule's own diagnostics (FedEx's residual relative to the update, SVD's discarded
energy).

    .venv/bin/python bench/lora_rules.py --experiment sst2 --variants fedit fedex --seeds 0 1 2
    .venv/bin/python bench/lora_rules.py --experiment ranks
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from fedslice.api import run_experiment
from fedslice.config import apply_overrides, merge_variant, read_config_file
from fedslice.experiment import validate_config
from fedslice.output import read_run

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"sst2": "configs/lora_rules_sst2.toml", "e2e": "configs/lora_rules_e2e.toml",
           "e2e-long": "configs/lora_rules_e2e_long.toml", "ranks": "configs/lora_ranks_sst2.toml"}
OUT = ROOT / "bench" / "results" / "lora_rules"


def variants(experiment: str) -> dict[str, dict]:
    data = read_config_file(ROOT / CONFIGS[experiment])
    base = {k: v for k, v in data.items() if k != "variants"}
    return {v["name"]: merge_variant(base, {k: x for k, x in v.items() if k != "name"})
            for v in data["variants"]}


def key(variant: str, seed: int) -> str:
    return variant if seed == 0 else f"{variant}@seed{seed}"


def _mean(values):
    vals = [v for v in values if isinstance(v, (int, float))]
    return statistics.fmean(vals) if vals else None


def figures(run: Path) -> dict:
    """What a finished run folder says about the rule: metric, bytes, server cost, diagnostics."""
    config, metrics, summary = read_run(run)
    primary = summary["primary_metric"]
    clients = [m for r in metrics for m in r["client_metrics"] if m.get("used", True)]
    out = {
        "primary": primary, "test": summary.get(f"test_{primary}"), "test_loss": summary.get("test_loss"),
        "test_bleu": summary.get("test_bleu"),
        "bytes_down": _mean(m.get("bytes_down") for m in clients),
        "bytes_down_base": _mean(m.get("bytes_down_frozen") for m in clients),
        "bytes_up": _mean(m.get("bytes_up") for m in clients),
        "flops_client": _mean(m.get("flops_measured") for m in clients),
        "trainable_params": _mean(m.get("trainable_params") for m in clients),
        "aggregate_s": _mean(r.get("aggregate_s") for r in metrics),
        "aggregate_flops": _mean(r.get("aggregate_flops") for r in metrics),
        "svd_flops": _mean(r.get("svd_flops_analytic") for r in metrics),
        # the stacked adapter of a round (every client's A and B): what each client would
        # download instead of the merged dense base, were the stack broadcast
        "flora_stack_bytes_per_client": _mean(r.get("flora_stack_bytes") for r in metrics),
        "fedex_residual_rel": _mean(r.get("fedex_residual_rel") for r in metrics),
        "svd_discarded_energy": _mean(r.get("svd_discarded_energy") for r in metrics),
        "svd_discarded_energy_by_rank": {k.rsplit("_r", 1)[1]: _mean(r.get(k) for r in metrics)
                                         for k in sorted({k for r in metrics for k in r
                                                          if k.startswith("svd_discarded_energy_r")})},
        "train_loss_last": metrics[-1].get("train_loss") if metrics else None,
        "rounds": len(metrics), "wall_s": summary.get("wall_time_s"),
        "personal": summary.get(f"personal_test_{primary}_mean"),
        "personal_global": summary.get(f"global_test_{primary}"),
        "personal_local": summary.get("personal_local_accuracy_mean"),
        "global_local": summary.get("global_local_accuracy_mean"),
        # one row per group of clients with one budget and plan (summary["plans"], the planner's)
        "tiers": [{"tier": g["budget_name"], "budget": ", ".join(f"{k} {v:g}" for k, v in g["budget"].items()),
                   "rank": g["plan"].get("rank"), "clients": len(g["clients"]),
                   "client_rounds": g["measured"]["client_rounds"],
                   "bytes_up_mean": (g["measured"]["upload_mb_mean"] or 0) * 1e6 or None,
                   "flops_measured_mean": (g["measured"]["gflops_per_round_mean"] or 0) * 1e9 or None}
                  for g in summary.get("plans") or []],
    }
    return out


def run(experiment: str, variant: str, seed: int, threads: int, overrides=()) -> dict:
    cfg = apply_overrides(variants(experiment)[variant], list(overrides))
    cfg["name"] = f"{experiment}-{key(variant, seed)}"
    cfg["seed"], cfg["threads"] = seed, threads
    out_dir = OUT / "runs"
    cfg.setdefault("output", {})["dir"] = str(out_dir)
    load = os.getloadavg()
    t0 = time.perf_counter()
    run_dir = run_experiment(validate_config(cfg, CONFIGS[experiment]), out_dir, progress=False)
    res = {"experiment": experiment, "variant": variant, "seed": seed, "threads": threads,
           "date": time.strftime("%Y-%m-%d %H:%M"), "loadavg_start": load[0],
           "loadavg_end": os.getloadavg()[0], "elapsed_s": time.perf_counter() - t0,
           "overrides": list(overrides), "run_dir": str(run_dir.relative_to(ROOT)), **figures(run_dir)}
    path = OUT / f"{experiment}--{key(variant, seed)}.json"
    path.write_text(json.dumps(res, indent=1))
    return res


def _mb(x):
    return "—" if x is None else f"{x / 2**20:.2f}"


def _f(x, fmt="{:.4f}"):
    return "—" if x is None else fmt.format(x)


def table(experiment: str) -> str:
    rows = [json.loads(p.read_text()) for p in sorted(OUT.glob(f"{experiment}--*.json"))]
    order = list(variants(experiment))
    rows.sort(key=lambda r: (order.index(r["variant"]) if r["variant"] in order else 99, r["seed"]))
    lines = [f"## {experiment} ({CONFIGS[experiment]})", "",
             "| variant | seed | test | test loss | personalised (fedsa) | down MiB / client-round (dense base) "
             "| up MiB | server s / aggregation | server GFLOPs (+SVD analytic) | client GFLOPs "
             "| FedEx residual / update | SVD discarded energy | rounds | load | wall s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        pers = "—" if r.get("personal") is None else (
            f"{r['personal']:.4f} (global {r['personal_global']:.4f} on the same sample"
            + (f"; label-weighted {r['personal_local']:.4f} vs {r['global_local']:.4f}"
               if r.get("personal_local") is not None else "") + ")")
        down = _mb(r["bytes_down"]) + (f" ({_mb(r['bytes_down_base'])})" if r.get("bytes_down_base") else "")
        if r.get("flora_stack_bytes_per_client"):
            down += f"; stack {_mb(r['flora_stack_bytes_per_client'])}"
        server = _f(r["aggregate_flops"] / 1e9 if r.get("aggregate_flops") is not None else None, "{:.3f}")
        if r.get("svd_flops"):
            server += f" (+{r['svd_flops'] / 1e9:.3f})"
        energy = _f(r.get("svd_discarded_energy"))
        if r.get("svd_discarded_energy_by_rank"):
            energy += " (" + ", ".join(f"r{k}: {v:.3f}" for k, v in r["svd_discarded_energy_by_rank"].items()) + ")"
        lines.append(f"| {r['variant']} | {r['seed']} | {_f(r['test'])} | {_f(r.get('test_loss'))} | {pers} | {down} | {_mb(r['bytes_up'])} "
                     f"| {_f(r['aggregate_s'], '{:.3f}')} | {server} "
                     f"| {_f(r['flops_client'] / 1e9 if r.get('flops_client') else None, '{:.1f}')} "
                     f"| {_f(r.get('fedex_residual_rel'), '{:.3f}')} | {energy} | {r['rounds']} "
                     f"| {r['loadavg_start']:.1f}–{r['loadavg_end']:.1f} | {r['elapsed_s']:.0f} |")
    tiers = [(r["variant"], t) for r in rows for t in r.get("tiers") or []]
    if tiers:
        lines += ["", "| variant | tier | budget | rank | clients | client-rounds | up MiB | client GFLOPs |",
                  "|---|---:|---|---:|---:|---:|---:|---:|"]
        for v, t in tiers:
            lines.append(f"| {v} | {t['tier']} | {t['budget']} | {t['rank']} | {t['clients']} "
                         f"| {t['client_rounds']} | {_mb(t['bytes_up_mean'])} "
                         f"| {_f(t['flops_measured_mean'] / 1e9 if t.get('flops_measured_mean') else None, '{:.1f}')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiment", choices=sorted(CONFIGS), required=True)
    ap.add_argument("--variants", nargs="*", help="default: every variant of the config")
    ap.add_argument("--seeds", nargs="*", type=int, default=[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--set", nargs="*", default=[], dest="overrides", metavar="KEY=VALUE",
                    help="config overrides for every run (a smoke test: federation.rounds=1)")
    ap.add_argument("--table", action="store_true", help="only rewrite results_<experiment>.md (figures re-read from the run folders kept)")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    md = OUT / f"results_{args.experiment}.md"
    if args.table:  # figures again from the run folders kept (a newer figures())
        for p in OUT.glob(f"{args.experiment}--*.json"):
            res = json.loads(p.read_text())
            if (ROOT / res["run_dir"]).is_dir():
                p.write_text(json.dumps({**res, **figures(ROOT / res["run_dir"])}, indent=1))
    else:
        for seed in args.seeds:
            for v in args.variants or list(variants(args.experiment)):
                res = run(args.experiment, v, seed, args.threads, args.overrides)
                print(f"{args.experiment} {key(v, seed)}: test {res['test']} in {res['elapsed_s']:.0f} s", flush=True)
                md.write_text(table(args.experiment))
    md.write_text(table(args.experiment))
    print(table(args.experiment))


if __name__ == "__main__":
    main()
