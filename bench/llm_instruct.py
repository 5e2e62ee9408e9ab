"""Benchmark (issue 57, part 5): federated instruction tuning of SmolLM2-135M-Instruct on
Alpaca-GPT4, dense LoRA against int8 and the planner's budgets, scored with lm-evaluation-harness.

Set-up: ``configs/instruct_alpaca_smollm2.toml`` (the dense row): FlowerTune's LoRA shape
(r 32, alpha 64) on q and v, 20 IID clients of ``alpaca-gpt4-demo``
(``bench/data/instruction_sets.py``), conversations of at most 128 tokens rendered with
SmolLM2's chat template, the loss on the assistant's tokens; ``--rounds`` rounds of
``--per-round`` clients, ``--local-steps`` AdamW steps of 4 conversations each.

Rows (each its own piece, resumable: a row whose result file exists is skipped unless
``--again``):

  base      the untrained model: held-out assistant loss (test split) and harness scores
  dense     FedPETuning, every client the whole model (fp32 base)
  int8      the same over an int8 base (``model.quantize = "int8"``)
  p30, p50  the planner (``[budgets]``, method fedpetuning: LoRA rank 8/16/32, an int8 copy of
            the base, adapters in the top half of the blocks, local work (``--local-work-by``:
            fewer steps, then fewer conversations in one), checkpointing and micro-batches),
            every client at 30% / 50% of the dense row's measured peak memory and training
            FLOPs per client-round
  mixed     the planner over a population of thirds at 30%, 50% and 100%
  natural-base, natural   the base and the dense row on ``alpaca-eval-gpt4`` split naturally by
            its ``dataset`` column (5 clients: selfinstruct, oasst, koala, helpful_base, vicuna;
            ``configs/instruct_natural_smollm2.toml``)
  alone     plans only (no training): at 30% (``--alone-budgets``), the planner with one knob family at a
            time (checkpointing + micro-batches; int8 base; LoRA rank; local work; adapter
            depth), and whether it fits (the planner's predicted costs)

Every trained row, then ``--harness`` (comma-separated lm_eval tasks, fedslice's local ones, the
first ``--limit`` examples, zero-shot) on its final model (adapter merged; applied over the int8
base for int8), through ``fedslice.harness.evaluate_harness`` (what ``fedslice evaluate --harness``
runs). ``--stage train`` or ``--stage harness`` runs one half of each asked row.

Columns: harness scores, held-out assistant loss (nats per assistant token of the 48 test
conversations), client peak memory (the largest client's measured peak: model + gradients +
AdamW state + saved activations, ``memory_mb_max``), training GFLOPs and upload MB per
client-round, and the training process's CPU seconds (wall time is not reported: the machine
is shared). Writes ``<out>/<row>.json`` and ``<out>/results.md``.

    python bench/data/instruction_sets.py
    flock /tmp/fedslice-heavy.lock python bench/llm_instruct.py --rows base dense
    flock /tmp/fedslice-heavy.lock python bench/llm_instruct.py --rows int8 p30 p50 mixed
    flock /tmp/fedslice-heavy.lock python bench/llm_instruct.py --rows natural-base natural alone
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"alpaca": ROOT / "configs/instruct_alpaca_smollm2.toml",
           "natural": ROOT / "configs/instruct_natural_smollm2.toml"}
TASKS = "arc_easy_local,mmlu_local"
#: the planner's knobs in the budget rows (fedpetuning's stages)
PLANNER = {"precisions": ["none", "int8"], "adapter_depths": [1.0, 0.5],
           "local_work": [1.0, 0.75, 0.5, 0.375, 0.25], "checkpointing": True,
           "micro_batches": [1, 2, 4]}
RANKS = [8, 16, 32]
#: the "alone" plans: one knob family each (the others held at the dense row's setting)
ALONE = {
    "checkpointing+micro-batches": {},
    "int8 base": {"precisions": ["none", "int8"]},
    "LoRA rank": {"ranks": RANKS},
    "local work": {"local_work": PLANNER["local_work"]},
    "adapter depth": {"adapter_depths": [1.0, 0.5]},
}
ROWS = ("base", "dense", "int8", "p30", "p50", "mixed", "natural-base", "natural", "alone")


def base_config(args, which: str = "alpaca") -> dict:
    from fedslice.experiment import load_config

    cfg = load_config(CONFIGS[which]).model_dump(mode="json")
    cfg["seed"], cfg["threads"] = args.seed, args.threads
    cfg["federation"].update(rounds=args.rounds, clients_per_round=args.per_round,
                             local_steps=args.local_steps)
    cfg["evaluation"]["every"] = args.rounds
    if cfg["data"]["partition"] == "natural":  # the dump spells out the default: taken from the data
        cfg["federation"].pop("num_clients", None)
    # a checkpoint every round: a piece stopped by its time limit resumes (``train_row``)
    cfg["output"].update(progress=False, plots=False, checkpoint_every=1)
    return cfg


def tier(f: float, dense: dict, share: float = 1.0) -> dict:
    """A tier at ``f`` of the dense client's measured peak memory and FLOPs per round."""
    return {"name": f"{f:.0%}", "share": share, "memory_mb": round(f * dense["memory_mb"], 1),
            "gflops_per_round": round(f * dense["gflops"], 2)}


