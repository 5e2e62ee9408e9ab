"""Benchmark: how far one round's measured FLOPs may fall from a correct prediction (issue 61).

No training: replays each client's round-1 local batches as its loader draws them
(``fl.client.local_batch_rows`` with the run's ``run.engine.client_seed``, packed as
``data.packing.row_capacity`` lays them out) for every client of a ``bench/budget_predictions.py``
classifier config, and compares the positions (rows x row length, what most of a step's FLOPs grow
with) to the planner's prediction (``methods.plan_batches.step_units``). Prints the mean over all
clients against the prediction, one client-round's spread, and how often the mean of a round of
k random clients is within 10% of the prediction.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/flops_sampling.py --data sst2 --clients 51 63 83
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import budget_predictions as bp  # noqa: E402  (the benchmark's own configs)

from fedslice.data.packing import ROW_TOKENS, row_capacity  # noqa: E402
from fedslice.experiment import validate_config  # noqa: E402
from fedslice.fl.client import local_batch_rows  # noqa: E402
from fedslice.methods.plan_batches import step_units  # noqa: E402
from fedslice.run.engine import client_seed  # noqa: E402
from fedslice.run.setup import load_inputs  # noqa: E402


def round_positions(data, cfg: dict, seed: int, pack: bool) -> int:
    gen = torch.Generator().manual_seed(seed)
    total = 0
    for rows in local_batch_rows(data, cfg, gen):
        lens = data.lengths[rows].tolist()
        if pack:
            capacity, place = row_capacity(lens, ROW_TOKENS)
            total += (1 + max(r for r, _ in place)) * capacity
        else:
            total += len(lens) * max(lens)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="sst2", choices=[d for d in bp.DATASETS if d != "e2e"])
    ap.add_argument("--pack", choices=["on", "off"], default="on")
    ap.add_argument("--clients", type=int, nargs="*", default=[], help="clients to show one by one")
    ap.add_argument("--round", type=int, default=1)
    args = ap.parse_args()
    pack = args.pack == "on"
    ns = argparse.Namespace(threads=1, clients=3, rounds=1)
    cfg = validate_config(bp.config(args.data, "fedpetuning", pack, True, 1e6, ns))
    inputs = load_inputs(cfg, "both", weights="random")
    method, data = inputs.method(cfg, "both"), inputs.data
    fed = cfg.federation
    sizes = sorted(len(p) for p in data.partitions)
    median = sizes[len(sizes) // 2]
    predicted = step_units(cfg, torch.as_tensor(method.token_lengths), pack, fed.batch_size, median)[0] \
        * fed.local_steps
    local = {"local_steps": fed.local_steps, "batch_size": fed.batch_size, "group_by_length": fed.group_by_length}
    per = np.array([round_positions(data.client(c), local, client_seed(cfg.seed, args.round, c), pack)
                    for c in range(fed.num_clients)], dtype=float)
    print(f"{args.data}, pack {args.pack}: predicted positions per client-round {predicted:.0f}; "
          f"{fed.num_clients} clients' round-{args.round} batches: mean {per.mean():.0f} "
          f"({per.mean() / predicted:.3f} of it), one client-round's sd {per.std() / per.mean():.0%} of the mean")
    for c in args.clients:
        print(f"  client {c}: {per[c]:.0f} positions ({per[c] / predicted:.3f})")
    rng = np.random.default_rng(0)
    for k in (3, 12, 30):
        r = np.array([per[rng.choice(len(per), k, replace=False)].mean() / predicted for _ in range(4000)])
        lo, hi = np.percentile(r, [5, 95])
        print(f"  a round of {k} clients: mean within 10% of the prediction {np.mean(abs(r - 1) <= 0.1):.0%} "
              f"of the time (5-95%: {lo:.2f}-{hi:.2f})")


if __name__ == "__main__":
    main()
