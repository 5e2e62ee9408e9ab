"""Secure aggregation on a local Flower federation (issue 60, part 5): a SuperLink and ``--nodes``
SuperNodes on loopback, one real model (MiniLM-L6 on SST-2, or SmolLM2-135M on SST-2 as
label-word classification), one method; for each variant a fresh federation runs ``--rounds``
rounds and the ServerApp's records give, per client-round, the bytes up (the masked vector under
secure aggregation; the plain reply otherwise) and down (the payload), the key stages' bytes
(measured from Flower's primitives for the round's clients), and each round's time
(``round_time_s``: from the round's configure to its aggregate, key stages and unmasking
included; the ServerApp's evaluation is not in it).

Variants: ``plain``, ``secure``, ``kill1`` / ``kill3`` (secure aggregation; during round 1 the
first 1 / 3 SuperNodes whose masked vectors were sent are SIGKILLed before the unmasking: the
round must complete with every masked vector in the sum, the dead nodes' private masks rebuilt
from the survivors' shares, and the run go on without them). The variants run one after the
other in one invocation, with ``uptime``'s load before and after each.

Each SuperNode starts a fresh ClientApp process per message (Flower's deployment), so a node is
a light process between messages; keep the data and steps small (``--train-per-client``,
``--steps``) on a small machine. What those processes cost is sampled every 0.25 s (psutil,
every process of the federation): per ClientApp process its peak RSS and how long it lived
(one message) and its CPU seconds (user + system, at its last sample: a figure that holds on
a loaded machine, where wall seconds do not), the most ClientApp processes alive at once, the
largest sum of RSS over all the federation's processes (SuperLink, ServerApp, SuperNodes,
ClientApps) and the machine's available memory before the federation and at its lowest. RSS counts shared pages (libraries,
a model file that safetensors maps) once per process, so the sum overstates what the processes
take together; the drop of available memory is the machine's real cost.

    python bench/secagg_federation.py --model minilm --method fedpetuning --variants plain secure
    python bench/secagg_federation.py --model minilm --method fedpetuning --variants kill1 kill3

Where a round's time goes: ``--flower-debug --keep-logs`` keeps every process's log with
Flower's time stamps (each HTTP request through the SuperLink included) and the JSON has each
kind of process's CPU seconds every 0.5 s (``cpu_s_series``) and the timeline's zero on the
wall clock (``t0_unix``); ``bench/secagg_timeline.py`` and ``bench/flower_log_events.py`` read
them. Under an outer ``timeout``, give it ~90 s more than ``--timeout``: stopping the
federation and reading its log take that long on a loaded machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import tomli_w

from fedslice.flower.deploy import write_app
from fedslice.flower.local import LocalFederation
from fedslice.output import read_run

REPO = Path(__file__).resolve().parents[1]
SST2 = (REPO / ".." / "shared" / "data" / "sst2").resolve()

MODELS = {
    "minilm": {"model": {"name": "minilm"}, "data": {"max_length": 64}},
    "smollm2": {"model": {"name": "smollm2"}, "data": {"max_length": 48},
                "task": {"prompt": "Review: {sentence}\nSentiment:",
                         "label_words": {"0": " negative", "1": " positive"}}},
}
METHODS = {
    "fedpetuning": {"name": "fedpetuning"},
    # no client trains the whole model (FLOPs tiers 0.5 / 0.75): the union is smaller than it
    "raffm+heads": {"name": "raffm+heads", "tiers": [{"share": 0.5, "flops": 0.5},
                                                     {"share": 0.5, "flops": 0.75}],
                    "width_steps": 4, "sparsity": 0.5, "importance_max_examples": 16},
}


def experiment(args, work: Path, secure: bool) -> dict:
    m = MODELS[args.model]
    d = {
        "name": f"secagg-{args.model}-{args.method}", "seed": 0, "threads": 1,
        "data": {"path": str(SST2), "partition": "iid",
                 "max_train_examples": args.train_per_client * args.nodes,
                 "max_dev_examples": args.dev, "max_test_examples": args.dev, **m["data"]},
        "model": m["model"],
        "lora": {"r": 8, "alpha": 16, "targets": ["q", "v"]},
        "federation": {"num_clients": args.nodes, "clients_per_round": args.nodes,
                       "rounds": args.rounds, "local_steps": args.steps,
                       "batch_size": args.batch_size, "lr": args.lr, "min_replies": 2},
        "method": METHODS[args.method],
        "privacy": {"secure_aggregation": secure},
        "evaluation": {"every": args.rounds, "batch_size": 32},
        "output": {"dir": str(work / "runs"), "progress": False, "plots": False,
                   "save_weights": False},
    }
    if "task" in m:
        d["task"] = m["task"]
    return d


def key_bytes(n: int, threshold: int) -> tuple[int, int]:
    """(up, down) bytes of one client's key stages in a round of ``n`` clients, from Flower's
    functions: up = its two public keys, one ciphertext per other client, its shares for the
    unmasking (one per client at most); down = every client's public keys and the ciphertexts
    the others sent it."""
    from fedslice.fl import secagg as sp

    peers = {c: sp.setup(c) for c in range(n)}
    pub = {c: (s.pk1, s.pk2) for c, s in peers.items()}
    boxes = {c: sp.share_keys(peers[c], pub, threshold) for c in range(n)}
    for c in range(n):
        sp.receive_shares(peers[c], {s: boxes[s][c] for s in range(n) if s != c})
    shares = sp.unmask_shares(peers[0], list(range(n)), [], threshold)
    up = len(peers[0].pk1) + len(peers[0].pk2) + sum(map(len, boxes[0].values())) + \
        sum(map(len, shares.values()))
    down = sum(len(a) + len(b) for a, b in pub.values()) + sum(len(boxes[s][0]) for s in range(1, n))
    return up, down


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def sent_train_reply(log: Path) -> bool:
    """The SuperNode has sent its TRAIN reply (its masked vector) in this run."""
    if not log.is_file():
        return False
    text = log.read_text(errors="replace")
    i = text.rfind("Sending: train message")
    return i >= 0 and "Sent successfully" in text[i:]


class ProcessSampler(threading.Thread):
    """Every ``period`` s: the RSS of every process of the federation (its processes and all
    below them), kept per process as (kind, first seen, last seen, peak RSS), the largest total,
    the most ClientApp processes alive at once, and the machine's lowest available memory."""

    def __init__(self, fed: LocalFederation, period: float = 0.25, floor_mb: float = 0.0):
        super().__init__(daemon=True)
        self.fed, self.period, self.stop_flag = fed, period, threading.Event()
        #: set once the machine's available memory fell below ``floor_mb`` (the run is stopped)
        self.low_memory, self.floor = threading.Event(), floor_mb * 2**20
        self.procs: dict[int, dict] = {}
        self.peak_total = self.peak_clientapps = 0
        self.t0 = time.monotonic()  # the timeline's zero (the federation just started)
        self.t0_unix = time.time()  # the same instant on the wall clock (Flower's log stamps)
        #: per kind of process, [seconds from t0, its CPU seconds so far] every ``cpu_every`` s:
        #: what each kind computed in a window (the CPU of a process that ended stays counted)
        self.cpu_series: dict[str, list[list[float]]] = {}
        self.cpu_every, self._last_cpu_sample = 0.5, -1.0
        self.min_available = None

    @staticmethod
    def kind(cmd: list[str]) -> str:
        text = " ".join(cmd)
        for k in ("flwr-clientapp", "flwr-serverapp", "flower-superexec", "flower-supernode",
                  "flower-superlink"):
            if k in text:
                return k
        return "other"

    def run(self) -> None:
        import psutil

        from fedslice.flower.local import descendants

        while not self.stop_flag.is_set():
            now, total, apps = time.monotonic(), 0, 0
            for top in list(self.fed.processes):
                try:
                    tops = [psutil.Process(top.pid)] if top.alive() else []
                except psutil.Error:
                    tops = []
                for p in [*tops, *descendants(top.pid)]:
                    try:
                        rss, cmd, cpu = p.memory_info().rss, p.cmdline(), p.cpu_times()
                    except psutil.Error:
                        continue
                    rec = self.procs.setdefault(p.pid, {"kind": self.kind(cmd), "first": now,
                                                        "last": now, "peak_rss": 0, "cpu_s": 0.0})
                    rec["last"], rec["peak_rss"] = now, max(rec["peak_rss"], rss)
                    rec["cpu_s"] = max(rec["cpu_s"], cpu.user + cpu.system)
                    total += rss
                    apps += rec["kind"] == "flwr-clientapp"
            self.peak_total = max(self.peak_total, total)
            if now - self._last_cpu_sample >= self.cpu_every:
                self._last_cpu_sample = now
                by_kind: dict[str, float] = {}
                for r in self.procs.values():
                    by_kind[r["kind"]] = by_kind.get(r["kind"], 0.0) + r["cpu_s"]
                for k, v in by_kind.items():
                    self.cpu_series.setdefault(k, []).append([round(now - self.t0, 2), round(v, 2)])
            self.peak_clientapps = max(self.peak_clientapps, apps)
            avail = psutil.virtual_memory().available
            self.min_available = avail if self.min_available is None else min(self.min_available, avail)
            if avail < self.floor:
                self.low_memory.set()
            self.stop_flag.wait(self.period)

    def summary(self, heavy_mb: float = 300.0) -> dict:
        """ClientApp processes split at ``heavy_mb`` of peak RSS: heavy = a TRAIN message (the
        model loaded), light = a QUERY (partition, key stages, unmasking: no torch)."""
        mb = 1 / 2**20
        out = {"peak_total_rss_mb": self.peak_total * mb,
               "peak_clientapps_alive": self.peak_clientapps,
               "min_available_mb": (self.min_available or 0) * mb}
        apps = [r for r in self.procs.values() if r["kind"] == "flwr-clientapp"]
        for name, group in (("heavy", [r for r in apps if r["peak_rss"] * mb >= heavy_mb]),
                            ("light", [r for r in apps if r["peak_rss"] * mb < heavy_mb])):
            rss = sorted(r["peak_rss"] * mb for r in group)
            life = sorted(r["last"] - r["first"] for r in group)
            cpu = sorted(r["cpu_s"] for r in group)
            out[f"clientapp_{name}"] = {
                "n": len(group), "peak_rss_mb_max": rss[-1] if rss else None,
                "peak_rss_mb_median": rss[len(rss) // 2] if rss else None,
                # CPU seconds (user + system) at its last sample: what the process cost, however
                # loaded the machine (its last <= 0.25 s are not seen)
                "cpu_s_median": cpu[len(cpu) // 2] if cpu else None,
                "cpu_s_sum": sum(cpu) if cpu else None,
                "seconds_median": life[len(life) // 2] if life else None,
                "seconds_max": life[-1] if life else None}
        for kind in ("flwr-serverapp", "flower-supernode", "flower-superlink"):
            rss = [r["peak_rss"] * mb for r in self.procs.values() if r["kind"] == kind]
            out[f"{kind}_peak_rss_mb_max"] = max(rss) if rss else None
        # CPU seconds of every kind of process over the run (the SuperNodes' and SuperExecs'
        # polling included), and each ClientApp's (first seen, last seen) in seconds from the
        # federation's start with its CPU seconds and peak RSS: the key stages' processes, their
        # spread and the idle time around them (compare the round's secagg_*_s)
        out["cpu_s_by_kind"] = {k: round(sum(r["cpu_s"] for r in self.procs.values() if r["kind"] == k), 2)
                                for k in sorted({r["kind"] for r in self.procs.values()})}
        out["clientapp_timeline"] = sorted(
            [round(r["first"] - self.t0, 2), round(r["last"] - self.t0, 2), round(r["cpu_s"], 2),
             round(r["peak_rss"] * mb)] for r in apps)
        out["cpu_s_series"] = self.cpu_series
        out["t0_unix"] = self.t0_unix
        return out


def run_variant(args, variant: str, work: Path) -> dict:
    secure = variant != "plain"
    kill = int(variant[4:]) if variant.startswith("kill") else 0
    work.mkdir(parents=True, exist_ok=True)
    config = work / "exp.json"
    config.write_text(json.dumps(experiment(args, work, secure)))
    result = work / "result.txt"
    rc = work / "rc.toml"
    rc.write_text(tomli_w.dumps({"config": str(config), "out-dir": str(work / "runs"),
                                 "result-file": str(result), "round-timeout": args.round_timeout,
                                 "connect-timeout": 300.0}))
    import psutil

    before, t0, killed = uptime(), time.monotonic(), []
    available_before = psutil.virtual_memory().available / 2**20
    with LocalFederation(work / "flower", args.nodes, server_roots=[work]) as fed:
        sampler = ProcessSampler(fed, floor_mb=args.memory_floor_mb)
        sampler.start()
        run_id = fed.submit(write_app(work / "app"), rc)
        status = "running"
        while time.monotonic() - t0 < args.timeout:
            if sampler.low_memory.is_set():
                status = (f"stopped: the machine's available memory fell below "
                          f"{args.memory_floor_mb:g} MB")
                print(f"  {variant}: {status}", flush=True)
                break
            if len(killed) < kill:
                for i in range(args.nodes):
                    if i not in killed and len(killed) < kill and \
                            sent_train_reply(fed.log_dir / f"supernode-{i}.log"):
                        fed.kill_supernode(i)
                        killed.append(i)
                        print(f"  {variant}: killed SuperNode {i} after its masked vector was "
                              f"sent ({time.monotonic() - t0:.0f} s)", flush=True)
            if result.exists():
                status = fed.status(run_id)
                if status.startswith("finished"):
                    break
            time.sleep(0.2)
        else:
            status = fed.status(run_id)
        log_text = fed.run_log(run_id)
        sampler.stop_flag.set()
        sampler.join()
    after = uptime()
    processes = {**sampler.summary(), "available_before_mb": available_before}
    (work / "run.log").write_text(log_text)
    if args.keep_logs:  # every process's log (with --flower-debug: time-stamped lines)
        keep = args.out / f"logs_{args.model}_{args.method}_{variant}".replace("+", "-")
        shutil.rmtree(keep, ignore_errors=True)
        shutil.copytree(work / "flower" / "logs", keep)
        shutil.copy(work / "run.log", keep / "serverapp.log")
    if not result.exists():
        # the rounds the run finished before it was stopped (its staging folder's records)
        done = [json.loads(line) for f in sorted((work / "runs").glob(".*.partial-*/metrics.jsonl"))
                for line in f.read_text().splitlines() if line.strip()]
        return {"variant": variant, "status": status, "processes": processes,
                "error": "no result", "rounds_finished": round_rows(done),
                "log_tail": log_text[-3000:]}
    _, metrics, summary = read_run(Path(result.read_text().strip()))
    rounds = round_rows(metrics)
    # the ServerApp's word that a killed node's unmasking answer is missing (after masking)
    unmask_missing = sorted(set(re.findall(r"client (\d+) did not answer the unmasking", log_text)))
    out = {"variant": variant, "status": status, "uptime_before": before, "uptime_after": after,
           "killed_nodes": killed, "unmask_missing_clients": unmask_missing,
           "processes": processes,
           "rounds": rounds, "wall_s": time.monotonic() - t0,
           "test_accuracy": summary.get("test_accuracy"), "test_loss": summary.get("test_loss"),
           "final_dev_accuracy": summary.get("final_dev_accuracy")}
    if secure:
        from fedslice.config import PrivacyConfig
        out["key_bytes_up_down"] = key_bytes(args.nodes, PrivacyConfig().threshold(args.nodes))
    return out


def round_rows(metrics: list[dict]) -> list[dict]:
    """Per round record (metrics.jsonl): what the tables show."""
    rounds = []
    for m in metrics:
        used = [c for c in m["client_metrics"] if c.get("used")]
        rounds.append({
            "round": m["round"], "time_s": m["round_time_s"], "selected": len(m["clients"]),
            "used": len(used), "skipped": m["skipped"],
            "excluded": [(e["client"], e["reason"][:400]) for e in m["excluded"]],
            "bytes_up": _mean([c.get("bytes_up") for c in used]),
            "bytes_up_plain": _mean([c.get("bytes_up_plain") for c in used]),
            "bytes_down": _mean([c.get("bytes_down") for c in used]),
            **{k: m.get(k) for k in ("secagg_clients", "secagg_recovered", "secagg_clipped",
                                     "secagg_upload_bytes", "secagg_full_upload_bytes",
                                     "secagg_skipped", "secagg_setup_s", "secagg_share_keys_s",
                                     "secagg_unmask_s", "secagg_keys_ahead")}})
    return rounds


def _stages(x: dict) -> str:
    """The round's key-stage seconds (setup / key sharing / unmasking), '-' for a plain round;
    the setup's is '0 (ahead N)' when N clients' keys were drawn ahead and none needed one."""
    t = [x.get(f"secagg_{s}_s") for s in ("setup", "share_keys", "unmask")]
    if all(v is None for v in t):
        return "-"
    text = " / ".join("-" if v is None else f"{v:.1f}" for v in t)
    ahead = x.get("secagg_keys_ahead")
    return text if not ahead else f"{text} (keys ahead: {ahead})"


def _n(v) -> str:
    """A byte count, '-' where the round used no client (skipped)."""
    return "-" if v is None else f"{v:,.0f}"


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def table(args, results: list[dict]) -> str:
    lines = [f"{args.model}, {args.method}, {args.nodes} SuperNodes, {args.steps} local steps of "
             f"{args.batch_size}, {args.train_per_client} examples per client", "",
             "| variant | round | time (s) | used / selected | in the sum (recovered) | up per client (B) "
             "| plain up (B) | down per client (B) | key stages up / down (B) | key stages setup / "
             "share / unmask (s) | load before -> after |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['variant']} | - | {r['status']}: {r['error']} |||||||")
            continue
        load = lambda s: s.split("load average:")[-1].strip()  # noqa: E731
        keys = r.get("key_bytes_up_down")
        for x in r["rounds"]:
            lines.append(
                f"| {r['variant']} | {x['round']} | {x['time_s']:.1f} | {x['used']} / {x['selected']} | "
                f"{x.get('secagg_clients') or '-'} ({x.get('secagg_recovered') or 0}) | "
                f"{_n(x['bytes_up'])} | {_n(x['bytes_up_plain'] or x['bytes_up'])} | "
                f"{_n(x['bytes_down'])} | {f'{keys[0]:,} / {keys[1]:,}' if keys else '-'} | "
                f"{_stages(x)} | {load(r['uptime_before'])} -> {load(r['uptime_after'])} |")
    lines.append("")
    for r in results:
        if "error" not in r:
            lines.append(f"- {r['variant']}: killed {r['killed_nodes']} (clients missing at the "
                         f"unmasking: {r.get('unmask_missing_clients')}), test accuracy "
                         f"{r['test_accuracy']} (loss {r.get('test_loss')}), excluded per round "
                         f"{[x['excluded'] for x in r['rounds']]}, wall {r['wall_s']:.0f} s")
    lines.append("")
    lines.append("| variant | ClientApp processes heavy / light | heavy peak RSS max / median (MB) | "
                 "heavy s per message median / max | light peak RSS max (MB) | light s median | "
                 "light CPU-s median / sum | "
                 "ClientApps alive at once | ServerApp peak RSS (MB) | federation peak RSS (MB) | "
                 "available before -> lowest (MB) |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    f = lambda v, d=0: "-" if v is None else f"{v:,.{d}f}"  # noqa: E731
    for r in results:
        pr = r.get("processes")
        if not pr:
            continue
        h, li = pr["clientapp_heavy"], pr["clientapp_light"]
        lines.append(f"| {r['variant']} | {h['n']} / {li['n']} | {f(h['peak_rss_mb_max'])} / "
                     f"{f(h['peak_rss_mb_median'])} | {f(h['seconds_median'], 1)} / "
                     f"{f(h['seconds_max'], 1)} | {f(li['peak_rss_mb_max'])} | "
                     f"{f(li['seconds_median'], 1)} | {f(li.get('cpu_s_median'), 2)} / "
                     f"{f(li.get('cpu_s_sum'), 1)} | {pr['peak_clientapps_alive']} | "
                     f"{f(pr['flwr-serverapp_peak_rss_mb_max'])} | {f(pr['peak_total_rss_mb'])} | "
                     f"{f(pr.get('available_before_mb'))} -> {f(pr['min_available_mb'])} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="minilm")
    p.add_argument("--method", choices=sorted(METHODS), default="fedpetuning")
    p.add_argument("--variants", nargs="+", default=["plain", "secure"],
                   choices=["plain", "secure", "kill1", "kill3"])
    p.add_argument("--nodes", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--train-per-client", type=int, default=32)
    p.add_argument("--dev", type=int, default=200)
    p.add_argument("--round-timeout", type=float, default=300.0)
    p.add_argument("--timeout", type=float, default=560.0, help="per variant")
    p.add_argument("--memory-floor-mb", type=float, default=1500.0,
                   help="stop the federation when the machine's available memory falls below this")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "secagg5")
    p.add_argument("--settle", type=float, default=0.0,
                   help="before each variant, wait (at most this many seconds) until the 1-minute "
                        "load average is below --settle-load: the previous variant's processes "
                        "leave the load average high for minutes after they end")
    p.add_argument("--settle-load", type=float, default=1.0)
    p.add_argument("--keep-logs", action="store_true",
                   help="copy every process's log (SuperLink, SuperNodes, the run's ServerApp "
                        "log) to --out/logs_MODEL_METHOD_VARIANT")
    p.add_argument("--flower-debug", action="store_true",
                   help="FLWR_LOG_LEVEL=DEBUG for the federation: Flower's processes (and "
                        "fedslice's ServerApp log) stamp every line with its time; more logging "
                        "CPU, so not for a round-time figure")
    args = p.parse_args()
    # an outer `timeout` (SIGTERM) still stops the federation's processes (LocalFederation's
    # exit) instead of leaving them running
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.flower_debug:
        os.environ["FLWR_LOG_LEVEL"] = "DEBUG"
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for v in args.variants:
        settle(args.settle, args.settle_load)
        work = Path(tempfile.mkdtemp(prefix=f"fedslice-secagg-{v}-"))
        try:
            results.append(run_variant(args, v, work))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(json.dumps(results[-1])[:2000], flush=True)
    name = f"{args.model}_{args.method}_{'_'.join(args.variants)}".replace("+", "-")
    (args.out / f"{name}.json").write_text(json.dumps({"command": " ".join(sys.argv),
                                                       "results": results}, indent=1))
    text = table(args, results)
    (args.out / f"{name}.md").write_text(text + "\n")
    print(text)
    return 0 if all("error" not in r for r in results) else 1


def settle(seconds: float, below: float) -> None:
    """Wait until the 1-minute load average is below ``below``, at most ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and os.getloadavg()[0] >= below:
        time.sleep(5)


if __name__ == "__main__":
    sys.exit(main())
