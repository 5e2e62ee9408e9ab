"""Benchmark: what a dense client loses with less local work per round (issue 34, the planner's
local-work knob), in the frontier's setting (bench/frontier.py: SST-2 / MiniLM-L6, LoRA q/v,
100 IID clients, 4 per round, 30 rounds, seed 0, one thread, padded batches).

Each variant is fedpetuning at full width with a round of ``steps`` local steps of ``batch``
examples and LoRA rank ``rank``; the frontier's dense row is 8 x 32 at rank 16 (83.49). The
question the planner's order rests on: at the same FLOPs, is it better to keep the whole model
and train fewer examples per round, or to train a narrower sub-model on every example?

    .venv/bin/python bench/local_work_sst2.py --variants 3x32r16 8x12r16 8x12r4

A variant ``...t<k>`` puts LoRA on the top k of MiniLM's 6 layers only (the question behind a
planner axis "adapter depth": the backward stops below layer 6 - k, so the same FLOPs train more
examples per step).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import frontier  # noqa: E402

from fedslice.api import run_experiment  # noqa: E402
from fedslice.experiment import validate_config  # noqa: E402


def run(variant: str, args) -> dict:
    steps, rest = variant.split("x")
    rest, _, top = rest.partition("t")
    batch, rank = (int(x) for x in rest.split("r"))
    path = args.out / f"{variant}.json"
    if path.is_file():
        return json.loads(path.read_text())
    fargs = argparse.Namespace(rounds=args.rounds, clients_per_round=4, local_steps=int(steps),
                               importance_examples=32, test_examples=None, threads=1, seed=args.seed,
                               task="sst2", measured_widths=False, local_work=None, depths=None,
                               server_opt="none", dense_batch=None, lr=None, upload_dtype="fp32",
                               lora_aggregation=None)
    cfg = frontier.config("dense", fargs, None)
    cfg["name"] = variant
    cfg["federation"]["batch_size"] = batch
    cfg["lora"].update(r=rank, alpha=2 * rank)
    if args.lr is not None:
        cfg["federation"]["lr"] = args.lr
    if top:  # LoRA on q/v of the top ``top`` layers only: the backward stops below them
        layers = range(6 - int(top), 6)
        cfg["lora"]["target_modules"] = [f"layer.{i}.attention.self.{m}" for i in layers
                                         for m in ("query", "value")]
    t0 = time.time()
    run_dir = run_experiment(validate_config(cfg), args.out / "runs", progress=False)
    s = json.loads((run_dir / "summary.json").read_text())
    s["bench_wall_s"] = time.time() - t0
    out = {"variant": variant, **frontier.measured(s)}
    path.write_text(json.dumps(out, indent=1))
    print(variant, {k: v for k, v in out.items() if k != "plans"}, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=["3x32r16", "8x12r16", "8x12r4"],
                    help="<local steps>x<batch>r<LoRA rank>[t<top layers with LoRA>]")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=None, help="federation.lr (default the frontier's 1e-3)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/local_work_sst2"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for v in args.variants:
        run(v, args)


if __name__ == "__main__":
    main()
