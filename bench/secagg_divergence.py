"""Where a secure run's weights part from the plain run's (issue 60, part 5 diagnosis): the
settings of ``bench/secagg_accuracy.py`` run twice in process with the same seed, secure then
plain, and per round:

- **protocol error**: in the secure run, the round's state from the secure sum against the
  plain aggregation of *the same replies* (``inner.aggregate_train``), next to the stated bound
  (:func:`fedslice.fl.secagg.error_bound`, per coordinate of the weighted sums) and the count of
  clipped coordinates: what quantization, clipping and the union's weights cost in one round;
- **run divergence**: the secure run's global state against the plain run's after the same
  round (trained tensors only), and how many of the round's clients kept other heads than in the
  plain run (``head_kept``, raffm+heads / heads: a discrete choice on the received model).

If the protocol error stays at the bound while the runs part by orders of magnitude more, the
difference in accuracy comes from training on slightly different models (the heads each client
keeps flip between near-equal importances), not from the quantization range, clipping or the
union's weights. Accuracy and weight differences only (the machine is shared: no wall times).
With ``--save DIR`` each variant can run alone (``--variants secure``, then ``--variants plain``:
a heavy run stays short); its per-round states and rows go to ``DIR/divergence-<method>-<variant>.pt``
and the table is printed once both files exist.

    python bench/secagg_divergence.py --method raffm+heads \\
        --set budgets.width_steps=4 --set 'budgets.tiers=[{share=0.5,flops_share=0.5},{share=0.5,flops_share=0.75}]'
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from fedslice.api import setup
from fedslice.experiment import load_config
from fedslice.fl.rules import SecureAggregation, find_rule
from fedslice.run.engine import Simulation

from secagg_accuracy import CONFIGS  # bench/ is the script's folder: on sys.path


def run(cfg_path: str, overrides: list[str], secure: bool, keys: list[str] | None):
    """(trained keys, per-round states of them, per-round head_kept by client, per-round
    protocol rows, summary)."""
    cfg = load_config(cfg_path, [*overrides, f"privacy.secure_aggregation={str(secure).lower()}"])
    method, data = setup(cfg)
    rule = find_rule(method.strategy, SecureAggregation) if secure else None
    keys = keys if keys is not None else list(rule.trainable)
    states, kept, protocol = [], [], []
    strategy = rule if secure else method.strategy

    original = type(strategy).aggregate_train
    combine_sums = SecureAggregation.combine_sums
    dens = {}

    def spy_sums(self, server_round, state, num, den):
        dens[server_round] = {k: v.clone() for k, v in den.items()}
        return combine_sums(self, server_round, state, num, den)

    def spy(self, server_round, state, payloads, replies):
        kept.append({c: r.metrics.get("head_kept") for c, r in replies.items()})
        if secure:  # the plain aggregation of the same replies, before the protocol strips them
            same = self.inner.aggregate_train(server_round, state, payloads, dict(replies))
        result = original(self, server_round, state, payloads, replies)
        if secure and not result.skipped:
            from fedslice.fl import secagg as sp
            layout = self.layout(state, {c: payloads[c] for c in result.used})
            bound = sp.error_bound(len(result.used), layout, self.params(len(payloads)))
            errs = {k: (result.state[k] - same.state[k]).abs() for k in keys if k in same.state}
            key = max(errs, key=lambda k: float(errs[k].max()))
            worst = float(errs[key].max())
            W = layout.bounds[key] if key in layout.bounds else float("nan")
            den = dens.get(server_round, {}).get(key)
            at = den.reshape(-1)[int(errs[key].reshape(-1).argmax())] / W if den is not None else None
            held = [d[d > 0] / layout.bounds[k] for k, d in dens.get(server_round, {}).items()]
            held = torch.cat([h.reshape(-1) for h in held]) if held else torch.zeros(1)
            protocol.append({"round": server_round, "protocol_error": worst, "worst_key": key,
                             "den_at_worst": None if at is None else float(at),
                             "den_min": float(held.min()), "den_median": float(held.median()),
                             "small_den": int((held < 1e-3).sum()),
                             "bound_num": max(b[0] for b in bound.values()),
                             "bound_den": max(b[1] for b in bound.values()),
                             "clipped": result.metrics.get("secagg_clipped"),
                             "single_holder": result.metrics.get("secagg_single_holder")})
        return result

    setattr(type(strategy), "aggregate_train", spy)
    SecureAggregation.combine_sums = spy_sums
    try:
        sim = Simulation(cfg, method, data)
        run_round = sim.run_round

        def keep(server_round, state):
            new, record = run_round(server_round, state)
            states.append({k: new[k].detach().clone() for k in keys if k in new})
            return new, record

        sim.run_round = keep
        _, _, summary = sim.run()
    finally:
        setattr(type(strategy), "aggregate_train", original)
        SecureAggregation.combine_sums = combine_sums
    return keys, states, kept, protocol, summary


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", choices=sorted(CONFIGS), default="raffm+heads")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--set", action="append", default=[], help="more overrides (key=value)")
    p.add_argument("--variants", nargs="+", choices=["secure", "plain"], default=["secure", "plain"],
                   help="which runs to do now (with --save: the others are read from DIR)")
    p.add_argument("--save", type=Path, help="folder of each variant's saved result")
    args = p.parse_args(argv)
    base = [f"federation.rounds={args.rounds}", f"federation.local_steps={args.steps}",
            "federation.batch_size=16", "federation.lr=3e-3", "federation.num_clients=10",
            "federation.clients_per_round=4", "data.max_length=48", "data.max_dev_examples=500",
            "data.max_test_examples=500", f"evaluation.every={args.rounds}", "output.plots=false",
            "output.progress=false", "output.save_weights=false", *args.set]
    got = {}
    for variant in ("secure", "plain"):  # the plain run compares the secure run's trained keys
        path = args.save / f"divergence-{args.method}-{variant}.pt" if args.save else None
        if variant in args.variants:
            keys = got["secure"][0] if "secure" in got else None
            if variant == "plain" and keys is None:
                p.error("--variants plain needs the secure run first (or its --save file)")
            got[variant] = run(CONFIGS[args.method], base, variant == "secure", keys)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save({"overrides": base, "result": got[variant]}, path)
        elif path is not None and path.exists():
            saved = torch.load(path, weights_only=False)
            if saved["overrides"] != base:
                p.error(f"{path} was saved with other settings: {saved['overrides']}")
            got[variant] = saved["result"]
    if len(got) < 2:
        print(f"saved {', '.join(sorted(got))}; run the other variant with the same settings")
        return 0
    keys, s1, k1, prot, m1 = got["secure"]
    _, s0, k0, _, m0 = got["plain"]
    print(f"\n{args.method}: test accuracy plain {m0['test_accuracy']:.4f}, secure "
          f"{m1['test_accuracy']:.4f}; {len(keys)} trained tensors compared\n")
    print("| round | protocol error: state from the secure sum vs the plain aggregation of the "
          "same replies | stated bound per coordinate of the sums: update (weight) | clipped | "
          "single-holder coordinates | secure vs plain run: largest weight difference | "
          "clients keeping other heads |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    by_round = {row["round"]: row for row in prot}
    for r in range(len(s1)):
        row = by_round.get(r + 1)
        div = max(float((s1[r][k] - s0[r][k]).abs().max()) for k in s1[r] if k in s0[r])
        flipped = sum(1 for c in k1[r] if k1[r][c] is not None and k1[r][c] != k0[r].get(c))
        proto = (f"{row['protocol_error']:.2e} | {row['bound_num']:.2e} ({row['bound_den']:.2e}) | "
                 f"{row['clipped']} | {row['single_holder']}") if row else "skipped | | |"
        print(f"| {r + 1} | {proto} | {div:.2e} | {flipped} / {len(k1[r])} |")
    print("\nwhere the protocol error is largest (the summed weight over W there, and over every "
          "element the round's clients held: min / median / elements below 1e-3):")
    for row in prot:
        print(f"- round {row['round']}: {row['worst_key']}: error {row['protocol_error']:.2e} where "
              f"sum w / W = {row['den_at_worst']:.3g}; held elements: min {row['den_min']:.3g}, "
              f"median {row['den_median']:.3g}, {row['small_den']} below 1e-3")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
