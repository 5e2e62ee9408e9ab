"""Benchmark (issue 57, part 4): federated DPO of SmolLM2-135M-Instruct on HH-RLHF pairs.

Data: ``bench/data/hh_harmless_pairs.py`` (Anthropic HH-RLHF harmless-base, single-turn pairs;
458 train / 50 dev / 150 test). The train pairs go IID to ``--clients`` clients; each round
``--per-round`` of them run ``--local-steps`` AdamW steps of ``--batch-size`` pairs with LoRA
(r 8, alpha 16 on q/k/v/o) against the frozen base (adapters off) as DPO's reference. Prompts are
the human turn as a user turn of SmolLM2's chat template, cut to its last ``--prompt-tokens``
tokens (the template's default system prompt comes first and is what is cut); answers to
``--answer-tokens`` tokens with the end-of-turn token.

The held-out figure is the test split (150 pairs), evaluated every ``--eval-every`` rounds
(``evaluation.track_test``): reward accuracy (the DPO reward of the chosen answer above the
rejected one's), mean margin, the trained model's own preference (log p(chosen) > log p(rejected))
and the base's, summed over the answer's tokens and per token. Rounds run until ``--rounds`` or
until the clients' training has taken ``--budget-s`` seconds of this process's CPU time (one
thread; evaluation not counted: the reference's held-out scores are computed once, the policy's
at each evaluation).

    OMP_NUM_THREADS=1 .venv/bin/python bench/llm_dpo.py --out bench/results/llm_dpo
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from fedslice.api import setup
from fedslice.experiment import validate_config
from fedslice.run.engine import Simulation, finish_round
from fedslice.run.session import Rounds
from fedslice.tasks.preference import preference_metrics

KEYS = ("reward_accuracy", "reward_margin", "chosen_reward", "rejected_reward", "loss", "accuracy",
        "base_accuracy", "base_accuracy_per_token")


def config(args) -> dict:
    return {
        "seed": args.seed, "threads": args.threads,
        "data": {"path": args.data, "max_length": args.prompt_tokens,
                 "max_dev_examples": None if "dev" in args.held_out.split(",") else 10},
        "model": {"name": "smollm2"},
        "task": {"kind": "preference", "dpo_beta": args.beta, "max_target_length": args.answer_tokens},
        "lora": {"r": 8, "alpha": 16, "targets": ["q", "k", "v", "o"], "dropout": 0.0},
        "federation": {"num_clients": args.clients, "clients_per_round": args.per_round,
                       "rounds": args.rounds, "local_steps": args.local_steps,
                       "batch_size": args.batch_size, "lr": args.lr},
        "method": {"name": "fedpetuning"},
        "compute": {"workers": 1},
        "evaluation": {"every": args.eval_every, "batch_size": 16, "track_test": True},
        "output": {"dir": str(Path(args.out) / "runs"), "progress": False, "plots": False,
                   "checkpoint_every": 0},
    }


SCORES = ("chosen", "rejected", "ref_chosen", "ref_rejected", "chosen_tokens", "rejected_tokens")


def held_out_stats(scores: list[dict], beta: float) -> dict:
    """The held-out splits' pairs pooled: the metrics, and each comparison with its standard
    error (one seed: the sampling error of the pairs only). Reward accuracy against 50% (a
    reward accuracy before training: every reward 0, ties split) with the binomial error
    sqrt(p(1-p)/n); against the base's own summed preference and the trained model's own
    preference against the base's, paired per pair: the mean of d_i = [trained right] - [base
    right] and sd(d)/sqrt(n)."""
    s = {k: torch.tensor([v for sc in scores for v in sc[k]], dtype=torch.float64) for k in SCORES}
    n = len(s["chosen"])
    m = preference_metrics(s, beta)
    reward_right = (beta * (s["chosen"] - s["ref_chosen"]) > beta * (s["rejected"] - s["ref_rejected"])).double()
    own_right = (s["chosen"] > s["rejected"]).double()
    base_right = (s["ref_chosen"] > s["ref_rejected"]).double()
    p = float(reward_right.mean())

    def paired(d):
        return {"diff_pt": 100 * float(d.mean()), "se_pt": 100 * float(d.std(unbiased=True)) / n ** 0.5}

    return {"pairs": n, **m,
            "reward_accuracy_vs_50": {"diff_pt": 100 * (p - 0.5), "se_pt": 100 * (p * (1 - p) / n) ** 0.5},
            "reward_accuracy_vs_base_preference": paired(reward_right - base_right),
            "own_preference_vs_base_preference": paired(own_right - base_right)}


def staged(args, cfg, method, data, out: Path) -> None:
    """The run in pieces that each fit a time slot (``--state FILE``, ``--wall-budget S``): each
    call trains rounds until its wall budget is spent, saving the global state and the
    selector's RNG after every round (the same clients as one uninterrupted run); once every
    round is trained, the next call (or this one, when training took less than half its budget)
    evaluates the last model on test (policy and reference), then on ``--train-eval`` training
    pairs, each saved as it finishes. The base's figures are those of round 0 of the
    uninterrupted script (the same data files): not recomputed here."""
    path = Path(args.state)
    saved = torch.load(path, weights_only=False) if path.is_file() else \
        {"round": 0, "state": None, "records": [], "train_cpu_s": 0.0}
    t0 = time.perf_counter()
    if saved["round"] < cfg.federation.rounds:
        sim = Simulation(cfg, method, data)
        state = saved["state"] if saved["state"] is not None else Rounds(cfg, method).initial_state(sim.selector)
        if saved.get("selector"):
            sim.selector.load_state_dict(saved["selector"])
        for rnd in range(saved["round"] + 1, cfg.federation.rounds + 1):
            c0 = time.process_time()
            state, record = sim.run_round(rnd, state)
            saved["train_cpu_s"] += time.process_time() - c0
            saved["records"].append({"round": rnd, "train_loss": record.get("train_loss"),
                                     "clients": record.get("clients"), "train_cpu_s": saved["train_cpu_s"]})
            saved.update(round=rnd, state=state, selector=sim.selector.state_dict())
            torch.save(saved, path)
            print(json.dumps(saved["records"][-1]), flush=True)
            if time.perf_counter() - t0 > args.wall_budget and rnd < cfg.federation.rounds:
                print(f"stopped after round {rnd}: run the same command again to go on", flush=True)
                return
        if time.perf_counter() - t0 > args.wall_budget / 2:
            return  # evaluation in the next call (its own time slot)
    held_out = args.held_out.split(",")
    splits = {"test": data.test, "dev": data.dev if "dev" in held_out else None,
              "train": data.train.subset(list(range(min(args.train_eval, len(data.train)))))
              if args.train_eval else None}
    for name, split in splits.items():
        if split is None or name in saved:
            continue
        if name != "test" and time.perf_counter() - t0 > args.wall_budget / 2:
            print(f"run the same command again to score the {name} pairs", flush=True)
            break
        c0, p0 = time.perf_counter(), time.process_time()
        with method.compute.autocast():
            s = method.task.scores(method.eval_model(saved["state"]), split, 16)
        ev = preference_metrics(s, cfg.task.dpo_beta)
        saved[name] = {"pairs": len(split), "eval_s": time.perf_counter() - c0,
                       "eval_cpu_s": time.process_time() - p0, **{k: ev[k] for k in KEYS},
                       "scores": {k: s[k].tolist() for k in SCORES}}
        torch.save(saved, path)
        print(json.dumps({name: {k: v for k, v in saved[name].items() if k != "scores"}}), flush=True)
    names = [n for n in held_out if n in saved]
    pooled = held_out_stats([saved[n]["scores"] for n in names], cfg.task.dpo_beta) if names else None
    if pooled:
        pooled["splits"] = names
        print(json.dumps({"held_out": pooled}), flush=True)
    result = {"args": vars(args), "rounds_run": saved["round"], "train_cpu_s": saved["train_cpu_s"],
              "train_pairs": len(data.train), "test_pairs": len(data.test), "records": saved["records"],
              "held_out": pooled,
              **{k: {m: v for m, v in saved[k].items() if m != "scores"}
                 for k in ("test", "dev", "train") if k in saved}}
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "held_out_scores.json").write_text(json.dumps({n: saved[n]["scores"] for n in names}) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "records"}))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="hh-harmless-single")
    ap.add_argument("--out", default="bench/results/llm_dpo")
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--per-round", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--local-steps", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--eval-every", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--train-eval", type=int, default=0,
                    help="also score the last round's model on this many training pairs (does "
                         "what it learned on its own pairs transfer?)")
    ap.add_argument("--held-out", default="test", choices=["test", "test,dev"],
                    help="with --state: the pairs scored after the last round (test,dev: the 50 "
                         "dev pairs too, pooled with test: none is trained on or selects anything)")
    ap.add_argument("--state", help="run in pieces (see staged): the file of the state between them")
    ap.add_argument("--wall-budget", type=float, default=420.0,
                    help="with --state: seconds of training (or evaluation) per call")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = validate_config(config(args))
    t0 = time.perf_counter()
    method, data = setup(cfg)
    setup_s = time.perf_counter() - t0
    if args.state:
        return staged(args, cfg, method, data, out)
    t0 = time.perf_counter()
    base = method.task.evaluate(method.model, data.test, 16)  # adapter B = 0: the base itself
    base_eval_s = time.perf_counter() - t0
    rows = [{"round": 0, **{k: base[k] for k in KEYS}}]
    print(json.dumps(rows[0]), flush=True)
    sim = Simulation(cfg, method, data)
    state = Rounds(cfg, method).initial_state(sim.selector)
    t0 = time.perf_counter()
    train_cpu = 0.0
    records = []
    for rnd in range(1, cfg.federation.rounds + 1):
        c0 = time.process_time()
        state, record = sim.run_round(rnd, state)
        train_cpu += time.process_time() - c0
        record["train_cpu_s"] = train_cpu
        finish_round(cfg, method, data, sim.selector, rnd, state, record)
        records.append(record)
        if record.get("test_reward_accuracy") is not None:
            rows.append({"round": rnd, **{k: record.get(f"test_{k}") for k in KEYS}})
            print(json.dumps(rows[-1]), flush=True)
        else:
            print(json.dumps({"round": rnd, "train_loss": record.get("train_loss"),
                              "train_cpu_s": train_cpu}), flush=True)
        if train_cpu > args.budget_s:
            break
    elapsed = time.perf_counter() - t0
    last = records[-1]["round"] if records else 0
    if rows[-1]["round"] != last:  # the last round's model, evaluated once more
        ev = method.evaluate(state, data.test, 16)
        rows.append({"round": last, **{k: ev[k] for k in KEYS}})
        print(json.dumps(rows[-1]), flush=True)
    train_rows = {}
    if args.train_eval:
        seen = data.train.subset(list(range(min(args.train_eval, len(data.train)))))
        ev = method.evaluate(state, seen, 16)
        train_rows = {"pairs": len(seen), **{k: ev[k] for k in KEYS}}
        print(json.dumps({"train": train_rows}), flush=True)
    result = {"args": vars(args), "rounds_run": last, "train_pairs_scored": train_rows,
              "train_cpu_s": train_cpu,
              "train_eval_wall_s": elapsed, "setup_s": setup_s,
              "base_eval_s": base_eval_s, "train_pairs": len(data.train), "test_pairs": len(data.test),
              "train_loss": [r.get("train_loss") for r in records], "rows": rows}
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))


if __name__ == "__main__":
    main()
