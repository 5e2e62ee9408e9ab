"""Curves (issue 22, target 9) on the CPU: round time against clients per round, local steps and
sequence length (the workload of bench/perf/minilm_sst2.toml, one parameter varied at a time,
2 rounds each, the steady round = round 2), for one process (compute.workers = 1) and the
default workers; and peak memory (PSS of the process tree) against the client population.
Writes bench/results/perf/curves.json and curves.png.

    .venv/bin/python bench/curves.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "perf"))
from common import RESULTS, machine, python, run_measured, save  # noqa: E402

CONFIG = "bench/perf/minilm_sst2.toml"
SWEEPS = {"federation.clients_per_round": [2, 5, 10, 20], "federation.local_steps": [2, 4, 8, 16],
          "data.max_length": [32, 64, 128]}
MODES = {"one process": ["compute.workers=1"], "workers": []}
POPULATION = [100, 300, 1000]


def point(out: Path, name: str, sets: list[str]) -> dict:
    args = [python(), "-m", "fedslice.cli", "run", CONFIG, "-q", "--out", str(out), "--set", f"output.name={name}",
            "--set", "federation.rounds=2", "--set", "evaluation.every=100", "--set", "data.max_test_examples=64"]
    for s in sets:
        args += ["--set", s]
    r = run_measured(args)
    metrics = [json.loads(l) for l in (out / name / "metrics.jsonl").read_text().splitlines()]
    return {"round_s": metrics[-1]["round_time_s"], "pss_peak_mb": r["pss_peak_mb"], "rss_peak_mb": r["rss_peak_mb"]}


def main() -> None:
    res = {"machine": machine(), "sweeps": {}, "population": {}}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        i = 0
        for key, values in SWEEPS.items():
            res["sweeps"][key] = {}
            for mode, sets in MODES.items():
                ys = []
                for v in values:
                    i += 1
                    p = point(out, f"p{i}", [*sets, f"{key}={v}"])
                    ys.append(p["round_s"])
                    print(f"{key}={v} {mode}: round {p['round_s']:.1f} s", flush=True)
                res["sweeps"][key][mode] = {"x": values, "round_s": ys}
        for n in POPULATION:
            i += 1
            p = point(out, f"p{i}", [f"federation.num_clients={n}"])
            res["population"][n] = p
            print(f"population {n}: PSS {p['pss_peak_mb']:.0f} MB", flush=True)
    res["machine"]["loadavg_end"] = os.getloadavg()[0]
    save("curves", res)
    plot(res)


def plot(res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (key, modes) in zip(axes, res["sweeps"].items()):
        for mode, d in modes.items():
            ax.plot(d["x"], d["round_s"], marker="o", label=mode)
        ax.set_xlabel(key.split(".")[-1])
        ax.set_ylabel("round time (s)")
        ax.legend()
    pop = res["population"]
    axes[3].plot([int(n) for n in pop], [pop[n]["pss_peak_mb"] for n in pop], marker="o")
    axes[3].set_xlabel("clients in the population")
    axes[3].set_ylabel("peak PSS (MB)")
    fig.suptitle(f"MiniLM + LoRA, SST-2, CPU ({res['machine']['cores']} cores)")
    fig.tight_layout()
    fig.savefig(RESULTS / "curves.png", dpi=90)


if __name__ == "__main__":
    main()
