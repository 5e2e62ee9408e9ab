"""The raffm method: planner, slice aggregation, end-to-end runs on the tiny BERT."""

import json

import numpy as np
import pytest
import torch

from fedslice.config import FederationConfig
from fedslice.methods.raffm import RaFFMMethod
from fedslice.experiment import validate_config
from fedslice.errors import ConfigError
from fedslice.api import setup
from fedslice.run.engine import Simulation
from fedslice.fl.strategy import Reply
from fedslice.methods.budgets import ClientBudget, client_budgets
from fedslice.methods.plan_records import ClientPlan, Knobs
from fedslice.methods.raffm import RaFFMStrategy
from fedslice.models.arch import ARCHITECTURES
from fedslice.slicing.aggregate import fedavg
from fedslice.slicing.planner import WidthsByFlops, width_candidates
from fedslice.slicing.spec import SliceSpec

DIMS = {"num_layers": 2, "num_heads": 4, "head_dim": 2, "hidden": 8, "ffn": 6}
ARCH = ARCHITECTURES["bert"]


def _raffm(cfg_dict, **opts):
    cfg_dict["method"] = {"name": "raffm", **opts}
    return cfg_dict


def _run(cfg_dict):
    cfg = validate_config(cfg_dict)
    method, data = setup(cfg)
    state, records, summary = Simulation(cfg, method, data).run()
    return method, state, records, summary


# ---- slice aggregation ---------------------------------------------------------------------

def _toy_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    state = {}
    for l in range(DIMS["num_layers"]):
        for part, shape in (("q", (8, 8)), ("o", (8, 8)), ("ffn_in", (6, 8)), ("ffn_out", (8, 6))):
            state[f"{ARCH.part_name(l, part)}.weight"] = torch.randn(shape, generator=g)
        state[f"{ARCH.part_name(l, 'q')}.bias"] = torch.randn(8, generator=g)
    state["classifier.weight"] = torch.randn(2, 8, generator=g)
    return state


def _strategy(specs):
    plans = {c: ClientPlan(c, 0, ClientBudget(flops_share=1.0), Knobs(s), 0.0, 0.0, 0.0, flops_share=1.0)
             for c, s in enumerate(specs)}
    fed = FederationConfig(num_clients=len(specs), clients_per_round=len(specs))
    return RaFFMStrategy(fed, RaFFMMethod(reorder=False), ARCH, DIMS, plans, None)


