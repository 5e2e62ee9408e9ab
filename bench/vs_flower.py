"""fedslice against Flower 1.41's simulation on equal work (issue 22, target 4).

The workload (bench/perf/minilm_sst2.toml): MiniLM-L6 + LoRA r16 on q/v and the classifier,
SST-2, 100 IID clients, 10 per round, 8 local steps x 32 sentences, max length 64, 3 rounds.
Flower runs a ClientApp written the usual way (bench/perf/flower_baseline.py: HF + peft, padded
batches, AdamW; ``flower-gbl``: the same with batches of similar length, as HF's
``group_by_length`` makes them; Ray with one CPU per actor, as many actors as cores). fedslice runs:

* ``sequential``: one client after another at all cores' threads, padded batches
  (``group_by_length = false``, ``compute.workers = 1``): the equal padded work of Flower's;
* ``workers, padded``: the default concurrency (one worker process per core), padded batches;
* ``default``: fedslice's defaults (workers + length-grouped batches);
* ``default-bf16``: the same with bf16 autocast (this CPU has AVX512-BF16; not the default).

Each runs in a fresh process; round times are the engine's (Flower: configure -> aggregate), the
steady round is the median of rounds 2..R; memory is summed over each run's process tree (RSS,
and PSS which counts pages shared by forked workers once). Run on a quiet machine:

    .venv/bin/python bench/vs_flower.py [--rounds 3] [--only flower,default]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "perf"))
from common import ROOT, machine, median, python, run_measured, save  # noqa: E402

CONFIG = "bench/perf/minilm_sst2.toml"
VARIANTS = {
    "sequential": ["compute.workers=1", "federation.group_by_length=false"],
    "workers-padded": ["federation.group_by_length=false"],
    "default": [],
    "default-bf16": ['compute.precision="bf16"'],
}


def run_fedslice(name: str, sets: list[str], rounds: int, out: Path) -> dict:
    args = [python(), "-m", "fedslice.cli", "run", CONFIG, "--out", str(out), "-q",
            "--set", f"federation.rounds={rounds}", "--set", f"output.name={name}"]
    for s in sets:
        args += ["--set", s]
    r = run_measured(args)
    run = out / name
    metrics = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()] if run.exists() else []
    summary = json.loads((run / "summary.json").read_text()) if run.exists() else {}
    return {**r, "round_times_s": [m["round_time_s"] for m in metrics],
            "client_mode": [m.get("client_mode") for m in metrics],
            "test_accuracy": summary.get("test_accuracy")}


def run_flower(rounds: int, out: Path, group_by_length: bool = False) -> dict:
    tag = "flower-gbl" if group_by_length else "flower"
    res, mark = out / f"{tag}.json", out / f"{tag}-first-step"
    t0 = time.time()
    r = run_measured([python(), "bench/perf/flower_baseline.py", str(res), str(rounds)],
                     env={"FLOWER_BENCH_FIRST_STEP": str(mark),
                          "FLOWER_BENCH_GROUP_BY_LENGTH": "1" if group_by_length else "0",
                          "PYTHONPATH": str(ROOT / "src") + ":" + str(ROOT / "bench" / "perf")})
    got = json.loads(res.read_text()) if res.exists() else {}
    start = float(mark.read_text()) - t0 if mark.exists() else None
    return {**r, **got, "startup_s": start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="flower,flower-gbl," + ",".join(VARIANTS))
    ap.add_argument("--name", default="vs_flower", help="results file bench/results/perf/NAME.json")
    args = ap.parse_args()
    info = machine()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only.split(","):
            t = time.strftime("%H:%M:%S")
            rows[name] = run_flower(args.rounds, Path(tmp), name == "flower-gbl") \
                if name.startswith("flower") else run_fedslice(name, VARIANTS[name], args.rounds, Path(tmp))
            r = rows[name]
            r["steady_round_s"] = median(r.get("round_times_s", [])[1:])
            print(f"{t} {name}: rc={r['rc']} steady round {r['steady_round_s']} s, rounds "
                  f"{[round(x, 1) for x in r.get('round_times_s', [])]}, test acc {r.get('test_accuracy')}, "
                  f"RSS {r['rss_peak_mb']:.0f} MB, PSS {r['pss_peak_mb']:.0f} MB, wall {r['wall_s']:.0f} s",
                  flush=True)
            if r["rc"]:
                print(r["tail"])
    info["loadavg_end"] = __import__("os").getloadavg()[0]
    for ref in ("flower", "flower-gbl"):
        base = rows.get(ref, {}).get("steady_round_s")
        for name, r in rows.items():
            if base and r.get("steady_round_s") and not name.startswith("flower"):
                r[f"speedup_vs_{ref}"] = base / r["steady_round_s"]
                print(f"{name}: {r[f'speedup_vs_{ref}']:.2f}x {ref}'s steady round")
    print("saved", save(args.name, {"machine": info, "rounds": args.rounds, "runs": rows}))


if __name__ == "__main__":
    main()
