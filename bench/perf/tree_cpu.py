"""CPU seconds of a command's whole process tree (every descendant, also those that leave the
tree's session or are re-parented): psutil samples the tree every ``--every`` s and counts each
process at its last sample (user + system); the command's own reaped children are added from
``RUSAGE_CHILDREN`` where larger. Prints one line: ``tree_cpu_s=... wall_s=... procs=...``.

    python bench/perf/tree_cpu.py [--every 0.3] [--out FILE.json] -- CMD ARGS...

A measure of test/benchmark work on a shared machine (load inflates it less than wall time); not
a timing.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import psutil


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--every", type=float, default=0.3)
    ap.add_argument("--out")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd
    start = time.monotonic()
    popen = subprocess.Popen(cmd)
    root = psutil.Process(popen.pid)
    seen: dict[tuple[int, float], tuple[str, float]] = {}  # (pid, create time) -> (name, cpu)
    known: dict[int, psutil.Process] = {popen.pid: root}

    def sample() -> None:
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            procs = []
        for p in procs:
            known.setdefault(p.pid, p)
        for pid, p in list(known.items()):
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    seen[(pid, p.create_time())] = (" ".join(p.cmdline()[:3])[:120], t.user + t.system)
            except psutil.Error:
                known.pop(pid, None)

    while popen.poll() is None:
        sample()
        time.sleep(args.every)
    wall = time.monotonic() - start
    tree = sum(c for _, c in seen.values())
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    reaped = ru.ru_utime + ru.ru_stime
    total = max(tree, reaped)
    print(f"tree_cpu_s={total:.1f} sampled={tree:.1f} reaped={reaped:.1f} wall_s={wall:.1f} "
          f"procs={len(seen)} rc={popen.returncode}", file=sys.stderr)
    if args.out:
        by: dict[str, float] = {}
        for name, c in seen.values():
            by[name] = by.get(name, 0.0) + c
        with open(args.out, "w") as f:
            json.dump({"tree_cpu_s": total, "sampled": tree, "reaped": reaped, "wall_s": wall,
                       "cmd": cmd, "by_process": dict(sorted(by.items(), key=lambda kv: -kv[1]))},
                      f, indent=1)
    return popen.returncode


if __name__ == "__main__":
    sys.exit(main())
