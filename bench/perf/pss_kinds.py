"""A fedslice run with each process of its tree sampled from /proc: PSS by process and by kind
of mapping (issue 34: why a run over an int8 base has a higher tree PSS than fp32).

Every ``--every`` seconds (default 0.5) each process's ``/proc/<pid>/smaps`` is read and its
mappings summed by kind: ``weights`` (a ``.safetensors``/``.bin`` file: transformers
memory-maps the weight file), ``libs`` (``.so`` files), ``heap`` (glibc's ``[heap]``), ``anon``
(anonymous maps: glibc's large allocations, thread arenas, torch's own), ``other`` (stacks,
other files). Kept: the tree's PSS peak (with each process's breakdown at that moment), the
main process's breakdown at each sample (its timeline, thinned), and each worker's largest
private memory::

    PYTHONPATH=src .venv/bin/python bench/perf/pss_kinds.py CONFIG OUT.json [--set key=value ...]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tree_pss import children  # noqa: E402  (the process tree's pids, depth first)

ROOT = Path(__file__).resolve().parents[2]
PAGE = os.sysconf("SC_PAGE_SIZE")
FIELDS = ("Rss", "Pss", "Pss_Anon", "Pss_File", "Shared_Clean", "Shared_Dirty", "Private_Clean",
          "Private_Dirty", "Anonymous")


def kind(path: str) -> str:
    if path.endswith((".safetensors", ".bin", ".pt")):
        return "weights"
    if ".so" in path.rsplit("/", 1)[-1]:
        return "libs"
    if path == "[heap]":
        return "heap"
    if path == "" or path.startswith("[anon"):
        return "anon"
    return "other"


def smaps(pid: int) -> dict | None:
    """MB by kind of mapping and field, plus the count of anonymous maps >= 1 MB."""
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return None
    out: dict[str, dict[str, float]] = {}
    cur = None
    big_anon = 0
    ranges: list[tuple[str, int, int]] = []
    for line in text.splitlines():
        head = line.split(None, 5)
        if not head:
            continue
        if "-" in head[0] and not head[0].endswith(":"):  # a mapping's header line
            path = head[5].strip() if len(head) > 5 else ""
            cur = out.setdefault(kind(path), {f: 0.0 for f in FIELDS})
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            big_anon += kind(path) == "anon" and (hi - lo) >= 2**20
            ranges.append((kind(path), lo, hi))
            continue
        name = head[0].rstrip(":")
        if cur is not None and name in cur:
            cur[name] += int(head[1]) / 1024
    res = {k: {f: round(v, 1) for f, v in d.items()} for k, d in out.items()}
    res["total"] = {f: round(sum(d[f] for d in out.values()), 1) for f in FIELDS}
    res["big_anon_maps"] = big_anon
    return res, ranges


def frames(pid: int, ranges: list[tuple[str, int, int]]) -> dict[str, np.ndarray] | None:
    """The physical frame numbers of ``pid``'s resident pages, by kind of mapping (root only:
    /proc/<pid>/pagemap shows frame numbers to CAP_SYS_ADMIN)."""
    out: dict[str, list[np.ndarray]] = {}
    try:
        with open(f"/proc/{pid}/pagemap", "rb") as f:
            for k, lo, hi in ranges:
                if hi - lo > 2**36:  # a reservation, not memory
                    continue
                f.seek(lo // PAGE * 8)
                v = np.frombuffer(f.read((hi - lo) // PAGE * 8), dtype=np.uint64)
                v = v[(v >> np.uint64(63)) & np.uint64(1) == 1] & np.uint64((1 << 55) - 1)
                out.setdefault(k, []).append(v)
    except OSError:
        return None
    return {k: np.concatenate(v) for k, v in out.items()}


def unique_mb(per_proc: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """MB of distinct physical pages the processes map, by kind and in all: what the tree holds,
    each page once, however many processes (of the tree or outside it) map it."""
    kinds = {k for d in per_proc for k in d}
    res = {k: np.unique(np.concatenate([d[k] for d in per_proc if k in d])).size * PAGE / 2**20
           for k in kinds}
    res["total"] = sum(res.values())
    res["total_no_libs"] = res["total"] - res.get("libs", 0.0)
    return {k: round(v, 1) for k, v in res.items()}


def main() -> None:
    config, out, rest = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    every = 0.5
    if "--every" in rest:
        i = rest.index("--every")
        every = float(rest[i + 1])
        rest = rest[:i] + rest[i + 2:]
    sets = [a for s in rest if s != "--set" for a in ("--set", s)]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "fedslice.cli", "run", config, "--out", tmp, "-q",
               "--set", "output.name=x", *sets]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=os.environ, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        timeline, peak, upeak, workers = [], (0.0, -1.0, {}, {}), (0.0, -1.0, {}, 0.0, {}), {}
        while proc.poll() is None:
            t = time.perf_counter() - t0
            procs, pages = {}, {}
            for pid in (proc.pid, *children(proc.pid)):
                got = smaps(pid)
                r = got and got[0]
                if got and (fr := frames(pid, got[1])) is not None:
                    pages["main" if pid == proc.pid else f"worker {pid}"] = fr
                if r:
                    procs["main" if pid == proc.pid else f"worker {pid}"] = r
                    if pid != proc.pid:
                        w = workers.setdefault(pid, {})
                        for k, v in r.items():
                            if k == "big_anon_maps":
                                w[k] = max(w.get(k, 0), v)
                                continue
                            for f in ("Pss", "Private_Dirty", "Rss"):
                                w[f"{k}.{f}"] = max(w.get(f"{k}.{f}", 0.0), v[f])
            tree = sum(p["total"]["Pss"] for p in procs.values())
            uniq = unique_mb(list(pages.values())) if pages else {"total_no_libs": 0.0}
            main_uniq = unique_mb([pages["main"]]) if "main" in pages else {}
            if tree > peak[1]:
                peak = (t, tree, procs, uniq)
            if uniq["total_no_libs"] > upeak[1]:
                upeak = (t, uniq["total_no_libs"], uniq, tree, {n: p["total"]["Pss"] for n, p in procs.items()})
            if "main" in procs:
                timeline.append({"t": round(t, 1), "tree_pss": round(tree, 1), "n_workers": len(procs) - 1,
                                 "tree_unique": uniq, "main_unique": main_uniq,
                                 "workers": {n: {f: p["total"][f] for f in ("Pss", "Private_Dirty")}
                                             for n, p in procs.items() if n != "main"},
                                 "main": {k: (v if k == "big_anon_maps" else
                                              {f: v[f] for f in ("Pss", "Rss", "Private_Dirty", "Pss_Anon", "Pss_File")})
                                          for k, v in procs["main"].items()}})
            time.sleep(every)
        tail = proc.stdout.read()[-2000:]
        wall = time.perf_counter() - t0
        summary = Path(tmp, "x", "summary.json")
        summ = json.loads(summary.read_text()) if summary.exists() else {}
    res = {"config": config, "sets": rest, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "rc": proc.returncode, "load_end": os.getloadavg(), "wall_s": round(wall, 1),
           "tree_pss_peak_mb": round(peak[1], 1), "peak_at_s": round(peak[0], 1), "at_peak": peak[2],
           "unique_at_pss_peak": peak[3],
           "tree_unique_peak_mb": upeak[1], "unique_peak_at_s": round(upeak[0], 1), "unique_at_peak": upeak[2],
           "pss_at_unique_peak": round(upeak[3], 1), "pss_by_process_at_unique_peak": upeak[4],
           "workers_max": {str(k): v for k, v in workers.items()},
           "summary": {k: v for k, v in summ.items() if "memory" in k or "accuracy" in k},
           "timeline": timeline, "tail": tail}
    out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("rc", "wall_s", "tree_pss_peak_mb", "peak_at_s", "unique_at_pss_peak",
                                          "tree_unique_peak_mb", "unique_peak_at_s", "unique_at_peak",
                                          "pss_at_unique_peak", "pss_by_process_at_unique_peak")}))
    for name, p in peak[2].items():
        print(name, {k: (v if k == "big_anon_maps" else {f: v[f] for f in ("Pss", "Private_Dirty", "Shared_Clean", "Shared_Dirty")})
                     for k, v in p.items()})
    if proc.returncode:
        print(tail)


if __name__ == "__main__":
    main()
