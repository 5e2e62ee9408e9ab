"""Start-up anatomy (issue 22, target 5): process start -> first local training step of the
workload (bench/perf/minilm_sst2.toml), phase by phase, each in a fresh process
(bench/perf/startup_probe.py): interpreter, imports, reading the data, loading the model,
tokenizing (or reading the token cache) and partitioning, building the method, the first step.
One cold run (an empty cache folder: the data is tokenized) then ``--repeats`` warm runs
(medians). Also lists whether flwr, ray, datasets or matplotlib were imported.

Alongside, alternating with the warm runs, each in a fresh process (issue 36, target 3): a bare
``python -c "import torch"`` and ``python -c "import fedslice.api"``; the ratios of the API
import and of the whole start-up (process start -> first step) to the bare torch import.

    .venv/bin/python bench/startup.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "perf"))
from common import ROOT, machine, python, save  # noqa: E402

PHASES = ("python", "import", "data_read", "model", "data_tokenize_partition", "method", "first_step", "total")


def probe(cache: str, config: str) -> dict:
    out = subprocess.run([python(), "bench/perf/startup_probe.py", config], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "FEDSLICE_CACHE_DIR": cache})
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def import_seconds(module: str) -> float:
    """Wall time of ``python -c "import MODULE"`` in a fresh process (interpreter included)."""
    t = time.perf_counter()
    subprocess.run([python(), "-c", f"import {module}"], cwd=ROOT, check=True)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--config", default="bench/perf/minilm_sst2.toml")
    args = ap.parse_args()
    info = machine()
    with tempfile.TemporaryDirectory() as cache:
        cold = probe(cache, args.config)
        warm, imports = [], {"torch": [], "fedslice.api": []}
        for _ in range(args.repeats):  # alternating: the same load for all three
            warm.append(probe(cache, args.config))
            for module in imports:
                imports[module].append(import_seconds(module))
    med = {k: statistics.median(w[k] for w in warm) for k in PHASES}
    bare = {m: statistics.median(v) for m, v in imports.items()}
    print(f"{'phase':26} {'cold':>7} {'warm (median)':>14}")
    for k in PHASES:
        print(f"{k:26} {cold[k]:7.2f} {med[k]:14.2f}")
    print("imported:", {m: v for m, v in warm[-1]["modules"].items() if v})
    ratios = {"api_import_vs_torch": bare["fedslice.api"] / bare["torch"],
              "startup_vs_torch": med["total"] / bare["torch"]}
    print(f"python -c 'import torch' {bare['torch']:.2f} s, 'import fedslice.api' "
          f"{bare['fedslice.api']:.2f} s ({ratios['api_import_vs_torch']:.2f}x, target <= 1.5x); "
          f"start-up {med['total']:.2f} s ({ratios['startup_vs_torch']:.2f}x, target <= 2x)")
    info["loadavg_end"] = os.getloadavg()[0]
    print("saved", save("startup", {"machine": info, "cold": cold, "warm": warm, "warm_median": med,
                                    "imports": imports, "imports_median": bare, "ratios": ratios}))


if __name__ == "__main__":
    main()
