"""Secure aggregation against the plain run (issue 60 target: final accuracy within 0.2 pt after
10 rounds): MiniLM-L6 + LoRA on SST-2 (configs/fedpetuning_sst2.toml, shrunk to ROUNDS rounds
of STEPS local steps), the same seed with and without ``privacy.secure_aggregation``, in process.
Accuracy and the largest weight difference only (the machine is shared: no wall times).

    python bench/secagg_accuracy.py [ROUNDS] [STEPS]
"""

from __future__ import annotations

import sys

from fedslice.api import setup
from fedslice.experiment import load_config
from fedslice.run.engine import Simulation


def main(argv: list[str]) -> int:
    rounds = int(argv[0]) if argv else 10
    steps = int(argv[1]) if len(argv) > 1 else 4
    base = [f"federation.rounds={rounds}", f"federation.local_steps={steps}",
            "data.max_dev_examples=256", "evaluation.every=100", "output.plots=false",
            "output.progress=false", "output.save_weights=false"]
    out = {}
    for secure in (False, True):
        cfg = load_config("configs/fedpetuning_sst2.toml",
                          [*base, f"privacy.secure_aggregation={str(secure).lower()}"])
        method, data = setup(cfg)
        state, records, summary = Simulation(cfg, method, data).run()
        out[secure] = (state, summary, records)
    (s0, m0, r0), (s1, m1, r1) = out[False], out[True]
    worst = max(float((s0[k] - s1[k]).abs().max()) for k in s0)
    print(f"| run | rounds x steps | test accuracy | final dev accuracy | clipped |")
    print("|---|---|---|---|---|")
    print(f"| plain | {rounds} x {steps} | {m0['test_accuracy']:.4f} | "
          f"{m0['final_dev_accuracy']:.4f} | - |")
    print(f"| secure aggregation | {rounds} x {steps} | {m1['test_accuracy']:.4f} | "
          f"{m1['final_dev_accuracy']:.4f} | {sum(r.get('secagg_clipped', 0) for r in r1)} |")
    print(f"\nlargest difference of a trained weight: {worst:.3g}; accuracy difference "
          f"{100 * (m1['test_accuracy'] - m0['test_accuracy']):+.2f} pt; same clients every round: "
          f"{[r['clients'] for r in r0] == [r['clients'] for r in r1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
