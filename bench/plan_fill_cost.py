"""What ``budgets.local_work_fill`` costs the planner: measured steps and planning time.

    OMP_NUM_THREADS=1 .venv/bin/python bench/plan_fill_cost.py [--fill]

The SST-2 frontier's ``planned-depth-work`` row of seed 0 (``bench/frontier.py --budgets 0.4
--memory-share 0.5 --upload-share 0.5 --lr 2e-3``; its dense row's measured costs set the
budget, read from ``bench/results/frontier_sst2_lr2e-3/dense.json``): ``setup()`` twice in the
process (the first warms the data and model caches), the second timed, with the planner's
measured steps (``StepCosts._measure`` calls) counted. Prints the plan. Run it with and
without ``--fill``, alternating, on a quiet machine.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import frontier as fr  # noqa: E402

from fedslice.api import setup  # noqa: E402
from fedslice.experiment import validate_config  # noqa: E402
from fedslice.methods import plan_costs as pl  # noqa: E402


def main() -> None:
    import torch

    fill = "--fill" in sys.argv[1:]
    sys.argv = ["frontier.py", "--seed", "0", "--budgets", "0.4", "--memory-share", "0.5",
                "--upload-share", "0.5", "--rows", "planned-depth-work", "--lr", "2e-3",
                "--out", "bench/results/frontier_sst2_lr2e-3"] + (["--fill"] if fill else [])
    torch.set_num_threads(1)
    count = {"n": 0}
    measure = pl.StepCosts._measure

    def counted(self, knobs, need="all"):
        count["n"] += 1
        return measure(self, knobs, need)

    pl.StepCosts._measure = counted

    def plan_only(name, row, args, budgets):
        if row == "dense":
            return json.loads((args.out / "dense.json").read_text())
        if row == "dense-lr":
            return {}
        cfg = validate_config(fr.config(row, args, budgets))
        setup(cfg)  # warm: data and model
        count["n"] = 0
        t0 = time.perf_counter()
        method, _ = setup(cfg)
        seconds = time.perf_counter() - t0
        plan = next(iter(method.plans.values()))
        print(f"local_work_fill={fill}: {count['n']} measured steps, set-up and planning "
              f"{seconds:.2f} s; plan: {plan.knobs.describe()}")
        raise SystemExit

    fr.run_row = plan_only
    fr.main()


if __name__ == "__main__":
    main()
