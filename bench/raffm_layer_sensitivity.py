"""Experiment (issue 35, part 4): SmolLM2's RaFFM sub-models with per-layer widths from each
layer's *measured* sensitivity (``method.widths = "measured"``), before training, against the
uniform width RaFFM's planner uses by default, at the same linear parameters.

With the activation-salience order (``method.salience = "activation"``), layer l cut alone to
each of ``width_levels`` widths raises the calibration rows' loss by rise[l][k]
(:func:`fedslice.slicing.widths.layer_rise`); the allocation (:func:`allocate_spec`) keeps, within
the uniform slice's linear parameters, the per-layer widths of least summed rise. Both are scored
on E2E test MRs (target NLL over all their references) by masking the full model (exact: see
:mod:`fedslice.slicing.masks`). ``--widths`` are the uniform widths compared (0.125, 0.396,
0.708 are the heads and units per layer the planner keeps at 0.25 / 0.5 / 0.75 of the FLOPs).

    OMP_NUM_THREADS=1 nice -n 10 python bench/raffm_layer_sensitivity.py --test-mrs 20
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from fedslice.api import setup
from fedslice.experiment import load_config, validate_config
from fedslice.slicing.masks import masked_inputs
from fedslice.slicing.planner import spec_params
from fedslice.slicing.salience import output_modules, stack_order
from fedslice.slicing.spec import SliceSpec
from fedslice.slicing.widths import allocate_spec, level_sizes, slice_masks
from fedslice.tasks.text2text import eval_mode

ROOT = Path(__file__).resolve().parents[1]


def config(args) -> dict:
    cfg = load_config(ROOT / "configs/e2e_smollm2.toml").model_dump(mode="json")
    cfg.update(name="raffm-sensitivity", seed=args.seed, threads=args.threads)
    cfg["compute"]["workers"] = 1
    cfg["method"] = {"name": "raffm", "salience": "activation", "widths": "measured",
                     "width_levels": args.levels, "calibration_examples": args.calibration_examples,
                     "tiers": [{"share": 1.0, "flops": 1.0}], "elastic_sizes": [1.0]}
    cfg["data"]["max_test_examples"] = args.test_mrs
    cfg["data"]["max_dev_examples"] = 64
    cfg["output"].update(dir=str(args.out), progress=False, plots=False, save_weights=False)
    return cfg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--test-mrs", type=int, default=20)
    p.add_argument("--calibration-examples", type=int, default=16)
    p.add_argument("--levels", type=int, default=8, help="method.width_levels")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--widths", nargs="+", type=float, default=[0.125, 0.396, 0.708])
    p.add_argument("--out", type=Path, default=Path("bench/results/raffm_layer_sensitivity"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    method, data = setup(validate_config(config(args)))  # measures the rises (its planner's grid)
    dims = method.all_dims[0]
    t_rise = time.time() - t0
    rise, levels = method.layer_rise, method.width_levels
    order = stack_order(method.loaded_salience[0], dims)
    model = method.model  # the loaded model: the masks cut it in the salience order
    mods = output_modules(model, method.arch)
    res = {"levels": levels, "rise": rise, "setup_and_rise_s": t_rise, "rows": []}

    def nll(spec: SliceSpec) -> float:
        sizes = [(len(h), len(f)) for h, f in zip(spec.heads, spec.neurons)]
        with masked_inputs(slice_masks(mods, order, sizes)), eval_mode(model):
            return method.task.target_nll(model, data.test, args.batch_size)

    for w in args.widths:
        uniform = SliceSpec.leading(dims, *level_sizes(dims, w))
        budget = spec_params(uniform, dims)
        measured = allocate_spec(rise, dims, levels, budget)
        row = {"width": w, "uniform_heads": len(uniform.heads[0]), "uniform_ffn": len(uniform.neurons[0]),
               "params_M": budget / 1e6, "measured_params_M": spec_params(measured, dims) / 1e6,
               "measured": measured.describe(), "uniform_test_nll": nll(uniform),
               "measured_test_nll": nll(measured)}
        res["rows"].append(row)
        print(f"width {w}: uniform {row['uniform_heads']} heads / {row['uniform_ffn']} FFN per layer, "
              f"test NLL {row['uniform_test_nll']:.3f}; measured heads {row['measured']['heads']} FFN "
              f"{row['measured']['ffn']} ({row['measured_params_M']:.1f}M of {row['params_M']:.1f}M) "
              f"test NLL {row['measured_test_nll']:.3f}", flush=True)
        (args.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    with eval_mode(model):
        res["full_test_nll"] = method.task.target_nll(model, data.test, args.batch_size)
    print(f"full model test NLL {res['full_test_nll']:.3f}; {time.time() - t0:.0f} s", flush=True)
    (args.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
