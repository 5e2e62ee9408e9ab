"""lm-evaluation-harness scores of SmolLM2-135M-Instruct (the base model, untrained) on
fedslice's local tasks (docs/harness.md), through the same code `fedslice evaluate --harness`
runs (:func:`fedslice.harness.run_harness`).

    python bench/data/build_harness_tasks.py          # once: the tasks' data files
    python bench/llm_harness_base.py [--limit 200] [--tasks arc_easy_local,...] [--out FILE]

Prints one row per task and metric (the examples scored, the shots) and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

DEFAULT = ("arc_easy_local,arc_challenge_local,hellaswag_local,mmlu_local,"
           "truthfulqa_mc1_local,truthfulqa_mc2_local")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=float, default=200)
    p.add_argument("--tasks", default=DEFAULT)
    p.add_argument("--num-fewshot", type=int)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("bench/results/harness_base.json"))
    args = p.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fedslice.harness import _scores, check_tasks, parse_tasks, run_harness, task_manager
    from fedslice.models.loading import resolve_model_path

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    names = parse_tasks(args.tasks)
    tm = task_manager(names=names)
    check_tasks(tm, names)
    folder = resolve_model_path("smollm2")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    limit = args.limit if args.limit < 1 else int(args.limit)
    res = run_harness(model, tok, names, tm, limit=limit, num_fewshot=args.num_fewshot,
                      batch_size=args.batch_size)
    import lm_eval
    scores = _scores(res, names)
    rows = [{"task": t, "metric": m, "value": v, "stderr": s["stderr"].get(m),
             "examples": s["samples"], "of": s["of"], "shots": s["num_fewshot"]}
            for t, s in scores.items() for m, v in s["metrics"].items()]
    print(f"SmolLM2-135M-Instruct (base, fp32), lm_eval {lm_eval.__version__}, limit {limit}, "
          f"batch size {args.batch_size}")
    print("| task | metric | score | stderr | examples | shots |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        se = f"{r['stderr']:.4f}" if isinstance(r["stderr"], float) else "-"
        print(f"| {r['task']} | {r['metric']} | {r['value']:.4f} | {se} | {r['examples']} of "
              f"{r['of']} | {r['shots']} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": "SmolLM2-135M-Instruct", "lm_eval": lm_eval.__version__,
                                    "limit": limit, "batch_size": args.batch_size,
                                    "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                    "rows": rows}, indent=2) + "\n")
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
