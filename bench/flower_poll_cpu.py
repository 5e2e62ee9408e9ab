"""What an idle local Flower federation's polling costs: a ``LocalFederation`` of ``--nodes``
SuperNodes, left ``--settle`` s after its start (imports done), then the CPU seconds (user +
system) of each kind of process (SuperLink, SuperNodes, SuperExecs: the SuperLink's and one per
SuperNode) over ``--seconds`` s, per second. The SuperExecs ask their SuperNode for a task every
``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` s (Flower's default 1 s; set it in the environment to
compare), the SuperNodes the SuperLink every 3 s (fixed).

    FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.25 python bench/flower_poll_cpu.py --nodes 2
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import psutil

from fedslice.flower.local import LocalFederation


def cpu_by_process(roots: list[int]) -> dict[tuple[int, str], float]:
    """(pid, program) -> CPU seconds of ``roots`` and every process below them."""
    out = {}
    for pid in roots:
        try:
            procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            continue
        for p in procs:
            try:
                name = Path(" ".join(p.cmdline()[1:2])).name
                t = p.cpu_times()
                out[(p.pid, name)] = t.user + t.system
            except psutil.Error:
                pass
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--settle", type=float, default=20.0)
    p.add_argument("--seconds", type=float, default=30.0)
    args = p.parse_args()
    interval = os.environ.get("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "1.0 (default)")
    with LocalFederation(Path(tempfile.mkdtemp(prefix="fedslice-poll-")), args.nodes) as fed:
        time.sleep(args.settle)
        roots = [proc.pid for proc in fed.processes]
        before, t0 = cpu_by_process(roots), time.monotonic()
        time.sleep(args.seconds)
        after, dt = cpu_by_process(roots), time.monotonic() - t0
    kinds: dict[str, float] = {}
    for key, v in after.items():
        kinds[key[1]] = kinds.get(key[1], 0.0) + v - before.get(key, v)
    per_s = {k: round(v / dt, 4) for k, v in sorted(kinds.items())}
    print(f"SuperExec poll {interval} s, {args.nodes} SuperNodes: CPU-s per s {per_s}, "
          f"all {sum(per_s.values()):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
