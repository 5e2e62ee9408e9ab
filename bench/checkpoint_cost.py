"""Benchmark (issue 24): what a checkpoint of the trainable state costs per round, per method.

Each method's SST-2 config of ``configs/`` (MiniLM-L6), run for ``--rounds`` rounds in-process
with ``output.checkpoint_every = 1`` (the default), the distillation before FL shortened to
``--distill-steps`` (its cost is not what is measured) and a small dev set. For every round:
the round's time, the time to capture the checkpoint (copying the global and server state, the
RNGs and the records) and to write it (safetensors into a temporary file, fsync, rename, fsync
of the folder), and the file's size. Ratios are to the round time of the same run.

    .venv/bin/python bench/checkpoint_cost.py --out bench/results/checkpoint_cost
    .venv/bin/python bench/checkpoint_cost.py --methods fedpetuning fedavg --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"fedavg": "fedavg_sst2.toml", "fedpetuning": "fedpetuning_sst2.toml",
           "fedpft": "fedpft_sst2.toml", "fedot": "fedot_sst2.toml",
           "heads": "heads_sst2.toml", "raffm": "raffm_sst2.toml"}


def measure(method: str, args) -> dict:
    from fedslice.api import setup
    from fedslice.experiment import load_config
    from fedslice.run import checkpoint, engine
    from fedslice.run.session import Rounds

    overrides = [f"federation.rounds={args.rounds}", f"threads={args.threads}",
                 "data.max_dev_examples=64", "evaluation.every=1000", "output.checkpoint_every=1",
                 "federation.selection=uniform"]
    if method in ("fedpft", "fedot"):
        overrides += [f"method.distill.steps={args.distill_steps}", "method.distill.cache_dir="]
    cfg = load_config(REPO / "configs" / CONFIGS[method], overrides)
    m, data = setup(cfg)
    times: list[dict] = []
    folder = Path(tempfile.mkdtemp(prefix="fedslice-ckpt-"))

    class Timed(Rounds):
        """Every round checkpointed as a run session does, capture and write timed apart."""

        def round_done(self, server_round, state, record, selector):
            super().round_done(server_round, state, record, selector)
            t0 = time.perf_counter()
            ckpt = checkpoint.capture(server_round, cfg.model_dump(mode="json"), m, selector,
                                      state, self.records, self.elapsed())
            t1 = time.perf_counter()
            path = checkpoint.write_checkpoint(folder, ckpt)
            times.append({"capture_s": t1 - t0, "write_s": time.perf_counter() - t1,
                          "mb": path.stat().st_size / 2**20,
                          "state_mb": sum(t.numel() * t.element_size()
                                          for t in ckpt.state.values()) / 2**20})

    _, records, _ = engine.Simulation(cfg, m, data).run(Timed(cfg, m))
    rows = []
    for r, t in zip(records, times):
        total = t["capture_s"] + t["write_s"]
        rows.append({"round": r["round"], "round_s": r["round_time_s"], **t, "checkpoint_s": total,
                     "ratio": total / r["round_time_s"]})
    later = rows[1:] or rows  # round 1 includes first-touch costs
    return {"method": method, "rounds": rows,
            "checkpoint_mb": later[-1]["mb"], "state_mb": later[-1]["state_mb"],
            "checkpoint_s": statistics.median(x["checkpoint_s"] for x in later),
            "round_s": statistics.median(x["round_s"] for x in later),
            "ratio": statistics.median(x["ratio"] for x in later)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=list(CONFIGS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--distill-steps", type=int, default=5)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "checkpoint_cost")
    args = p.parse_args()
    os.chdir(REPO)  # the configs' relative data paths
    args.out.mkdir(parents=True, exist_ok=True)
    load = [os.getloadavg()]
    results = []
    for method in args.methods:
        results.append(measure(method, args))
        load.append(os.getloadavg())
        print(json.dumps({k: v for k, v in results[-1].items() if k != "rounds"}), flush=True)
    lines = ["| method | checkpoint (MB) | global state (MB) | capture + write (s) | round (s) | checkpoint / round |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['method']} | {r['checkpoint_mb']:.2f} | {r['state_mb']:.2f} | "
                     f"{r['checkpoint_s']:.3f} | {r['round_s']:.1f} | {100 * r['ratio']:.2f}% |")
    report = {"command": " ".join(sys.argv), "machine": platform.platform(), "cpus": os.cpu_count(),
              "threads": args.threads, "loadavg": load, "results": results}
    (args.out / "checkpoint_cost.json").write_text(json.dumps(report, indent=2))
    (args.out / "checkpoint_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