def _round(strategy, state, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    clients = list(range(len(n)))
    payloads = strategy.configure_train(1, state, clients)
    replies = {c: Reply({k: t + torch.randn(t.shape, generator=g) for k, t in payloads[c].arrays.items()},
                        n[c], {"loss": 0.1}) for c in clients}
    return payloads, replies, strategy.aggregate_train(1, state, payloads, replies)


def test_full_specs_are_exactly_fedavg():
    state = _toy_state()
    n = [3, 5, 11]
    payloads, replies, res = _round(_strategy([SliceSpec.full(DIMS)] * 3), state, n)
    ref = fedavg(state, [replies[c].arrays for c in range(3)], n)
    for k in state:
        torch.testing.assert_close(res.state[k], ref[k], rtol=0, atol=0)


def test_slice_aggregation_against_numpy_reference():
    state = _toy_state()
    specs = [SliceSpec.leading(DIMS, 3, 5),
             SliceSpec.leading(DIMS, 2, 3),  # heads 0-1, neurons 0-2 in both layers
             SliceSpec(( 1,), ((1,),), ((0, 4),), 2, 4, 2, 6)]  # depth: layer 1 only, odd indices
    n = np.array([3.0, 5.0, 11.0])
    payloads, replies, res = _round(_strategy(specs), state, [3, 5, 11])
    # numpy reference: per element, the example-weighted mean over the clients that held it
    for key, g in state.items():
        num, den = np.zeros(g.shape), np.zeros(g.shape)
        for c, spec in enumerate(specs):
            held = np.zeros(g.shape, dtype=bool)
            local = np.zeros(g.shape)
            if key.startswith("classifier"):
                held[:] = True
                local = replies[c].arrays[key].numpy()
            else:
                layer = int(key.split(".")[3])
                if layer not in spec.layers:
                    continue
                j = spec.layers.index(layer)
                sub_key = key.replace(f"layer.{layer}.", f"layer.{j}.")
                part = next(p for p in ("ffn_in", "ffn_out", "q", "o") if ARCH.part_name(layer, p) + "." in key + ".")
                kind = "heads" if part in ("q", "o") else "ffn"
                idx = spec.index(j, kind).numpy()
                t = replies[c].arrays[sub_key].numpy()
                if part in ("q", "ffn_in"):
                    held[idx] = True
                    local[idx] = t
                else:
                    held[:, idx] = True
                    local[:, idx] = t
            num += n[c] * held * local
            den += n[c] * held
        ref = np.where(den > 0, num / np.where(den > 0, den, 1), g.numpy())
        np.testing.assert_allclose(res.state[key].numpy(), ref, rtol=1e-5, atol=1e-5, err_msg=key)
    # a never-held element keeps its value exactly: layer 0, neuron 5 (W_in row 5)
    k = f"{ARCH.part_name(0, 'ffn_in')}.weight"
    assert torch.equal(res.state[k][5], state[k][5])
    assert not torch.equal(res.state[k][0], state[k][0])


def test_size_weight_leans_shared_elements_toward_larger_submodels():
    """size_weight = p: weight n_c * f_c^p on the elements a client holds (np.average reference);
    an element held by one client still takes that client's value whatever its weight."""
    state = _toy_state()
    specs, fracs, n = [SliceSpec.full(DIMS), SliceSpec.leading(DIMS, 2, 3)], [1.0, 0.25], [3, 5]
    strategy = _strategy(specs)
    strategy.opts = RaFFMMethod(reorder=False, size_weight=2.0)
    for c, f in enumerate(fracs):
        strategy.plans[c] = ClientPlan(c, 0, ClientBudget(flops_share=f), Knobs(specs[c]), 0.0, 0.0, 0.0,
                                       flops_share=f)
    payloads, replies, res = _round(strategy, state, n)
    w = [n[c] * fracs[c] ** 2 for c in range(2)]
    ref = np.average([replies[c].arrays["classifier.weight"].numpy() for c in range(2)], axis=0, weights=w)
    np.testing.assert_allclose(res.state["classifier.weight"].numpy(), ref, rtol=1e-5, atol=1e-6)
    k = f"{ARCH.part_name(0, 'ffn_in')}.weight"  # neuron 4: only the full client holds it
    torch.testing.assert_close(res.state[k][4], replies[0].arrays[k][4])
    assert strategy.client_factor(payloads[1]) == strategy.size_factor(1) == pytest.approx(0.0625)


def test_sit_out_client_is_excluded_with_reason():
    state = _toy_state()
    s = _strategy([SliceSpec.full(DIMS), SliceSpec.full(DIMS)])
    s.plans[1] = ClientPlan(1, 2, ClientBudget(flops_share=0.01, field="method.tiers[2]"), Knobs(), 0.0, 0.0, 0.0,
                            sits_out="too small")
    payloads = s.configure_train(1, state, [0, 1])
    assert payloads[1].arrays == {} and payloads[1].config["sit_out"] == "too small"
    replies = {0: Reply(dict(payloads[0].arrays), 4, {"loss": 0.1}), 1: Reply({}, 0, {"loss": float("nan")})}
    res = s.aggregate_train(1, state, payloads, replies)
    assert res.used == [0] and res.excluded == [{"client": 1, "reason": "sat out: too small"}]


# ---- planner ---------------------------------------------------------------------------------

def _fake_measure(spec):
    """Cost grows with kept units, plus noise the formula does not know (as a real model has)."""
    units = sum(len(h) * 3 + len(f) for h, f in zip(spec.heads, spec.neurons)) + 4 * len(spec.layers)
    wobble = 1.0 + 0.05 * ((sum(map(len, spec.heads)) * 7) % 3)
    return float(units * wobble), units * 0.5 * wobble, units, units


@pytest.mark.parametrize("depth", [False, True])
def test_elastic_sizes_never_return_a_spec_over_their_fraction(depth):
    cands = width_candidates(DIMS, 12, depth=depth)
    assert cands[-1].is_full and all(len(h) >= 1 for s in cands for h in s.heads)
    sizes = WidthsByFlops(cands, _fake_measure)
    for b in np.linspace(0.01, 1.0, 40):
        plan = sizes.at(float(b))
        if plan.spec is None:
            assert "below the smallest sub-model" in plan.reason
            assert sizes.cost(cands[0]).flops_ratio > b
        else:
            assert plan.cost.flops_ratio <= b + 1e-12
            assert plan.cost == sizes.cost(plan.spec)  # measured, not estimated
    assert sizes.at(1.0).spec.is_full


def test_tiers_follow_shares():
    from fedslice.config import BudgetsConfig
    budgets = BudgetsConfig(tiers=[{"share": 0.5, "flops_share": 0.3}, {"share": 0.3, "flops_share": 0.6},
                                   {"share": 0.2, "memory_mb": 100}])
    out = client_budgets(budgets, 10, seed=0)
    tiers = [t for t, _ in out.values()]
    assert tiers.count(0) == 5 and tiers.count(2) == 2
    assert out == client_budgets(budgets, 10, seed=0)
    assert {b.field for t, b in out.values() if t == 2} == {"budgets.tiers[2]"}


# ---- config errors ---------------------------------------------------------------------------

@pytest.mark.parametrize("method, field", [
    ({"tiers": [{"share": 1.0, "flops": 0}]}, "method.tiers.0.flops"),
    ({"tiers": [{"share": 1.0, "flops": 1.2}]}, "method.tiers.0.flops"),
    ({"tiers": [{"share": 0.5, "flops": 0.5}, {"share": 0.3, "flops": 1}]}, "method.tiers"),
    ({"tiers": [{"share": 1.0, "memory_mb": -5}]}, "method.tiers.0.memory_mb"),
    ({"budget_distribution": {"low": 0.0, "high": 0.5}}, "method.budget_distribution.low"),
    ({"elastic_sizes": [0.5, 1.5]}, "method.elastic_sizes"),
])
def test_bad_budgets_name_the_field(method, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate_config({"method": {"name": "raffm", **method}})


# ---- end to end ------------------------------------------------------------------------------

def test_memory_limit_below_every_submodel_names_field_and_clients(tiny_cfg_dict):
    tiers = [{"share": 0.5, "flops": 1.0}, {"share": 0.5, "memory_mb": 0.001}]
    cfg = validate_config(_raffm(tiny_cfg_dict, tiers=tiers, on_infeasible="error"))
    with pytest.raises(ConfigError, match=r"client \d \(method\.tiers\[1\], tier1\): budget 0\.001 MiB"):
        setup(cfg)
    cfg = validate_config(_raffm(tiny_cfg_dict, tiers=[{"share": 1.0, "memory_mb": 0.001}]))
    with pytest.raises(ConfigError, match="every client would sit out"):
        setup(cfg)


@pytest.mark.parametrize("tuning", ["lora", "full"])
def test_two_round_run_with_tiers(tiny_cfg_dict, tuning):
    """Packed batches (rows of several examples): every client's analytic FLOPs equal the
    measured ones, sliced sub-models too (the packed extrapolation is exact; the analytic count
    takes attention at the packed row length and leaves out the bottom block's gradients autograd
    skips). Before: a sliced client's attention correction used the example length, 39% over."""
    tiers = [{"share": 0.5, "flops": 0.4}, {"share": 0.25, "flops": 1.0}, {"share": 0.25, "flops": 0.02}]
    tiny_cfg_dict["federation"].update(num_clients=4, clients_per_round=3, pack=True)
    method, state, records, summary = _run(_raffm(tiny_cfg_dict, tiers=tiers, tuning=tuning,
                                                  reorder_every=1, width_steps=8))
    plans = method.strategy.plans
    small = [c for c, cp in plans.items() if cp.tier == 0]
    assert all(plans[c].flops_share <= 0.4 for c in small)
    sat = [c for c, cp in plans.items() if cp.sits_out is not None]
    assert sat and all(plans[c].tier == 2 for c in sat)
    for rec in records:  # a client that sits out every round is never selected
        assert sorted(rec["clients"]) == sorted(set(range(4)) - set(sat)) and not rec["excluded"]
        by_client = {m["client"]: m for m in rec["client_metrics"]}
        f_small = by_client[small[0]]["flops_measured"]
        f_full = next(m["flops_measured"] for m in rec["client_metrics"] if m.get("tier") == 1)
        assert f_small < 0.5 * f_full
        for m in by_client.values():
            if not m["sat_out"]:
                assert m["flops_measured"] == pytest.approx(m["flops_analytic"], rel=1e-9), m["tier"]
    assert summary["sat_out_replies"] == 0 and set(summary["sat_out"]) == {str(c) for c in sat}
    sizes = [e["size"] for e in summary["elastic"]]
    assert sizes == [0.25, 0.5, 0.75, 1.0]
    assert summary["elastic"][-1]["test_accuracy"] == pytest.approx(summary["test_accuracy"])
    assert summary["elastic"][0]["forward_flops_ratio"] < 0.5
    assert not method.strategy.perm.is_identity
    # export un-permutes: the exported state equals the model order of the checkpoint
    exported = method.exported(state)
    assert exported.keys() == state.keys()
    json.dumps(summary)


def test_run_folder_has_elastic_plot_and_unpermuted_weights(tiny_cfg_dict):
    from safetensors.torch import load_file

    from fedslice.api import run_experiment
    from fedslice.output import WEIGHTS
    tiny_cfg_dict["output"]["plots"] = True
    tiny_cfg_dict["federation"]["rounds"] = 1
    cfg = validate_config(_raffm(tiny_cfg_dict, tuning="lora", width_steps=4))
    path = run_experiment(cfg)
    summary = json.loads((path / "summary.json").read_text())
    assert [e["size"] for e in summary["elastic"]] == [0.25, 0.5, 0.75, 1.0]
    assert summary["permutation_applied"] and (path / "elastic.png").is_file()
    # the frozen base weights were permuted during training; exported, they are the checkpoint's
    from transformers import AutoModelForSequenceClassification
    ckpt = AutoModelForSequenceClassification.from_pretrained(cfg.model.name).state_dict()
    saved = load_file(path / WEIGHTS)
    for part, leaf in (("query", "base_layer.weight"), ("key", "weight"), ("value", "base_layer.weight")):
        base = f"base_model.model.bert.encoder.layer.1.attention.self.{part}.{leaf}"
        assert torch.equal(saved[base], ckpt[f"bert.encoder.layer.1.attention.self.{part}.weight"])
    base = "base_model.model.bert.encoder.layer.0.intermediate.dense.bias"
    assert torch.equal(saved[base], ckpt["bert.encoder.layer.0.intermediate.dense.bias"])


def test_measured_costs_scale_linearly_with_the_batch(tiny_model_dir):
    from fedslice.config import ModelConfig
    from fedslice.models.loading import load_model
    from fedslice.slicing.planner import measure_training_step, profile_batch
    model = load_model(ModelConfig(name=str(tiny_model_dir)), 2, 0).model
    batch = profile_batch(model.config.vocab_size, 8, 16)
    whole = measure_training_step(model, batch, measure_rows=None)
    part = measure_training_step(model, batch, measure_rows=2)
    assert part[0] == pytest.approx(whole[0], rel=1e-6)
    assert part[1] == pytest.approx(whole[1], rel=0.02)
    assert part[2:] == whole[2:]


def test_depth_tiers_and_a_drawn_flops_share(tiny_cfg_dict):
    """Elastic depth: a client at 0.2x dense's FLOPs keeps one layer; drawn shares stay in
    their range."""
    cfg = validate_config(_raffm(tiny_cfg_dict, width_steps=4, elastic_depth=True,
                                 tiers=[{"share": 0.5, "flops": 1.0}, {"share": 0.5, "flops": 0.2}]))
    method, _ = setup(cfg)
    small = [cp for cp in method.strategy.plans.values() if cp.tier == 1]
    assert all(cp.flops_share <= 0.2 for cp in small)
    assert len(small[0].knobs.spec.layers) < 2  # at 0.2x the tiny model keeps one layer
    state, records, summary = Simulation(cfg, method, _).run()
    assert summary["sat_out_replies"] == 0 and all(not r["excluded"] for r in records)
    from fedslice.config import BudgetsConfig
    draws = client_budgets(BudgetsConfig(flops_share_range=[0.3, 0.6]), 50, seed=1)
    assert all(0.3 <= b.flops_share <= 0.6 and t is None for t, b in draws.values())
