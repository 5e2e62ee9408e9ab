"""Shared helpers of the performance benchmarks (bench/vs_flower.py, bench/decoder_client.py,
bench/startup.py, bench/memory.py, bench/curves.py): run a command in a fresh process while
sampling the memory of its whole process tree, the machine's description, result files."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "perf"


def machine() -> dict:
    """What the figures were measured on, and how busy it was."""
    import torch

    return {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": platform.processor() or platform.machine(),
            "cores": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "python": platform.python_version(), "loadavg_start": os.getloadavg()[0]}


class TreeMemory:
    """Peak RSS and PSS summed over a process and all its descendants, sampled every
    ``interval_s`` (RSS counts a page shared by forked workers once per process; PSS divides it
    among them, so PSS is the memory the tree really holds)."""

    def __init__(self, pid: int, interval_s: float = 0.25):
        self.pid, self.interval_s = pid, interval_s
        self.rss_peak = self.pss_peak = 0
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.perf_counter()
        while not self._stop.is_set():
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                return
            rss = pss = 0
            for p in procs:
                try:
                    info = p.memory_full_info()
                    rss += info.rss
                    pss += getattr(info, "pss", info.rss)
                except psutil.Error:
                    pass
            self.rss_peak, self.pss_peak = max(self.rss_peak, rss), max(self.pss_peak, pss)
            self.samples.append((time.perf_counter() - t0, rss, pss))
            self._stop.wait(self.interval_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def run_measured(cmd: list[str], env: dict | None = None, timeout: float = 3600,
                 memory: bool = True) -> dict:
    """Run ``cmd`` in a fresh process; wall time, exit code, tree memory peaks (MB), output tail.
    ``memory=False``: no memory sampling (no peaks or curve in the result) for a caller that
    reads none: each sample reads the smaps of every process of the tree (~14 CPU-ms per
    torch process, 4 samples a second), CPU taken from the command it measures."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if not memory:
        out, _ = proc.communicate(timeout=timeout)
        return {"wall_s": time.perf_counter() - t0, "rc": proc.returncode, "tail": out[-3000:]}
    with TreeMemory(proc.pid) as mem:
        out, _ = proc.communicate(timeout=timeout)
    return {"wall_s": time.perf_counter() - t0, "rc": proc.returncode,
            "rss_peak_mb": mem.rss_peak / 2**20, "pss_peak_mb": mem.pss_peak / 2**20,
            "memory_curve": [(round(t, 2), round(r / 2**20), round(p / 2**20)) for t, r, p in mem.samples[::4]],
            "tail": out[-3000:]}


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def python() -> str:
    return sys.executable


def save(name: str, data: dict) -> Path:
    """Write ``bench/results/perf/<name>.json`` (the raw figures behind a BENCHMARKS.md table)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, default=str))
    return path
