"""Benchmark: the accuracy-versus-budget frontier (issue 34, part 3), SST-2 / MiniLM-L6 or E2E / SmolLM2.

First the dense reference (fedpetuning, LoRA r16 on q/v, every client the whole model); its
measured client peak memory M (``memory_mb_max``), training GFLOPs per client-round F and upload
U set the budgets: a client at budget f may use f*M MiB, f*F GFLOPs per round and f*U MB of
upload. Then, at each budget f, every row plans its clients with ``[budgets]`` (the planner
tunes each method to the budget: heads its sparsity, raffm its sub-model and rank, and every
row micro-batches and checkpointing):

  heads          the head stage alone (its FLOPs do not fall: it fits no FLOPs budget < 1);
  raffm          the sub-model stage alone;
  int8           fedpetuning over an int8 base (model.quantize): memory, not FLOPs;
  fp32-int8      fedpetuning whose planner may give a client an int8 copy of the fp32 base
                 (budgets.precisions = ["none", "int8"]): per client, only where fp32 misses;
  planned        raffm+heads: the planner's composition;
  planned-fs     the same with heads' importance from the first local step (no pass of its own);
  mixed          raffm+heads, a population of thirds at 30%, 50% and 100% (run once);
  planned-work   raffm+heads whose planner may also give a client part of a round's local work
                 (budgets.local_work = LOCAL_WORK or --local-work; by default fewer examples per
                 step) before a narrower model;
  mixed-work     the mixed population with local work;
  int8-work      int8 with local work (budgets.local_work as the -work rows): the whole model at
                 fewer examples per step;
  planned-int8-work  planned-work whose planner may also give a client an int8 copy of its slice
                 (budgets.precisions = ["none", "int8"]; raffm+heads over a quantized copy, since
                 2026-11-27 05:20): the whole model over int8 where fp32 misses, before a slice.
  planned-depth-work, planned-int8-depth-work  those two whose planner may also train the
                 adapters of the top half of the blocks only (budgets.adapter_depths = DEPTHS,
                 since 2026-11-27 08:00): more examples per step for the same FLOPs.

``--lora-aggregation ffa``: the budget rows train FFA-LoRA (A frozen from the seed, B sent), so
an upload budget affords twice the rank; dense stays FedIT (row names end in ``-ffa``).
``--upload-dtype fp16``: the budget rows send their replies in fp16 (``federation.upload_dtype``),
so an upload budget affords twice the rank (row names end in ``-fp16``); the budgets stay shares
of the dense row's fp32 upload. The row ``dense-fp16`` is the dense row with fp16 replies (what
the rounding alone costs).
``--fill``: the ``-work`` rows plan with ``budgets.local_work_fill`` (the library's default since
2026-11-28: between two shares of local work, the most examples per step that fit; rows end in
``-fill``); without it they plan on the shares alone, as every row taken before.
``--dense-batch N`` with the row ``dense-batch``: the dense row on N examples per step, nothing
else changed (``dense-bN``): what a budget row's fewer examples cost on their own, apart from its
precision, rank and sub-model.
``--lr X``: the budget rows' learning rate (dense keeps the task's; rows ``<row>-lrX@...``); the
row ``dense-lr`` is the dense row at that rate (``dense-lrX``).
``--server-opt NAME`` (``--server-opt-lr``, ``--server-momentum``): every row, dense included,
under that server optimizer (``server_opt``: fedavgm, fedadagrad, fedadam, fedyogi); use its own
``--out``.

A row whose budget no plan fits is recorded as such (the planner's message), not run.
Columns: test accuracy and its difference to dense, measured peak memory (largest client), training
+ importance GFLOPs per client-round, upload and download MB per client-round, wall time.
Writes ``<out>/<row>.json`` and ``<out>/results.md``. Accuracy runs may share the machine; the
wall times are then indicative only.

``--task e2e``: E2E NLG with SmolLM2-135M-Instruct, the set-up of ``configs/e2e_smollm2.toml`` (as
``bench/e2e_methods.py`` takes it: 20 clients, 4 per round, 6 LoRA steps x 8, by default 4 rounds),
the same rows and budgets; the metric is the test ROUGE-L (BLEU kept too), out
``bench/results/frontier_e2e``.

    .venv/bin/python bench/frontier.py --rounds 30 --clients-per-round 4 --local-steps 8
    .venv/bin/python bench/frontier.py --upload-only --budgets 0.1 --rows heads raffm planned
    .venv/bin/python bench/frontier.py --memory-only --budgets 0.25 --rows raffm fp32-int8
    .venv/bin/python bench/frontier.py --budgets 0.4 --memory-share 0.5 --upload-share 0.5 --rows planned-work
    .venv/bin/python bench/frontier.py --task e2e --budgets 0.3 --rows planned-work --measured-widths
    .venv/bin/python bench/frontier.py --task e2e --test-examples 50 --budgets 0.3 --rows planned-work int8
    .venv/bin/python bench/frontier.py --task e2e --test-examples 50 --threads 2 --budgets 0.3 0.5 --rows planned-int8-work
    .venv/bin/python bench/frontier.py --budgets 0.4 --memory-share 0.5 --upload-share 0.5 --rows planned-depth-work
    .venv/bin/python bench/frontier.py --task e2e --test-examples 50 --threads 2 --budgets 0.3 --rows planned-int8-depth-work
    .venv/bin/python bench/frontier.py --task e2e --test-examples 50 --budgets 0.3 --rows planned-int8-depth-work --depths 1 0.5 0.25
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from fedslice.api import run_experiment
from fedslice.errors import ConfigError
from fedslice.experiment import load_config, validate_config

ROOT = Path(__file__).resolve().parents[1]

METHODS = {"dense": "fedpetuning", "heads": "heads", "raffm": "raffm", "int8": "fedpetuning",
           "fp32-int8": "fedpetuning",
           "planned": "raffm+heads", "planned-fs": "raffm+heads", "mixed": "raffm+heads",
           "planned-work": "raffm+heads", "mixed-work": "raffm+heads", "int8-work": "fedpetuning",
           "planned-int8-work": "raffm+heads", "planned-depth-work": "raffm+heads",
           "planned-int8-depth-work": "raffm+heads", "dense-fp16": "fedpetuning",
           "dense-lr": "fedpetuning", "dense-batch": "fedpetuning"}
#: budgets.adapter_depths of the ``-depth-`` rows: shares of the top blocks whose adapters train
DEPTHS = [1.0, 0.5]
#: budgets.local_work of the ``-work`` rows: shares of a round's local work a client may train
LOCAL_WORK = [1.0, 0.75, 0.5, 0.375, 0.25]
#: per task: the row's metric key, the summary's key for it, its scale in the table, the defaults
#: of --rounds / --clients-per-round / --local-steps and of --out
TASKS = {"sst2": ("accuracy", "test_accuracy", 100, (30, 4, 8), "bench/results/frontier_sst2"),
         "e2e": ("rougeL", "test_rougeL", 1, (4, 4, 6), "bench/results/frontier_e2e")}


def e2e_config(row: str, args, method: dict) -> dict:
    """The E2E / SmolLM2 run of a row: ``configs/e2e_smollm2.toml`` as bench/e2e_methods.py takes it."""
    cfg = load_config(ROOT / "configs/e2e_smollm2.toml").model_dump(mode="json")
    if "raffm" in method["name"]:  # after training, the global model at the full size only: each
        method["elastic_sizes"] = [1.0]  # size is one more generation pass over dev and test
    cfg.update(name=f"e2e-{row}", seed=args.seed, threads=args.threads, method=method)
    cfg["model"]["quantize"] = "int8" if row.startswith("int8") else "none"
    cfg["federation"].update(rounds=args.rounds, clients_per_round=args.clients_per_round,
                             local_steps=args.local_steps)
    cfg["data"].update(max_test_examples=args.test_examples, max_dev_examples=64)
    cfg["evaluation"].update(every=args.rounds, dev_generations=10)
    cfg["compute"]["workers"] = 1
    cfg["output"].update(progress=False, plots=False, save_weights=False)
    return cfg


def config(row: str, args, budgets: dict | None) -> dict:
    method = {"name": METHODS[row]}
    if "heads" in METHODS[row]:
        method["importance_max_examples"] = args.importance_examples
        if row.endswith("-fs"):  # the paper's rule: scores from the first local step, no pass
            method["importance_source"] = "first_step"
    if args.measured_widths and "raffm" in METHODS[row]:  # issue 35 part 4's sub-models
        method.update(salience="activation", widths="measured", width_levels=4, calibration_examples=16)
    if args.task == "e2e":
        cfg = e2e_config(row, args, method)
        if budgets is not None:
            cfg["lora"]["ranks"] = [4, 8, 16]
        return with_budgets(cfg, row, args, budgets)
    cfg = {
        "name": row, "seed": args.seed, "threads": args.threads,
        "data": {"path": "sst2", "max_length": 64, "partition": "iid",
                 "max_dev_examples": 256, "max_test_examples": args.test_examples},
        "model": {"name": "minilm", "quantize": "int8" if row.startswith("int8") else "none"},
        # the planner may lower each client's rank in every planned row (the head stage takes
        # ranks since 2026-11-26 18:20; the rows "planned" and "heads" before had none)
        "lora": {"r": 16, "alpha": 32, "targets": ["q", "v"],
                 **({"ranks": [4, 8, 16]} if budgets is not None else {})},
        "federation": {"num_clients": 100, "clients_per_round": args.clients_per_round,
                       "rounds": args.rounds, "local_steps": args.local_steps, "batch_size": 32,
                       "lr": 1e-3, "pack": False},  # every row as the dense one was taken
        "compute": {"workers": 1},
        "method": method,
        "evaluation": {"every": args.rounds, "batch_size": 128},
        "output": {"progress": False, "plots": False},
    }
    return with_budgets(cfg, row, args, budgets)


def with_budgets(cfg: dict, row: str, args, budgets: dict | None) -> dict:
    if args.server_opt != "none":  # every row, the dense one too
        cfg["server_opt"] = {"name": args.server_opt, "lr": args.server_opt_lr,
                             "momentum": args.server_momentum}
    if row == "dense-batch":  # dense on fewer examples per step: what the examples alone cost
        cfg["federation"]["batch_size"] = args.dense_batch
    if args.lr is not None and (budgets is not None or row == "dense-lr"):  # dense keeps its rate
        cfg["federation"]["lr"] = args.lr
    if row == "dense-fp16" or (budgets is not None and args.upload_dtype != "fp32"):
        cfg["federation"]["upload_dtype"] = "fp16" if row == "dense-fp16" else args.upload_dtype
    if budgets is not None and args.lora_aggregation:  # the planned rows only: dense stays fedit
        cfg["lora"]["aggregation"] = args.lora_aggregation
    if budgets is not None:
        cfg["budgets"] = {**budgets, **({"precisions": ["none", "int8"]}
                                        if row in ("fp32-int8", "planned-int8-work",
                                                   "planned-int8-depth-work") else {}),
                          **({"adapter_depths": args.depths or DEPTHS} if "-depth-" in row else {}),
                          # local work is the planner's default since 2026-11-27: rows without
                          # "-work" keep every client's whole round, as they were taken
                          "local_work": (args.local_work or LOCAL_WORK) if row.endswith("-work") else [1.0],
                          # rows taken before 2026-11-28 planned on the shares alone
                          "local_work_fill": args.fill and row.endswith("-work")}
    return cfg


def tier(f: float, dense: dict, name: str, share: float = 1.0, upload_only: bool = False,
         memory_only: bool = False, memory_f: float | None = None, upload_f: float | None = None) -> dict:
    """A tier at ``f`` of the dense client's measured costs (``memory_f``, ``upload_f``: other
    shares for memory and upload, as the issue's target puts them: 0.5 memory, 0.4 FLOPs)."""
    if upload_only:  # a client whose link, not its device, is what it cannot afford
        return {"name": name, "share": share, "upload_mb_per_round": round(f * dense["upload_mb"], 4)}
    if memory_only:  # a client whose memory, not its compute or link, is what it cannot afford
        return {"name": name, "share": share, "memory_mb": round(f * dense["memory_mb"], 1)}
    return {"name": name, "share": share, "memory_mb": round((memory_f or f) * dense["memory_mb"], 1),
            "gflops_per_round": round(f * dense["gflops"], 2),
            "upload_mb_per_round": round((upload_f or f) * dense["upload_mb"], 4)}


