"""Sanity check of the slicing code on SmolLM2 (issue 35, part 4): do slices that remove almost
nothing keep the pretrained model's E2E target NLL? If removing one FFN unit or one query head per
layer already moved the NLL far, the collapse of RaFFM's sizes would be a slicing bug; if the NLL
grows smoothly with what is removed, it is the model's sensitivity to uniform width cuts.

No training; target NLL on ``--test-mrs`` E2E test MRs (all their references). Salience order
(``method.reorder = true``) and the checkpoint's order side by side::

    OMP_NUM_THREADS=1 python bench/raffm_slice_sanity.py --test-mrs 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from raffm_decoder_diag import ROOT  # noqa: E402

from fedslice.api import setup  # noqa: E402
from fedslice.experiment import load_config, validate_config  # noqa: E402
from fedslice.slicing.planner import depth_layers  # noqa: E402
from fedslice.slicing.spec import SliceSpec  # noqa: E402
from fedslice.slicing.state import extract_state  # noqa: E402


def cfg(args, reorder: bool) -> dict:
    c = load_config(ROOT / "configs/e2e_smollm2.toml").model_dump(mode="json")
    c.update(name="raffm-sanity", seed=0, threads=1)
    c["compute"]["workers"] = 1
    # one candidate (the full model): the planner measures nothing else
    c["method"] = {"name": "raffm", "tiers": [{"share": 1.0, "flops": 1.0}], "width_steps": 1,
                   "elastic_sizes": [1.0], "reorder": reorder}
    c["data"]["max_test_examples"] = args.test_mrs
    c["data"]["max_dev_examples"] = 8
    c["output"].update(dir="/tmp", progress=False, plots=False, save_weights=False)
    return c


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--test-mrs", type=int, default=8)
    p.add_argument("--out", type=Path, default=Path("bench/results/raffm_slice_sanity"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    res = {}
    for reorder in (True, False):
        method, data = setup(validate_config(cfg(args, reorder)))
        dims = method.arch.all_dims(method.model.config)[0]
        H, F, L = dims["num_heads"], dims["ffn"], dims["num_layers"]
        state = method.initial_state()
        specs = {
            "full (spec = every unit)": SliceSpec.leading(dims, H, F),
            f"FFN {F - 1}/{F}": SliceSpec.leading(dims, H, F - 1),
            f"FFN {F - 64}/{F}": SliceSpec.leading(dims, H, F - 64),
            f"FFN {F // 2}/{F}": SliceSpec.leading(dims, H, F // 2),
            f"heads {H - 3}/{H} (one K/V group)": SliceSpec.leading(dims, H - 3, F),
            f"layers {L - 1}/{L}": SliceSpec.leading(dims, H, F, depth_layers(L, L - 1)),
            f"layers {L - 4}/{L}": SliceSpec.leading(dims, H, F, depth_layers(L, L - 4)),
        }
        for name, spec in specs.items():
            t0 = time.perf_counter()
            model = method.submodel(spec)
            method._load(model, extract_state(state, spec, method.arch))
            model.eval()
            with torch.no_grad():
                nll = method.task.target_nll(model, data.test, 32)
            key = f"{'salience order' if reorder else 'checkpoint order'}: {name}"
            res[key] = nll
            print(f"{key}: NLL {nll:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
            (args.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    lines = ["# Slicing sanity on SmolLM2-135M-Instruct, pretrained, E2E target NLL", "",
             f"Command: `python bench/raffm_slice_sanity.py {' '.join(sys.argv[1:])}` "
             f"({time.strftime('%Y-%m-%d')}, {args.test_mrs} test MRs, all references)", "",
             "| sub-model | target NLL |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in res.items()]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
