"""Memory (issue 22, target 6) on the workload (bench/perf/minilm_sst2.toml), each part a fresh
process whose whole tree is sampled (RSS summed, and PSS: pages shared by forked workers once):

* ``workload``: peak memory of the 3-round run with fedslice's defaults and with one process.
* ``population``: 100 vs 1,000 clients (same rounds and clients per round); the bound is the
  100-client peak + 900 x (one client's trainable state + its tokenized data) + 5%.
* ``growth``: 20 rounds (2 local steps each), the process RSS at every round end.
* ``per_client``: a client's ``memory_mb`` as the run reports it (model held + saved activations +
  gradients + AdamW state) against that client's training alone in a fresh process (peak RSS
  during ``fit`` minus RSS after the model and data were loaded: what training adds).

    .venv/bin/python bench/memory.py [--parts workload population growth per_client]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "perf"))
from common import machine, python, run_measured, save  # noqa: E402

CONFIG = "bench/perf/minilm_sst2.toml"


def fedslice_run(out: Path, name: str, *sets: str) -> dict:
    args = [python(), "-m", "fedslice.cli", "run", CONFIG, "-q", "--out", str(out), "--set", f"output.name={name}"]
    for s in sets:
        args += ["--set", s]
    r = run_measured(args)
    run = out / name
    r["metrics"] = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()] if run.exists() else []
    r["summary"] = json.loads((run / "summary.json").read_text()) if run.exists() else {}
    if r["rc"]:
        print(r["tail"])
    return r


ALONE = textwrap.dedent("""
    import json, sys, threading, time, psutil
    proc = psutil.Process()
    before = proc.memory_info().rss
    from fedslice.api import setup
    from fedslice.experiment import load_config
    from fedslice.fl.engine import client_seed
    cfg = load_config(sys.argv[1], ["compute.workers=1"])
    method, data = setup(cfg)
    payload = method.strategy.configure_train(1, method.initial_state(), [0])[0]
    before = proc.memory_info().rss  # model and data loaded: what follows is training
    peak = [before]
    stop = threading.Event()
    def sample():
        while not stop.is_set():
            peak.append(proc.memory_info().rss); stop.wait(0.005)
    t = threading.Thread(target=sample); t.start()
    reply = method.fit(payload, data.client(0), client_seed(cfg.seed, 1, 0))
    stop.set(); t.join()
    print(json.dumps({"alone_training_rss_mb": (max(peak) - before) / 2**20,
                      "reported": {k: reply.metrics.get(k) for k in
                                   ("memory_mb", "model_mb", "activation_mb", "peak_rss_mb")}}))
""")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["workload", "population", "growth", "per_client"])
    args = ap.parse_args()
    res = {"machine": machine()}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        if "workload" in args.parts:
            for name, sets in (("default", ()), ("one-process", ("compute.workers=1",))):
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
            res["growth"] = {"process_rss_mb": rss, "growth_after_round_5": max(rss[5:]) / rss[4] - 1,
                             "pss_peak_mb": r["pss_peak_mb"]}
            print(f"20 rounds: RSS per round {[round(x) for x in rss]}; growth after round 5 "
                  f"{res['growth']['growth_after_round_5']:+.1%}", flush=True)
        if "per_client" in args.parts:
            r = run_measured([python(), "-c", ALONE, CONFIG])
            got = json.loads(r["tail"].strip().splitlines()[-1])
            res["per_client"] = got
            rep = got["reported"]
            print(f"one client: reported memory_mb {rep['memory_mb']:.0f} MB = model {rep['model_mb']:.0f} + "
                  f"training {rep['activation_mb']:.1f} (activations, grads, AdamW); its training alone in a "
                  f"fresh process raised RSS by {got['alone_training_rss_mb']:.1f} MB", flush=True)
    res["machine"]["loadavg_end"] = os.getloadavg()[0]
    print("saved", save("memory", res))


if __name__ == "__main__":
    main()
