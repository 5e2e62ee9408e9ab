"""One run of bench/perf/minilm_sst2.toml (fedslice's defaults) with each process of its tree
sampled every 100 ms from /proc/<pid>/smaps_rollup: the tree's peak PSS, each process's PSS and
private memory at that moment, each worker's largest private memory, the workers' CPU time
(user and system, summed over every round's workers) and the engine's round times. ``SRC`` is
the fedslice source tree to run (a paired A/B runs two, alternated):

    .venv/bin/python bench/perf/tree_pss.py SRC OUT.json [--set key=value ...]

e.g. old against new: ``git archive OLD src | tar -x -C /tmp/old``, then alternate
``tree_pss.py /tmp/old/src old_1.json`` and ``tree_pss.py src new_1.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TICK = os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    try:
        kids = [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return [d for k in kids for d in (k, *children(k))]


def rollup(pid: int) -> dict | None:
    """smaps_rollup's fields (MB) and the process's user and system CPU seconds."""
    d = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            p = line.split()
            if len(p) >= 3 and p[-1] == "kB":
                d[p[0].rstrip(":")] = int(p[1]) / 1024
        st = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    d["utime"], d["stime"] = int(st[11]) / TICK, int(st[12]) / TICK
    return d


def main() -> None:
    src, out, sets = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "fedslice.cli", "run", "bench/perf/minilm_sst2.toml", "--out", tmp, "-q",
               "--set", "output.name=x", *[a for s in sets if s != "--set" for a in ("--set", s)]]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(Path(src).resolve())},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        samples, cpu = [], {}
        while proc.poll() is None:
            t = time.perf_counter() - t0
            procs = {}
            for pid in (proc.pid, *children(proc.pid)):
                r = rollup(pid)
                if r:
                    procs[pid] = r
                    if pid != proc.pid:
                        cpu[pid] = (r["utime"], r["stime"])
            samples.append((t, procs))
            time.sleep(0.1)
        tail = proc.stdout.read()[-1500:]
        wall = time.perf_counter() - t0
        metrics = Path(tmp, "x", "metrics.jsonl")
        rounds = [json.loads(l)["round_time_s"] for l in metrics.read_text().splitlines()] if metrics.exists() else []
    t_peak, peak = max(((t, pr) for t, pr in samples), key=lambda s: sum(v["Pss"] for v in s[1].values()))
    worker_private = {}
    for _, pr in samples:
        for pid, v in pr.items():
            if pid != proc.pid:
                worker_private[pid] = max(worker_private.get(pid, 0), v.get("Private_Dirty", 0))
    res = {"src": src, "sets": sets, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rc": proc.returncode,
           "loadavg_end": os.getloadavg(), "wall_s": wall, "round_times_s": rounds,
           "steady_round_s": statistics.median(rounds[1:]) if len(rounds) > 1 else None,
           "pss_peak_mb": round(sum(v["Pss"] for v in peak.values())), "peak_at_s": round(t_peak, 1),
           "at_peak": {("main" if pid == proc.pid else f"worker {pid}"): {k: round(peak[pid].get(k, 0))
                       for k in ("Pss", "Rss", "Private_Dirty", "Shared_Dirty", "Shared_Clean")} for pid in peak},
           "workers_private_max_mb": sorted((round(v) for v in worker_private.values()), reverse=True),
           "workers_user_s": round(sum(u for u, _ in cpu.values()), 2),
           "workers_sys_s": round(sum(s for _, s in cpu.values()), 2), "tail": tail}
    out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "tail"}))


if __name__ == "__main__":
    main()
