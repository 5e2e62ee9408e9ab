"""The key stages of a ``bench/secagg_federation.py`` run, read from its JSON: the light (QUERY)
ClientApp processes of ``clientapp_timeline`` clustered by start (a gap of more than ``--gap``
seconds after the last one ended starts a new stage: partition query, share keys, unmasking,
end of run), and per cluster its span (first start -> last end), how its starts spread, and its
CPU seconds; with each round's stage seconds (``secagg_*_s``), a stage's seconds minus its
cluster's span is the time spent waiting at its edges (the SuperNodes' pull, the SuperExecs'
poll, the replies' push and the ServerApp's pull).

Between two clusters (a light stage, or the TRAIN ClientApps) no ClientApp runs: each such gap
is printed with the CPU seconds every kind of process spent in it (``cpu_s_series``, recorded
since sec9), which tells a gap that computes (whose CPU) from one that waits.

    python bench/secagg_timeline.py bench/results/sec8/smollm2_raffm-heads_secure.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def stages(timeline: list[list[float]], gap: float, heavy_mb: float) -> list[list[list[float]]]:
    """Light ClientApps ([first, last, cpu_s, rss_mb]) grouped into stages by start time."""
    out: list[list[list[float]]] = []
    for x in sorted(t for t in timeline if t[3] < heavy_mb):
        if out and x[0] - max(y[1] for y in out[-1]) <= gap:
            out[-1].append(x)
        else:
            out.append([x])
    return out


def cpu_between(series: dict[str, list[list[float]]], lo: float, hi: float) -> dict[str, float]:
    """CPU seconds each kind of process spent between ``lo`` and ``hi`` (seconds from the
    federation's start; each series is cumulative, sampled every 0.5 s)."""
    def at(points: list[list[float]], t: float) -> float:
        below = [c for s, c in points if s <= t]
        return below[-1] if below else 0.0

    return {k: round(at(v, hi) - at(v, lo), 1) for k, v in sorted(series.items())
            if at(v, hi) - at(v, lo) > 0.05}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result", type=Path)
    p.add_argument("--gap", type=float, default=2.0)
    p.add_argument("--heavy-mb", type=float, default=300.0)
    args = p.parse_args()
    for r in json.loads(args.result.read_text())["results"]:
        pr = r.get("processes") or {}
        print(f"{r['variant']}: CPU-s by process kind {pr.get('cpu_s_by_kind')}")
        timeline = pr.get("clientapp_timeline") or []
        for s in stages(timeline, args.gap, args.heavy_mb):
            first, last, starts = min(x[0] for x in s), max(x[1] for x in s), [x[0] for x in s]
            print(f"  light stage: {len(s)} ClientApps, {first:.1f} -> {last:.1f} s (span "
                  f"{last - first:.1f} s, starts spread over {max(starts) - min(starts):.1f} s), "
                  f"{sum(x[2] for x in s):.1f} CPU-s")
        heavy = [t for t in timeline if t[3] >= args.heavy_mb]
        if heavy:
            print(f"  TRAIN: {len(heavy)} ClientApps, {min(x[0] for x in heavy):.1f} -> "
                  f"{max(x[1] for x in heavy):.1f} s, {sum(x[2] for x in heavy):.1f} CPU-s")
        series = pr.get("cpu_s_series")
        spans = sorted([(min(x[0] for x in s), max(x[1] for x in s))
                        for s in stages(timeline, args.gap, args.heavy_mb)] +
                       ([(min(x[0] for x in heavy), max(x[1] for x in heavy))] if heavy else []))
        for (_, end), (start, _) in zip(spans, spans[1:]):
            if series and start > end:
                print(f"  no ClientApp {end:.1f} -> {start:.1f} s ({start - end:.1f} s): CPU-s "
                      f"{cpu_between(series, end, start)}")
        for x in r.get("rounds", []):
            print(f"  round {x['round']}: {x['time_s']:.1f} s; stage seconds setup / share keys / "
                  f"unmask: {x.get('secagg_setup_s')} / {x.get('secagg_share_keys_s')} / "
                  f"{x.get('secagg_unmask_s')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
