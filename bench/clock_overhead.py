"""Benchmark (issue 59 target): the simulated clock adds < 2% to a run's wall time.

The same small run (SST-2, MiniLM-L6 + LoRA, fedpetuning, ``round_policy = "all"``) with and
without ``[devices]`` (log-normal devices, 70% availability: selection among the online
clients, each client-round's seconds, the round's settlement, the records), alternating
``--reps`` times in one process after a warm-up pair, so that the two arms share the machine's
state. Each repetition times ``setup`` (data, model, method: the population is drawn there)
plus the rounds (``simulation_for(...).run()``), and the rounds alone. Prints each repetition,
the medians, and the ratio of medians (with devices / without); ``uptime`` before and after
(a timing counts only on a quiet machine: load <= 1.5 before and after).

Note that a run with devices selects among the online clients, so its clients (and their
batches) differ from the run without: the rounds' work is the same in kind and amount
(``clients_per_round`` clients, ``local_steps`` steps of ``batch_size`` examples each), and
the median over repetitions of different seeds evens out the batches' lengths::

    python bench/clock_overhead.py --reps 7 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def config(args, seed: int, devices: bool) -> dict:
    d = {
        "name": "clock-overhead", "seed": seed, "threads": args.threads,
        "data": {"path": args.data, "max_length": args.max_length, "partition": "iid",
                 "max_dev_examples": args.dev_examples, "max_test_examples": 16},
        "model": {"name": args.model},
        "lora": {"r": 16, "alpha": 32, "targets": ["q", "v"]},
        "method": {"name": "fedpetuning"},
        "federation": {"num_clients": args.clients, "clients_per_round": args.per_round,
                       "rounds": args.rounds, "local_steps": args.local_steps,
                       "batch_size": args.batch_size, "lr": 3e-3},
        "evaluation": {"every": args.rounds, "batch_size": 32},
        "output": {"progress": False, "plots": False},
    }
    if devices:
        d["devices"] = {"distribution": "lognormal", "gflops_per_s": 20.0, "upload_mb_per_s": 1.0,
                        "download_mb_per_s": 5.0, "availability": 0.7}
    return d


def one_run(args, seed: int, devices: bool) -> tuple[float, float]:
    """(setup + rounds, rounds) wall seconds of one run."""
    from fedslice.api import setup
    from fedslice.experiment import validate_config
    from fedslice.run.asynchronous import simulation_for

    cfg = validate_config(config(args, seed, devices))
    t0 = time.perf_counter()
    method, data = setup(cfg)
    t1 = time.perf_counter()
    _, records, _ = simulation_for(cfg, method, data).run()
    t2 = time.perf_counter()
    assert len(records) == args.rounds and (("sim_time_s" in records[-1]) == devices)
    return t2 - t0, t2 - t1


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv=None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7, help="pairs (with, without), alternating")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--per-round", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--local-steps", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=48)
    ap.add_argument("--dev-examples", type=int, default=64)
    ap.add_argument("--data", default="sst2")
    ap.add_argument("--model", default="minilm")
    args = ap.parse_args(argv)
    print(f"threads {args.threads}; {args.reps} pairs after a warm-up pair; "
          f"{args.rounds} rounds of {args.per_round} of {args.clients} clients, "
          f"{args.local_steps} steps of {args.batch_size} (max {args.max_length} tokens)")
    print("uptime before:", uptime(), flush=True)
    one_run(args, 0, True), one_run(args, 0, False)  # warm-up: caches, the model's first load
    arms = {True: [], False: []}
    for rep in range(args.reps):
        order = (True, False) if rep % 2 == 0 else (False, True)  # alternate which goes first
        for devices in order:
            total, rounds = one_run(args, rep, devices)
            arms[devices].append((total, rounds))
            print(f"rep {rep} {'with' if devices else 'without'} devices: total {total:.3f} s, "
                  f"rounds {rounds:.3f} s", flush=True)
    print("uptime after:", uptime())
    out = {}
    for i, what in enumerate(("total", "rounds")):
        w = statistics.median(t[i] for t in arms[True])
        wo = statistics.median(t[i] for t in arms[False])
        out[what] = w / wo
        print(f"{what}: median with devices {w:.3f} s, without {wo:.3f} s, ratio {w / wo:.4f} "
              f"({(w / wo - 1) * 100:+.2f}%; target < +2%)")
    return out


if __name__ == "__main__":
    main()
    sys.exit(0)