def step_cache(args) -> Path:
    """The planner's measured steps, shared by the rows that plan (and by reruns): ``--step-cache``,
    else ``<out>/plan_steps`` (beside the rows' results, so a run folder kept outside the checkout
    keeps its cache too)."""
    return (args.step_cache or args.out / "plan_steps").resolve()


def budgets(tiers: list[dict], knobs: dict, cache: Path) -> dict:
    b = {"tiers": tiers, "precisions": ["none"], "adapter_depths": [1.0], "local_work": [1.0],
         "checkpointing": True, "micro_batches": [1, 2, 4], "step_cache": str(cache)}
    b.update({k: v for k, v in knobs.items() if k != "ranks"})
    return b


def row_config(row: str, args, dense: dict | None) -> dict:
    cfg = base_config(args, "natural" if row.startswith("natural") else "alpaca")
    cfg["name"] = f"instruct-{row}"
    if row == "int8":
        cfg["model"]["quantize"] = "int8"
    tiers = {"p30": [tier(0.3, dense)] if dense else None, "p50": [tier(0.5, dense)] if dense else None,
             "mixed": [tier(f, dense, s) for f, s in ((0.3, 0.33), (0.5, 0.33), (1.0, 0.34))]
             if dense else None}.get(row)
    if tiers is not None:
        cfg["budgets"] = {**budgets(tiers, PLANNER, step_cache(args)),
                          "local_work_by": args.local_work_by}
        cfg["lora"]["ranks"] = RANKS
    return cfg


def save(out: Path, row: str, result: dict) -> dict:
    path = out / f"{row}.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    old.update(result)
    path.write_text(json.dumps(old, indent=1) + "\n")
    return old


def load(out: Path, row: str) -> dict:
    path = out / f"{row}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def measured(s: dict) -> dict:
    return {"test_loss": s.get("test_loss"), "test_perplexity": s.get("test_perplexity"),
            "test_rougeL": s.get("test_rougeL"), "memory_mb": s.get("memory_mb_max"),
            "gflops": ((s.get("flops_measured_mean") or 0) + (s.get("flops_importance_mean") or 0)) / 1e9,
            "upload_mb": (s.get("bytes_up_mean") or 0) / 1e6,
            "plans": s.get("plans"), "rounds": s.get("rounds_completed", s.get("rounds")),
            "samples": s.get("samples")}


