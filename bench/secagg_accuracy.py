"""Secure aggregation against the plain run (issue 60 target: final accuracy within 0.2 pt after
10 rounds): MiniLM-L6 + LoRA on SST-2 (configs/fedpetuning_sst2.toml, or
configs/raffm_heads_sst2.toml with ``--method raffm+heads``), sized so that the plain run
clearly learns in a few minutes of one CPU thread, with the same seed with and without
``privacy.secure_aggregation``, in process (the same protocol code as on Flower, whose weights
equal the in-process ones for the same seed: tests/test_flower_secagg.py). Accuracy and the
largest weight difference only (the machine is shared: no wall times).

    python bench/secagg_accuracy.py [--rounds 10] [--steps 10] [--method fedpetuning]

Each variant can run alone (``--variants plain`` then ``--variants secure``: a heavy run stays
short) with ``--save DIR``: its final state, summary and records go to
``DIR/<method>[-<tag>]-<variant>.pt`` and the comparison is printed once both files exist.

    python bench/secagg_accuracy.py --method raffm+heads --variants plain --save bench/results/secagg6 \
        --set 'budgets.tiers=[{share=0.5, flops_share=0.5}, {share=0.5, flops_share=0.75}]'
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from fedslice.api import setup
from fedslice.experiment import load_config
from fedslice.run.engine import Simulation

CONFIGS = {"fedpetuning": "configs/fedpetuning_sst2.toml",
           "raffm+heads": "configs/raffm_heads_sst2.toml"}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", choices=sorted(CONFIGS), default="fedpetuning")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--per-round", type=int, default=4)
    p.add_argument("--max-length", type=int, default=48)
    p.add_argument("--dev", type=int, default=500)
    p.add_argument("--set", action="append", default=[], help="more overrides (key=value)")
    p.add_argument("--variants", nargs="+", choices=["plain", "secure"], default=["plain", "secure"])
    p.add_argument("--save", type=Path, default=None,
                   help="folder: keep each variant's result there (compare once both exist)")
    p.add_argument("--tag", default="", help="name of this setting in the saved files")
    args = p.parse_args(argv)
    base = [f"federation.rounds={args.rounds}", f"federation.local_steps={args.steps}",
            f"federation.batch_size={args.batch_size}", f"federation.lr={args.lr}",
            f"federation.num_clients={args.clients}",
            f"federation.clients_per_round={args.per_round}", f"data.max_length={args.max_length}",
            f"data.max_dev_examples={args.dev}", f"data.max_test_examples={args.dev}",
            f"evaluation.every={args.rounds}", "output.plots=false", "output.progress=false",
            "output.save_weights=false", *args.set]
    out = {}
    name = f"{args.method}{'-' + args.tag if args.tag else ''}".replace("+", "-")
    for variant in ("plain", "secure"):
        secure = variant == "secure"
        path = args.save / f"{name}-{variant}.pt" if args.save else None
        if variant not in args.variants:
            if path is not None and path.is_file():
                out[secure] = torch.load(path, weights_only=False)
            continue
        cfg = load_config(CONFIGS[args.method],
                          [*base, f"privacy.secure_aggregation={str(secure).lower()}"])
        method, data = setup(cfg)
        state, records, summary = Simulation(cfg, method, data).run()
        out[secure] = (state, summary, records)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(out[secure], path)
        print(f"secure={secure}: test {summary.get('test_accuracy')} dev "
              f"{summary.get('final_dev_accuracy')}", flush=True)
    if len(out) < 2:
        print("one variant only: the comparison waits for the other (--save)")
        return 0
    (s0, m0, r0), (s1, m1, r1) = out[False], out[True]
    worst = max(float((s0[k] - s1[k]).abs().max()) for k in s0)
    up = [r.get("secagg_upload_bytes") for r in r1]
    full = [r.get("secagg_full_upload_bytes") for r in r1]
    plain_up = [r.get("bytes_up_mean") for r in r0]
    print(f"\n{args.method}: {args.clients} clients, {args.per_round} per round, {args.rounds} rounds "
          f"x {args.steps} steps of {args.batch_size}, lr {args.lr}, max_length {args.max_length}, "
          f"{args.dev} dev / test sentences\n")
    print("| run | test accuracy | final dev accuracy | clipped | upload per client-round (B) |")
    print("|---|---|---|---|---|")
    print(f"| plain | {m0['test_accuracy']:.4f} | {m0['final_dev_accuracy']:.4f} | - | "
          f"{sum(plain_up) / len(plain_up):,.0f} (mean) |")
    print(f"| secure aggregation | {m1['test_accuracy']:.4f} | {m1['final_dev_accuracy']:.4f} | "
          f"{sum(r.get('secagg_clipped', 0) for r in r1)} | {max(up):,} (union; full shape "
          f"{max(full):,}) |")
    print(f"\nlargest difference of a trained weight: {worst:.3g}; test accuracy difference "
          f"{100 * (m1['test_accuracy'] - m0['test_accuracy']):+.2f} pt; same clients every round: "
          f"{[r['clients'] for r in r0] == [r['clients'] for r in r1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
