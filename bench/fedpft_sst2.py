"""Benchmark: FedPETuning vs FedOT vs FedPFT (+ ablations _B, _D, _N) on SST-2 with MiniLM-L6.

MiniLM-L6-H384 (6 layers, FFN 1536) on SST-2; IID and Dirichlet(1.0) label skew (Table 3 of the
FedPFT paper), the same partition and seed for every method of a setting. Equal trainable
parameters (the paper's rule): LoRA on q/k/v/o of every layer (FedPETuning, FedPFT) and the same
count on FedOT's adapter (its LoRA rank scaled by layers / adapter layers), plus the classifier.
Transformer parameters of the client model: FedPFT's proxy and FedOT's adapter + emulator are
both kept at <= 60% of the full model's (``--keep-ratio``, ``--whole-layers``, ``--emulator``).

Runs go in priority order (IID first: fedpetuning, fedot, fedpft, then the ablations) and stop
starting new runs once ``--budget-min`` minutes have passed, so a time budget gives a partial but
consistent table. Layer-level KD is cached (``--cache``): FedPFT and FedPFT_B share one
distillation, and a re-run skips it. Writes run folders and ``results.md`` under ``--out``.

    .venv/bin/python bench/fedpft_sst2.py --rounds 20 --budget-min 120
    .venv/bin/python bench/fedpft_sst2.py --methods fedpetuning fedpft --partitions iid --rounds 5
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from fedslice.api import run_experiment
from fedslice.experiment import validate_config

NUM_LAYERS = 6  # MiniLM-L6
METHODS = {  # name -> method section (filled in by method_section)
    "fedpetuning": "FedPETuning", "fedot": "FedOT", "fedpft": "FedPFT",
    "fedpft_b": "FedPFT_B", "fedpft_d": "FedPFT_D", "fedpft_n": "FedPFT_N",
}
KD = {"fedpft": "both", "fedpft_b": "before", "fedpft_d": "during", "fedpft_n": "none"}


def distill_section(args) -> dict:
    return {"steps": args.kd_steps, "batch_size": args.kd_batch, "max_length": args.kd_length,
            "lr": args.kd_lr, "mu": args.mu, "cache_dir": str(args.cache), "seed": args.kd_seed}


def method_section(method: str, args) -> dict:
    if method == "fedpetuning":
        return {"name": "fedpetuning"}
    if method == "fedot":
        adapter = 2  # 1 bottom + 1 top (the depth-scaled default for 6 layers)
        return {"name": "fedot", "emulator_layers": args.emulator, "distill_emulator": True,
                "lora_r": args.lora_r * NUM_LAYERS // adapter, "distill": distill_section(args)}
    return {"name": "fedpft", "kd": KD[method], "keep_ratio": args.keep_ratio,
            "whole_layers": args.whole_layers, "align_every": args.align_every,
            "align_proportion": 0.5, "align_steps": args.align_steps,
            "apoz_max_examples": args.apoz_examples,
            "distill": distill_section(args)}


def config(method: str, partition: str, args, seed: int | None = None) -> dict:
    seed = args.seed if seed is None else seed
    suffix = f"-s{seed}" if len(args.seeds) > 1 else ""
    return {
        "name": f"{method}-{partition}{suffix}", "seed": seed, "threads": args.threads,
        "data": {"path": "sst2", "max_length": 64, "partition": partition, "alpha": 1.0,
                 "max_dev_examples": args.dev_examples},
        "model": {"name": "minilm"},
        "lora": {"r": args.lora_r, "alpha": 2 * args.lora_r, "targets": ["q", "k", "v", "o"]},
        "federation": {"num_clients": args.clients, "clients_per_round": args.per_round,
                       "rounds": args.rounds, "local_steps": args.local_steps, "batch_size": 32,
                       "lr": args.lr},
        "method": method_section(method, args),
        "evaluation": {"every": args.eval_every, "target_accuracy": 0.85, "batch_size": 256},
        "output": {"dir": str(args.out), "progress": False, "save_weights": False},
    }


def _mb(x):
    return "—" if x is None else f"{x / 1e6:.3f}"


def row(method: str, s: dict, seed: int | None = None) -> str:
    params = s.get("proxy_transformer_params") or s.get("full_transformer_params")
    full = s.get("full_transformer_params")
    frac = f"{params / 1e6:.2f}M ({params / full:.0%})" if params and full else "10.65M (100%)"
    kd_t = sum(s.get(k) or 0.0 for k in ("kd_before_time_s", "kd_during_time_s"))
    kd_f = sum(s.get(k) or 0.0 for k in ("kd_before_flops", "kd_during_flops"))
    cached = " (cached)" if s.get("kd_before_cached") else ""
    proxy = s.get("proxy_test_accuracy")
    name = METHODS[method] + ("" if seed is None else f" (seed {seed})")
    return (f"| {name} | {s['test_accuracy']:.4f} | "
            f"{'—' if proxy is None else f'{proxy:.4f}'} | {frac} | "
            f"{s['trainable_params_mean']:.0f} | "
            f"{kd_f / 1e12:.2f} TFLOP, {kd_t:.0f} s{cached} | "
            f"{_mb(s['bytes_down_mean'])} / {_mb(s['bytes_up_mean'])} | "
            f"{s['flops_measured_mean'] / 1e9:.0f} | {s['wall_time_s'] / 60:.1f} |")


HEADER = ("| method | test acc (full FM) | test acc (proxy) | transformer params of the client model "
          "| trainable params | server KD cost | MB down / up per client-round "
          "| GFLOPs per client-round (measured) | FL wall min |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|")


def seed_means(acc: dict[str, list[float]], multi: bool) -> list[str]:
    """Mean, sample std and the paired gap to FedPETuning of each method's test accuracy."""
    if not multi:
        return []
    ref = acc.get("fedpetuning")
    lines = ["| method | seeds | test acc mean | std | mean Δ vs FedPETuning pt (paired) |",
             "|---|---:|---:|---:|---:|"]
    for method, xs in acc.items():
        a = np.array(xs)
        n = min(len(a), len(ref)) if ref else 0
        gap = f"{100 * float(np.mean(a[:n] - np.array(ref[:n]))):+.1f}" if n and method != "fedpetuning" else "—"
        std = f"{a.std(ddof=1):.4f}" if len(a) > 1 else "—"
        lines.append(f"| {METHODS[method]} | {len(a)} | {a.mean():.4f} | {std} | {gap} |")
    return lines + [""]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--partitions", nargs="+", default=["iid", "dirichlet"])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--per-round", type=int, default=5)
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--keep-ratio", type=float, default=0.09)
    p.add_argument("--whole-layers", type=int, nargs="*", default=[0, -1])
    p.add_argument("--emulator", type=int, default=1, help="FedOT emulator layers (of 4 middle)")
    p.add_argument("--kd-steps", type=int, default=100)
    p.add_argument("--kd-batch", type=int, default=16)
    p.add_argument("--kd-length", type=int, default=64)
    p.add_argument("--kd-lr", type=float, default=6e-4)
    p.add_argument("--mu", type=float, default=1.0)
    p.add_argument("--align-every", type=int, default=5)
    p.add_argument("--align-steps", type=int, default=20)
    p.add_argument("--apoz-examples", type=int, default=256, help="Local examples per APoZ report.")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--dev-examples", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="Run every method with each "
                   "seed (partition, sampling, LoRA init) and add mean/std rows; default: --seed.")
    p.add_argument("--kd-seed", type=int, default=None, help="Seed of the distillation before FL "
                   "(default: the run's seed); fixed, all seeds share one cached proxy/emulator.")
    p.add_argument("--budget-min", type=float, default=None, help="Start no run after this.")
    p.add_argument("--out", type=Path, default=Path("bench/results/fedpft"))
    p.add_argument("--cache", type=Path, default=Path("bench/results/fedpft/cache"))
    args = p.parse_args()
    args.seeds = args.seeds or [args.seed]
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    report = [f"Command: `python bench/fedpft_sst2.py {' '.join(sys.argv[1:])}`  ",
              f"Machine: {platform.machine()}, {args.threads} threads, torch {torch.__version__}; "
              f"date {time.strftime('%Y-%m-%d')}", ""]
    skipped = []
    multi = len(args.seeds) > 1
    for partition in args.partitions:
        rows, acc = [], {}
        for seed in args.seeds:
            for method in args.methods:
                if args.budget_min is not None and (time.perf_counter() - t0) / 60 > args.budget_min:
                    skipped.append(f"{method}-{partition}-s{seed}")
                    continue
                run = run_experiment(validate_config(config(method, partition, args, seed)))
                summary = json.loads((run / "summary.json").read_text())
                rows.append(row(method, summary, seed if multi else None))
                acc.setdefault(method, []).append(summary["test_accuracy"])
                section = [f"### SST-2, {partition}{' (Dirichlet 1.0)' if partition == 'dirichlet' else ''}",
                           "", HEADER, *rows, "", *seed_means(acc, multi)]
                (args.out / f"results-{partition}.md").write_text("\n".join(section) + "\n")
        if rows:
            rows += ["", *seed_means(acc, multi)]
            report += [f"### SST-2, {partition}{' (Dirichlet 1.0)' if partition == 'dirichlet' else ''}",
                       "", HEADER, *rows, ""]
    if skipped:
        report.append(f"Not run (time budget of {args.budget_min} min spent): {', '.join(skipped)}")
    report.append(f"Total wall time: {(time.perf_counter() - t0) / 60:.1f} min")
    (args.out / "results.md").write_text("\n".join(report) + "\n")
    print("\n".join(report))


if __name__ == "__main__":
    main()
