"""Benchmark (issue 26): FedPFT's Table 2 shape on DINOv2-S/14 + Fashion-MNIST, on CPU.

The set-up of ``configs/fmnist_dinov2.toml``: 100 clients, 10 per round, IID or Dirichlet(1.0)
label skew, ``--rounds`` rounds of ``--local-steps`` LoRA steps x 32 images, 28 px images
upsampled to 56 px (4 x 4 patches + the class token = 17 tokens; the resolution study is
``bench/fmnist_resolution.py``), the full 10,000 test images. Every run of a partition and seed
uses the same partition, the same held-apart server images (5% of train: FedPFT's and FedOT's
distillation corpus, as the paper distils ViT on ImageNet) and the same test set. Rows:

* ``fedpetuning``: LoRA (r 8) on q/k/v/o of every layer + the classifier, FedAvg: the baseline;
* ``fedpft``: proxy with 25% of the FFN neurons of layers 1..10 (layers 0 and 11 whole), layer KD
  before FL (200 steps x 32 held-apart images), neuron KD after round 5 (20 steps), LoRA r 8;
* ``fedot``: adapter = 2 bottom + 2 top layers (LoRA r 24: the trainable parameters of r 8 on 12
  layers, FedPFT's rule), 3 of the 8 middle layers as the emulator, distilled (200 steps);
* ``raffm``: four equal tiers at 0.25 / 0.5 / 0.75 / 1.0 of the full model's training FLOPs (LoRA),
  the global model evaluated at those sizes (elastic inference; checked monotone);
* ``heads90``: FedPETuning with 90% of the heads pruned per client (Eq. 6 on 128 local images,
  the class token left out of the keys), head-weighted aggregation;
* ``fedpft_kd300``, ``fedpft_kd1000``, ``fedpft_kd5000``: ``fedpft`` with 300 / 1,000 / 5,000
  layer-KD steps before FL (``fedpft`` itself has ``--kd-steps``): the proxy's own accuracy and the
  plug-in gap (proxy vs the full model with the proxy's LoRA) against the distillation budget,
  whose cost is ``kd_before_flops`` (issue 35, part 5);
* ``fedpft_refit``: ``fedpft`` + the server's head re-fit after the last round
  (``method.head_refit_steps`` 200, lr 1e-3: the proxy's predictions on the held-apart images
  distilled into the plugged-in full model's classifier; cost ``head_refit_flops``);
  ``fedpft_refit1000``: the same with 1,000 re-fit steps; ``fedpft_refit_act``: ``fedpft_refit``
  whose proxy keeps the neurons of largest activation salience (``method.salience =
  "activation"`` on 256 of the server's held-apart images) instead of Eq. 8's weight norms;
  ``fedpft_refit_k50``: ``fedpft_refit`` whose proxy keeps half of the middle layers' FFN units
  (``keep_ratio`` 0.5 instead of the config's 0.25: is the proxy's slower learning its width?).

Each run writes ``runs/<key>.json`` (key ``variant-partition-sN``) under ``--out`` and is skipped
when present, so invocations may run side by side (one ``--variants`` / ``--seeds`` subset each)
and resume; ``results.md`` / ``results.json`` are rebuilt from every row (``--table``: only that).

    .venv/bin/python bench/fmnist_dinov2.py --partitions iid --variants fedpetuning fedpft --seeds 0 1 2
    .venv/bin/python bench/fmnist_dinov2.py --table
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from fedslice.api import run_experiment
from fedslice.experiment import load_config, validate_config

ROOT = Path(__file__).resolve().parents[1]
QUARTERS = [0.25, 0.5, 0.75, 1.0]
LAYERS, LORA_R = 12, 8
VARIANTS = {
    "fedpetuning": {"name": "fedpetuning"},
    "fedpft": None,  # the config file's method section
    "fedot": {"name": "fedot", "bottom_layers": 2, "top_layers": 2, "emulator_layers": 3,
              "lora_r": LORA_R * LAYERS // 4, "distill_emulator": True,
              "distill": {"corpus": "server_holdout", "steps": 200, "batch_size": 32, "seed": 0}},
    "raffm": {"name": "raffm", "tiers": [{"share": 0.25, "flops": f} for f in QUARTERS],
              "elastic_sizes": QUARTERS},
    "heads90": {"name": "heads", "sparsity": 0.9, "importance_max_examples": 128},
    # the proxy and the plug-in gap vs the distillation budget: layer-KD steps, the same FL
    "fedpft_kd300": 300,
    "fedpft_kd1000": 1000,
    "fedpft_kd5000": 5000,
    # the plug-in's classifier re-fitted on the server after FL (the config's method + REFIT)
    "fedpft_refit": None,
    "fedpft_refit1000": None,
    # ... and the proxy's neurons by activation salience on 256 held-apart images (issue 35 part 5)
    "fedpft_refit_act": None,
    # ... and a wider proxy: half the FFN units kept instead of a quarter (issue 35 part 5)
    "fedpft_refit_k50": None,
}
REFIT = {"fedpft_refit": {"head_refit_steps": 200, "head_refit_lr": 1e-3},
         "fedpft_refit1000": {"head_refit_steps": 1000, "head_refit_lr": 1e-3},
         "fedpft_refit_act": {"head_refit_steps": 200, "head_refit_lr": 1e-3,
                              "salience": "activation", "calibration_examples": 256},
         "fedpft_refit_k50": {"head_refit_steps": 200, "head_refit_lr": 1e-3, "keep_ratio": 0.5}}
CLAIMS = {
    "fedpetuning": "baseline: LoRA on the full model",
    "fedpft": "FedPFT: > FedOT, within 1.5 pt of FedPETuning (Table 2)",
    "fedot": "FedOT: emulator + adapter, below FedPFT",
    "raffm": "RaFFM: tiers of 0.25-1x FLOPs; elastic sizes monotone",
    "heads90": "heads at 90%: close to dense, less upload",
    "fedpft_kd300": "FedPFT with 300 layer-KD steps",
    "fedpft_kd1000": "FedPFT with 1,000 layer-KD steps: does the proxy -> full-model gap close?",
    "fedpft_kd5000": "FedPFT with 5,000 layer-KD steps",
    "fedpft_refit": "FedPFT + server-side head re-fit: within 3 pt of FedPETuning (issue 35, part 5)",
    "fedpft_refit1000": "fedpft_refit with 1,000 re-fit steps (its budget)",
    "fedpft_refit_act": "fedpft_refit with the proxy's neurons by activation salience (issue 35, part 5)",
    "fedpft_refit_k50": "fedpft_refit with a wider proxy, keep_ratio 0.5 (issue 35, part 5)",
}


def key(variant: str, partition: str, seed: int) -> str:
    return f"{variant}-{partition}-s{seed}"


def config(variant: str, partition: str, seed: int, args) -> dict:
    base = load_config(ROOT / "configs" / "fmnist_dinov2.toml").model_dump(mode="json")
    base.update(name=key(variant, partition, seed), seed=seed, threads=args.threads)
    base["data"].update(partition=partition, alpha=1.0, max_test_examples=args.test_examples)
    if args.dev_examples is not None:
        base["data"]["max_dev_examples"] = args.dev_examples
    if args.image_size is not None:
        base["task"]["image_size"] = args.image_size
    base["federation"].update(rounds=args.rounds, local_steps=args.local_steps,
                              clients_per_round=args.clients_per_round)
    base["output"] = {"dir": str(args.out / "runs"), "progress": False, "save_weights": False,
                      "plots": False}
    # one process per run, clients one after another, 1 intra-op thread (the load stated per row)
    base["compute"] = {**base.get("compute", {}), "device": "cpu", "workers": 1, "batched_clients": False}
    if isinstance(VARIANTS[variant], dict):
        base["method"] = VARIANTS[variant]
    base["method"] = json.loads(json.dumps(base["method"]))
    base["method"].update(REFIT.get(variant, {}))
    if base["method"]["name"] == "fedpft" and args.align_every:
        base["method"]["align_every"] = args.align_every
    if "distill" in base["method"]:
        kd = VARIANTS[variant]
        base["method"]["distill"]["steps"] = kd if isinstance(kd, int) else args.kd_steps
    return base


def run(variant: str, partition: str, seed: int, args) -> dict:
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    path = run_experiment(validate_config(config(variant, partition, seed, args)), progress=False)
    wall = time.perf_counter() - t0
    s = json.loads((path / "summary.json").read_text())
    metrics = [json.loads(l) for l in (path / "metrics.jsonl").read_text().splitlines()]
    s.update(variant=variant, partition=partition, seed=seed, run_dir=str(path), bench_wall_s=wall,
             round_time_s=statistics.fmean(m["round_time_s"] for m in metrics),
             loadavg_start=load0[0], loadavg_end=os.getloadavg()[0], threads=args.threads,
             machine=f"{platform.node()} ({os.cpu_count()} CPUs)",
             rounds_run=len(metrics), local_steps=args.local_steps,
             clients_per_round=args.clients_per_round,
             image_size=args.image_size or 56, kd_steps=args.kd_steps,
             date=time.strftime("%Y-%m-%d %H:%M"))
    return s


def _mb(v):
    return None if v is None else v / 1e6


def _fmt(v, nd: int = 2) -> str:
    if v is None:
        return "—"
    return f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def _row(s: dict, base: dict | None) -> str:
    acc = s.get("test_accuracy")
    d = None if base is None or base is s else 100 * (acc - base["test_accuracy"])
    up, down = s.get("bytes_up_mean"), s.get("bytes_down_mean")
    ratio = None if base is None or not up else base["bytes_up_mean"] / up
    proxy = s.get("proxy_test_accuracy")
    load = f"{s['loadavg_start']:.1f}/{s['loadavg_end']:.1f}"
    return (f"| {s['variant']} | {s['seed']} | {_fmt(100 * acc, 2)} | {_fmt(d, 2)} | "
            f"{_fmt(None if proxy is None else 100 * proxy, 2)} | {_fmt(_mb(up), 3)} | {_fmt(_mb(down), 3)} | "
            f"{_fmt(ratio, 2)} | {_fmt(s['flops_measured_mean'] / 1e9, 1)} | {_fmt(s['round_time_s'], 1)} | "
            f"{_fmt(s['bench_wall_s'] / 60, 1)} | {load} |")


def table(out: Path) -> str:
    rows = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]
    if not rows:
        return "no runs yet"
    by = {(r["variant"], r["partition"], r["seed"]): r for r in rows}
    r0 = next((r for r in rows if r.get("machine")), rows[0])  # a restored row may lack the set-up
    px = r0.get("image_size", 56)
    lines = [f"DINOv2-S/14 + Fashion-MNIST ({px} px, {(px // 14) ** 2 + 1} tokens/image), 100 clients x "
             f"{r0.get('clients_per_round', 10)} per round, "
             f"{r0['rounds_run']} rounds x {r0['local_steps']} steps x 32 images, test = "
             f"{(r0['test_examples'] or 10000) if 'test_examples' in r0 else '?'} images; fedpft/fedot "
             f"layer KD {r0.get('kd_steps', '?')} steps x 32 images; per client-round means; "
             f"threads {r0.get('threads', '?')}; machine {r0.get('machine', '?')}.", ""]
    cols = ["variant", "seed", "test acc %", "Δ vs fedpetuning (pt)", "proxy/emulator acc %",
            "up MB", "down MB", "up: base/this", "train GFLOPs (measured)", "s/round (train)",
            "wall min", "load start/end"]
    for partition in ("iid", "dirichlet"):
        part = [r for r in rows if r["partition"] == partition]
        if not part:
            continue
        lines += [f"### {partition}" + (" (Dirichlet alpha 1.0)" if partition == "dirichlet" else ""), "",
                  "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for v in VARIANTS:
            for seed in sorted({r["seed"] for r in part}):
                s = by.get((v, partition, seed))
                if s:
                    lines.append(_row(s, by.get(("fedpetuning", partition, seed))))
        lines += [""] + claims(by, partition) + [""] + kd_table(part, by, partition)
        raffm = [r for r in part if r["variant"] == "raffm" and r.get("elastic")]
        for r in raffm:
            lines += [f"raffm elastic inference, seed {r['seed']} (the one global model at each size):", "",
                      "| size | heads/layer | FFN/layer | train FLOPs ratio | forward FLOPs ratio | dev acc % | test acc % |",
                      "|---|---|---|---|---|---|---|"]
            for e in r["elastic"]:
                if "error" in e:
                    lines.append(f"| {e['size']} | — | — | — | — | {e['error']} | |")
                    continue
                lines.append(f"| {e['size']} | {e['heads'][0]} | {e['ffn'][0]} | {_fmt(e['train_flops_ratio'])} | "
                             f"{_fmt(e.get('forward_flops_ratio'))} | {_fmt(100 * e['dev_accuracy'])} | "
                             f"{_fmt(100 * e['test_accuracy'])} |")
            lines.append("")
    return "\n".join(lines)


def kd_table(part: list[dict], by: dict, partition: str) -> list[str]:
    """FedPFT against its layer-KD budget: the proxy's own accuracy, the plugged-in full model's,
    and the distillation's measured cost (issue 35, part 5)."""
    rows = sorted((r for r in part if r["variant"].startswith("fedpft")),
                  key=lambda r: (r["seed"], r.get("kd_before_steps") or 0))
    if not rows:
        return []
    out = ["FedPFT vs its layer-KD budget (Δ against fedpetuning of the same seed; plug-in = full "
           "model with the proxy's LoRA − the proxy itself):", "",
           "| seed | KD steps | KD TFLOPs (measured) | KD min | KD loss start → end | head re-fit "
           "(steps, TFLOPs, min) | proxy acc % | plugged-in acc % | plug-in (pt) | "
           "proxy − fedpetuning (pt) | plugged-in − fedpetuning (pt) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = by.get(("fedpetuning", partition, r["seed"]))
        acc, proxy = 100 * r["test_accuracy"], 100 * (r.get("proxy_test_accuracy") or 0)
        b = None if base is None else 100 * base["test_accuracy"]
        out.append(f"| {r['seed']} | {r.get('kd_before_steps', 0)} | {_fmt((r.get('kd_before_flops') or 0) / 1e12, 1)} | "
                   f"{_fmt((r.get('kd_before_time_s') or 0) / 60, 1)}{' (cached)' if r.get('kd_before_cached') else ''} | "
                   f"{_fmt(r.get('kd_before_loss_start'), 3)} → {_fmt(r.get('kd_before_loss_end'), 3)} | "
                   f"{_refit(r)} | {proxy:.2f} | {acc:.2f} | {acc - proxy:+.2f} | "
                   f"{_fmt(None if b is None else proxy - b)} | {_fmt(None if b is None else acc - b)} |")
    return out + [""]


def _refit(r: dict) -> str:
    """The head re-fit's steps, measured TFLOPs and minutes (— when off)."""
    if not r.get("head_refit_steps"):
        return "—"
    return (f"{r['head_refit_steps']}, {r['head_refit_flops'] / 1e12:.2f}, "
            f"{r['head_refit_time_s'] / 60:.1f}")


def claims(by: dict, partition: str) -> list[str]:
    """The issue's three checks, on the rows present."""
    out = []
    seeds = sorted({s for (v, p, s) in by if p == partition and v in ("fedpetuning", "fedpft")})
    pairs = [(by[("fedpetuning", partition, s)], by[("fedpft", partition, s)]) for s in seeds
             if ("fedpetuning", partition, s) in by and ("fedpft", partition, s) in by]
    if pairs:
        gaps = [100 * (b["test_accuracy"] - a["test_accuracy"]) for a, b in pairs]
        mean = statistics.fmean(gaps)
        out.append(f"- FedPFT − FedPETuning over {len(pairs)} seed(s): {', '.join(f'{g:+.2f}' for g in gaps)} pt "
                   f"(mean {mean:+.2f}): within 1.5 pt: {'met' if mean >= -1.5 else 'missed'}")
    for v, s in sorted((v, s) for (v, p, s) in by if p == partition and v in REFIT):
        a, b = by.get(("fedpetuning", partition, s)), by[(v, partition, s)]
        if a:
            gap = 100 * (b["test_accuracy"] - a["test_accuracy"])
            act = ", proxy by activation salience" if REFIT[v].get("salience") == "activation" else ""
            act += f", keep_ratio {REFIT[v]['keep_ratio']}" if "keep_ratio" in REFIT[v] else ""
            out.append(f"- FedPFT + head re-fit, {b['head_refit_steps']} steps{act} − FedPETuning (seed {s}): "
                       f"{gap:+.2f} pt: within 3 pt (issue 35, part 5): {'met' if gap >= -3 else 'missed'}")
    for s in seeds:
        a, b = by.get(("fedpft", partition, s)), by.get(("fedot", partition, s))
        if a and b:
            gap = 100 * (a["test_accuracy"] - b["test_accuracy"])
            out.append(f"- FedPFT − FedOT (seed {s}): {gap:+.2f} pt: FedPFT > FedOT: {'met' if gap > 0 else 'missed'}")
    for (v, p, s), r in sorted(by.items()):
        if v == "raffm" and p == partition and r.get("elastic"):
            accs = [e["test_accuracy"] for e in r["elastic"] if "test_accuracy" in e]
            mono = all(x <= y + 1e-12 for x, y in zip(accs, accs[1:]))
            out.append(f"- RaFFM elastic sizes (seed {s}) test accuracy {', '.join(f'{100 * x:.2f}' for x in accs)}: "
                       f"monotone: {'met' if mono else 'missed'}")
    return out


def restore_rows(out: Path) -> None:
    """Rows of ``results.json`` (committed) whose ``runs/`` file is missing (``runs/`` is not
    committed) are written back, marked ``restored_from``, so a new row does not drop them from
    the table."""
    path = out / "results.json"
    if not path.is_file():
        return
    for r in json.loads(path.read_text()):
        row = out / "runs" / f"{key(r['variant'], r['partition'], r['seed'])}.json"
        if not row.exists():
            row.write_text(json.dumps({**r, "restored_from": "results.json"}, indent=1, default=str))


def _claimed(claim: Path) -> bool:
    """Another live invocation runs this row (its pid is in the claim file)."""
    try:
        os.kill(int(claim.read_text()), 0)
        return True
    except (OSError, ValueError):
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--partitions", nargs="+", choices=["iid", "dirichlet"], default=["iid", "dirichlet"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--local-steps", type=int, default=4)
    p.add_argument("--clients-per-round", type=int, default=10)
    p.add_argument("--align-every", type=int, default=None,
                   help="fedpft: neuron KD after every t-th round (default: the config's)")
    p.add_argument("--image-size", type=int, default=None, help="task.image_size (default: the config's 56)")
    p.add_argument("--dev-examples", type=int, default=None, help="default: the config's 1000")
    p.add_argument("--test-examples", type=int, default=None, help="default: all 10,000")
    p.add_argument("--kd-steps", type=int, default=200, help="distillation steps before FL (fedpft, fedot)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fmnist_dinov2")
    p.add_argument("--table", action="store_true", help="only rebuild results.md from the rows")
    args = p.parse_args()
    (args.out / "runs").mkdir(parents=True, exist_ok=True)
    restore_rows(args.out)
    if not args.table:
        for partition in args.partitions:
            for seed in args.seeds:
                for v in args.variants:
                    row = args.out / "runs" / f"{key(v, partition, seed)}.json"
                    claim = row.with_suffix(".running")
                    if row.exists() or _claimed(claim):
                        continue  # done, or another invocation runs it
                    claim.write_text(str(os.getpid()))
                    try:
                        s = run(v, partition, seed, args)
                    finally:
                        claim.unlink(missing_ok=True)
                    s["test_examples"] = args.test_examples
                    row.write_text(json.dumps(s, indent=1, default=str))
                    print(f"{key(v, partition, seed)}: test accuracy {s['test_accuracy']:.4f}, "
                          f"{s['round_time_s']:.1f} s/round, {s['bench_wall_s'] / 60:.1f} min", flush=True)
                    (args.out / "results.md").write_text(table(args.out) + "\n")
    (args.out / "results.md").write_text(table(args.out) + "\n")
    rows = [json.loads(p.read_text()) for p in sorted((args.out / "runs").glob("*.json"))]
    keep = ("variant", "partition", "seed", "test_accuracy", "proxy_test_accuracy", "bytes_up_mean",
            "bytes_down_mean", "flops_measured_mean", "flops_analytic_mean", "round_time_s",
            "bench_wall_s", "loadavg_start", "loadavg_end", "elastic", "test_accuracy_per_class",
            "kd_before_steps", "kd_before_flops", "kd_before_time_s", "kd_before_loss_start",
            "kd_before_loss_end", "kd_before_cached", "kd_during_rounds", "proxy_dev_accuracy",
            "final_dev_accuracy", "threads", "machine", "kd_steps", "test_examples",
            "head_refit_steps", "head_refit_flops", "head_refit_time_s",
            "head_refit_loss_start", "head_refit_loss_end", "rounds_run", "clients_per_round", "local_steps", "image_size",
            "date")
    (args.out / "results.json").write_text(json.dumps([{k: r.get(k) for k in keep} for r in rows],
                                                      indent=1, default=str))
    print(table(args.out))


if __name__ == "__main__":
    main()