def measured(s: dict, task: str = "sst2") -> dict:
    metric, key = TASKS[task][:2]
    return {metric: s.get(key), **({"bleu": s.get("test_bleu")} if task == "e2e" else {}),
            "memory_mb": s.get("memory_mb_max"),
            "gflops": ((s.get("flops_measured_mean") or 0) + (s.get("flops_importance_mean") or 0)) / 1e9,
            "upload_mb": (s.get("bytes_up_mean") or 0) / 1e6,
            "download_mb": (s.get("bytes_down_mean") or 0) / 1e6,
            "wall_s": s.get("bench_wall_s"), "plans": s.get("plans")}


def run_row(name: str, row: str, args, budgets: dict | None) -> dict:
    path = args.out / f"{name}.json"
    if path.is_file() and not args.again:
        return json.loads(path.read_text())
    t0 = time.time()
    try:
        cfg = config(row, args, budgets)
        cfg["name"] = name  # the run folder: one per result row (two budgets of a row never share one)
        run = run_experiment(validate_config(cfg), args.out / "runs", progress=False)
    except ConfigError as e:
        out = {"row": name, "fits": False, "why": str(e).splitlines()[1].strip() if "\n" in str(e) else str(e),
               "budgets": budgets}
    else:
        s = json.loads((run / "summary.json").read_text())
        s["bench_wall_s"] = time.time() - t0
        out = {"row": name, "fits": True, "budgets": budgets, **measured(s, args.task)}
    path.write_text(json.dumps(out, indent=1))
    print(name, {k: v for k, v in out.items() if k not in ("plans", "budgets")}, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=list(TASKS), default="sst2")
    ap.add_argument("--rounds", type=int, default=None, help="default 30 (sst2), 4 (e2e)")
    ap.add_argument("--clients-per-round", type=int, default=None, help="default 4")
    ap.add_argument("--local-steps", type=int, default=None, help="default 8 (sst2), 6 (e2e)")
    ap.add_argument("--importance-examples", type=int, default=32)
    ap.add_argument("--test-examples", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budgets", type=float, nargs="*", default=[0.5, 0.3])
    ap.add_argument("--rows", nargs="*", default=["heads", "raffm", "int8", "planned", "mixed"])
    ap.add_argument("--upload-only", action="store_true",
                    help="budgets on upload alone (rows named <row>@up<f>): memory and FLOPs free")
    ap.add_argument("--memory-only", action="store_true",
                    help="budgets on memory alone (rows named <row>@mem<f>): FLOPs and upload free")
    ap.add_argument("--memory-share", type=float, default=None,
                    help="memory at this share of dense's instead of the budget's (rows <row>@<f>m<share>)")
    ap.add_argument("--upload-share", type=float, default=None,
                    help="upload at this share of dense's instead of the budget's (rows <row>@<f>u<share>)")
    ap.add_argument("--local-work", type=float, nargs="+", default=None,
                    help="budgets.local_work of the -work rows (default LOCAL_WORK; rows <row>-lw<n>@...)")
    ap.add_argument("--depths", type=float, nargs="+", default=None,
                    help="budgets.adapter_depths of the -depth- rows (default DEPTHS; rows <row>-d<n>@...)")
    ap.add_argument("--measured-widths", action="store_true",
                    help="raffm rows: activation salience and measured per-layer widths (4 levels, "
                    "16 calibration rows; rows <row>-mw@...)")
    ap.add_argument("--server-opt", default="none", help="server_opt.name of every row (dense too)")
    ap.add_argument("--server-opt-lr", type=float, default=None, help="server_opt.lr")
    ap.add_argument("--server-momentum", type=float, default=None, help="server_opt.momentum")
    ap.add_argument("--lora-aggregation", default=None, help="lora.aggregation of the budget rows "
                    "(dense keeps fedit): ffa sends B only, so the planner can afford a higher rank")
    ap.add_argument("--fill", action="store_true",
                    help="budgets.local_work_fill in the -work rows (the library's default since "
                         "2026-11-28; rows <row>-fill@...): the most examples per step that fit")
    ap.add_argument("--dense-batch", type=int, default=None,
                    help="the row dense-b<N>: the dense row on N examples per step (nothing else "
                         "changed): a budget row's loss from its fewer examples alone")
    ap.add_argument("--lr", type=float, default=None,
                    help="federation.lr of the budget rows (dense keeps the task's; rows <row>-lr<x>@...)")
    ap.add_argument("--upload-dtype", default="fp32", choices=["fp32", "fp16"],
                    help="federation.upload_dtype of the budget rows (dense stays fp32; rows <row>-fp16@...)")
    ap.add_argument("--again", action="store_true", help="re-run rows whose results exist")
    ap.add_argument("--out", type=Path, default=None, help="default bench/results/frontier_<task>")
    args = ap.parse_args()
    *_, defaults, out = TASKS[args.task]
    for name, d in zip(("rounds", "clients_per_round", "local_steps"), defaults):
        setattr(args, name, d if getattr(args, name) is None else getattr(args, name))
    args.out = args.out or Path(out)
    args.out.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()[0]
    dense = run_row("dense", "dense", args, None)
    if "dense-fp16" in args.rows:
        run_row("dense-fp16", "dense-fp16", args, None)
    if "dense-lr" in args.rows and args.lr is not None:  # the dense row at the budget rows' rate
        run_row(f"dense-lr{args.lr:g}", "dense-lr", args, None)
    if "dense-batch" in args.rows and args.dense_batch:
        run_row(f"dense-b{args.dense_batch}", "dense-batch", args, None)
    for f in args.budgets:
        for row in args.rows:
            if row.startswith("mixed") or row in ("dense-fp16", "dense-lr", "dense-batch"):
                continue
            at = f"up{f:g}" if args.upload_only else f"mem{f:g}" if args.memory_only else f"{f:g}"
            at += (f"m{args.memory_share:g}" if args.memory_share else "") + \
                (f"u{args.upload_share:g}" if args.upload_share else "")
            tag = f"-lw{len(args.local_work)}" if args.local_work and row.endswith("-work") else ""
            tag += "-fill" if args.fill and row.endswith("-work") else ""
            tag += "-mw" if args.measured_widths and "raffm" in METHODS[row] else ""
            tag += f"-d{len(args.depths)}" if args.depths and "-depth-" in row else ""
            tag += f"-{args.lora_aggregation}" if args.lora_aggregation else ""
            tag += f"-{args.upload_dtype}" if args.upload_dtype != "fp32" else ""
            tag += f"-lr{args.lr:g}" if args.lr is not None else ""
            run_row(f"{row}{tag}@{at}", row, args, {"tiers": [tier(f, dense, f"{f:.0%}", upload_only=args.upload_only,
                                                              memory_only=args.memory_only,
                                                              memory_f=args.memory_share,
                                                              upload_f=args.upload_share)]})
    for row in ("mixed", "mixed-work"):
        if row in args.rows:
            run_row(row, row, args, {"tiers": [tier(f, dense, f"{f:.0%}", s) for f, s in
                                               ((0.3, 0.33), (0.5, 0.33), (1.0, 0.34))]})
    write_table(args, dense, load0, os.getloadavg()[0])


def write_table(args, dense: dict, load0: float, load1: float) -> None:
    rows = [json.loads(p.read_text()) for p in sorted(args.out.glob("*.json"), key=lambda p: p.stat().st_mtime)]
    metric, _, scale, *_ = TASKS[args.task]
    e2e = args.task == "e2e"
    setting = (f"E2E NLG / SmolLM2-135M-Instruct (configs/e2e_smollm2.toml), LoRA r16 q/v, 20 clients, "
               f"{args.clients_per_round} per round, {args.rounds} rounds, {args.local_steps} local steps "
               f"x 8, test = {args.test_examples or 200} MRs (all references)" if e2e else
               f"SST-2 / MiniLM-L6, LoRA r16 q/v, 100 clients, {args.clients_per_round} per round, "
               f"{args.rounds} rounds, {args.local_steps} local steps x 32")
    lines = [f"{setting}, seed {args.seed}, threads "
             f"{args.threads}; dense client: {dense['memory_mb']:.0f} MiB peak, {dense['gflops']:.1f} "
             f"GFLOPs/round, {dense['upload_mb']:.3f} MB up; load {load0:.1f} -> {load1:.1f}.", "",
             f"| row | fits | {'test ROUGE-L | BLEU' if e2e else 'test acc'} | Δ vs dense (pt) | peak MiB (× dense) | "
             "GFLOPs/round (× dense) | up MB (× dense) | down MB | wall s |",
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if e2e else "")]
    for r in rows:
        if not r.get("fits"):
            lines.append(f"| {r['row']} | no: {r['why'][:110]} | | | | | | | |" + (" |" if e2e else ""))
            continue
        acc = r[metric] or float("nan")
        bleu = f" {r.get('bleu') or float('nan'):.2f} |" if e2e else ""
        lines.append(
            f"| {r['row']} | yes | {scale * acc:.2f} |{bleu} {scale * (acc - dense[metric]):+.2f} | "
            f"{r['memory_mb']:.0f} ({r['memory_mb'] / dense['memory_mb']:.2f}) | "
            f"{r['gflops']:.1f} ({r['gflops'] / dense['gflops']:.2f}) | "
            f"{r['upload_mb']:.3f} ({r['upload_mb'] / dense['upload_mb']:.2f}) | {r['download_mb']:.3f} | "
            f"{r['wall_s'] or float('nan'):.0f} |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
