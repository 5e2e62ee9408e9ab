"""RaFFM's salience-allocated per-layer widths (``method.widths = "salience"``, issue 35 part 4):
the allocation against a hand-worked reference, nesting, the spec grid on the tiny LLaMA and a
run end to end."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from fedslice.api import setup
from fedslice.experiment import validate_config
from fedslice.methods.raffm import RaFFMMethod
from fedslice.models.arch import arch_for
from fedslice.run.engine import Simulation
from fedslice.slicing.planner import spec_params, width_candidates
from fedslice.slicing.salience import LayerSalience, model_salience, output_activations
from fedslice.slicing.widths import allocate, salience_width_candidates, shares_in_order


def test_allocate_keeps_the_largest_shares_and_one_unit_per_layer():
    concentrated = torch.tensor([0.9, 0.05, 0.05], dtype=torch.float64)
    flat = torch.full((3,), 1 / 3, dtype=torch.float64)
    # 3 of 6: the first unit of each layer, then the flat layer's 1/3 before the 0.05s
    assert allocate([concentrated, flat], 0.5) == [1, 2]
    assert allocate([concentrated, flat], 4 / 6) == [1, 3]
    assert allocate([concentrated, flat], 5 / 6) == [2, 3]  # tie 0.05 / 0.05: the earlier unit
    assert allocate([concentrated, flat], 1.0) == [3, 3]
    assert allocate([concentrated, flat], 0.01) == [1, 1]  # never below one unit per layer


def test_allocation_is_nested_and_matches_a_greedy_reference():
    g = torch.Generator().manual_seed(0)
    scores = [torch.rand(n, generator=g) ** 4 for n in (7, 12, 5, 9)]
    shares = [shares_in_order(s, torch.argsort(s, descending=True).tolist()) for s in scores]
    prev = [0] * 4
    for j in range(1, 34):
        w = j / 33
        got = allocate(shares, w)
        # reference: start at one unit per layer, add the unit of largest share one at a time
        ref, want = [1] * 4, max(4, round(w * 33))
        while sum(ref) < want:
            best = max((float(shares[l][ref[l]]), -l) for l in range(4) if ref[l] < len(shares[l]))
            ref[-best[1]] += 1
        assert got == ref and sum(got) == want
        assert all(a >= b for a, b in zip(got, prev))  # a larger width keeps a superset
        prev = got


def test_shares_follow_the_order_and_never_increase():
    s = torch.tensor([1.0, 4.0, 2.0, 3.0])
    # grouped-query order (groups whole) may put a smaller score first: the running minimum
    out = shares_in_order(s, [1, 0, 3, 2])
    torch.testing.assert_close(out, torch.tensor([0.4, 0.1, 0.1, 0.1], dtype=torch.float64))
    torch.testing.assert_close(shares_in_order(torch.zeros(3), [0, 1, 2]),
                               torch.full((3,), 1 / 3, dtype=torch.float64))


def test_candidates_on_the_tiny_llama(tiny_lm_dirs):
    import transformers as T
    model = T.AutoModelForCausalLM.from_pretrained(tiny_lm_dirs["llama"], attn_implementation="eager")
    arch = arch_for(model)
    dims = arch.all_dims(model.config)
    mlp = model.model.layers[0].mlp
    with torch.no_grad():  # layer 0's FFN salience in one unit: it keeps fewer units than others
        mlp.gate_proj.weight[1:] *= 1e-3
        mlp.up_proj.weight[1:] *= 1e-3
        mlp.down_proj.weight[:, 1:] *= 1e-3
    sal = model_salience(model.state_dict(), arch, dims, "l1")
    specs = salience_width_candidates(sal, dims, 4)
    uniform = width_candidates(dims, 4)
    assert specs[-1].is_full and len(specs) == 4
    params = [spec_params(s, dims[0]) for s in specs]
    assert params == sorted(params)
    d, F, H = dims[0], dims[0]["ffn"], dims[0]["num_heads"]
    for spec, w in zip(specs, (0.25, 0.5, 0.75, 1.0)):
        assert sum(map(len, spec.neurons)) == max(d["num_layers"], round(w * F * d["num_layers"]))
        assert sum(map(len, spec.heads)) == max(d["num_layers"], round(w * H * d["num_layers"]))
    half = specs[1]
    assert len(half.neurons[0]) < min(len(f) for f in half.neurons[1:])
    assert len(set(map(len, uniform[1].neurons))) == 1  # the default grid is uniform


def test_option_needs_reorder_and_excludes_depth():
    assert RaFFMMethod().widths == "uniform"
    with pytest.raises(ValidationError, match="reorder"):
        RaFFMMethod(widths="salience", reorder=False)
    with pytest.raises(ValidationError, match="elastic_depth"):
        RaFFMMethod(widths="salience", elastic_depth=True)


def test_run_with_salience_widths(tiny_gen_cfg_dict):
    cfg = tiny_gen_cfg_dict
    cfg["federation"].update(num_clients=2, clients_per_round=2)
    cfg["method"] = {"name": "raffm", "widths": "salience", "salience": "activation",
                     "calibration_examples": 6, "width_steps": 4,
                     "tiers": [{"share": 0.5, "flops": 0.985}, {"share": 0.5, "flops": 1.0}],
                     "elastic_sizes": [0.985, 1.0]}
    cfg = validate_config(cfg)
    method, data = setup(cfg)
    state, records, summary = Simulation(cfg, method, data).run()
    specs = method.planner.candidates
    assert specs == method.width_specs(4)  # one salience pass, the same grid
    assert any(len(set(map(len, s.neurons))) > 1 for s in specs[:-1])  # per-layer widths
    assert [e["size"] for e in summary["elastic"]] == [0.985, 1.0]
    assert not any(m.get("sat_out") for r in records for m in r["client_metrics"])
