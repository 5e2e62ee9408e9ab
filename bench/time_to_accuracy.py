"""Benchmark (issue 59, part 4): time to accuracy on a simulated clock.

A population of clients whose training speeds are log-normal (``--speed-sigma`` 0.9: the
5th-95th percentile spread is 19x) and links too, online ``--availability`` (0.7) of the rounds
(a seeded draw per round and client), dense clients (fedpetuning: LoRA), on two workloads:

* ``sst2``: SST-2 with MiniLM-L6 (dev accuracy, higher is better);
* ``e2e``: E2E NLG with SmolLM2-135M-Instruct (dev loss on the references, lower is better).

Rows, the same federation and seed each:

* ``all``: every selected client. Its dev metric after ``--target-rounds`` (30) rounds is the
  **target**; the simulated time at which it first reached it is ``t*``; it runs on to ``2 t*``;
* ``deadline``: the round deadline at the ``--deadline-quantile`` (0.7) of the client-round
  times ``all`` measured in its first ``--target-rounds`` rounds, 30% over-selection;
* ``async``: FedBuff, ``concurrency`` = 2 x clients per round, ``buffer_size`` = clients per
  round (the library's defaults);
* ``planner``: fedpetuning with ``[budgets]`` and the same deadline as ``deadline``, no
  over-selection: the planner fits each client's local work (examples per step,
  ``budgets.local_work_by = "batch"``) to the deadline on its own device (part 3), so no reply
  is late; a client-round whose first step alone is predicted past the deadline sits the round
  out (sent no work; counted in the report).

Every row stops at ``2 t*`` (the budget). The dev metric is measured on the model *available*
at each time point: ``all`` every ``--all-eval-every`` rounds (and at round 30); the others on
a grid of ``T30 / (30 / all-eval-every)`` simulated seconds (T30 = ``all``'s time at round 30),
each point evaluating the last model published by then, plus the budget point ``2 t*``. Per
row and seed: simulated time to the target (cost to target; its ratio to ``all``'s ``t*``), the
dev metric at ``2 t*`` (quality under budget), wasted client FLOPs (replies dropped) within the
budget, MB uploaded within it, and each client-round's simulated seconds over the planner's
predicted seconds. The summary gives the mean and spread over seeds.

Each (workload, row, seed) run is one piece (a JSON file under ``--out``, written when the
piece completes; an existing one is reused), so a shared machine can run them one at a time;
``deadline`` and ``planner`` read ``all``'s piece (the deadline, the grid, the budget). A piece
keeps a checkpoint of its last round (``NAME.partial/``, every ``--checkpoint-every`` rounds):
one that ``timeout`` ends is written as it stands (not complete; the bench exits with status 3
and starts nothing more) and the same command resumes it from there, exactly as it would have
run on. ``--eval-rounds N`` also measures a row's model every N rounds, and the report then sets
its learning per round against its rounds per simulated second (budget or implementation)::

    flock /tmp/fedslice-heavy.lock python bench/time_to_accuracy.py --seeds 0 --rows all
    flock /tmp/fedslice-heavy.lock python bench/time_to_accuracy.py --seeds 0 --rows deadline async planner
    python bench/time_to_accuracy.py --seeds 0 1 2 --report bench/results/time4/sst2.md

``--report`` writes the table (markdown) and the time-to-accuracy plot beside it (.png: the
seeds' mean against simulated seconds, one line per row).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import sys
import time
import warnings
from pathlib import Path

import numpy as np

ROWS = ("all", "deadline", "async", "planner")
#: main's exit status when `timeout` ended a piece (written as it stands; the same command resumes it)
INTERRUPTED = 3


def parse_variant(variant: str) -> tuple[str, dict]:
    """A row and its setting: ``"planner"`` (the defaults), ``"deadline@p30"`` / ``"planner@p50"``
    (the deadline at that percentile of all's client-round times), ``"planner@p30+fit"``
    (and ``budgets.fit_rounds``), ``"planner@p30+fp16"`` (and ``budgets.upload_dtypes``
    fp32, fp16: the planner may send a client's reply in half precision before it cuts its
    plan), ``"planner@p30+more2"`` (``budgets.max_local_work`` 2: a client whose whole round fits
    with time to spare trains up to twice the local steps), ``"planner@p30+zeros"`` (``lora.padding = "zeros"``: a rank component averaged over
    every client, the missing ones as zeros), ``"async@20x5"`` (concurrency x buffer_size), ``"async@10x5+a1+lr2"`` (and
    ``federation.staleness_exponent`` 1, ``server_lr`` 2), ``"async@10x5+avgm0.9+e0.5"``
    (``server_opt`` fedavgm with momentum 0.9 and step size 0.5; ``+adam0.01``: fedadam with
    step size 0.01). The settings are the user's knobs; every one tried is reported."""
    row, _, setting = variant.partition("@")
    if row not in ROWS:
        raise ValueError(f"unknown row {variant!r}: one of {', '.join(ROWS)}, with @setting")
    if not setting:
        return row, {}
    if row == "planner" and "+" in setting:  # budgets.fit_rounds, budgets.upload_dtypes
        base, *flags = setting.split("+")
        known = {"fit": {"fit_rounds": True}, "fp16": {"upload_dtypes": ["fp32", "fp16"]},
                 "zeros": {"lora_padding": "zeros"}}
        def flag(f: str) -> dict | None:  # +moreX: budgets.max_local_work X
            if f in known:
                return known[f]
            try:
                return {"max_local_work": float(f[4:])} if f.startswith("more") else None
            except ValueError:
                return None
        if base.startswith("p") and flags and all(flag(f) is not None for f in flags):
            out = parse_variant(f"planner@{base}")[1]
            for f in flags:
                out.update(flag(f))
            return row, out
    if row in ("deadline", "planner") and setting.startswith("p"):
        try:
            q = float(setting[1:]) / 100
        except ValueError:
            q = None
        if q is not None:
            if not 0 < q <= 1:
                raise ValueError(f"{variant!r}: the percentile must be in (0, 100]")
            return row, {"quantile": q}
    if row == "async" and "x" in setting:  # CxB, then +aA, +lrL, +avgmM, +adamE, +eE
        sizes, *knobs = setting.split("+")
        keys = (("lr", "server_lr"), ("avgm", "fedavgm"), ("adam", "fedadam"),
                ("a", "staleness_exponent"), ("e", "server_opt_lr"))
        try:
            conc, buf = (int(x) for x in sizes.split("x"))
            out = {"concurrency": conc, "buffer_size": buf}
            for k in knobs:
                prefix, key = next((p, n) for p, n in keys if k.startswith(p))
                value = float(k[len(prefix):])
                if key in ("fedavgm", "fedadam"):  # the server optimizer and its own number
                    out["server_opt"] = {"name": key, **({"momentum": value} if key == "fedavgm"
                                                         else {"lr": value})}
                elif key == "server_opt_lr":
                    out["server_opt_lr"] = value
                else:
                    out[key] = value
            if "server_opt_lr" in out:
                if "server_opt" not in out:
                    raise ValueError
                out["server_opt"]["lr"] = out.pop("server_opt_lr")
            return row, out
        except (ValueError, StopIteration):
            pass
    raise ValueError(f"{variant!r}: a setting is @pNN (deadline, planner; planner@pNN+fit, "
                     "planner@pNN+fp16, +more2, +zeros) or @CxB (async; async@CxB+aA+lrL: staleness exponent A, "
                     "server lr L; +avgmM / +adamE: server_opt fedavgm with momentum M / fedadam "
                     "with step size E, +eE: fedavgm's step size)")

#: workload -> (the config's fixed part, the dev metric, higher is better)
WORKLOADS = {
    "sst2": ({"data": {"path": "sst2", "partition": "iid", "max_test_examples": 16},
              "model": {"name": "minilm"}}, "accuracy", True),
    "e2e": ({"data": {"path": "e2e_nlg", "holdout_fraction": 0.1, "group_column": "mr",
                      "max_test_examples": 4},
             "model": {"name": "smollm2"},
             "task": {"kind": "generation", "prompt": "Describe the restaurant: {mr}\n",
                      "target": "{ref}", "max_new_tokens": 8}}, "loss", False),
}

#: per-workload defaults of the sizing flags (a flag given on the command line wins)
DEFAULTS = {
    "sst2": dict(clients=50, per_round=5, local_steps=2, batch_size=8, max_length=32, lr=3e-3,
                 dev_examples=500, target_rounds=30, all_eval_every=2, gflops=20.0),
    "e2e": dict(clients=20, per_round=4, local_steps=1, batch_size=2, max_length=32, lr=3e-3,
                dev_examples=16, target_rounds=8, all_eval_every=1, gflops=20.0),
}


class Budget(Exception):
    """The piece reached its simulated-time budget (raised from the rounds' driver)."""


class Interrupted(BaseException):
    """The piece was ended from outside (SIGTERM, as `timeout` sends). A BaseException, as
    KeyboardInterrupt is: raised from the signal handler wherever the run happens to be, it
    must pass the library's ``except Exception`` (a reply's validation would count it as a
    malformed reply, drop the client and train on)."""


def base_config(args, seed: int) -> dict:
    fixed, _, _ = WORKLOADS[args.workload]
    d = json.loads(json.dumps(fixed))
    d["data"].update(max_length=args.max_length, max_dev_examples=args.dev_examples)
    if args.workload == "e2e":
        d["task"]["max_target_length"] = args.max_length
    return {
        "name": f"time-{args.workload}", "seed": seed, "threads": args.threads, **d,
        "lora": {"r": 16, "alpha": 32, "targets": ["q", "v"]},
        "method": {"name": "fedpetuning"},
        "federation": {"num_clients": args.clients, "clients_per_round": args.per_round,
                       "rounds": args.max_rounds, "local_steps": args.local_steps,
                       "batch_size": args.batch_size, "lr": args.lr},
        "devices": {"distribution": "lognormal", "gflops_per_s": args.gflops,
                    "upload_mb_per_s": args.upload, "download_mb_per_s": args.download,
                    "availability": args.availability, "speed_sigma": args.speed_sigma},
        # the bench evaluates the model available at its time points itself (Driver)
        "evaluation": {"every": 10 ** 6, "batch_size": 32},
        "output": {"progress": False, "plots": False},
    }


def row_config(args, seed: int, variant: str, ref: dict | None) -> dict:
    row, setting = parse_variant(variant)
    d = base_config(args, seed)
    fed = d["federation"]
    if row in ("deadline", "planner"):
        fed.update(round_policy="deadline", round_deadline_s=ref["deadline_s"],
                   overselect=0.3 if row == "deadline" else 0.0)
    if row == "planner":
        # the deadline applies to every client (round_policy = "deadline"); the tier says it too
        # adapter depths: a client on a slow link sends the top blocks' adapters only (fewer
        # bytes), where even its least local work would not reply in time with every block's
        d["budgets"] = {"tiers": [{"share": 1.0, "name": "everyone",
                                   "seconds_per_round": ref["deadline_s"]}], "local_work_by": "batch",
                        "adapter_depths": args.adapter_depths,
                        "micro_batches": [1], "checkpointing": False,
                        "on_infeasible": args.on_infeasible}
        # ... and a lower LoRA rank where that is not enough (heterogeneous ranks aggregate over
        # the clients that hold each component); a client no allowed plan fits sits out
        # (--on-infeasible sit_out: never selected) or stops the run ('error')
        d["lora"]["ranks"] = args.ranks
        if setting.get("fit_rounds"):
            d["budgets"]["fit_rounds"] = True
        if setting.get("upload_dtypes"):
            d["budgets"]["upload_dtypes"] = setting["upload_dtypes"]
        if setting.get("max_local_work"):
            d["budgets"]["max_local_work"] = setting["max_local_work"]
        if setting.get("lora_padding"):
            d["lora"]["padding"] = setting["lora_padding"]
    if row == "async":
        fed.update(round_policy="async",
                   concurrency=setting.get("concurrency", min(2 * args.per_round, args.clients)),
                   buffer_size=setting.get("buffer_size", args.per_round))
        fed.update({k: setting[k] for k in ("staleness_exponent", "server_lr") if k in setting})
        if "server_opt" in setting:
            d["server_opt"] = dict(setting["server_opt"])
    return d


def piece_path(args, seed: int, variant: str) -> Path:
    name = variant.replace("@", "-").replace("+", "-")
    if variant != "all":  # a piece cut short of 2 t* is a piece of its own
        name += ("" if args.budget_x == 2 else f"-to{args.budget_x:g}t") + ("-stop" if args.stop_at_target else "")
    return args.out / f"{args.workload}-seed{seed}-{name}.json"


def report_piece(args, seed: int, variant: str) -> Path:
    """The piece a report reads for a row: the one ``--budget-x`` / ``--stop-at-target`` name,
    else the row's piece that ran furthest (a full one to 2 t*, else the cut piece with the
    largest budget), so one report covers rows whose pieces were cut at different budgets
    (each row's table cell says how far its piece ran: "rounds to 2t*" counts to its end)."""
    path = piece_path(args, seed, variant)
    if path.is_file() or variant == "all":
        return path
    full = piece_path(argparse.Namespace(**{**vars(args), "budget_x": 2.0, "stop_at_target": False}),
                      seed, variant)
    found = [p for p in [full, *full.parent.glob(f"{full.stem}-to*t*.json"),
                         full.with_name(f"{full.stem}-stop.json")] if p.is_file()]
    if not found:
        return path
    return max(found, key=lambda p: (p == full, json.loads(p.read_text()).get("budget_s") or 0.0))


def variant_ref(args, seed: int, variant: str) -> dict:
    """``all``'s reference (target, t*, budget) with the variant's deadline: the default
    ``--deadline-quantile``'s, or its own percentile of the client-round times ``all`` measured
    in its first ``--target-rounds`` rounds."""
    path = piece_path(args, seed, "all")  # as it ran (an interrupted all is not resumed here)
    piece = json.loads(path.read_text()) if path.is_file() else run_piece(args, seed, "all")
    ref = dict(piece["ref"])
    q = parse_variant(variant)[1].get("quantile")
    if q is not None:
        secs = [m["sim_s"] for r in piece["records"][:args.target_rounds] for m in r["client_metrics"]]
        ref["deadline_s"] = float(np.quantile(secs, q))
    return ref


def better(higher: bool, x: float | None, target: float) -> bool:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return False
    return x >= target - 1e-12 if higher else x <= target + 1e-12


def make_driver(args, method, data, row: str, ref: dict | None):
    """The rounds' driver of one piece (a :class:`Rounds` that evaluates the model available at
    the piece's time points and stops at the budget)."""
    from fedslice.run.session import Rounds

    _, metric, higher = WORKLOADS[args.workload]

    class Driver(Rounds):
        def __init__(self, cfg, checkpoint=None, partial: Path | None = None):
            super().__init__(cfg, method, checkpoint)
            self.partial = partial  # the folder of the piece's checkpoint (None: none kept)
            self.saved = checkpoint.round if checkpoint is not None else 0  # the round it holds
            self.evals: list[dict] = []  # {t, round, metric}: the model available from t on
            # {t, round, metric} every --eval-rounds rounds (a row other than all): its learning
            # per round, against all's (measured every --all-eval-every rounds)
            self.round_evals: list[dict] = []
            self.measured: dict[int, float] = {}  # round -> its model's dev metric
            self.prev: tuple[int, dict] | None = None  # (round, state) published before this one
            self.target = self.t_star = self.t_target = None
            self.stopped_at_target = False
            if ref is not None:
                self.budget = args.budget_x * ref["t_star"]
                g = ref["t_target"] / (args.target_rounds / args.all_eval_every)
                pts = list(np.arange(1, math.floor(self.budget / g) + 1) * g) + [self.budget]
                self.points = sorted({round(float(p), 9) for p in pts})
            else:
                self.budget, self.points = math.inf, []
            if checkpoint is not None:  # a resumed piece: where it stood after that round
                b = checkpoint.server["bench"]
                self.evals, self.round_evals, self.points = b["evals"], b["round_evals"], b["points"]
                self.measured = {int(k): v for k, v in b["measured"]}
                self.budget = math.inf if b["budget"] is None else b["budget"]
                self.target, self.t_star, self.t_target = b["target"], b["t_star"], b["t_target"]

        def initial_state(self, selector, clock=None):
            state = super().initial_state(selector, clock)
            if self.checkpoint is not None:  # the model published last before the interruption
                self.prev = (self.checkpoint.round, state)
            return state

        def save(self, rnd: int, state: dict, selector, clock) -> None:
            """The piece's checkpoint after round ``rnd``: the library's (the global state, the
            server's, the selector's and the clock's: what is in flight; the RNGs) with what
            this driver has measured, in one file written atomically."""
            from fedslice.run.checkpoint import capture, write_checkpoint

            ckpt = capture(rnd, self.cfg.model_dump(mode="json"), method, selector, state,
                           self.records, self.elapsed(), clock)
            ckpt.server["bench"] = {
                "evals": self.evals, "round_evals": self.round_evals, "points": self.points,
                "measured": [[k, v] for k, v in self.measured.items()],
                "budget": None if math.isinf(self.budget) else self.budget,
                "target": self.target, "t_star": self.t_star, "t_target": self.t_target}
            self.partial.mkdir(parents=True, exist_ok=True)
            write_checkpoint(self.partial, ckpt)
            self.saved = rnd

        def measure(self, rnd: int, state: dict) -> float:
            """Round ``rnd``'s model's dev metric (each model measured once)."""
            if rnd in self.measured:
                return self.measured[rnd]
            if metric == "loss" and hasattr(method.task, "target_nll"):
                # a generative task: the loss on the references only (no generations)
                from fedslice.tasks.text2text import eval_mode

                model = method.eval_model(state)
                with eval_mode(model), method.compute.autocast():
                    value = method.task.target_nll(model, data.dev, args.eval_batch_size)
            else:
                value = method.evaluate(state, data.dev, args.eval_batch_size)[metric]
            self.measured[rnd] = float(value)
            return self.measured[rnd]

        def evaluate(self, rnd: int, state: dict, t: float) -> None:
            self.evals.append({"t": t, "round": rnd, "metric": self.measure(rnd, state)})

        def round_done(self, rnd, state, record, selector, clock=None):
            super().round_done(rnd, state, record, selector, clock)
            now = record["sim_time_s"]
            while self.points and self.points[0] < now - 1e-9:  # passed before this round ended
                p = self.points.pop(0)
                if self.prev is not None:
                    self.evaluate(*self.prev, p)
            if self.points and abs(self.points[0] - now) <= 1e-9:
                self.evaluate(rnd, state, self.points.pop(0))
            if ref is not None and args.eval_rounds and rnd % args.eval_rounds == 0:
                self.round_evals.append({"t": now, "round": rnd, "metric": self.measure(rnd, state)})
            if ref is None and (rnd % args.all_eval_every == 0 or rnd == args.target_rounds):
                self.evaluate(rnd, state, now)
            if ref is None and rnd == args.target_rounds:
                sm = smoothed(self.evals, args.smooth)
                self.target, self.t_target = sm[-1], now
                self.t_star = next(e["t"] for e, v in zip(self.evals, sm) if better(higher, v, self.target))
                self.budget = 2 * self.t_star
                self.points = [self.budget] if self.budget > now + 1e-9 else []
            self.prev = (rnd, state)
            print(f"  round {rnd}: sim {now:.1f} s, wall {self.elapsed():.0f} s"
                  + (f", dev {metric} {self.evals[-1]['metric']:.4f} (t={self.evals[-1]['t']:.1f})"
                     if self.evals else ""), flush=True)
            if ref is not None and args.stop_at_target and self.evals \
                    and better(higher, smoothed(self.evals, args.smooth)[-1], ref["target"]):
                self.stopped_at_target = True  # the time to the target is known: no more needed
                raise Budget
            if now >= self.budget - 1e-9 and not self.points:
                raise Budget
            if self.partial is not None and args.checkpoint_every and rnd % args.checkpoint_every == 0:
                self.save(rnd, state, selector, clock)

    return Driver


def partial_path(path: Path) -> Path:
    """The folder of a piece's checkpoint (kept after every ``--checkpoint-every`` rounds until
    the piece completes): a piece that ``timeout`` ended resumes from it."""
    return path.with_suffix(".partial")


def to_run(path: Path) -> bool:
    """A piece not run yet, or interrupted with a checkpoint to resume from."""
    from fedslice.run.checkpoint import CHECKPOINT

    return not path.is_file() or (not json.loads(path.read_text())["complete"]
                                  and (partial_path(path) / CHECKPOINT).is_file())


def run_piece(args, seed: int, variant: str) -> dict:
    """One (workload, row and setting, seed) run, cached as JSON under --out. A piece that was
    interrupted (``timeout``) is written as it stands (not complete) and resumed by the next
    call from its checkpoint, exactly as it would have run on."""
    path = piece_path(args, seed, variant)
    partial = partial_path(path)
    if not to_run(path):
        piece = json.loads(path.read_text())
        if variant != "all" and getattr(args, "eval_rounds", 0) and "round_evals" not in piece:
            print(f"  {path.name}: reused as it ran, without --eval-rounds' measurements", flush=True)
        return piece
    from fedslice.api import setup
    from fedslice.experiment import validate_config
    from fedslice.run.asynchronous import simulation_for
    from fedslice.run.checkpoint import CHECKPOINT, check_same_config, read_checkpoint

    row = parse_variant(variant)[0]
    ref = None if row == "all" else variant_ref(args, seed, variant)
    cfg = validate_config(row_config(args, seed, variant, ref))
    checkpoint = None
    if (partial / CHECKPOINT).is_file():
        checkpoint = read_checkpoint(partial)
        check_same_config(checkpoint.config, cfg.model_dump(mode="json"), partial)
        print(f"  resumed after round {checkpoint.round} ({partial})", flush=True)
    t0 = time.perf_counter()
    method, data = setup(cfg)
    driver = make_driver(args, method, data, row, ref)(cfg, checkpoint,
                                                       partial if args.checkpoint_every else None)
    complete = interrupted_ = False

    def interrupted(signum, frame):  # `timeout` ends the piece: keep what it measured
        raise Interrupted

    previous = signal.signal(signal.SIGTERM, interrupted)
    try:
        simulation_for(cfg, method, data).run(driver)
    except Budget:
        complete = True
    except Interrupted:
        interrupted_ = True
        print(f"  interrupted at round {len(driver.records)}: the piece is written as it stands "
              "(not complete)" + (f"; the same command resumes it after round {driver.saved}"
                                  if driver.saved else ""), flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not interrupted_ and partial.is_dir():  # ended (the budget, the round cap): nothing to resume
        shutil.rmtree(partial)
    records = driver.records
    slim = [{k: r.get(k) for k in ("round", "sim_time_s", "sim_round_s", "wasted_flops",
                                   "round_flops", "staleness_mean", "examples_used", "sat_out",
                                   "rounds_fitted")}
            | {"bytes_up": sum(m.get("bytes_up") or 0 for m in r["client_metrics"]),
               "client_metrics": [{k: m.get(k) for k in ("client", "sim_s", "sim_s_predicted", "sim_s_planned",
                                                         "used", "examples", "examples_trained", "steps_cut", "tokens",
                                                         "flops_measured", "bytes_up", "bytes_down")}
                                  for m in r["client_metrics"]]}
            for r in records]
    out = {"workload": args.workload, "row": row, "variant": variant, "seed": seed,
           "complete": complete, "config": row_config(args, seed, variant, ref), "records": slim, "evals": driver.evals,
           **({"round_evals": driver.round_evals} if driver.round_evals else {}),
           "wall_s_loaded_machine": time.perf_counter() - t0 + (checkpoint.elapsed_s if checkpoint else 0.0),
           "budget_s": driver.budget, "stopped_at_target": driver.stopped_at_target,
           **({"interrupted": True} if interrupted_ else {})}
    if row == "all":
        secs = [m["sim_s"] for r in records[:args.target_rounds] for m in r["client_metrics"]]
        out["ref"] = {"target": driver.target, "t_star": driver.t_star, "t_target": driver.t_target,
                      "deadline_s": float(np.quantile(secs, args.deadline_quantile))}
    else:
        out["ref"] = ref
    if method.plans:
        out["plans"] = {str(c): {"seconds": p.seconds, "batch": p.knobs.batch,
                                 "rank": p.knobs.rank, "depth": p.knobs.depth, "upload": p.knobs.upload, "steps": p.knobs.steps,
                                 "gflops_per_round": p.gflops_per_round, "sits_out": p.sits_out}
                        for c, p in method.plans.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    tmp.replace(path)
    return out


# -- the summary ---------------------------------------------------------------------------------
def smoothed(evals: list[dict], k: int) -> list[float]:
    """Each measurement's running mean with the ``k - 1`` before it (fewer at the start): a
    dev set of a few hundred examples moves by a few points from one evaluation to the next,
    and a first crossing of the raw curve would time a lucky measurement."""
    m = [e["metric"] for e in evals]
    return [float(np.mean(m[max(0, i - k + 1):i + 1])) for i in range(len(m))]


def at_time(evals: list[dict], t: float, k: int = 1) -> float | None:
    """The (smoothed) dev metric of the model available at simulated time ``t`` (None: not
    measured)."""
    sm = smoothed(evals, k)
    done = [v for e, v in zip(evals, sm) if e["t"] <= t + 1e-9]
    return done[-1] if done else None


def time_to(evals: list[dict], target: float, higher: bool, k: int = 1) -> float | None:
    """The first time the (smoothed) dev metric reached ``target``."""
    return next((e["t"] for e, v in zip(evals, smoothed(evals, k)) if better(higher, v, target)), None)


def piece_stats(piece: dict, higher: bool, k: int) -> dict:
    ref = piece["ref"]
    budget = 2 * ref["t_star"]
    short = (piece.get("stopped_at_target") or piece.get("budget_s", budget) < budget - 1e-9
             or not piece["complete"])
    recs = [r for r in piece["records"] if r["sim_time_s"] <= budget + 1e-9]
    wasted = sum(r["wasted_flops"] or 0 for r in recs)
    total = sum(r["round_flops"] or 0 for r in recs)
    ratios = [m["sim_s"] / m["sim_s_predicted"] for r in recs for m in r["client_metrics"]
              if m.get("sim_s_predicted")]
    sat = sum(r.get("sat_out") or 0 for r in recs)
    sent = sum(len(r["client_metrics"]) for r in recs)
    tt = time_to(piece["evals"], ref["target"], higher, k)
    return {"rounds": len(recs), "t_to": tt, "ratio": None if tt is None else tt / ref["t_star"],
            "at_budget": None if short else at_time(piece["evals"], budget, k), "target": ref["target"],
            "wasted": wasted / total if total else 0.0,
            "upload_mb": sum(r["bytes_up"] for r in recs) / 1e6, "sim_pred": ratios,
            "sat_out": sat, "sent": sent, "deadline_s": ref.get("deadline_s"),
            "complete": piece["complete"]}


def _ms(xs: list[float | None], fmt: str) -> str:
    """mean ± standard deviation over seeds (n shown when some seed has none)."""
    v = [x for x in xs if x is not None and math.isfinite(x)]
    if not v:
        return "-"
    s = format(float(np.mean(v)), fmt)
    if len(v) > 1:
        s += " ± " + format(float(np.std(v, ddof=1)), fmt)
    if len(v) < len(xs):
        s += f" ({len(v)} of {len(xs)})"
    return s


def summarize(args) -> str:
    _, metric, higher = WORKLOADS[args.workload]
    variants = report_variants(args)
    stats: dict[str, list[dict]] = {r: [] for r in variants}
    seeds_of: dict[str, list[int]] = {r: [] for r in variants}
    per_seed = []
    for seed in args.seeds:
        if not piece_path(args, seed, "all").is_file():
            continue
        all_stats = None
        for row in variants:
            p = report_piece(args, seed, row)
            if not p.is_file():
                continue
            st = piece_stats(json.loads(p.read_text()), higher, args.smooth)
            if row == "all":
                all_stats = st
            st["delta"] = (None if st["at_budget"] is None or all_stats["at_budget"] is None
                           else (st["at_budget"] - all_stats["at_budget"]) * (100 if higher else 1))
            stats[row].append(st)
            seeds_of[row].append(seed)
            tt = "-" if st["t_to"] is None else f"{st['t_to']:.1f} ({st['ratio']:.2f}x)"
            per_seed.append(
                f"| {seed} | {row} | {st['rounds']} | {st['target']:.4f} | {tt} | "
                f"{_f(st['at_budget'])} | {st['wasted']:.1%} | {st['upload_mb']:.1f} |"
                + ("" if st["complete"] else " (not complete: the round cap or interrupted)"))
    unit = "pt" if higher else "nats"
    head = (f"| row | seeds | deadline s | rounds to 2t* | sim s to target | x all's t* | dev {metric} at 2t* | "
            f"vs all at 2t* ({unit}) | wasted FLOPs | upload MB to 2t* | client-round sim/pred "
            "(p5, median, p95; share within 10%) |\n|---|---|---|---|---|---|---|---|---|---|---|")
    lines = []
    for row in variants:
        st = stats[row]
        if not st:
            continue
        sp = [x for s in st for x in s["sim_pred"]]
        pred = ("-" if not sp else
                f"{np.percentile(sp, 5):.3f}, {np.median(sp):.3f}, {np.percentile(sp, 95):.3f}; "
                f"{np.mean(np.abs(np.asarray(sp) - 1) <= 0.1):.0%} of {len(sp)}")
        dl = ("-" if parse_variant(row)[0] not in ("deadline", "planner")
              else _ms([s["deadline_s"] for s in st], '.2f'))
        lines.append(f"| {row} | {','.join(map(str, seeds_of[row]))} | {dl} | "
                     f"{_ms([s['rounds'] for s in st], '.0f')} | {_ms([s['t_to'] for s in st], '.1f')} | "
                     f"{_ms([s['ratio'] for s in st], '.2f')} | {_ms([s['at_budget'] for s in st], '.4f')} | "
                     f"{'-' if row == 'all' else _ms([s['delta'] for s in st], '+.2f')} | "
                     f"{_ms([s['wasted'] for s in st], '.3f')} | {_ms([s['upload_mb'] for s in st], '.1f')} | "
                     f"{pred} |")
    sat = [f"{row}: {sum(s['sat_out'] for s in stats[row])} of "
           f"{sum(s['sat_out'] + s['sent'] for s in stats[row])} client-rounds"
           for row in variants if any(s["sat_out"] for s in stats[row])]
    sat_line = ("Sat out (predicted past the deadline after their first step, sent no work): "
                + "; ".join(sat) + ".\n\n") if sat else ""
    detail = ("| seed | row | rounds to 2t* | target | sim s to target (x all's t*) | "
              f"dev {metric} at 2t* | wasted FLOPs | upload MB |\n|---|---|---|---|---|---|---|---|")
    return (head + "\n" + "\n".join(lines) + "\n\n" + sat_line + prediction_breakdown(args)
            + "\nTime to lower targets (the seeds' mean ± sd; x: over all's time to the same):\n\n"
            + below_target(args) + per_round(args)
            + "\nPer seed:\n\n" + detail + "\n" + "\n".join(per_seed) + "\n")


def prediction_breakdown(args) -> str:
    """Where a planner client-round's simulated seconds depart from the prediction: the FLOPs it
    trained over the plan's predicted FLOPs, and its padded tokens over the mean tokens of the
    clients' rounds of the same plan (a round's batches vary in length; the planner predicts
    their mean). The links' seconds are exact (bytes / rate), so when the FLOPs ratio follows
    the tokens ratio the clock and the planner's costs agree and the spread is the data's."""
    rows = []
    for seed, variant in [(s, v) for s in args.seeds for v in report_variants(args)
                          if parse_variant(v)[0] == "planner"]:
        p = report_piece(args, seed, variant)
        if not p.is_file():
            continue
        piece = json.loads(p.read_text())
        plans = piece.get("plans", {})
        budget = 2 * piece["ref"]["t_star"]
        ms = [m for r in piece["records"] if r["sim_time_s"] <= budget + 1e-9
              for m in r["client_metrics"] if m.get("sim_s_predicted") and m.get("flops_measured")]
        by_batch: dict = {}
        for m in ms:
            by_batch.setdefault(plans[str(m["client"])]["batch"], []).append(m["tokens"])
        for m in ms:
            plan = plans[str(m["client"])]
            rows.append((m["sim_s"] / m["sim_s_predicted"],
                         m["flops_measured"] / (plan["gflops_per_round"] * 1e9),
                         m["tokens"] / np.mean(by_batch[plan["batch"]]), m.get("steps_cut") or 0,
                         m["sim_s"] / (m.get("sim_s_planned") or m["sim_s_predicted"])))
    if not rows:
        return ""
    a = np.asarray(rows, dtype=float)
    corr = float(np.corrcoef(a[:, 1], a[:, 2])[0, 1]) if len(a) > 2 else float("nan")
    q = lambda x: f"{np.percentile(x, 5):.3f} / {np.median(x):.3f} / {np.percentile(x, 95):.3f}"
    return (f"Planner client-rounds ({len(a)}): simulated / predicted seconds (p5 / median / p95) "
            f"{q(a[:, 0])}, within 10%: {np.mean(np.abs(a[:, 0] - 1) <= 0.1):.0%}, within 1%: "
            f"{np.mean(np.abs(a[:, 0] - 1) <= 0.01):.0%} (each round predicted from its own batches); "
            f"over the plan's mean round's seconds {q(a[:, 4])}, within 10%: "
            f"{np.mean(np.abs(a[:, 4] - 1) <= 0.1):.0%}; measured / the plan's mean FLOPs {q(a[:, 1])}; the round's padded tokens / "
            f"the mean of its plan's rounds {q(a[:, 2])}; correlation of the FLOPs ratio with the "
            f"tokens ratio {corr:.3f}; client-rounds with a step cut by the FLOPs budget "
            f"{int((a[:, 3] > 0).sum())}.\n")


def below_target(args) -> str:
    """Simulated time to targets below all's round-30 value (by ``--below`` points; on a loss,
    above it), each row's over all's time to the same: where the curves still climb the ratio
    measures speed; at the plateau all reaches in 30 rounds it measures the dev set's noise."""
    _, metric, higher = WORKLOADS[args.workload]
    scale = 100 if higher else 1
    variants = report_variants(args)
    head = ("| target | " + " | ".join(f"{r}: sim s (x all's)" for r in variants) + " |\n|---|"
            + "---|" * len(variants))
    lines = []
    for gap in args.below:
        cells = {r: [] for r in variants}
        for seed in args.seeds:
            if not piece_path(args, seed, "all").is_file():
                continue
            pieces = {r: json.loads(report_piece(args, seed, r).read_text()) for r in variants
                      if report_piece(args, seed, r).is_file()}
            ref = pieces["all"]["ref"]
            thr = ref["target"] - gap / scale if higher else ref["target"] + gap
            t_all = time_to(pieces["all"]["evals"], thr, higher, args.smooth)
            for r, p in pieces.items():
                budget = 2 * ref["t_star"]
                t = time_to([e for e in p["evals"] if e["t"] <= budget + 1e-9], thr, higher, args.smooth)
                cells[r].append((t, None if t is None or not t_all else t / t_all))
        lines.append(f"| all's round-{args.target_rounds} value {'-' if higher else '+'} {gap:g} "
                     f"{'pt' if higher else 'nats'} | "
                     + " | ".join(f"{_ms([t for t, _ in c], '.1f')} ({_ms([x for _, x in c], '.2f')})"
                                  if c else "-" for c in cells.values()) + " |")
    return head + "\n" + "\n".join(lines) + "\n"


def by_round(evals: list[dict]) -> dict[int, float]:
    """Each measured round's dev metric (a model measured at several time points counts once)."""
    return {e["round"]: e["metric"] for e in evals}


def per_round(args) -> str:
    """Speed against learning, for the rows measured every ``--eval-rounds`` rounds: a row's
    simulated time to a target is its rounds to it times its seconds per round, so it is slower
    or faster than all's either because its rounds are (the policy, the deadline, the plans'
    fit: the implementation) or because a round of it learns less (sub-models, stale or dropped
    replies: what the budget costs). Per seed: rounds and examples trained per simulated second
    (x all's), a round's length over the deadline and the clients' busy share of it, the dev
    metric minus all's at the same rounds (up to all's target round, and after it), and the
    round at which the row's running mean over the same rounds as all's (``--smooth``
    measurements ``--all-eval-every`` rounds apart) reaches the target, with its simulated time
    over all's t*."""
    _, metric, higher = WORKLOADS[args.workload]
    scale = 100 if higher else 1
    lines = []
    for seed in args.seeds:
        if not piece_path(args, seed, "all").is_file():
            continue
        base = json.loads(piece_path(args, seed, "all").read_text())
        ref, all_curve = base["ref"], by_round(base["evals"])
        t_star_round = next(e["round"] for e in base["evals"] if abs(e["t"] - ref["t_star"]) < 1e-9)
        for v in report_variants(args)[1:]:
            p = report_piece(args, seed, v)
            piece = json.loads(p.read_text()) if p.is_file() else {}
            if not piece.get("round_evals"):
                continue
            pace = {}
            for name, recs in (("all", base["records"]), ("row", piece["records"])):
                end = recs[-1]["sim_time_s"]
                ex = sum(m.get("examples_trained") or 0 for r in recs for m in r["client_metrics"]
                         if m.get("used") is not False)
                pace[name] = (len(recs) / end, ex / end)
            rows_ = piece["records"]
            dl = piece["ref"].get("deadline_s") if parse_variant(v)[0] in ("deadline", "planner") else None
            span = (f"{np.mean([r['sim_round_s'] for r in rows_]) / dl:.2f}" if dl else "-")
            busy = ("-" if parse_variant(v)[0] == "async" else  # versions, not rounds clients wait in
                    f"{np.mean([np.mean([m['sim_s'] for m in r['client_metrics']]) / r['sim_round_s'] for r in rows_ if r['client_metrics'] and r['sim_round_s']]):.2f}")
            curve = by_round(piece["round_evals"])
            diffs = [(r, (curve[r] - all_curve[r]) * scale) for r in sorted(curve) if r in all_curve]
            early = [d for r, d in diffs if r <= args.target_rounds]
            late = [d for r, d in diffs if r > args.target_rounds]
            rounds = [e for e in piece["round_evals"] if e["round"] % args.all_eval_every == 0]
            hit = next((e for e, x in zip(rounds, smoothed(rounds, args.smooth))
                        if better(higher, x, ref["target"])), None)
            d = lambda xs: "-" if not xs else f"{np.mean(xs):+.2f} ({len(xs)})"
            lines.append(
                f"| {v} | {seed} | {pace['row'][0] / pace['all'][0]:.2f} | "
                f"{pace['row'][1] / pace['all'][1]:.2f} | {span} | {busy} | {d(early)} | {d(late)} | "
                + (f"{hit['round']} (all: {t_star_round}) | {hit['t']:.1f} ({hit['t'] / ref['t_star']:.2f}x) |"
                   if hit else f"not by round {piece['round_evals'][-1]['round']} (all: {t_star_round}) | - |"))
    if not lines:
        return ""
    unit = "pt" if higher else "nats"
    return ("\nLearning per round against speed (rows measured every round or few: "
            f"--eval-rounds; all measured every {args.all_eval_every} rounds; x: over all's):\n\n"
            f"| row | seed | rounds per sim s (x) | examples per sim s (x) | mean round / deadline | "
            f"clients' busy share of a round | dev {metric} - all's at the same round, rounds <= "
            f"{args.target_rounds} ({unit}, n) | after | round reaching the target, running mean over "
            f"all's rounds | its sim s (x all's t*) |\n|---|---|---|---|---|---|---|---|---|---|\n"
            + "\n".join(lines) + "\n")


def report_variants(args, rows: list[str] | None = None) -> list[str]:
    """The variants a report covers (``rows``, default ``--rows``): ``all`` first, then the
    others in their order."""
    return ["all"] + [v for v in dict.fromkeys(rows or args.rows) if v != "all"]


def mean_curves(args) -> dict[str, tuple[np.ndarray, np.ndarray, int]]:
    """Each row's dev metric on a common simulated-time grid (0 .. the smallest budget over the
    seeds), the seeds' mean (the model available at each time; before a row's first
    measurement, the initial model's value is not known and the curve starts later)."""
    pieces = {r: [json.loads(report_piece(args, s, r).read_text()) for s in args.seeds
                  if report_piece(args, s, r).is_file()] for r in report_variants(args, args.plot_rows)}
    if not pieces["all"]:
        return {}
    end = min(2 * p["ref"]["t_star"] for p in pieces["all"])
    grid = np.linspace(0, end, 200)
    out = {}
    for r, ps in pieces.items():
        if not ps:
            continue
        # a piece cut short (--budget-x, --stop-at-target) is drawn to its last measurement
        vals = np.array([[np.nan if (v := at_time(p["evals"], t, args.smooth)) is None
                          or t > p["evals"][-1]["t"] + 1e-9 else v for t in grid] for p in ps])
        with warnings.catch_warnings():  # a time no seed has measured yet: NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            out[r] = (grid, np.nanmean(vals, axis=0), len(ps))
    return out


def plot(args, path: Path) -> Path:
    from fedslice.report import figure, save_figure
    from matplotlib.ticker import AutoLocator

    _, metric, higher = WORKLOADS[args.workload]
    curves = mean_curves(args)
    fig, (ax,) = figure(ncols=1, width=6.0, height=4.0)
    for r, (x, y, n) in curves.items():
        keep = ~np.isnan(y)
        ax.plot(x[keep], y[keep], label=f"{r} ({n} seed{'s' if n > 1 else ''})",
                drawstyle="steps-post")
    targets = [json.loads(piece_path(args, s, "all").read_text())["ref"]["target"]
               for s in args.seeds if piece_path(args, s, "all").is_file()]
    if targets:
        ax.axhline(float(np.mean(targets)), color="grey", lw=0.8, ls=":",
                   label="target (all, round 30; mean)" if args.workload == "sst2" else "target (mean)")
    ax.xaxis.set_major_locator(AutoLocator())
    ax.set(xlabel="simulated seconds", ylabel=f"dev {metric}",
           title=f"{args.workload}: dev {metric} against simulated time (seeds' mean)")
    ax.legend()
    return save_figure(fig, path)


def _f(x):
    return "-" if x is None else f"{x:.4f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="sst2")
    ap.add_argument("--out", type=Path, default=Path("bench/results/time6"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rows", nargs="+", default=list(ROWS),
                    help="rows, each with an optional setting: deadline@p30, planner@p50 (the "
                    "deadline at that percentile of all's client-round times), planner@p50+fit "
                    "(and budgets.fit_rounds), async@20x5 (concurrency x buffer_size), "
                    "async@10x5+a1+lr2 (staleness exponent 1, server lr 2)")
    ap.add_argument("--plot-rows", nargs="+", help="the rows the plot shows (default: --rows)")
    ap.add_argument("--clients", type=int)
    ap.add_argument("--per-round", type=int)
    ap.add_argument("--local-steps", type=int)
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--max-length", type=int)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--dev-examples", type=int)
    ap.add_argument("--eval-batch-size", type=int, default=128)
    ap.add_argument("--target-rounds", type=int, help="all's rounds that set the target")
    ap.add_argument("--all-eval-every", type=int)
    ap.add_argument("--adapter-depths", type=float, nargs="+", default=[1.0, 0.5, 0.25],
                    help="the planner row's budgets.adapter_depths")
    ap.add_argument("--on-infeasible", choices=["error", "sit_out"], default="error",
                    help="the planner row's budgets.on_infeasible: with a floor (--ranks and "
                    "--adapter-depths without the small values), 'sit_out' leaves out the "
                    "clients no allowed plan fits within the deadline")
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 8, 4, 2],
                    help="the planner row's lora.ranks")
    ap.add_argument("--below", type=float, nargs="+", help="also report the time to all's "
                    "target less these points (default 1 3 5); a loss: plus these nats (default "
                    "0.05 0.1 0.2)")
    ap.add_argument("--smooth", type=int, default=3, help="the dev metric is the running mean of "
                    "this many measurements (the target, the time to it, the value at the budget)")
    ap.add_argument("--budget-x", type=float, default=2.0, help="the rows other than all run to "
                    "this many t* (2: the quality-under-budget point; less: a cheaper piece that "
                    "gives the time to the target only where it is reached by then)")
    ap.add_argument("--stop-at-target", action="store_true", help="a row other than all stops "
                    "once its (smoothed) dev metric reaches the target (the time to it known; no "
                    "value at 2 t*)")
    ap.add_argument("--eval-rounds", type=int, default=0, help="a row other than all also "
                    "measures its model every this many rounds (the piece's round_evals; 0: not): "
                    "the report then compares its learning per round with all's (measured every "
                    "--all-eval-every rounds) and its speed in rounds per simulated second")
    ap.add_argument("--max-rounds", type=int, default=600, help="a piece stops here at the latest")
    ap.add_argument("--checkpoint-every", type=int, default=1, help="a piece keeps a checkpoint "
                    "every this many rounds (beside it: NAME.partial/, removed once it ends), from "
                    "which the same command resumes it after a timeout (0: none)")
    ap.add_argument("--gflops", type=float, help="median training GFLOP/s")
    ap.add_argument("--speed-sigma", type=float, default=0.9)
    ap.add_argument("--upload", type=float, default=1.0, help="median MB/s up")
    ap.add_argument("--download", type=float, default=5.0, help="median MB/s down")
    ap.add_argument("--availability", type=float, default=0.7)
    ap.add_argument("--deadline-quantile", type=float, default=0.7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--report", type=Path, help="write the table (markdown) here, and the "
                    "time-to-accuracy plot beside it (.png), from the pieces that have run "
                    "(none is started: run them under the heavy-run lock first)")
    args = ap.parse_args(argv)
    for v in args.rows + (args.plot_rows or []):
        try:
            parse_variant(v)
        except ValueError as e:
            ap.error(str(e))
    for k, v in DEFAULTS[args.workload].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.below is None:  # easier targets: points of accuracy, or nats of a loss
        args.below = [1.0, 3.0, 5.0] if WORKLOADS[args.workload][2] else [0.05, 0.1, 0.2]
    for seed in args.seeds:
        for row in sorted(args.rows, key=lambda v: v != "all"):  # all first: the others read its piece
            if row != "all" and not piece_path(args, seed, "all").is_file():
                print(f"{args.workload} seed {seed} {row}: skipped (run all first: --rows all)")
                continue
            if args.report:  # a report reads what has run; it never starts a piece
                if not report_piece(args, seed, row).is_file():
                    print(f"{args.workload} seed {seed} {row}: not run yet (left out)")
                    continue
            elif to_run(piece_path(args, seed, row)):
                print(f"{args.workload} seed {seed} {row}: running", flush=True)
                if run_piece(args, seed, row).get("interrupted"):  # timeout: start nothing more
                    print(f"{args.workload} seed {seed} {row}: interrupted; the same command "
                          "resumes it", flush=True)
                    return INTERRUPTED
            print(f"{args.workload} seed {seed} {row}: done", flush=True)
    table = summarize(args)
    print(table)
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(table)
        print("plot:", plot(args, args.report.with_suffix(".png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
