"""The budget planner's search over sub-models (methods/planner.py ``_specs_in_reach``): where the
sub-models nest (RaFFM's leading slices), the first one whose cheapest point fits is found by
bisection, and every plan, with its reason, is the one a scan of every sub-model gives."""

from __future__ import annotations

import json

import pytest

from fedslice.api import setup
from fedslice.experiment import validate_config
from fedslice.slicing.planner import width_candidates
from fedslice.slicing.spec import ModelSlice

DIMS = {"num_heads": 4, "head_dim": 8, "ffn": 64, "num_layers": 3, "hidden": 32}


def test_leading_slices_nest_and_elastic_depth_does_not():
    import fedslice.methods.planner as planner

    widths = width_candidates(DIMS, 8)[::-1]  # largest first, as the planner holds them
    assert len(widths) == 8 and planner.is_chain(widths) and planner.is_chain([None] + widths)
    assert not planner.is_chain(widths[::-1])  # a larger one after a smaller one
    assert planner.contains(widths[0], widths[-1]) and not planner.contains(widths[-1], widths[0])
    # fewer layers at a larger width: neither is part of the other
    deep = width_candidates(DIMS, 4, depth=True)[::-1]
    assert not planner.is_chain(deep)
    stacks = [ModelSlice.leading([DIMS, DIMS], w / 4) for w in (4, 3, 2, 1)]
    assert planner.is_chain(stacks) and not planner.is_chain(stacks[::-1])
    assert planner.is_chain([None]) and planner.is_chain([])


def _plans(d: dict, monkeypatch, scan: bool) -> tuple[dict, int, bool]:
    """Every client's plan, the steps the planner measured and whether it bisected."""
    import fedslice.methods.plan_costs as plan_costs
    import fedslice.methods.planner as planner
    from fedslice.slicing.planner import measure_step

    calls, chains = [], []
    real_chain = planner.is_chain

    def counted(*args, **kwargs):
        calls.append(1)
        return measure_step(*args, **kwargs)

    def chain(specs):
        chains.append(False if scan else real_chain(specs))
        return chains[-1]

    with monkeypatch.context() as mp:
        mp.setattr(plan_costs, "measure_step", counted)
        mp.setattr(planner, "is_chain", chain)
        method, _ = setup(validate_config(json.loads(json.dumps(d))))
    return {c: p.to_dict() for c, p in method.plans.items()}, len(calls), all(chains) and bool(chains)


def test_bisection_plans_what_the_scan_plans_with_fewer_measured_steps(tiny_cfg_dict, monkeypatch):
    """RaFFM on 24 widths, five budgets: FLOPs shares landing on different widths (the nearest
    larger width passed over in each reason), a memory share that binds before its FLOPs share,
    the dense client and one no width fits (it sits out). Plans, predicted costs and reasons
    equal the scan's, with under 0.6 of its measured steps."""
    d = json.loads(json.dumps(tiny_cfg_dict))
    d["federation"].update(num_clients=5, clients_per_round=5, rounds=1, local_steps=2)
    d["method"] = {"name": "raffm", "reorder_every": 1}
    d["budgets"] = {"tiers": [{"share": 0.2, "name": "dense", "flops_share": 1.0},
                              {"share": 0.2, "name": "f60", "flops_share": 0.6},
                              {"share": 0.2, "name": "f35", "flops_share": 0.35},
                              {"share": 0.2, "name": "f50m", "flops_share": 0.8, "memory_share": 0.89},
                              {"share": 0.2, "name": "none", "flops_share": 0.01}],
                    "width_steps": 24, "local_work": [1.0], "micro_batches": [1],
                    "checkpointing": False, "on_infeasible": "sit_out"}
    bisected, steps, nested = _plans(d, monkeypatch, scan=False)
    scanned, every, _ = _plans(d, monkeypatch, scan=True)
    assert nested
    assert bisected == scanned
    by_name = {p["budget_name"]: p for p in bisected.values()}
    widths = {n: p["width"] for n, p in by_name.items() if not p["sits_out"]}
    assert widths["dense"] == 1.0 and len(set(widths.values())) == 3, widths
    assert widths["f35"] < widths["f60"] < 1.0
    assert widths["f50m"] < widths["f60"]  # its memory share binds, not its FLOPs share
    assert by_name["none"]["sits_out"]
    assert all("the next larger plan" in by_name[n]["reason"] for n in ("f60", "f35", "f50m"))
    assert steps < 0.6 * every, (steps, every)
