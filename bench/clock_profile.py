"""Benchmark (issue 59 target: the simulated clock adds < 2% to a run's wall time), measured
directly: one run of bench/clock_overhead.py's config with devices under cProfile, and the
time of every call into fedslice.fl.clock and fedslice.fl.devices from outside them (with
everything those calls call), against the run. bench/clock_overhead.py's A/B of medians cannot
resolve 2%: a run with devices selects other clients, so its batches differ (+-20% per run).

    PYTHONPATH=src OMP_NUM_THREADS=2 python bench/clock_profile.py
"""
import argparse
import cProfile
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import clock_overhead as co  # noqa: E402


def main() -> float:
    args = argparse.Namespace(reps=1, threads=2, clients=20, per_round=5, rounds=3, local_steps=2,
                              batch_size=8, max_length=48, dev_examples=64, data="sst2", model="minilm")
    co.one_run(args, 0, True)  # warm-up
    pr = cProfile.Profile()
    pr.enable()
    total, rounds = co.one_run(args, 1, True)
    pr.disable()
    st = pstats.Stats(pr)
    def ours(f: str) -> bool:
        return "fedslice/fl/clock.py" in f or "fedslice/fl/devices.py" in f

    clock, entries = 0.0, []
    for (f, line, name), (cc, nc, tt, ct, callers) in st.stats.items():
        if not ours(f):
            continue
        outside = {c: v for c, v in callers.items() if not ours(c[0])}
        if outside:  # an entry point from the engine: its time with everything it calls
            t = sum(v[3] for v in outside.values())
            clock += t
            entries.append((t, name))
    for t, name in sorted(entries, reverse=True)[:6]:
        print(f"  {name}: {t*1000:.2f} ms")
    print(f"run total {total:.3f} s, rounds {rounds:.3f} s (under the profiler); the clock's calls "
          f"(fl/clock.py, fl/devices.py): {clock * 1000:.2f} ms = {100 * clock / total:.3f}% of the run")
    return clock / total


if __name__ == "__main__":
    main()
