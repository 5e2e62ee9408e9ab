"""Memory (issue 22, target 6) on the workload (bench/perf/minilm_sst2.toml), each part a fresh
process whose whole tree is sampled (RSS summed, and PSS: pages shared by forked workers once):

* ``workload``: peak memory of the 3-round run with fedslice's defaults and with one process,
  each also with ``compute.release_memory = true``.
* ``population``: 100 vs 1,000 clients (same rounds and clients per round); the bound is the
  100-client peak + 900 x (one client's trainable state + its tokenized data) + 5%.
* ``growth``: 20 rounds (2 local steps each), the process RSS at every round end.
* ``heap``: the workload with ``compute.release_memory`` false (glibc's own policy) and true,
  alternated (A B A B): peak RSS/PSS and wall time of each (a timing: run it on a quiet machine).
* ``thp``: the workload with torch's ``THP_MEM_ALLOC_ENABLE`` 0 and 1 (the CLI's default),
  alternated: peak memory and wall time (a timing: run it on a quiet machine).
* ``per_client``: a client's ``peak_rss_mb`` as a run reports it against that client's training
  alone in a fresh process (peak RSS during ``fit`` minus RSS after the model and data were
  loaded, sampled every 2 ms by the script): first alone, then again after five other clients
  trained in the same process (where a plain RSS delta reads ~0 because freed heap is reused).

    .venv/bin/python bench/memory.py [--parts workload population growth heap thp per_client]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "perf"))
from common import RESULTS, machine, median, python, run_measured, save  # noqa: E402

CONFIG = "bench/perf/minilm_sst2.toml"


def fedslice_run(out: Path, name: str, *sets: str, env: dict | None = None) -> dict:
    args = [python(), "-m", "fedslice.cli", "run", CONFIG, "-q", "--out", str(out), "--set", f"output.name={name}"]
    for s in sets:
        args += ["--set", s]
    r = run_measured(args, env=env)
    run = out / name
    r["metrics"] = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()] if run.exists() else []
    r["summary"] = json.loads((run / "summary.json").read_text()) if run.exists() else {}
    if r["rc"]:
        print(r["tail"])
    return r


ALONE = textwrap.dedent("""
    import json, sys, threading, psutil
    from fedslice.api import setup
    from fedslice.experiment import load_config
    from fedslice.run.engine import client_seed
    cfg = load_config(sys.argv[1], ["compute.workers=1"])
    method, data = setup(cfg)
    proc = psutil.Process()
    def fit(c):  # one client's training; what it reports, and RSS sampled here independently
        payload = method.strategy.configure_train(1, method.initial_state(), [c])[c]
        before = proc.memory_info().rss
        peak, stop = [before], threading.Event()
        def sample():
            while not stop.is_set():
                peak.append(proc.memory_info().rss); stop.wait(0.002)
        t = threading.Thread(target=sample); t.start()
        reply = method.fit(payload, data.client(c), client_seed(cfg.seed, 1, c))
        stop.set(); t.join()
        return (max(peak) - before) / 2**20, {k: reply.metrics.get(k) for k in
                                              ("memory_mb", "model_mb", "activation_mb", "peak_rss_mb")}
    alone, first = fit(0)  # client 0 alone: the first training of a fresh process
    later = [fit(c)[1]["peak_rss_mb"] for c in range(1, 6)]  # five more clients in the process
    again_sampled, again = fit(0)  # client 0 again, after them: as in a run
    print(json.dumps({"alone_training_rss_mb": alone, "reported": first,
                      "reported_in_run": again, "sampled_delta_in_run": again_sampled,
                      "later_clients_peak_rss_mb": later}))
