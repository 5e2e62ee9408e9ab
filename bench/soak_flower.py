"""Benchmark (issue 24): a Flower deployment under node churn, on loopback.

A SuperLink and ``--nodes`` SuperNodes (one partition each) on this machine, a tiny random BERT
(2 layers, hidden 32) on a synthetic sentiment task, ``--rounds`` rounds of ``--per-round``
clients. After round ``--kill-after`` the SuperNodes ``--victims`` are SIGKILLed with their
ClientApps (a machine gone: no goodbye to the SuperLink); after round ``--restart-after`` they
start again (new node ids; the ServerApp maps them to their partitions). Per round it records the
round time, the replies used, the dropped ones (failed node, no reply, rejected) and the
ServerApp's resident memory; at the end it checks that every round used at least
``federation.min_replies`` replies or was skipped, that the ServerApp's RSS grew at most 10% after
round 5, and that no SuperNode kept the run's model files (``--method fedot``: each node keeps the
adapter and emulator it received).

    .venv/bin/python bench/soak_flower.py --out bench/results/soak            # 10 nodes, 30 rounds
    .venv/bin/python bench/soak_flower.py --nodes 4 --rounds 6 --kill-after 2 --restart-after 4 \\
        --victims 1 --out /tmp/soak-small
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the tiny model and data of the test suite

from conftest import method_options, save_tiny_model, write_sentiment_tsv  # noqa: E402

import tomli_w  # noqa: E402

from fedslice.flower.deploy import write_app  # noqa: E402
from fedslice.flower.local import LocalFederation  # noqa: E402
from fedslice.output import read_run  # noqa: E402


def experiment(args, work: Path) -> dict:
    return {
        "name": "soak", "seed": 0, "threads": 1,
        "data": {"path": str(write_sentiment_tsv(work / "data", sizes=(40 * args.nodes, 40, 40))),
                 "max_length": 16},
        "model": {"name": str(save_tiny_model(work / "model"))},
        "lora": {"r": 4, "alpha": 8, "targets": ["q", "v"]},
        "federation": {"num_clients": args.nodes, "clients_per_round": args.per_round,
                       "rounds": args.rounds, "local_steps": 2, "batch_size": 8, "lr": 5e-3,
                       "min_replies": args.min_replies},
        "method": {"name": args.method, **method_options(args.method, work)},
        "evaluation": {"every": 1, "batch_size": 64},
        "output": {"dir": str(work / "runs"), "progress": False, "plots": False},
    }


def rounds_done(runs: Path) -> int:
    files = list(runs.glob(".soak.partial-*/metrics.jsonl"))
    return sum(1 for _ in files[0].open()) if files else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=10)
    p.add_argument("--per-round", type=int, default=5)
    p.add_argument("--min-replies", type=int, default=3)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--victims", type=int, nargs="+", default=[1, 4, 7])
    p.add_argument("--kill-after", type=int, default=8)
    p.add_argument("--restart-after", type=int, default=16)
    p.add_argument("--method", default="fedot")
    p.add_argument("--round-timeout", type=float, default=120.0)
    p.add_argument("--timeout", type=float, default=5400.0)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "soak")
    args = p.parse_args()

    out = args.out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="fedslice-soak-"))  # model, data, Flower's files
    config = work / "soak.json"
    config.write_text(json.dumps(experiment(args, work)))
    result_file = work / "result.txt"
    result_file.unlink(missing_ok=True)
    run_config = work / "run_config.toml"
    run_config.write_text(tomli_w.dumps({
        "config": str(config), "out-dir": str(work / "runs"), "result-file": str(result_file),
        "round-timeout": args.round_timeout, "connect-timeout": 300.0}))
    events: list[dict] = []
    t0 = time.monotonic()
    load = [os.getloadavg()]
    with LocalFederation(work / "flower", args.nodes, server_roots=[work]) as fed:
        run_id = fed.submit(write_app(work / "app"), run_config)
        killed = restarted = False
        status = "running"
        next_status = time.monotonic() + 10
        while time.monotonic() - t0 < args.timeout:
            done = rounds_done(work / "runs")
            if done >= args.kill_after and not killed:
                for i in args.victims:
                    fed.kill_supernode(i)
                killed = True
                events.append({"after_round": done, "event": f"killed SuperNodes {args.victims}",
                               "t_s": time.monotonic() - t0})
            if done >= args.restart_after and killed and not restarted:
                for i in args.victims:
                    fed.start_supernode(i)
                restarted = True
                events.append({"after_round": done, "event": f"restarted SuperNodes {args.victims}",
                               "t_s": time.monotonic() - t0})
            if result_file.exists() or time.monotonic() >= next_status:
                status = fed.status(run_id)
                next_status = time.monotonic() + 10
                load.append(os.getloadavg())
                if status.startswith("finished"):
                    break
            time.sleep(1.0)
        log_text = fed.run_log(run_id)
    (out / "run.log").write_text(log_text)
    if status != "finished:completed" or not result_file.exists():
        print(f"run ended with status {status}; see {out / 'run.log'}")
        return 1
    run_dir = Path(result_file.read_text().strip())
    _, metrics, summary = read_run(run_dir)
    per_round = []
    for m in metrics:
        reasons = [e["reason"] for e in m["excluded"]]
        per_round.append({
            "round": m["round"], "time_s": round(m["round_time_s"], 2),
            "selected": len(m["clients"]), "used": sum(c["used"] for c in m["client_metrics"]),
            "dropped": len(reasons), "failed_nodes": m.get("failed_nodes", 0),
            "rejected": m.get("rejected", 0), "skipped": m["skipped"],
            "server_rss_mb": round(m["server_rss_mb"], 1), "dev_accuracy": m.get("dev_accuracy"),
            "reasons": sorted(set(re.sub(r"node \d+", "node", r)[:70] for r in reasons))})
    min_ok = all(r["skipped"] or r["used"] >= args.min_replies for r in per_round)
    rss = [r["server_rss_mb"] for r in per_round]
    base = rss[4] if len(rss) >= 5 else rss[0]
    growth = max(rss[4:] or rss) / base - 1
    leftovers = sorted(str(p) for p in (work / "flower" / "flwr-home").glob("fedslice-node-state/run-*"))
    report = {
        "command": " ".join(sys.argv), "machine": platform.platform(), "cpus": os.cpu_count(),
        "loadavg_start_mid_end": [load[0], load[len(load) // 2], load[-1]],
        "method": args.method, "nodes": args.nodes, "per_round": args.per_round,
        "min_replies": args.min_replies, "rounds": args.rounds, "events": events,
        "wall_s": round(time.monotonic() - t0, 1), "test_accuracy": summary.get("test_accuracy"),
        "dropped_replies": sum(r["dropped"] for r in per_round),
        "skipped_rounds": sum(r["skipped"] for r in per_round),
        "min_replies_honoured": min_ok, "rss_growth_after_round_5": round(growth, 4),
        "rss_flat": growth <= 0.10, "node_files_left": leftovers, "per_round": per_round,
    }
    (out / "soak.json").write_text(json.dumps(report, indent=2))
    lines = ["| round | time (s) | selected | used | dropped | why | skipped | ServerApp RSS (MiB) |",
             "|---:|---:|---:|---:|---:|---|:-:|---:|"]
    for r in per_round:
        lines.append(f"| {r['round']} | {r['time_s']:.1f} | {r['selected']} | {r['used']} | "
                     f"{r['dropped']} | {'; '.join(r['reasons'])} | {'yes' if r['skipped'] else ''} | "
                     f"{r['server_rss_mb']:.1f} |")
    (out / "soak.md").write_text("\n".join(lines) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    print("\n".join(lines))
    print(json.dumps({k: v for k, v in report.items() if k != "per_round"}, indent=2))
    return 0 if min_ok and growth <= 0.10 and not leftovers else 1


if __name__ == "__main__":
    sys.exit(main())
