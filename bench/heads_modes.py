"""Benchmark: the two ``heads`` pruning modes side by side on two classification tasks (issue 15).

For each task, MiniLM-L6 (6 layers x 12 heads) and the same partition, seed and client sequence:

* ``dense``: sparsity 0 = FedPETuning (B1 of the paper's Table 1: no pruning, FedAvg);
* ``{parameters,forward}{50,75,90}``: ours (importance pruning, Eq. 8 aggregation) in each mode,
  the shape of the paper's Fig. 4: ``prune="parameters"`` (the paper's §3.1: a pruned head's
  LoRA slices are neither trained nor sent, the frozen head still runs forward) and
  ``prune="forward"`` (pruned heads leave the client's sub-model);
* ``B2-parameters90`` (``--b2-modes`` adds ``forward``): random pruning + FedAvg (B2 of Table 1).

Tasks:

* ``sst2``: GLUE SST-2 (test = GLUE validation), as in ``bench/heads_sst2.py``;
* ``e2e_rating``: a real 3-class task derived from E2E NLG's human references: text = the
  reference sentence, label = its MR's ``customer rating`` collapsed to low ("1 out of 5", "low")
  / average ("3 out of 5", "average") / high ("5 out of 5", "high"); rows whose MR has no customer
  rating are dropped. train = the shared ``train.csv`` (the challenge's dev split), test =
  ``test.csv`` (the challenge's test split; the two share no MR); dev is carved off train by MR
  (``data.group_column = "mr"``), so no MR crosses a split. The TSVs are written at run time under
  ``--out/data/`` from the shared data folder (found like ``data.path``), never committed.

Records, per run: test accuracy, upload bytes per client-round, measured training FLOPs per
client-round (FlopCounterMode on the model the client really trains; the importance pass is
counted separately), the paper's Table 6 OPs, and ratios to the dense run of the same task and
seed. Writes ``results.md`` and ``results.json`` under ``--out`` (run folders beside them are not
committed). Finished run folders are reused (resume) unless ``--rerun``::

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python bench/heads_modes.py --rounds 10 --e2e-rounds 6 \\
        --e2e-lr 3e-3 --eval-every 5 --threads 1
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from heads_sst2 import _records, client_totals, config as sst2_config, markdown  # noqa: E402

from fedslice.api import run_experiment  # noqa: E402
from fedslice.experiment import validate_config  # noqa: E402
from fedslice.data.locate import data_search_dirs  # noqa: E402

MODES = ("parameters", "forward")
SPARSITIES = (0.5, 0.75, 0.9)
TASKS = ("sst2", "e2e_rating")
RATING = {"1 out of 5": "low", "low": "low", "3 out of 5": "average", "average": "average",
          "5 out of 5": "high", "high": "high"}


def variants(b2_modes=MODES, per_layer: bool = False) -> dict[str, dict]:
    """name -> method options, in the order they are run (90% rows first). ``per_layer``: also
    ``forward{75,90}-per_layer``, forward mode keeping the same share of heads in every layer
    (``method.scope = "per_layer"``: no layer left without heads; issue 35 part 2), and
    ``forward{75,90}-per_layer-mean``, the same with ``method.fill = "mean"``."""
    out = {"dense": {"pruning": "none", "aggregation": "fedavg", "sparsity": 0.0}}
    for s in sorted(SPARSITIES, reverse=True):
        for mode in MODES:
            out[f"{mode}{round(100 * s)}"] = {"pruning": "importance", "aggregation": "head_weighted",
                                               "sparsity": s, "prune": mode}
        if per_layer and s > 0.5:
            out[f"forward{round(100 * s)}-per_layer"] = {**out[f"forward{round(100 * s)}"], "scope": "per_layer"}
            # the pruned heads' mean outputs added back while the client trains (method.fill)
            out[f"forward{round(100 * s)}-per_layer-mean"] = {**out[f"forward{round(100 * s)}-per_layer"],
                                                             "fill": "mean"}
        if s == 0.9:
            for mode in b2_modes:
                out[f"B2-{mode}90"] = {"pruning": "random", "aggregation": "fedavg", "sparsity": 0.9,
                                       "prune": mode}
    return out


# --------------------------------------------------------------------------- the second task
def e2e_rating_data(out: Path) -> tuple[Path, dict]:
    """Write ``train.tsv``/``test.tsv`` (columns text, label, mr) of the E2E customer-rating task
    under ``out``; returns the folder and counts. Raises when the shared E2E files are absent."""
    src = next((d / "e2e_nlg" for d in data_search_dirs() if (d / "e2e_nlg" / "train.csv").is_file()),
               None)
    if src is None:
        raise SystemExit("e2e_nlg/train.csv not found in " + ", ".join(map(str, data_search_dirs())))
    folder = out / "data" / "e2e_rating"
    folder.mkdir(parents=True, exist_ok=True)
    counts: dict = {"source": str(src)}
    mrs: dict[str, set[str]] = {}
    for split in ("train", "test"):
        with open(src / f"{split}.csv", newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
        kept, labels = [], {}
        for r in rows:
            m = re.search(r"customer rating\[([^\]]*)\]", r["mr"])
            if not m:
                continue
            label = RATING[m.group(1).strip()]
            text = " ".join(r["ref"].split())  # no tabs/newlines inside a TSV field
            mr = " ".join(r["mr"].split())
            if text:
                kept.append((text, label, mr))
                labels[label] = labels.get(label, 0) + 1
        mrs[split] = {k[2] for k in kept}
        (folder / f"{split}.tsv").write_text("text\tlabel\tmr\n" + "".join("\t".join(k) + "\n" for k in kept),
                                             encoding="utf-8")
        counts[split] = {"rows_read": len(rows), "rows": len(kept), "mrs": len(mrs[split]),
                         "labels": dict(sorted(labels.items()))}
    shared = mrs["train"] & mrs["test"]
    if shared:
        raise SystemExit(f"{len(shared)} MRs on both sides of train/test")
    return folder, counts


def config(task: str, name: str, method: dict, args, data_dir: Path | None) -> dict:
    cfg = sst2_config(name, method, "random", args, args.e2e_rounds if task == "e2e_rating" else args.rounds)
    cfg["output"]["dir"] = str(args.out)
    cfg["output"]["plots"] = False
    if task == "e2e_rating":
        cfg["data"] = {"path": str(data_dir), "text_columns": ["text"], "label_column": "label",
                       "group_column": "mr", "max_length": 64, "partition": "iid",
                       "max_dev_examples": args.dev_examples}
        cfg["federation"]["num_clients"] = args.e2e_clients
        cfg["federation"]["lr"] = args.e2e_lr
    if args.server_opt != "none":  # every variant, dense too (docs/aggregation.md)
        cfg["server_opt"] = {"name": args.server_opt, "lr": args.server_opt_lr}
    return cfg


# --------------------------------------------------------------------------- one run's figures
def figures(run: Path) -> dict:
    """Per client-round means (all client-rounds of the run) and the final test accuracy."""
    s = json.loads((run / "summary.json").read_text())
    recs = _records(run)
    ms = [m for r in recs for m in r["client_metrics"] if m.get("num_examples", 0) > 0]
    n = max(len(ms), 1)
    t = client_totals(run)
    mean = lambda k: sum(m.get(k) or 0.0 for m in ms) / n  # noqa: E731
    return {
        "test_accuracy": s["test_accuracy"], "rounds": s["rounds"],
        "dev_accuracy_last": recs[-1].get("dev_accuracy"),
        "train_loss": [round(r["train_loss"], 4) for r in recs if r.get("train_loss") is not None],
        "client_rounds": len(ms),
        "bytes_up": mean("bytes_up"), "bytes_down": mean("bytes_down"),
        "flops_measured": mean("flops_measured"), "flops_analytic": mean("flops_analytic"),
        "flops_importance": mean("flops_importance"), "tokens": mean("tokens"),
        "flops_measured_per_token": t["flops_measured"] / max(t["tokens"], 1),
        "heads_kept": mean("heads_kept") if any("heads_kept" in m for m in ms) else None,
        "headless_layers": mean("headless_layers"),
        "paper_ops_T512": s.get("paper_ops_T512"), "wall_s": s.get("wall_time_s") or s.get("wall_s"),
    }


def _median(vals: list[float | None]) -> float | None:
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def table(task: str, names: list[str], res: dict, seeds: list[int]) -> list[dict]:
    """Rows of one task: medians over seeds; ratios dense/this from the dense run of the same seed."""
    rows = []
    for name in names:
        per = [res[task][name][s] for s in seeds if s in res[task].get(name, {})]
        if not per:
            continue
        dense = [res[task]["dense"].get(s) for s in seeds if s in res[task].get(name, {})]
        ratio = lambda k, per=per, dense=dense: _median(  # noqa: E731
            [d[k] / f[k] if d and f[k] else None for f, d in zip(per, dense)])
        ratio_total = _median([(d["flops_measured"] + d["flops_importance"])
                               / (f["flops_measured"] + f["flops_importance"]) if d else None
                               for f, d in zip(per, dense)])
        accs = [f["test_accuracy"] for f in per]
        opts = variants(MODES, per_layer=True)[name]
        row = {
            "run": name,
            "mode": opts.get("prune", "-") if opts["sparsity"] else "-",
            "pruning": {"none": "none (B1)", "random": "random (B2)", "importance": "importance (ours)"}[opts["pruning"]],
            "sparsity": f"{round(100 * opts['sparsity'])}%",
            "heads kept": f"{_median([f['heads_kept'] for f in per]) or 72:.1f}",
            f"test acc ({'median of ' + str(len(per)) + ' seeds' if len(per) > 1 else '1 seed'})":
                f"{100 * _median(accs):.2f}%" + (f" ({', '.join(f'{100 * a:.1f}' for a in accs)})" if len(per) > 1 else ""),
            "Δ vs dense (pt)": f"{100 * _median([f['test_accuracy'] - d['test_accuracy'] for f, d in zip(per, dense) if d]):+.2f}",
            "MB up /client-round": f"{_median([f['bytes_up'] for f in per]) / 1e6:.3f}",
            "train GFLOPs /client-round (measured)": f"{_median([f['flops_measured'] for f in per]) / 1e9:.2f}",
            "+ importance GFLOPs": f"{_median([f['flops_importance'] for f in per]) / 1e9:.2f}",
            "dense ÷ this: up": f"{ratio('bytes_up'):.2f}x",
            "dense ÷ this: train FLOPs": f"{ratio('flops_measured'):.3f}x",
            "dense ÷ this: train + importance FLOPs": f"{ratio_total:.3f}x",
            "dense ÷ this: paper OPs T=512": f"{ratio('paper_ops_T512'):.2f}x",
        }
        rows.append(row)
    return rows


def write_report(args, header: list[str], res: dict, counts: dict) -> None:
    seeds = args.seeds
    out = ["# heads: `prune=\"parameters\"` vs `\"forward\"` (issue 15)", "", *header, ""]
    for task in TASKS:
        if task not in res or "dense" not in res[task]:
            continue
        title = {"sst2": "SST-2 (GLUE; test = GLUE validation, 872 sentences)",
                 "e2e_rating": "E2E customer rating (3 classes; test = E2E test refs with a rating)"}[task]
        sweep = ["dense"] + [f"{m}{round(100 * s)}" for m in MODES for s in SPARSITIES] + \
            [f"forward{round(100 * s)}-per_layer{x}" for x in ("", "-mean") for s in SPARSITIES]
        t1 = ["dense", "B2-parameters90", "parameters90", "B2-forward90", "forward90"]
        t1 = [n for n in t1 if n in res[task]]
        out += [f"## {title}", "", "### Sparsity sweep (the shape of Fig. 4), random selection", "",
                markdown(table(task, sweep, res, seeds)), "",
                "### Table 1 shape at 90% (B1 = dense: no pruning + FedAvg; B2 = random pruning + "
                "FedAvg; ours = importance pruning + Eq. 8), random selection", "",
                markdown(table(task, t1, res, seeds)), ""]
    if counts:
        out += ["## Data of the second task", "", "```", json.dumps(counts, indent=1), "```", ""]
    (args.out / "results.md").write_text("\n".join(out) + "\n")
    (args.out / "results.json").write_text(json.dumps(
        {"command": header[0], "settings": vars_json(args), "e2e_rating_data": counts,
         "runs": {t: {n: {str(s): f for s, f in v.items()} for n, v in r.items()} for t, r in res.items()}},
        indent=1) + "\n")


def vars_json(args) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument("--only", nargs="*", help="run only these variants (dense, parameters90, ...)")
    p.add_argument("--rerun", action="store_true", help="run again runs whose folder exists")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--e2e-rounds", type=int, default=6, help="rounds of the E2E task (its rows "
                   "are about twice as long as SST-2's)")
    p.add_argument("--b2-modes", nargs="*", default=["parameters"], choices=MODES,
                   help="modes of the B2 baseline (random pruning + FedAvg)")
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--clients-per-round", type=int, default=2)
    p.add_argument("--e2e-clients", type=int, default=20, help="clients of the E2E task (SST-2: 100)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--e2e-lr", type=float, default=3e-3, help="learning rate of the E2E task (at "
                   "1e-3 its 90%% runs had not left chance level after 6 rounds)")
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--dev-examples", type=int, default=256)
    p.add_argument("--importance-examples", type=int, default=128)
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--workers", default="auto", help="compute.workers: 'auto' (a forked worker "
                   "per core) or N; 1 keeps a run on one core")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--per-layer", action="store_true",
                   help="also forward mode at 75%% and 90%% with every layer keeping heads (scope per_layer), "
                   "without and with method.fill = 'mean'")
    p.add_argument("--server-opt", default="none", help="server_opt.name of every variant (use its own --out)")
    p.add_argument("--server-opt-lr", type=float, default=None, help="server_opt.lr")
    p.add_argument("--out", type=Path, default=Path("bench/results/heads_modes"))
    args = p.parse_args()
    args.track_test = False
    args.out.mkdir(parents=True, exist_ok=True)
    data_dir, counts = (e2e_rating_data(args.out) if "e2e_rating" in args.tasks else (None, {}))
    header = [f"Command: `python bench/heads_modes.py {' '.join(sys.argv[1:])}`  ",
              f"Machine: {platform.machine()}, {args.threads} torch thread(s), torch "
              f"{torch.__version__}; date {time.strftime('%Y-%m-%d')}  ",
              f"Setting: MiniLM-L6 (72 heads), LoRA r=16 on q/v, {args.rounds} (SST-2) / "
              f"{args.e2e_rounds} (E2E) rounds x "
              f"{args.local_steps} local steps of 32, {args.clients_per_round} clients per round "
              f"(random selection) of 100 (SST-2) / {args.e2e_clients} (E2E), IID, lr {args.lr:g} "
              f"(SST-2) / {args.e2e_lr:g} (E2E), max length 64, "
              f"importance on {args.importance_examples} local sentences, seeds {args.seeds}"]
    every = variants(args.b2_modes, per_layer=args.per_layer)
    names = [n for n in every if not args.only or n in args.only or n == "dense"]
    first = [n for n in names if n == "dense" or n.endswith("90")]
    # order: every task's dense + 90% rows first, so a cut-short sweep still has the headline
    plan = [(s, t, n) for s in args.seeds for group in (first, [n for n in names if n not in first])
            for t in args.tasks for n in group]
    res: dict = {}
    for seed, task, name in plan:
        args.seed = seed
        run_name = f"{task}-{name}-s{seed}"
        folder = args.out / run_name
        if args.rerun or not (folder / "summary.json").is_file():
            t0 = time.perf_counter()
            cfg = config(task, run_name, every[name], args, data_dir)
            if args.workers != "auto":
                cfg["compute"] = {"workers": int(args.workers)}
            folder = run_experiment(validate_config(cfg))
            print(f"{run_name}: {time.perf_counter() - t0:.0f} s", flush=True)
        f = figures(folder)
        res.setdefault(task, {}).setdefault(name, {})[seed] = f
        print(f"  acc {f['test_accuracy']:.4f} up {f['bytes_up'] / 1e6:.3f} MB "
              f"flops {f['flops_measured'] / 1e9:.2f} G", flush=True)
        write_report(args, header, res, counts)


if __name__ == "__main__":
    main()
