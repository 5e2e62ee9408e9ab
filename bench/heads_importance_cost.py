"""Issue 35 part 1: what heads' importance (Eq. 6) costs, and the cheap ways to score heads.

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python bench/heads_importance_cost.py --seeds 0 \\
        --only dense today first_step training
    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python bench/heads_importance_cost.py --seeds 1 2 \\
        --only today first_step training
    .venv/bin/python bench/heads_importance_cost.py --report-only --seeds 0 1 2
    OMP_NUM_THREADS=1 .venv/bin/python bench/heads_importance_cost.py --rank   # scores only
    OMP_NUM_THREADS=2 .venv/bin/python bench/heads_importance_cost.py --seeds 0 --threads 2 \
        --only training first_step dense --out bench/results/heads_importance_time_a   # wall time

SST-2, MiniLM-L6 (6 x 12 heads), the setting of BENCHMARKS.md's 20-round heads rows (issue 35
part 3): 100 IID clients, 2 per round, 20 rounds x 10 local steps of 32, lr 1e-3, LoRA r16 on q
and v, max length 64, random selection, sparsity 0.9 (7 of 72 heads kept per client), dev = 256
sentences every 10 rounds, test = the 872 GLUE validation sentences. Variants (same seed: same
partition, LoRA init and client sequence):

* ``dense``: FedPETuning (sparsity 0, no importance pass);
* ``today``: heads, ``prune="parameters"``, Eq. 6 from a separate inference pass over 128 sampled
  local sentences each client-round (``importance_max_examples = 128``, every earlier benchmark);
* ``first_step``: heads, ``prune="parameters"``, ``importance_source = "first_step"``: the scores
  come from the client's first training batch (32 sentences), captured from that step's own
  forward (eager attention for that step); no separate forward;
* ``training``: heads, ``prune="parameters"``, ``importance_source = "training"`` (not the
  paper's rule): every training step's forward is captured, the client trains every head and
  after training sends the top heads of the scores over its 10 training batches (320 sentences);
* ``sample16``: heads, ``prune="parameters"``, the pass over 16 sampled sentences;
* ``fwd-today`` / ``fwd-sample8`` / ``fwd-sample16``: heads, ``prune="forward"``, the pass over
  128 / 8 / 16 sentences; ``fwd-mean-*``: the same with ``method.fill = "mean"`` (the pruned
  heads' mean output from that pass).

Wall time (the speed issue's rules: a quiet machine, one run at a time, ``--threads 2``):
per run the median over rounds 2.. of ``round_time_s`` (a round's client work, importance and
training, and its aggregation; no evaluation), and its ratio to the dense run of the same
invocation. Run-to-run spread on this machine: about ±5% (dense's 2.41-2.82 s across four
invocations), so time ratios are read over several invocations. ``--lr`` sets every run's rate.

``--rank`` (no training): for 8 clients' partitions, Spearman rank correlation over the 72 heads
and kept-set overlap at sparsity 0.9 of each cheap score against today's (the pass over 128
sampled sentences, eval mode): the first-step capture (the client's first training batch of 32,
training mode: attention weights after dropout), the same batch scored by the pass (eval mode: no
dropout), and the pass on 16 and 8 sampled sentences; with the FLOPs each costs (counted), and a
training step's counted FLOPs and peak tensor memory with eager vs sdpa attention.

Per run: test accuracy, per client-round means of the measured training FLOPs (FlopCounterMode on
the model the client trains), of the importance pass's FLOPs (``flops_importance``, counted by the
same counter around the pass), their total, the ratio of the total to the dense run's of the same
seed (every variant trains the same clients on the same batches: the tokens per client-round are
checked equal), and the upload. Writes ``results.md`` / ``results.json`` under ``--out``; run
folders are reused unless ``--rerun``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from heads_sst2 import _records, config as sst2_config, markdown  # noqa: E402

from fedslice.api import run_experiment  # noqa: E402
from fedslice.experiment import validate_config  # noqa: E402

HEADS90 = {"pruning": "importance", "aggregation": "head_weighted", "sparsity": 0.9}
VARIANTS = {
    "dense": ({"pruning": "none", "aggregation": "fedavg", "sparsity": 0.0}, 128),
    "today": ({**HEADS90, "prune": "parameters"}, 128),
    "first_step": ({**HEADS90, "prune": "parameters", "importance_source": "first_step"}, None),
    "training": ({**HEADS90, "prune": "parameters", "importance_source": "training"}, None),
    "sample16": ({**HEADS90, "prune": "parameters"}, 16),
    "fwd-today": ({**HEADS90, "prune": "forward"}, 128),
    "fwd-sample8": ({**HEADS90, "prune": "forward"}, 8),
    "fwd-sample16": ({**HEADS90, "prune": "forward"}, 16),
    "fwd-mean-today": ({**HEADS90, "prune": "forward", "fill": "mean"}, 128),
    "fwd-mean-sample8": ({**HEADS90, "prune": "forward", "fill": "mean"}, 8),
    "fwd-mean-sample16": ({**HEADS90, "prune": "forward", "fill": "mean"}, 16),
}


def run_config(name: str, seed: int, args) -> dict:
    method, examples = VARIANTS[name]
    ns = SimpleNamespace(seed=seed, threads=args.threads, dev_examples=256, clients_per_round=2,
                         local_steps=10, lr=args.lr, importance_examples=examples, eval_every=10,
                         target=0.8, track_test=False, out=args.out)
    cfg = sst2_config(f"{name}-s{seed}", method, "random", ns, args.rounds)
    cfg["output"]["plots"] = False
    cfg["compute"] = {"workers": 1}
    return cfg


def figures(run: Path) -> dict:
    s = json.loads((run / "summary.json").read_text())
    ms = [m for r in _records(run) for m in r["client_metrics"] if m.get("num_examples", 0) > 0]
    mean = lambda k: sum(m.get(k) or 0.0 for m in ms) / max(len(ms), 1)  # noqa: E731
    # wall time: a round's client work (importance + training) and aggregation, not evaluation;
    # round 1 (first-call warm-up) left out
    rounds = [r["round_time_s"] for r in _records(run) if r["round"] > 1]
    return {"test_accuracy": s["test_accuracy"], "client_rounds": len(ms), "tokens": mean("tokens"),
            "round_s": statistics.median(rounds) if rounds else None,
            "train_s": mean("train_time_s"),
            "flops_measured": mean("flops_measured"), "flops_importance": mean("flops_importance"),
            "bytes_up": mean("bytes_up"), "bytes_down": mean("bytes_down"),
            "heads_kept": mean("heads_kept")}


def report(args) -> None:
    res = {}
    for seed in args.seeds:
        for name in VARIANTS:
            run = args.out / f"{name}-s{seed}"
            if (run / "summary.json").is_file():
                res[(name, seed)] = figures(run)
    rows = []
    for (name, seed), f in res.items():
        d = res.get(("dense", seed))
        total = f["flops_measured"] + f["flops_importance"]
        row = {"run": name, "seed": seed, "test acc %": f"{100 * f['test_accuracy']:.2f}",
               "train GFLOPs / client-round": f"{f['flops_measured'] / 1e9:.1f}",
               "+ importance GFLOPs": f"{f['flops_importance'] / 1e9:.2f}",
               "total GFLOPs": f"{total / 1e9:.1f}"}
        if d is not None:
            dt = d["flops_measured"] + d["flops_importance"]
            row["Δ acc vs dense (pt)"] = f"{100 * (f['test_accuracy'] - d['test_accuracy']):+.2f}"
            row["total ÷ dense"] = f"{total / dt:.3f}"
            row["same tokens as dense"] = "yes" if abs(f["tokens"] - d["tokens"]) < 0.5 else \
                f"no ({f['tokens']:.0f} vs {d['tokens']:.0f})"
        ref = "today" if not name.startswith("fwd") else \
            "fwd-mean-today" if name.startswith("fwd-mean") else "fwd-today"
        t = res.get((ref, seed))
        if t is not None and name not in ("dense",):
            row["Δ acc vs today (pt)"] = f"{100 * (f['test_accuracy'] - t['test_accuracy']):+.2f}"
        row["MB up / client-round"] = f"{f['bytes_up'] / 1e6:.3f}"
        if f.get("round_s") is not None:
            row["s / round (median, rounds ≥ 2)"] = f"{f['round_s']:.2f}"
            if d is not None and d.get("round_s"):
                row["round s ÷ dense"] = f"{f['round_s'] / d['round_s']:.3f}"
        rows.append(row)
    cols = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    rows = [{c: r.get(c, "") for c in cols} for r in rows]
    lines = [markdown(rows)] if rows else []
    # medians over seeds
    for name in VARIANTS:
        accs = [res[(name, s)]["test_accuracy"] for s in args.seeds if (name, s) in res]
        if len(accs) > 1:
            lines.append(f"- {name}: median test acc {100 * statistics.median(accs):.2f} over "
                         f"seeds {[s for s in args.seeds if (name, s) in res]}")
    pairs = [("first_step", "today"), ("training", "today"), ("sample16", "today"),
             ("fwd-sample8", "fwd-today"), ("fwd-sample16", "fwd-today"),
             ("fwd-mean-sample8", "fwd-mean-today"), ("fwd-mean-sample16", "fwd-mean-today")]
    for name, ref in pairs:
        gaps = [100 * (res[(name, s)]["test_accuracy"] - res[(ref, s)]["test_accuracy"])
                for s in args.seeds if (name, s) in res and (ref, s) in res]
        if gaps:
            lines.append(f"- {name} − {ref} per seed (pt): {[round(g, 2) for g in gaps]}, median "
                         f"{statistics.median(gaps):+.2f}, mean {statistics.mean(gaps):+.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    (args.out / "results.json").write_text(json.dumps(
        {f"{n}-s{s}": f for (n, s), f in res.items()}, indent=1))
    print("\n".join(lines))


def spearman(a, b) -> float:
    ra, rb = a.flatten().argsort().argsort().float(), b.flatten().argsort().argsort().float()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def rank(args) -> None:
    import torch
    from fedslice import measure
    from fedslice.api import setup
    from fedslice.fl.client import local_batches
    from fedslice.slicing.heads import keep_mask

    torch.set_num_threads(args.threads)
    cfg = validate_config(run_config("today", 0, args))
    method, data = setup(cfg)
    model = method.model
    train_cfg = {"batch_size": 32, "local_steps": 10}
    rows = []
    for c in range(8):
        split = data.client(c)
        ref, ref_fl = method.importance(split, c)  # today's: 128 sampled (the config's option)
        first = next(iter(local_batches(split, train_cfg, torch.Generator().manual_seed(c))))
        got = {}
        # the capture, as first_step runs it: training mode, dropout on, no backward
        torch.manual_seed(c)
        model.train()
        with measure.count_flops() as fc:
            loss = method.first_step_loss(lambda a: got.__setitem__("first_step", a))(model, first)
        del loss
        got_fl = {"first_step": 0.0}
        step_fwd = float(fc.total)
        # the same batch, eval mode (what the pass would score on those 32 sentences)
        model.eval()
        with torch.no_grad():
            method.first_step_loss(lambda a: got.__setitem__("batch_eval", a))(model, first)
        got_fl["batch_eval"] = step_fwd  # a forward of its own if run as a pass
        model.train()
        for n in (32, 16, 8):
            method.opts.importance_max_examples = n
            got[f"pass{n}"], got_fl[f"pass{n}"] = method.importance(split, c)
        method.opts.importance_max_examples = 128
        for k, v in got.items():
            rows.append({"client": c, "score": k, "spearman": spearman(v, ref),
                         "kept_overlap_0.9": float((keep_mask(v, 0.9) & keep_mask(ref, 0.9)).sum()
                                                   / keep_mask(ref, 0.9).sum()),
                         "gflops": got_fl[k] / 1e9, "ref_gflops": ref_fl / 1e9,
                         "first_step_forward_gflops": step_fwd / 1e9})
            print(rows[-1], flush=True)
    # eager vs sdpa: one training step (forward + backward) on a 32 x 64 batch
    from fedslice.slicing.heads import ensure_eager_attention
    split = data.client(0)
    batch = next(iter(local_batches(split, train_cfg, torch.Generator().manual_seed(0))))
    base = model.get_base_model()
    cost = {}
    for impl in ("sdpa", "eager"):
        base.set_attn_implementation(impl)
        model.train()
        with measure.count_flops() as fc:
            method.task.loss(model, batch).backward()
        model.zero_grad(set_to_none=True)
        with measure.PeakMemory(model, interval_s=0.005) as mem:
            method.task.loss(model, batch).backward()
        model.zero_grad(set_to_none=True)
        cost[impl] = {"gflops": fc.total / 1e9, "tensor_peak_mb": mem.tensor_peak_mb}
    base.set_attn_implementation("sdpa")
    out = {"rows": rows, "eager_vs_sdpa_step": cost, "batch_shape": list(batch["input_ids"].shape)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rank.json").write_text(json.dumps(out, indent=1))
    lines = ["| score | Spearman vs pass on 128 (mean, min over 8 clients) | kept overlap at 0.9 (mean) | GFLOPs of its own |",
             "|---|---|---|---|"]
    for k in ("first_step", "batch_eval", "pass32", "pass16", "pass8"):
        r = [x for x in rows if x["score"] == k]
        lines.append(f"| {k} | {statistics.mean(x['spearman'] for x in r):.3f}, "
                     f"{min(x['spearman'] for x in r):.3f} | "
                     f"{statistics.mean(x['kept_overlap_0.9'] for x in r):.3f} | "
                     f"{statistics.mean(x['gflops'] for x in r):.2f} |")
    lines.append(f"| (today: pass on 128) | 1 | 1 | {statistics.mean(x['ref_gflops'] for x in rows):.2f} |")
    lines.append("")
    lines.append(f"One training step on a {out['batch_shape']} batch: " + "; ".join(
        f"{k}: {v['gflops']:.2f} GFLOPs counted, tensor peak {v['tensor_peak_mb']:.0f} MB"
        for k, v in cost.items()))
    (args.out / "rank.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--rerun", action="store_true")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--rank", action="store_true", help="rank agreement of the cheap scores only")
    p.add_argument("--out", type=Path, default=Path("bench/results/heads_importance_cost"))
    args = p.parse_args()
    if args.rank:
        return rank(args)
    if not args.report_only:
        for seed in args.seeds:
            for name in args.only:
                run = args.out / f"{name}-s{seed}"
                if (run / "summary.json").is_file() and not args.rerun:
                    continue
                print(f"== {name} seed {seed}", flush=True)
                got = run_experiment(validate_config(run_config(name, seed, args)))
                print(f"   {got}", flush=True)
    report(args)


if __name__ == "__main__":
    main()
