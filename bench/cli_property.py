"""Benchmark (issue 37, part 4): the property-based CLI test at a larger count than CI's.

Runs ``tests/test_cli_property.py`` (broken config files, data files and run folders through
``run``, ``validate``, ``compare``, ``export``, ``predict``, ``evaluate``) with
``FEDSLICE_CLI_EXAMPLES`` examples per case (each defect x file format x command; 20 times as
many per command for run folders), and writes the examples run, passed and invalid per family
and per case, the failing cases (none expected) and the wall time:

    .venv/bin/python bench/cli_property.py --examples 10 --out bench/results/cli_property
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=10, help="examples per case")
    p.add_argument("--out", default="bench/results/cli_property")
    args = p.parse_args()
    env = {**os.environ, "FEDSLICE_CLI_EXAMPLES": str(args.examples)}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/test_cli_property.py", "-q",
                           "-p", "no:cacheprovider", "--hypothesis-show-statistics",
                           "-W", "ignore::hypothesis.errors.HypothesisWarning"],
                          cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    cases = {}
    for name, body in re.findall(r"test_cli_property\.py::(\S+?):\n(.*?)(?=\n\S|\Z)", proc.stdout, re.S):
        m = re.search(r"(\d+) passing, (\d+) failing, and (\d+) invalid", body)
        if m:
            cases[name] = dict(zip(("passing", "failing", "invalid"), map(int, m.groups())))
    families: dict[str, dict[str, int]] = {}
    for name, counts in cases.items():
        fam = families.setdefault(name.split("[")[0], {"cases": 0, "passing": 0, "failing": 0,
                                                       "invalid": 0})
        fam["cases"] += 1
        for k, v in counts.items():
            fam[k] += v
    result = {"examples_per_case": args.examples, "families": families,
              "failing_cases": sorted(n for n, c in cases.items() if c["failing"]),
              "examples_run": sum(f["passing"] + f["failing"] for f in families.values()),
              "failing": sum(f["failing"] for f in families.values()),
              "pytest_rc": proc.returncode, "wall_s": round(wall, 1),
              "summary": proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "",
              "python": platform.python_version(), "cpus": os.cpu_count()}
    out = REPO / args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps({**result, "cases": cases}, indent=2) + "\n")
    if proc.returncode != 0:
        (out / "pytest.log").write_text(proc.stdout[-20000:] + proc.stderr[-5000:])
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