""")



def ab(out: Path, part: str, repeats: int, a: tuple[str, dict], b: tuple[str, dict]) -> dict:
    """Setting ``a`` against ``b`` on the workload, alternated (a b a b ...): each run's peak
    RSS/PSS, wall time and test accuracy, the medians, and b's ratios to a (a timing: quiet
    machine). A setting is ``(name, {"sets": overrides, "env": environment})``."""
    runs: dict[str, list[dict]] = {a[0]: [], b[0]: []}
    for i in range(repeats):
        for name, how in (a, b):
            r = fedslice_run(out, f"{part}-{name}-{i}", *how.get("sets", ()), env=how.get("env"))
            runs[name].append({k: r[k] for k in ("rss_peak_mb", "pss_peak_mb", "wall_s")}
                              | {"test_accuracy": r["summary"].get("test_accuracy")})
            print(f"{part} {name} #{i}: RSS {r['rss_peak_mb']:.0f} MB, PSS {r['pss_peak_mb']:.0f} MB, "
                  f"{r['wall_s']:.1f} s", flush=True)
    med = {n: {k: median([x[k] for x in v]) for k in ("rss_peak_mb", "pss_peak_mb", "wall_s")}
           for n, v in runs.items()}
    got = {"runs": runs, "median": med,
           "pss_ratio": med[b[0]]["pss_peak_mb"] / med[a[0]]["pss_peak_mb"],
           "time_ratio": med[b[0]]["wall_s"] / med[a[0]]["wall_s"],
           "date": time.strftime("%Y-%m-%d %H:%M"), "loadavg_end": os.getloadavg()[0]}
    print(f"{part}: {b[0]} against {a[0]}: PSS x{got['pss_ratio']:.2f}, wall time "
          f"x{got['time_ratio']:.3f} (medians of {repeats})", flush=True)
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["workload", "population", "growth", "heap", "thp", "per_client"])
    ap.add_argument("--repeats", type=int, default=3, help="A/B pairs of the heap part")
    args = ap.parse_args()
    res = {"machine": machine()}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        if "workload" in args.parts:
            release = "compute.release_memory=true"
            for name, sets in (("default", ()), ("one-process", ("compute.workers=1",)),
                               ("release", (release,)), ("release-one-process", (release, "compute.workers=1"))):
                r = fedslice_run(out, name, *sets)
                res[f"workload-{name}"] = {k: r[k] for k in ("rss_peak_mb", "pss_peak_mb", "wall_s", "memory_curve")}
                print(f"workload {name}: RSS {r['rss_peak_mb']:.0f} MB, PSS {r['pss_peak_mb']:.0f} MB", flush=True)
        if "population" in args.parts:
            pop = {}
            for n in (100, 1000):
                r = fedslice_run(out, f"pop{n}", f"federation.num_clients={n}")
                pop[n] = r
                print(f"population {n}: RSS {r['rss_peak_mb']:.0f} MB, PSS {r['pss_peak_mb']:.0f} MB", flush=True)
            s = pop[100]["summary"]
            state_mb = (s.get("bytes_up_mean") or 0) / 2**20
            data_mb = 67349 * 12 * 8 / 100 / 2**20  # SST-2 train ~12 tokens/row as int64, one client's share
            bound = (pop[100]["pss_peak_mb"] + 900 * (state_mb + data_mb)) * 1.05
            res["population"] = {str(n): {k: r[k] for k in ("rss_peak_mb", "pss_peak_mb")} for n, r in pop.items()}
            res["population"]["bound_pss_mb"] = bound
            print(f"1,000 clients: PSS {pop[1000]['pss_peak_mb']:.0f} MB; bound {bound:.0f} MB", flush=True)
        if "growth" in args.parts:
            r = fedslice_run(out, "growth", "federation.rounds=20", "federation.local_steps=2",
                             "evaluation.every=5")
            rss = [m["process_rss_mb"] for m in r["metrics"]]
            # the first evaluation (round 5) shows in round 6's figure: growth is measured from there
            res["growth"] = {"process_rss_mb": rss, "growth_after_round_6": max(rss[5:]) / rss[5] - 1,
                             "pss_peak_mb": r["pss_peak_mb"]}
            print(f"20 rounds: RSS per round {[round(x) for x in rss]}; growth after round 6 "
                  f"{res['growth']['growth_after_round_6']:+.1%}", flush=True)
        if "heap" in args.parts:
            res["heap"] = ab(out, "heap", args.repeats,
                             ("glibc", {"sets": ("compute.release_memory=false",)}),
                             ("release", {"sets": ("compute.release_memory=true",)}))
        if "thp" in args.parts:
            res["thp"] = ab(out, "thp", args.repeats,
                            ("torch-default", {"env": {"THP_MEM_ALLOC_ENABLE": "0"}}),
                            ("thp", {"env": {"THP_MEM_ALLOC_ENABLE": "1"}}))
        if "per_client" in args.parts:
            r = run_measured([python(), "-c", ALONE, CONFIG])
            got = json.loads(r["tail"].strip().splitlines()[-1])
            res["per_client"] = got
            rep, again = got["reported"], got["reported_in_run"]
            print(f"client 0 alone in a fresh process: training raised RSS by {got['alone_training_rss_mb']:.1f} MB "
                  f"(sampled); it reported peak_rss_mb {rep['peak_rss_mb']:.1f}; trained again after five other "
                  f"clients in the same process it reported {again['peak_rss_mb']:.1f} "
                  f"(a plain RSS delta read {got['sampled_delta_in_run']:.1f}); the other clients "
                  f"{[round(x, 1) for x in got['later_clients_peak_rss_mb']]}; memory_mb (model "
                  f"{rep['model_mb']:.0f} + tensors {rep['activation_mb']:.1f}) {rep['memory_mb']:.0f}", flush=True)
    res["machine"]["loadavg_end"] = os.getloadavg()[0]
    # parts not run this time keep their earlier figures (each part says when it was measured)
    for part in res:
        if isinstance(res[part], dict) and part != "machine":
            res[part]["measured"] = res["machine"]["date"]
    earlier = RESULTS / "memory.json"
    merged = {**(json.loads(earlier.read_text()) if earlier.exists() else {}), **res}
    print("saved", save("memory", merged))


if __name__ == "__main__":
    main()
