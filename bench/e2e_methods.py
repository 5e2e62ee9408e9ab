"""Benchmark (issue 15, part 7): every method on SmolLM2-135M-Instruct + E2E NLG.

The federated set-up of ``configs/e2e_smollm2.toml`` (20 IID clients, 4 per round, 6 LoRA steps
x 8 examples) for ``--rounds`` rounds, the final model scored once on ``--test-mrs`` test MRs
against all their references. One row per method variant, FedPETuning (LoRA on the full model)
measured in the same invocation as the baseline every ratio refers to:

* ``heads-{parameters,forward}-{50,90}``: per-client head pruning, both modes;
* ``raffm``: four equal tiers at 0.25 / 0.5 / 0.75 / 1.0 of the full model's training FLOPs,
  elastic inference of the global model at those sizes;
* ``fedpft`` (half the FFN neurons of the middle layers kept, layer KD before FL and neuron KD
  every 2 rounds) / ``fedot`` (adapter = first and last 5 layers, distilled emulator): both with
  short distillations (40 steps of 8 x 64 WikiText-2 tokens), stated in the table.

Columns: ROUGE-L, the proxy's own ROUGE-L (fedpft: the tuned proxy before plug-in), BLEU, upload and download MB per client-round, measured training GFLOPs per
client-round, the largest client's tensors saved for backward (measured: one measure for every
row; the process' RSS is kept in ``results.json`` but says little when several clients run in
one process). Results accumulate in ``results.json`` (re-run with other ``--variants`` to add
rows; invocations may run side by side); ``results.md`` is rewritten from it.

    .venv/bin/python bench/e2e_methods.py --variants fedpetuning raffm --rounds 4 --out bench/results/e2e_methods
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from fedslice.api import run_experiment
from fedslice.experiment import load_config, validate_config

ROOT = Path(__file__).resolve().parents[1]
QUARTERS = [0.25, 0.5, 0.75, 1.0]
VARIANTS = {
    "fedpetuning": {"name": "fedpetuning"},
    **{f"heads-{mode}-{s}": {"name": "heads", "prune": mode, "sparsity": s / 100}
       for mode in ("parameters", "forward") for s in (50, 90)},
    # Eq. 6 without the first token as a key (attention sinks; bench/heads_sinks.py)
    "heads-forward-50-sink1": {"name": "heads", "prune": "forward", "sparsity": 0.5, "sink_keys": 1},
    # issue 35, part 2: the pruned heads' mean output added back while a client trains
    "heads-forward-90-mean": {"name": "heads", "prune": "forward", "sparsity": 0.9, "fill": "mean"},
    "heads-forward-90-linear": {"name": "heads", "prune": "forward", "sparsity": 0.9, "fill": "linear"},
    "raffm": {"name": "raffm", "tiers": [{"share": 0.25, "flops": f} for f in QUARTERS],
              "elastic_sizes": QUARTERS},
    # short distillations (40 steps of 8 x 64 WikiText-2 tokens) so a 1-thread run stays < 30 min
    "fedpft": {"name": "fedpft", "keep_ratio": 0.5, "align_every": 2, "align_steps": 10,
               "distill": {"steps": 40, "batch_size": 8, "max_length": 64}},
    "fedot": {"name": "fedot", "distill_emulator": True,
              "distill": {"steps": 40, "batch_size": 8, "max_length": 64}},
    # issue 35, part 5: the layer-KD budget (the same proxy, 100 / 1,000 steps of 8 x 64 tokens)
    **{f"fedpft-kd{n}": {"name": "fedpft", "keep_ratio": 0.5, "align_every": 2, "align_steps": 10,
                         "distill": {"steps": n, "batch_size": 8, "max_length": 64}}
       for n in (100, 1000)},
    # issue 35, part 5: the proxy keeps the FFN units of largest mean |activation| x ||W_out
    # column||_1 on 32 corpus passages (WikiText-2, the server's), not Eq. 8's weight norms
    "fedpft-kd100-act": {"name": "fedpft", "keep_ratio": 0.5, "align_every": 2, "align_steps": 10,
                         "salience": "activation", "calibration_examples": 32,
                         "distill": {"steps": 100, "batch_size": 8, "max_length": 64}},
    # the same with 4x the neuron KD of each alignment round (40 steps instead of 10): does the
    # plug-in loss that grows with rounds (8 rounds) come from too little alignment?
    # a wider proxy: three quarters of the middle layers' FFN units kept (activation salience)
    "fedpft-kd100-act-k75": {"name": "fedpft", "keep_ratio": 0.75, "align_every": 2, "align_steps": 10,
                             "salience": "activation", "calibration_examples": 32,
                             "distill": {"steps": 100, "batch_size": 8, "max_length": 64}},
    "fedpft-kd100-act-a40": {"name": "fedpft", "keep_ratio": 0.5, "align_every": 2, "align_steps": 40,
                             "salience": "activation", "calibration_examples": 32,
                             "distill": {"steps": 100, "batch_size": 8, "max_length": 64}},
    # issue 35, part 4: is the small sizes' collapse the rounds each size trains? every client at
    # the 0.25 tier (16 client-rounds of the 0.25 sub-model in 4 rounds, against 2 in "raffm"),
    # LoRA on q/v as in "raffm", or the whole sub-model trained
    "raffm-t25only": {"name": "raffm", "tiers": [{"share": 1.0, "flops": 0.25}], "elastic_sizes": [0.25]},
    # issue 35, part 4: activation-aware salience (mean |input| x L1 column norm of W_o / W_out,
    # 32 dev rows), and the sandwich rule (every step also trains the smallest size, nested)
    "raffm-act": {"name": "raffm", "tiers": [{"share": 0.25, "flops": f} for f in QUARTERS],
                  "elastic_sizes": QUARTERS, "salience": "activation"},
    "raffm-act-sandwich": {"name": "raffm", "tiers": [{"share": 0.25, "flops": f} for f in QUARTERS],
                           "elastic_sizes": QUARTERS, "salience": "activation", "sandwich": True},
    # issue 35, part 4: per-layer widths from each layer's measured loss rise (16 dev rows,
    # widths 1/8 .. 7/8 per layer) at the uniform slices' linear parameters
    "raffm-act-measured": {"name": "raffm", "tiers": [{"share": 0.25, "flops": f} for f in QUARTERS],
                           "elastic_sizes": QUARTERS, "salience": "activation", "widths": "measured",
                           "width_levels": 8, "calibration_examples": 16},
    # the same with widths 1/4, 1/2, 3/4 per layer (30 x 3 calibration passes instead of 30 x 7)
    "raffm-act-measured4": {"name": "raffm", "tiers": [{"share": 0.25, "flops": f} for f in QUARTERS],
                            "elastic_sizes": QUARTERS, "salience": "activation", "widths": "measured",
                            "width_levels": 4, "calibration_examples": 16},
    # finer widths at the small end (1/32 .. 3/4: 30 x 7 calibration passes), so the 0.25 size's
    # budget can cut some layers below 1/4 and keep others wider
    "raffm-act-measured-fine": {"name": "raffm", "tiers": [{"share": 0.25, "flops": f} for f in QUARTERS],
                                "elastic_sizes": QUARTERS, "salience": "activation", "widths": "measured",
                                "width_levels": [0.03125, 0.0625, 0.125, 0.25, 0.375, 0.5, 0.75],
                                "calibration_examples": 16},
    "raffm-sandwich": {"name": "raffm", "tiers": [{"share": 0.25, "flops": f} for f in QUARTERS],
                       "elastic_sizes": QUARTERS, "sandwich": True},
    "raffm-t25only-full": {"name": "raffm", "tiers": [{"share": 1.0, "flops": 0.25}],
                           "elastic_sizes": [0.25], "tuning": "full"},
}
# RaFFM's own setting: each client fine-tunes its whole sub-model (no LoRA), so a slice's weights
# can repair what slicing broke; at a full fine-tuning learning rate (federation.lr below)
VARIANTS["raffm-act-measured-fine-full"] = {**VARIANTS["raffm-act-measured-fine"], "tuning": "full"}
# ... and every client at the 0.25 size (16 client-rounds of it in 4 rounds, against 2 above)
VARIANTS["raffm-act-fine-full-t25only"] = {**VARIANTS["raffm-act-measured-fine-full"],
                                           "tiers": [{"share": 1.0, "flops": 0.25}], "elastic_sizes": [0.25]}
# ... and the mixed run with half of the clients in the 0.25 tier (the rest 0.5 / 0.75 / 1.0 at
# 3 / 3 / 4 of 20 clients): every size in one run, the smallest given the client-rounds it needs
VARIANTS["raffm-act-measured-fine-full-t25half"] = {
    **VARIANTS["raffm-act-measured-fine-full"],
    "tiers": [{"share": s, "flops": f} for s, f in zip((0.5, 0.15, 0.15, 0.2), QUARTERS)]}
#: federation settings a variant changes (the rest is configs/e2e_smollm2.toml's)
FEDERATION = {"raffm-act-measured-fine-full": {"lr": 1e-4}, "raffm-act-fine-full-t25only": {"lr": 1e-4},
              "raffm-t25only-full": {"lr": 1e-4}, "raffm-act-measured-fine-full-t25half": {"lr": 1e-4}}
#: what each row tests (the seed papers' claims)
CLAIMS = {
    "fedpetuning": "baseline (FedPETuning: LoRA on the full model)",
    "heads-parameters-50": "heads paper: 50% sparsity ~ dense quality, less upload",
    "heads-parameters-90": "heads paper: 90% sparsity within 2 pt of dense, 1.8x less communication",
    "heads-forward-50": "heads as a real sub-model: forward + backward saved",
    "heads-forward-90": "heads as a real sub-model at 90%",
    "heads-forward-50-sink1": "heads as a real sub-model at 50%, sinks not counted by Eq. 6",
    "heads-forward-90-mean": "heads as a real sub-model at 90%, pruned heads' mean output filled in (issue 35 part 2)",
    "heads-forward-90-linear": "heads as a real sub-model at 90%, a rank-64 linear map of the attention input in for the pruned heads (issue 35 part 2)",
    "raffm": "RaFFM: resource-aware sub-models close to the full model's quality; one model serves every size",
    "fedpft": "FedPFT: a proxy (FFN neurons dropped + KD) tuned, plugged back, close to FedPETuning",
    "fedot": "FedOT baseline: emulator + adapter, below FedPFT",
    "fedpft-kd100": "FedPFT with 100 layer-KD steps (issue 35 part 5)",
    "fedpft-kd1000": "FedPFT with 1,000 layer-KD steps (issue 35 part 5)",
    "fedpft-kd100-act": "FedPFT, 100 layer-KD steps, proxy neurons by activation salience on the corpus (issue 35 part 5)",
    "fedpft-kd100-act-k75": "fedpft-kd100-act with keep_ratio 0.75 (a wider proxy)",
    "fedpft-kd100-act-a40": "fedpft-kd100-act with 40 neuron-KD steps per alignment round instead of 10",
    "raffm-t25only": "RaFFM, every client at 0.25: the 0.25 size given more client-rounds (issue 35 part 4)",
    "raffm-t25only-full": "as raffm-t25only, the whole sub-model trained (no LoRA, lr 1e-4)",
    "raffm-act": "RaFFM, activation-aware salience: the small sizes keep the units the decoder needs (issue 35 part 4)",
    "raffm-act-measured": "raffm-act with per-layer widths from each layer's measured loss rise (issue 35 part 4)",
    "raffm-act-measured4": "raffm-act-measured with 4 width levels (1/4 .. 3/4 per layer)",
    "raffm-act-measured-fine": "raffm-act-measured with widths 1/32, 1/16, 1/8, 1/4, 3/8, 1/2, 3/4 per layer",
    "raffm-act-measured-fine-full": "raffm-act-measured-fine, each client fine-tuning its whole sub-model (lr 1e-4)",
    "raffm-act-fine-full-t25only": "raffm-act-measured-fine-full with every client at the 0.25 size",
    "raffm-act-measured-fine-full-t25half": "raffm-act-measured-fine-full with half of the clients at the 0.25 size",
    "raffm-act-sandwich": "raffm-act + the sandwich rule (each step also trains the nested smallest size)",
    "raffm-sandwich": "RaFFM (L1 salience) + the sandwich rule",
}


def key(variant: str, seed: int) -> str:
    """The results key (and run name) of a variant at a seed: seed 0 is the bare variant."""
    return variant if seed == 0 else f"{variant}@seed{seed}"


def config(variant: str, args) -> dict:
    cfg = load_config(ROOT / "configs/e2e_smollm2.toml").model_dump(mode="json")
    cfg["name"] = f"e2e-{key(variant, args.seed)}"
    cfg["seed"] = args.seed  # partition, client sampling, training and the test MRs
    cfg["threads"] = args.threads
    cfg["method"] = VARIANTS[variant]
    cfg["federation"]["rounds"] = args.rounds
    cfg["federation"].update(FEDERATION.get(variant, {}))
    cfg["data"]["max_test_examples"] = args.test_mrs
    cfg["evaluation"].update(every=args.rounds, dev_generations=10)
    cfg["data"]["max_dev_examples"] = 64
    cfg["output"].update(dir=str(args.out), progress=False, plots=False, save_weights=False)
    if args.workers:
        cfg["compute"]["workers"] = args.workers
    if args.server_opt != "none":  # every variant, FedPETuning too (docs/aggregation.md)
        cfg["server_opt"] = {"name": args.server_opt, "lr": args.server_opt_lr}
    return cfg


def run(variant: str, args) -> dict:
    t0 = time.perf_counter()
    path = run_experiment(validate_config(config(variant, args)), progress=False)
    s = json.loads((path / "summary.json").read_text())
    s.update(variant=key(variant, args.seed), run_dir=str(path), bench_wall_s=time.perf_counter() - t0)
    return s


def _mb(v):
    return None if v is None else v / 2**20


def row(s: dict, base: dict | None) -> list:
    """One table row; ratios and ΔROUGE-L against ``base`` (fedpetuning at the same seed)."""
    mem = s.get("activation_mb_max")  # tensors saved for backward, measured (RSS is per process)
    up, flops = s.get("bytes_up_mean"), s.get("flops_measured_mean")
    ratio = lambda a, b: None if not a or not b else b / a  # noqa: E731  (baseline / this)
    return [s["variant"], s.get("test_rougeL"), s.get("proxy_test_rougeL"), s.get("test_bleu"), _mb(up),
            _mb(s.get("bytes_down_mean")),
            None if flops is None else flops / 1e9, mem,
            ratio(up, base and base.get("bytes_up_mean")), ratio(flops, base and base.get("flops_measured_mean")),
            None if base is None else s.get("test_rougeL", 0) - base.get("test_rougeL", 0),
            s.get("bench_wall_s", 0) / 60]


def _fmt(v) -> str:
    if v is None:
        return "—"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def write(results: dict, args) -> None:
    cols = ["variant", "ROUGE-L", "proxy ROUGE-L (fedpft: its own model)", "BLEU", "up MB", "down MB", "train GFLOPs", "saved activations MiB (max)",
            "up: base/this", "FLOPs: base/this", "ΔROUGE-L vs base", "wall min"]
    lines = [f"E2E NLG, SmolLM2-135M-Instruct, {args.rounds} rounds x 4 clients x 6 steps x 8, "
             f"test = {args.test_mrs} MRs (all references); per client-round means.", "",
             "| " + " | ".join(cols) + " | claim tested |", "|" + "---|" * (len(cols) + 1)]
    seeds = sorted({0, *(int(k.rsplit("@seed", 1)[1]) for k in results if "@seed" in k)})
    for seed in seeds:
        base = results.get(key("fedpetuning", seed))
        for v in VARIANTS:
            if key(v, seed) in results:
                lines.append("| " + " | ".join(_fmt(x) for x in row(results[key(v, seed)], base))
                             + f" | {CLAIMS[v]} |")
    for name, raffm in results.items():
        if not (name.startswith("raffm") and raffm.get("elastic")):
            continue
        lines += ["", f"{name} elastic inference (the one global model at several sizes):", "",
                  "| size | heads/layer | FFN/layer | test ROUGE-L | forward GFLOPs/example |", "|---|---|---|---|---|"]
        for e in raffm["elastic"]:
            st = (e.get("stacks") or [e])[0] if "stacks" in e else e
            heads = st.get("heads", [None])[0] if st else None
            ffn = st.get("ffn", [None])[0] if st else None
            lines.append(f"| {e['size']} | {heads} | {ffn} | {_fmt(e.get('test_rougeL'))} | "
                         f"{_fmt(e.get('forward_gflops_per_example'))} |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--test-mrs", type=int, default=100)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--workers", type=int, default=None, help="compute.workers (1: the run stays on "
                   "one core; default: the config's 'auto')")
    p.add_argument("--seed", type=int, default=0, help="rows are keyed 'variant@seedN' for N > 0; "
                   "compare them with fedpetuning at the same seed (same partition and test MRs)")
    p.add_argument("--server-opt", default="none", help="server_opt.name of every variant (use its own --out)")
    p.add_argument("--server-opt-lr", type=float, default=None, help="server_opt.lr")
    p.add_argument("--out", type=Path, default=Path("bench/results/e2e_methods"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    store = args.out / "results.json"
    for v in args.variants:
        summary = run(v, args)
        # re-read before writing: several invocations may run side by side on one store
        results = json.loads(store.read_text()) if store.exists() else {}
        results[key(v, args.seed)] = summary
        store.write_text(json.dumps(results, indent=1, default=str))
        write(results, args)
        print(f"{key(v, args.seed)}: ROUGE-L {summary.get('test_rougeL')}", flush=True)


if __name__ == "__main__":
    main()