@contextlib.contextmanager
def cpu_costs():
    """The planner's own cost against a round's, in process CPU seconds (the machine is shared:
    wall time is no measure): CPU of the whole planning call (``plan_clients``), how many
    training steps it measured and their CPU, and each round's CPU. Installed around the run by
    this benchmark only (timers wrapped around the library's functions, restored after)."""
    from fedslice.methods import plan_costs, planner
    from fedslice.run.engine import Simulation

    got = {"plan_cpu_s": 0.0, "plan_calls": 0, "plan_steps": 0, "plan_steps_flops": 0,
           "plan_step_cpu_s": 0.0, "round_cpu_s": []}
    plan_clients, measure_step, run_round = planner.plan_clients, plan_costs.measure_step, Simulation.run_round

    def timed_plan(*a, **kw):
        c0 = time.process_time()
        try:
            return plan_clients(*a, **kw)
        finally:
            got["plan_cpu_s"] += time.process_time() - c0
            got["plan_calls"] += 1

    def timed_step(model, rows, loss_fn=None, flops=True, head=()):
        c0 = time.process_time()
        try:
            return measure_step(model, rows, loss_fn, flops, head)
        finally:
            got["plan_step_cpu_s"] += time.process_time() - c0
            got["plan_steps"] += 1
            got["plan_steps_flops"] += bool(flops)

    def timed_round(self, server_round, state):
        c0 = time.process_time()
        try:
            return run_round(self, server_round, state)
        finally:
            got["round_cpu_s"].append(time.process_time() - c0)

    planner.plan_clients, plan_costs.measure_step, Simulation.run_round = timed_plan, timed_step, timed_round
    try:
        yield got
    finally:
        planner.plan_clients, plan_costs.measure_step, Simulation.run_round = plan_clients, measure_step, run_round


