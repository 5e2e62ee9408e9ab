"""Diagnosis (issue 35, part 4): is RaFFM's collapse of SmolLM2's small sizes the budget or the
implementation? Function preservation of the *pretrained* model's slices, no training.

RaFFM's elastic sizes after 4 rounds on E2E were ROUGE-L 7.8 / 14.2 / 8.5 / 57.4 at 0.25 / 0.5 /
0.75 / 1.0 (BENCHMARKS.md, "Every method on SmolLM2 + E2E NLG"). A sub-model that starts broken
needs its few client-rounds (2-5 here, LoRA r16 on q/v only) to repair the slicing, not to learn
the task. This script cuts SmolLM2-135M-Instruct, before any training, to each size and scores it
on E2E test MRs (target NLL over all their references, greedy ROUGE-L):

* ``width``: RaFFM's sub-models as the run builds them: the planner's leading slice at each
  FLOPs budget (uniform width over all 30 layers) of the salience-ordered model
  (``method.reorder = true``, the default);
* ``width-noreorder``: the same slices of the checkpoint's own head/neuron order
  (``method.reorder = false``);
* ``depth``: full-width layers, as many as give the width slice's linear parameters, spread
  evenly with the first and last kept (``slicing.planner.depth_layers``, the rule the planner's
  ``method.elastic_depth`` candidates use; the planner itself mixes depth and width);
* ``ffn-only``: every layer and every head, only the FFN sliced (salience order) to the same
  linear parameters: which of attention and FFN slicing does the damage;
* ``heads-only``: every layer and every FFN unit, only the heads sliced to the width slice's
  heads per layer (whole key/value groups as the planner keeps them).

``--salience l1 activation`` scores every variant under each salience (``method.salience``):
``activation`` ranks FFN unit j by mean|a_j| x ||W_out[:, j]||_1 and query head h by the same
summed over its W_o input channels, on ``method.calibration_examples`` (32) dev-split examples
(``method.calibration = "dev"``, the server's held-out rows, the default).

Writes ``results.md`` / ``results.json`` under ``--out``::

    OMP_NUM_THREADS=1 nice -n 10 python bench/raffm_decoder_diag.py --test-mrs 30
    OMP_NUM_THREADS=1 nice -n 10 python bench/raffm_decoder_diag.py --test-mrs 20 \
        --salience l1 activation --variants width ffn-only heads-only --nll-only \
        --out bench/results/raffm_salience
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from fedslice import measure
from fedslice.api import setup
from fedslice.compute import model_device, to_device
from fedslice.experiment import load_config, validate_config
from fedslice.slicing.planner import depth_layers
from fedslice.slicing.spec import SliceSpec
from fedslice.slicing.state import extract_state

ROOT = Path(__file__).resolve().parents[1]
SIZES = [0.25, 0.5, 0.75, 1.0]


def config(args, reorder: bool, salience: str = "l1") -> dict:
    cfg = load_config(ROOT / "configs/e2e_smollm2.toml").model_dump(mode="json")
    cfg.update(name="raffm-diag", seed=args.seed, threads=args.threads)
    cfg["compute"]["workers"] = 1
    cfg["method"] = {"name": "raffm", "tiers": [{"share": 0.25, "flops": f} for f in SIZES],
                     "elastic_sizes": SIZES, "reorder": reorder, "salience": salience}
    cfg["data"]["max_test_examples"] = args.test_mrs
    cfg["data"]["max_dev_examples"] = 8
    cfg["output"].update(dir=str(args.out), progress=False, plots=False, save_weights=False)
    return cfg


def linear_params(dims, spec: SliceSpec) -> int:
    """Linear parameters of the kept blocks: q/o per query head, k/v per key/value group a kept
    query head reads (GQA), three SwiGLU matrices per FFN unit."""
    d, hd = dims["hidden"], spec.head_dim
    group = spec.num_heads // spec.num_kv_heads if spec.num_kv_heads else 1
    return sum(2 * d * hd * (len(h) + len({x // group for x in h})) + 3 * d * len(f)
               for h, f in zip(spec.heads, spec.neurons))


def score(method, spec, state, data, args) -> dict:
    model = method.submodel(spec)
    method._load(model, extract_state(state, spec, method.arch))
    rows = {k: v[:2] for k, v in method.profile.items() if k != "labels"}
    with torch.no_grad(), measure.count_flops() as fc:
        model.eval()
        model(**to_device(rows, model_device(model)))
    t0 = time.perf_counter()
    if args.nll_only:  # no generation: the target NLL alone (a fraction of the time)
        from fedslice.tasks.text2text import eval_mode
        with torch.no_grad(), eval_mode(model):
            res = {"loss": method.task.target_nll(model, data.test, args.batch_size),
                   "rougeL": float("nan")}
        method.task.last_samples = [{}]
    else:
        res = method.task.evaluate(model, data.test, args.batch_size)
    return {"layers": len(spec.layers), "heads_per_layer": sorted({len(h) for h in spec.heads}),
            "ffn_per_layer": sorted({len(f) for f in spec.neurons}),
            "linear_params_M": linear_params(method.dims_full, spec) / 1e6,
            "forward_gflops_per_example": fc.total / 2e9,
            "test_loss": res["loss"], "test_rougeL": res["rougeL"], "test_bleu": res.get("bleu"),
            "sample": (method.task.last_samples or [{}])[0].get("generated"),
            "eval_s": time.perf_counter() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--test-mrs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", nargs="+", default=["width", "width-noreorder", "depth", "ffn-only"])
    p.add_argument("--salience", nargs="+", default=["l1"], choices=["l1", "l2", "activation"],
                   help="method.salience of the reordered variants (rows named variant/salience "
                   "when more than one)")
    p.add_argument("--nll-only", action="store_true", help="score the test NLL only (no generation)")
    p.add_argument("--sizes", nargs="+", type=float, default=SIZES)
    p.add_argument("--out", type=Path, default=Path("bench/results/raffm_decoder_diag"))
    p.add_argument("--report-only", action="store_true", help="rewrite results.md from results.json")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        saved = json.loads((args.out / "results.json").read_text())
        sys.argv[1:] = saved["argv"]
        args.test_mrs = next((int(saved["argv"][i + 1]) for i, a in enumerate(saved["argv"])
                              if a == "--test-mrs"), args.test_mrs)
        write(args, saved["results"])
        return
    res: dict = {}
    runs = [(True, s) for s in args.salience] + [(False, "l1")]
    for reorder, sal in runs:
        wanted = [v for v in args.variants if (v == "width-noreorder") != reorder]
        if not wanted:
            continue
        tag = f"/{sal}" if len(args.salience) > 1 and reorder else ""
        method, data = setup(validate_config(config(args, reorder, sal)))
        dims = method.arch.all_dims(method.model.config)
        dims = dims[0] if isinstance(dims, list) else dims
        method.dims_full = dims
        state = method.initial_state()
        full = method.sizes.candidates[-1]
        full_p = linear_params(dims, full)
        for size in args.sizes:
            wspec = method.sizes.at(size).spec
            frac = linear_params(dims, wspec) / full_p
            specs = {}
            if reorder:
                if "width" in wanted:
                    specs["width"] = wspec
                if "depth" in wanted:
                    keep = max(1, round(frac * dims["num_layers"]))
                    specs["depth"] = SliceSpec.leading(dims, dims["num_heads"], dims["ffn"],
                                                       depth_layers(dims["num_layers"], keep))
                if "ffn-only" in wanted:
                    # every head kept; the FFN width that gives the same linear parameters
                    d, L = dims["hidden"], dims["num_layers"]
                    attn = full_p - 3 * d * dims["ffn"] * L
                    f = round((frac * full_p - attn) / (3 * d * L))
                    if f >= 1:
                        specs["ffn-only"] = SliceSpec.leading(dims, dims["num_heads"], f)
                if "heads-only" in wanted:
                    specs["heads-only"] = SliceSpec.leading(dims, len(wspec.heads[0]), dims["ffn"])
            else:
                specs["width-noreorder"] = wspec
            for name, spec in specs.items():
                name += tag
                r = score(method, spec, state, data, args)
                r["planned_flops_fraction"] = size
                res.setdefault(name, {})[str(size)] = r
                print(f"{name} {size}: layers {r['layers']} heads {r['heads_per_layer']} ffn "
                      f"{r['ffn_per_layer']} params {r['linear_params_M']:.1f}M loss {r['test_loss']:.3f} "
                      f"ROUGE-L {r['test_rougeL']:.2f} ({r['eval_s']:.0f} s) | {r['sample']!r:.80}",
                      flush=True)
                write(args, res)


def _num(v) -> str:
    """A score, or '—' where none was measured (``--nll-only``)."""
    return "—" if v is None or v != v else f"{v:.2f}"


def write(args, res: dict) -> None:
    lines = ["# RaFFM on SmolLM2: the pretrained model's slices before training (issue 35, part 4)", "",
             f"Command: `python bench/raffm_decoder_diag.py {' '.join(sys.argv[1:])}`  ",
             f"Machine: {platform.machine()}, {args.threads} thread(s), torch {torch.__version__}, "
             f"{time.strftime('%Y-%m-%d')}; {args.test_mrs} E2E test MRs (all their references), seed {args.seed}", "",
             "| slicing | size (planned FLOPs) | layers | heads/layer | FFN/layer | linear params M | "
             "fwd GFLOPs/example | test NLL | ROUGE-L | BLEU |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, per in res.items():
        for size, r in per.items():
            lines.append(f"| {name} | {size} | {r['layers']} | {r['heads_per_layer']} | {r['ffn_per_layer']} | "
                         f"{r['linear_params_M']:.1f} | {r['forward_gflops_per_example']:.2f} | "
                         f"{r['test_loss']:.3f} | {_num(r['test_rougeL'])} | {_num(r['test_bleu'])} |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    (args.out / "results.json").write_text(json.dumps({"argv": sys.argv[1:], "results": res}, indent=1) + "\n")


if __name__ == "__main__":
    main()
