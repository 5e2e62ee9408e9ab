"""The time-stamped lines of a ``bench/secagg_federation.py --flower-debug --keep-logs`` run on
the bench's timeline (seconds from the federation's start, as ``clientapp_timeline``): every
process's log (SuperLink, SuperNodes with their SuperExecs and ClientApps, the ServerApp's run
log), merged and sorted, filtered by a regular expression, or counted per kind of request
(``--requests``: the SuperLink's HTTP access lines, e.g. ``/v1/fleet/push-object``).

    python bench/flower_log_events.py bench/results/sec9/minilm_fedpetuning_secure.json \\
        bench/results/sec9/logs_minilm_fedpetuning_secure --from 200 --to 270 \\
        --match "Sending: train|replies to the training|unmasking asked"
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import re
from pathlib import Path

STAMP = re.compile(r"(\d{4}-\d\d-\d\d)[ T](\d\d:\d\d:\d\d)[,.](\d{3})")
COLOR = re.compile(r"\x1b\[[0-9;]*m")
REQUEST = re.compile(r'"POST (\S+) HTTP')


def events(logs: Path, t0_unix: float) -> list[tuple[float, str, str]]:
    """(seconds from t0, log name, text) of every time-stamped line (Flower's DEBUG format and
    uvicorn's access lines, both UTC)."""
    out = []
    for f in sorted(logs.glob("*.log")):
        for line in f.read_text(errors="replace").splitlines():
            line = COLOR.sub("", line)
            m = STAMP.search(line)
            if m:
                t = dt.datetime.fromisoformat(f"{m[1]}T{m[2]}.{m[3]}").replace(
                    tzinfo=dt.timezone.utc).timestamp() - t0_unix
                out.append((t, f.stem, line[m.end():].strip(" :Z")))
    return sorted(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result", type=Path, help="the bench's JSON (its t0_unix)")
    p.add_argument("logs", type=Path, help="the kept logs' folder")
    p.add_argument("--variant", default=None, help="the result's variant (default: the first)")
    p.add_argument("--from", dest="lo", type=float, default=float("-inf"))
    p.add_argument("--to", dest="hi", type=float, default=float("inf"))
    p.add_argument("--match", default=None, help="regular expression a line must match")
    p.add_argument("--requests", action="store_true", help="count the HTTP requests per path")
    args = p.parse_args()
    results = json.loads(args.result.read_text())["results"]
    r = next(x for x in results if args.variant in (None, x["variant"]))
    rows = [e for e in events(args.logs, r["processes"]["t0_unix"]) if args.lo <= e[0] <= args.hi]
    if args.requests:
        count = collections.Counter(m[1] for _, _, text in rows if (m := REQUEST.search(text)))
        for path, n in count.most_common():
            print(f"{n:7d} {path}")
        return 0
    for t, who, text in rows:
        if args.match is None or re.search(args.match, text):
            print(f"{t:8.2f} {who:12s} {text[:160]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