def train_row(row: str, args) -> dict:
    from fedslice.api import resume_experiment, run_experiment
    from fedslice.errors import ConfigError, FedsliceError
    from fedslice.experiment import validate_config
    from fedslice.interrupt import terminate_as_interrupt
    from fedslice.run.checkpoint import find_resumable

    dense = load(args.out, "dense") if row in ("p30", "p50", "mixed") else None
    if dense is not None and not dense.get("memory_mb"):
        raise SystemExit(f"{row}: train the dense row first (its measured costs set the budgets)")
    cfg = row_config(row, args, dense)
    t0, c0 = time.time(), time.process_time()
    try:
        resume = find_resumable(args.out / "runs" / cfg["name"])
    except FedsliceError:
        resume = None
    pieces = load(args.out, row).get("cpu_pieces", []) if resume else []
    try:
        with terminate_as_interrupt(), cpu_costs() as costs:  # `timeout`'s SIGTERM unwinds
            try:
                run = (resume_experiment(resume, progress=False) if resume else
                       run_experiment(validate_config(cfg), args.out / "runs", progress=False))
            finally:  # a piece stopped by its limit (SIGTERM: KeyboardInterrupt) keeps its costs
                pieces.append({**costs, "resumed": str(resume) if resume else None,
                               "cpu_s": time.process_time() - c0})
                save(args.out, row, {"cpu_pieces": pieces})
    except ConfigError as e:
        return save(args.out, row, {"row": row, "fits": False, "why": str(e), "budgets": cfg.get("budgets")})
    s = json.loads((run / "summary.json").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rss = max((r.get("peak_rss_mb_max") or 0 for r in records), default=None)
    return save(args.out, row, {"row": row, "fits": True, "run": str(run), "budgets": cfg.get("budgets"),
                                "cpu_s": sum(p["cpu_s"] for p in pieces), "wall_s": time.time() - t0,
                                "load": os.getloadavg()[0], "peak_rss_mb": rss, "cpu_costs": costs,
                                **measured(s)})


def base_row(row: str, args) -> dict:
    """The untrained model's held-out assistant loss (and answers), as a run evaluates test."""
    from fedslice.api import setup
    from fedslice.experiment import validate_config

    cfg = validate_config(row_config(row, args, None))
    method, data = setup(cfg)
    c0 = time.process_time()
    ev = method.task.evaluate(method.model, data.test, cfg.evaluation.batch_size)
    return save(args.out, row, {"row": row, "fits": True, "cpu_s": time.process_time() - c0,
                                "test_loss": ev["loss"], "test_perplexity": ev["perplexity"],
                                "test_rougeL": ev.get("rougeL"), "test_examples": len(data.test)})


def harness_row(row: str, args) -> dict:
    """The row's harness scores and each question's (``per_example``: rows compared question by
    question, a paired standard error). The model is what ``fedslice evaluate --harness`` scores
    (``harness_model``: the adapter merged, or applied over the int8 base); the run folder's
    harness.json is not written (the row's JSON holds the scores)."""
    from fedslice.harness import _scores, check_tasks, parse_tasks, per_example, run_harness, task_manager

    names = parse_tasks(args.harness)
    tm = task_manager(names=names)
    check_tasks(tm, names)
    limit = args.limit if args.limit < 1 else int(args.limit)
    c0 = time.process_time()
    if row.endswith("base"):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from fedslice.models.loading import resolve_model_path

        folder = resolve_model_path("smollm2")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(folder)
    else:
        from fedslice.export import read_run
        from fedslice.harness import harness_model

        run = load(args.out, row).get("run")
        if not run:
            raise SystemExit(f"{row}: no trained run (train it first)")
        model, tok, _ = harness_model(read_run(run))
    res = run_harness(model, tok, names, tm, limit=limit, batch_size=args.batch_size, log_samples=True)
    scores = _scores(res, names)
    harness = {t: {m: v for m, v in s["metrics"].items()} | {"examples": s["samples"]}
               for t, s in scores.items()}
    got = {"harness": harness, "harness_limit": limit, "harness_per_example": per_example(res),
           "harness_cpu_s": time.process_time() - c0}
    by_limit = load(args.out, row).get("harness_by_limit", {})  # every limit scored, kept
    by_limit[str(limit)] = got
    return save(args.out, row, {**got, "harness_by_limit": by_limit})


def paired(a: list[float], b: list[float]) -> tuple[float, float, int]:
    """Mean of a - b over the same questions, its standard error (sd of the differences / sqrt n)
    and n."""
    n = min(len(a), len(b))
    d = [x - y for x, y in zip(a[:n], b[:n])]
    m = sum(d) / n
    sd = (sum((x - m) ** 2 for x in d) / (n - 1)) ** 0.5 if n > 1 else float("nan")
    return m, sd / n ** 0.5, n


def alone_rows(args) -> dict:
    """Plans only: at 30% and 50% of dense, one knob family at a time."""
    from fedslice.errors import ConfigError
    from fedslice.experiment import validate_config
    from fedslice.plan import budget_plan

    dense = load(args.out, "dense")
    if not dense.get("memory_mb"):
        raise SystemExit("alone: train the dense row first (its measured costs set the budgets)")
    out = load(args.out, "alone").get("plans", {})
    for f in args.alone_budgets:
        for name, knobs in {**ALONE, "all (the planner)": {**PLANNER, "ranks": RANKS}}.items():
            key = f"{name}@{f:g}"
            if key in out and not args.again:
                continue
            cfg = row_config("dense", args, None)
            cfg["budgets"] = budgets([tier(f, dense)], {"checkpointing": False, "micro_batches": [1],
                                                        **knobs}
                                     if name != "checkpointing+micro-batches" else {}, step_cache(args))
            cfg["budgets"]["local_work_by"] = args.local_work_by  # as the planner rows
            if "ranks" in knobs:
                cfg["lora"]["ranks"] = knobs["ranks"]
            path = args.out / "plan.json"
            try:
                budget_plan(validate_config(cfg), str(path))
                plan = json.loads(path.read_text())["0"]
                out[key] = {"fits": True, "plan": {k: plan[k] for k in
                                                   ("rank", "checkpointing", "micro_batches",
                                                    "precision", "steps", "batch", "depth")},
                            "predicted": plan["predicted"], "budget": plan["budget"]}
            except ConfigError as e:
                out[key] = {"fits": False, "why": " ".join(str(e).split())[:400]}
            print(key, json.dumps(out[key]), flush=True)
            save(args.out, "alone", {"row": "alone", "plans": out})
    return load(args.out, "alone")


def per_example_at(r: dict) -> dict[int, dict]:
    """A row's per-question harness scores at every limit it was scored at (``{limit: {task:
    {metric: [score per question]}}}``), the latest at ``harness_limit`` included."""
    out = {int(float(k)): v["harness_per_example"] for k, v in (r.get("harness_by_limit") or {}).items()
           if v.get("harness_per_example")}
    if r.get("harness_per_example") and r.get("harness_limit") is not None:
        out[int(r["harness_limit"])] = r["harness_per_example"]
    return out


def paired_lines(rows: dict[str, dict], tasks: list[str]) -> list[str]:
    """Each row's harness accuracy against the base's and dense's on the same questions (in
    points: mean difference ± its paired standard error), at every limit both were scored at."""
    out = []
    for name, r in rows.items():
        mine = per_example_at(r)
        for ref in ("base", "dense"):
            if name in (ref, "base", "natural-base"):
                continue
            theirs = per_example_at(rows[ref])
            for limit in sorted(set(mine) & set(theirs)):
                cells = []
                for t in tasks:
                    for metric in ("acc", "acc_norm"):
                        a = (mine[limit].get(t) or {}).get(metric)
                        b = (theirs[limit].get(t) or {}).get(metric)
                        if a and b:
                            m, se, n = paired(a, b)
                            changed = sum(x != y for x, y in zip(a, b))
                            cells.append(f"{t} {metric} {100 * m:+.2f} ± {100 * se:.2f} pt "
                                         f"({changed} of {n} answers differ)")
                if cells:
                    out.append(f"- {name} − {ref} (at {limit}): " + "; ".join(cells))
    return ["", "Paired differences (same questions; mean ± standard error of the per-question "
            "difference):", ""] + out if out else []


def fmt(v, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def write_table(args) -> None:
    rows = {r: load(args.out, r) for r in ROWS}
    dense = rows["dense"]
    tasks = [t for t in args.harness.split(",")]
    c = base_config(args)
    lines = [f"SmolLM2-135M-Instruct, LoRA r32 alpha 64 on q,v, Alpaca-GPT4 demo (849 train "
             f"conversations, 20 IID clients), max {c['data']['max_length']} tokens, {args.rounds} "
             f"rounds x {args.per_round} clients x {args.local_steps} local steps x "
             f"{c['federation']['batch_size']} conversations, lr {c['federation']['lr']:g}, seed "
             f"{args.seed}; held-out: {c['data']['max_test_examples']} test conversations; "
             f"harness: {', '.join(tasks)}, zero-shot, acc (the first N questions scored).", "",
             "| row | fits | " + " | ".join(f"{t} acc" for t in tasks) +
             " | held-out loss | Δ loss vs dense | test ROUGE-L | peak MiB (× dense) | GFLOPs/client-round "
             "(× dense) | upload MB/client-round | process CPU-s (train + test eval) |",
             "|---|---|" + "---|" * len(tasks) + "---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if not r or name == "alone":
            continue
        if not r.get("fits", True):
            lines.append(f"| {name} | no: {' '.join(r['why'].split())[:150]} |" + " |" * (len(tasks) + 7))
            continue
        h = r.get("harness", {})
        accs = [fmt((h.get(t) or {}).get("acc"), ".4f") +
                (f" ({h[t]['examples']})" if (h.get(t) or {}).get("examples") else "") for t in tasks]
        dl = (r["test_loss"] / dense["test_loss"] - 1) if dense.get("test_loss") and r.get("test_loss") \
            and not name.startswith("natural") else None
        mem = r.get("memory_mb")
        x = lambda v, k: f" ({v / dense[k]:.2f})" if v and dense.get(k) else ""  # noqa: E731
        lines.append(f"| {name} | yes | " + " | ".join(accs) + f" | {fmt(r.get('test_loss'), '.4f')} | "
                     f"{fmt(None if dl is None else 100 * dl, '+.2f')}{'%' if dl is not None else ''} | "
                     f"{fmt(r.get('test_rougeL'), '.4f')} | {fmt(mem, '.0f')}{x(mem, 'memory_mb')} | "
                     f"{fmt(r.get('gflops') or None, '.1f')}{x(r.get('gflops'), 'gflops')} | "
                     f"{fmt(r.get('upload_mb') or None, '.3f')} | {fmt(r.get('cpu_s'), '.0f')} |")
    lines += paired_lines(rows, tasks)
    for name in ("p30", "p50", "mixed"):
        for p in rows[name].get("plans") or []:
            lines.append(f"- {name}: {json.dumps(p)[:300]}")
    alone = rows["alone"].get("plans", {})
    if alone:
        lines += ["", "Plans only (the planner's predictions, one knob family at a time):", "",
                  "| knobs | budget | fits | plan | predicted MiB | predicted GFLOPs/round | upload MB |",
                  "|---|---|---|---|---|---|---|"]
        for key, p in alone.items():
            name, f = key.rsplit("@", 1)
            if not p["fits"]:
                lines.append(f"| {name} | {float(f):.0%} | no | {p['why'][:160]} | | | |")
                continue
            pr = p["predicted"]
            lines.append(f"| {name} | {float(f):.0%} | yes | {json.dumps(p['plan'])} | "
                         f"{pr['memory_mb']:.0f} | {pr['gflops_per_round']:.1f} | {pr['upload_mb']:.3f} |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="*", default=list(ROWS), choices=ROWS)
    ap.add_argument("--stage", choices=["train", "harness", "both"], default="both")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-round", type=int, default=2)
    ap.add_argument("--local-steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--local-work-by", choices=["batch", "steps"], default="steps",
                    help="budgets.local_work_by of the planner rows (steps, the default since "
                         "2026-11-30: fewer local steps of whole batches, then one step of fewer "
                         "conversations; batch: every step on fewer conversations, the rows "
                         "before that date)")
    ap.add_argument("--harness", default=TASKS)
    ap.add_argument("--limit", type=float, default=50)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--alone-budgets", type=float, nargs="*", default=[0.3])
    ap.add_argument("--again", action="store_true")
    ap.add_argument("--table", action="store_true", help="only rewrite results.md")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/llm_instruct")
    ap.add_argument("--step-cache", type=Path, default=None,
                    help="the planner's measured steps (budgets.step_cache; default <out>/plan_steps)")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    for row in [] if args.table else args.rows:
        have = load(args.out, row)
        if row == "alone":
            alone_rows(args)
            continue
        # --again retrains a row, one that did not fit too (the planner may have changed)
        if args.stage in ("train", "both") and (args.again or ("test_loss" not in have and have.get("fits", True))):
            print(row, "train", json.dumps({k: v for k, v in
                                            (base_row(row, args) if row.endswith("base") else
                                             train_row(row, args)).items() if k not in ("plans", "samples", "budgets")}),
                  flush=True)
        have = load(args.out, row)
        if row == "natural-base" and load(args.out, "base").get("harness"):  # the same untrained model
            b = load(args.out, "base")
            save(args.out, row, {"harness": b["harness"], "harness_limit": b["harness_limit"],
                                 "harness_from": "base"})
            continue
        if args.stage in ("harness", "both") and have.get("fits", True) and (args.again or "harness" not in have):
            print(row, "harness", json.dumps(harness_row(row, args).get("harness")), flush=True)
    write_table(args)


if __name__ == "__main__":
    main()
