"""Packing (issue 36, target 1): the steady round of the workload bench/perf/minilm_sst2.toml with
padded batches (``federation.pack = false``, the default before packing) and packed ones (the default),
at 100 and 1,000 clients (equal steps per round), one run after the other in one invocation;
the machine's load before and after each run. Steady round = median of rounds 2..R.
Writes bench/results/perf/packing.json.

    .venv/bin/python bench/packing.py                 # 3 rounds per run
    .venv/bin/python bench/packing.py --rounds 4 --populations 100 1000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "perf"))
from common import machine, python, run_measured, save  # noqa: E402

CONFIG = "bench/perf/minilm_sst2.toml"


def run(out: Path, name: str, population: int, pack: bool, rounds: int, extra: list[str]) -> dict:
    args = [python(), "-m", "fedslice.cli", "run", CONFIG, "-q", "--out", str(out),
            "--set", f"output.name={name}", "--set", f"federation.rounds={rounds}",
            "--set", "evaluation.every=100", "--set", "data.max_test_examples=64",
            "--set", f"federation.num_clients={population}",
            "--set", f"federation.pack={'true' if pack else 'false'}"]
    for s in extra:
        args += ["--set", s]
    load0 = os.getloadavg()[0]
    r = run_measured(args)
    load1 = os.getloadavg()[0]
    metrics = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    times = [m["round_time_s"] for m in metrics if "round_time_s" in m]
    return {"population": population, "pack": pack, "round_s": times,
            "steady_s": statistics.median(times[1:]) if len(times) > 1 else times[0],
            "pss_peak_mb": r["pss_peak_mb"], "load_before": load0, "load_after": load1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--populations", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--set", action="append", default=[], help="extra --set for every run")
    args = ap.parse_args()
    res = {"machine": machine(), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for population in args.populations:
            for pack in (False, True):
                name = f"p{population}-{'packed' if pack else 'padded'}"
                row = run(Path(tmp), name, population, pack, args.rounds, args.set)
                res["runs"].append(row)
                print(json.dumps(row), flush=True)
    for population in args.populations:
        pad, packed = (next(r for r in res["runs"] if r["population"] == population and r["pack"] == p)
                       for p in (False, True))
        print(f"{population} clients: padded {pad['steady_s']:.1f} s, packed {packed['steady_s']:.1f} s, "
              f"{pad['steady_s'] / packed['steady_s']:.2f}x (load {pad['load_before']:.1f}-{packed['load_after']:.1f})")
    save("packing", res)


if __name__ == "__main__":
    main()
