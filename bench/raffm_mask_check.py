"""Slicing or choice of units? (issue 35, part 4) SmolLM2-135M-Instruct, pretrained, E2E target NLL.

``bench/raffm_slice_sanity.py`` found that slicing away the 64 least salient FFN units of every
layer (4%) takes the target NLL from 2.5 to 9.2. Two readings: the slicing code is wrong, or
RaFFM's weight-norm salience picks units the model needs. This script masks units in the
unsliced model (zeroes the FFN output projection's columns: the same function a correct slice
computes) and compares:

* the 64 least salient units per layer (RaFFM's L1 order: rows of gate and up + column of down):
  equal NLL to the slice = the slicing is right, the choice is wrong;
* the last 64 units of the checkpoint's order, 64 random units (seeded);
* the 64 units with the smallest mean |activation| x ||down column|| on 64 E2E training rows
  (a data-aware order, the structured-pruning literature's choice: Minitron, LLM-Pruner);

and, for the two orders, the NLL at 25% / 50% / 75% of the units kept (FFN only, every head)::

    OMP_NUM_THREADS=1 python bench/raffm_mask_check.py --test-mrs 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from raffm_slice_sanity import cfg  # noqa: E402

from fedslice.api import setup  # noqa: E402
from fedslice.experiment import validate_config  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--test-mrs", type=int, default=8)
    p.add_argument("--act-rows", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("bench/results/raffm_mask_check"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    method, data = setup(validate_config(cfg(args, True)))
    model, arch, task = method.model, method.arch, method.task
    dims = arch.all_dims(model.config)[0]
    F, L = dims["ffn"], dims["num_layers"]
    method.initial_state()  # computes RaFFM's salience order (the model itself is not touched)
    sal_order = [list(o) for o in method.own_strategy.perm.stacks[0].neurons]  # most salient first
    downs = [arch.ffn_part(model, 0, l, "ffn_out") for l in range(L)]
    original = [d.weight.detach().clone() for d in downs]

    # data-aware importance: mean |input of down_proj| x ||its column||
    acts = [torch.zeros(F) for _ in range(L)]
    counts = [0] * L

    def hook(l):
        def f(mod, inp):
            x = inp[0].detach().abs().reshape(-1, F)
            acts[l] += x.sum(0)
            counts[l] += x.shape[0]
        return f

    hs = [d.register_forward_pre_hook(hook(l)) for l, d in enumerate(downs)]
    rows = task.limit(data.train, args.act_rows, 0)
    model.eval()
    with torch.no_grad():
        task.target_nll(model, rows, 16)
    for h in hs:
        h.remove()
    act_order = [torch.argsort((acts[l] / counts[l]) * original[l].abs().sum(0), descending=True).tolist()
                 for l in range(L)]
    g = torch.Generator().manual_seed(0)
    rand_order = [torch.randperm(F, generator=g).tolist() for _ in range(L)]
    ckpt_order = [list(range(F)) for _ in range(L)]

    def nll_keeping(orders, keep: int) -> float:
        with torch.no_grad():
            for l, d in enumerate(downs):
                w = original[l].clone()
                w[:, orders[l][keep:]] = 0
                d.weight.copy_(w)
            out = task.target_nll(model, data.test, 32)
            for l, d in enumerate(downs):
                d.weight.copy_(original[l])
        return out

    res = {"full": nll_keeping(ckpt_order, F)}
    print(f"full: {res['full']:.3f}", flush=True)
    orders = {"RaFFM L1 salience": sal_order, "activation x weight (data-aware)": act_order,
              "checkpoint order": ckpt_order, "random": rand_order}
    for keep in (F - 1, F - 64, round(0.75 * F), F // 2, F // 4):
        for name, o in orders.items():
            if name in ("checkpoint order", "random") and keep not in (F - 64, F // 2):
                continue
            t0 = time.perf_counter()
            k = f"{name}: keep {keep}/{F}"
            res[k] = nll_keeping(o, keep)
            print(f"{k}: {res[k]:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
            (args.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    lines = ["# FFN units masked in the unsliced SmolLM2 (pretrained): E2E target NLL", "",
             f"Command: `python bench/raffm_mask_check.py {' '.join(sys.argv[1:])}` "
             f"({time.strftime('%Y-%m-%d')}, {args.test_mrs} test MRs, all references; activations on "
             f"{args.act_rows} training rows)", "", "| units kept per layer (every head kept) | target NLL |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in res.items()]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
