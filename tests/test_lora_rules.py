"""LoRA aggregation rules (issue 23, part 3) and heterogeneous ranks (part 4), each against a numpy
reference: FedEx's model update is the weighted mean of the clients' B·A, FFA never changes A,
FLoRA merges the weighted sum of B·A, SVD is the rank-r truncation of the averaged ΔW; FedSA keeps
B on the clients; clients of lower rank are zero-padded at the global adapter's scale."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from conftest import assert_refused_naming
from fedslice.api import setup
from fedslice.config import FederationConfig
from fedslice.experiment import validate_config
from fedslice.run.engine import Simulation
from fedslice.fl.rules import SVD, FedEx, FedSA, FLoRA, LoraRanks, find_rule
from fedslice.fl.strategy import Payload, Reply, Strategy
from fedslice.models.arch import CONV1D
from fedslice.peft.tuners.lora.aggregate import (discarded_energy, lora_pairs, pad_rank,
                                                 target_update)

S = 0.5  # alpha / r of the tests' adapters
OUT, IN, R = 6, 5, 4
M = "layer.0.q"  # a wrapped module
A, B, W = f"{M}.lora_A.default.weight", f"{M}.lora_B.default.weight", f"{M}.base_layer.weight"


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {A: torch.randn(R, IN, generator=g), B: torch.randn(OUT, R, generator=g),
            W: torch.randn(OUT, IN, generator=g), "classifier.weight": torch.randn(2, IN, generator=g)}


def _clients(state, n: int = 3, seed: int = 1):
    """Each client's trained A and B (and classifier), as replies' full states."""
    g = torch.Generator().manual_seed(seed)
    return [{k: state[k] + 0.3 * torch.randn(state[k].shape, generator=g)
             for k in (A, B, "classifier.weight")} for _ in range(n)]


def _replies(locals_, sizes):
    return {c: Reply(arrays=dict(s), num_examples=n, metrics={"loss": 0.5}) for c, (s, n) in enumerate(zip(locals_, sizes))}


def _aggregate(rule_cls, state, locals_, sizes, **kw):
    fed = FederationConfig(num_clients=len(sizes), clients_per_round=len(sizes))
    rule = rule_cls(Strategy(fed), S, **kw)
    payloads = {c: Payload(arrays={k: state[k] for k in (A, B, "classifier.weight")},
                           config={"client": c}) for c in range(len(sizes))}
    new, metrics = rule.aggregate(1, state, payloads, _replies(locals_, sizes))
    return new, metrics


def _np(t):
    return t.double().numpy()


def _mean_products(locals_, sizes):
    w = np.array(sizes, float) / sum(sizes)
    return sum(wc * S * (_np(s[B]) @ _np(s[A])) for wc, s in zip(w, locals_))


# --------------------------------------------------------------------------------------------
# Pure rules against numpy
# --------------------------------------------------------------------------------------------

def test_fedex_model_update_is_the_weighted_mean_of_the_clients_products():
    state = _state()
    locals_ = _clients(state)
    sizes = [10, 30, 20]
    new, metrics = _aggregate(FedEx, state, locals_, sizes)
    # the factors are FedIT's means ...
    w = np.array(sizes, float) / sum(sizes)
    np.testing.assert_allclose(_np(new[A]), sum(wc * _np(s[A]) for wc, s in zip(w, locals_)), atol=1e-6)
    # ... and the effective weight W + s B A moved by exactly the mean of s B_c A_c minus s B_g A_g
    before = _np(state[W]) + S * _np(state[B]) @ _np(state[A])
    after = _np(new[W]) + S * _np(new[B]) @ _np(new[A])
    np.testing.assert_allclose(after, before - S * _np(state[B]) @ _np(state[A])
                               + _mean_products(locals_, sizes), atol=1e-6)
    assert metrics["fedex_residual_norm"] > 0
    # the classifier (no LoRA pair) is the method's mean
    np.testing.assert_allclose(_np(new["classifier.weight"]),
                               sum(wc * _np(s["classifier.weight"]) for wc, s in zip(w, locals_)), atol=1e-6)


def test_fedex_residual_follows_the_base_weight_layout():
    state = _state()
    state[W] = state[W].T.contiguous()  # GPT-2's Conv1D: (in, out)
    locals_ = _clients(state)
    new, _ = _aggregate(FedEx, state, locals_, [1, 1, 1], layout=CONV1D)
    after = _np(new[W]).T + S * _np(new[B]) @ _np(new[A])
    before = _np(state[W]).T
    np.testing.assert_allclose(after - before, _mean_products(locals_, [1, 1, 1]), atol=1e-6)


def test_flora_merges_the_weighted_sum_of_products_and_restarts_the_adapter():
    state = _state()
    state[B] = torch.zeros(OUT, R)  # a fresh adapter: B = 0
    locals_ = _clients(state)
    sizes = [5, 15, 30]
    new, metrics = _aggregate(FLoRA, state, locals_, sizes)
    np.testing.assert_allclose(_np(new[W]) - _np(state[W]), _mean_products(locals_, sizes), atol=1e-6)
    assert torch.equal(new[B], torch.zeros(OUT, R)) and not torch.equal(new[A], state[A])
    # the stacked adapter of 3 clients at rank R, float32
    assert metrics["flora_stack_bytes"] == 3 * R * (IN + OUT) * 4


def test_svd_is_the_rank_r_truncation_of_the_averaged_update():
    state = _state()
    locals_ = _clients(state)
    sizes = [3, 1, 2]
    new, metrics = _aggregate(SVD, state, locals_, sizes)
    target = _mean_products(locals_, sizes)  # rank up to 3 R > R: the truncation drops some
    u, sv, vt = np.linalg.svd(target)
    truncated = (u[:, :R] * sv[:R]) @ vt[:R]
    np.testing.assert_allclose(S * _np(new[B]) @ _np(new[A]), truncated, atol=1e-5)
    assert metrics["svd_discarded_energy"] == pytest.approx((sv[R:] ** 2).sum() / (sv ** 2).sum(), rel=1e-5)
    assert torch.equal(new[W], state[W])  # the base is untouched
    # the leading r components are the best rank-r approximation (what a rank-r client gets)
    r = 2
    np.testing.assert_allclose(S * _np(new[B][:, :r]) @ _np(new[A][:r]),
                               (u[:, :r] * sv[:r]) @ vt[:r], atol=1e-5)


def test_products_are_weighted_per_element_with_the_methods_weights():
    """Heads' Eq. 8 weighs B's rows of a q head by α; RaFFM's masks hold rows/columns: the
    product's element (i, j) gets the smaller of its row's and column's weights."""
    state = _state()
    locals_ = _clients(state, n=2)
    alpha = [torch.tensor([0.9, 0.9, 0.9, 0.1, 0.1, 0.1]), torch.tensor([0.2, 0.2, 0.2, 0.7, 0.7, 0.7])]
    weights = [{A: 10.0, B: a[:, None].expand(OUT, R)} for a in alpha]
    deltas = [{k: s[k] - state[k] for k in (A, B)} for s in locals_]
    (pair,) = lora_pairs(state)
    target, held = target_update(state, deltas, weights, pair, S)
    prods = [S * _np(s[B]) @ _np(s[A]) for s in locals_]
    a = np.stack([x.numpy() for x in alpha])[:, :, None]           # (2, OUT, 1)
    np.testing.assert_allclose(_np(target), (a[0] * prods[0] + a[1] * prods[1]) / (a[0] + a[1]), atol=1e-6)
    assert bool(held.all())
    # a client holding rows 0..2 only (a RaFFM slice): rows 3..5 come from the other one alone,
    # and an element nobody holds keeps s B_g A_g
    masks = [torch.tensor([1., 1, 1, 0, 0, 0]), torch.tensor([1., 1, 1, 1, 0, 0])]
    weights = [{A: 4.0, B: 4.0 * m[:, None].expand(OUT, R)} for m in masks]
    target, held = target_update(state, deltas, weights, pair, S)
    np.testing.assert_allclose(_np(target[:3]), (prods[0][:3] + prods[1][:3]) / 2, atol=1e-6)
    np.testing.assert_allclose(_np(target[3]), prods[1][3], atol=1e-6)
    np.testing.assert_allclose(_np(target[4:]), S * (_np(state[B]) @ _np(state[A]))[4:], atol=1e-6)
    assert held[:4].all() and not held[4:].any()


@pytest.mark.parametrize("padding", ["holders", "zeros"])
def test_heterogeneous_ranks_pad_and_average_each_component(padding):
    """A rank-2 and a rank-4 client of a rank-4 adapter: components 0-1 are averaged over both;
    components 2-3 over their one holder (or, HetLoRA's zero-padding, with the other's zeros)."""
    state = _state()
    fed = FederationConfig(num_clients=2, clients_per_round=2)

    class Ranked(Strategy):
        def client_rank(self, client):
            return [2, 4][client]

    rule = LoraRanks(Ranked(fed), padding)
    payloads = rule.configure_train(1, state, [0, 1])
    assert payloads[0].arrays[A].shape == (2, IN) and payloads[0].arrays[B].shape == (OUT, 2)
    assert payloads[0].config["lora_rank"] == 2 and payloads[1].arrays[A].shape == (R, IN)
    g = torch.Generator().manual_seed(3)
    replies = {c: Reply({**p.arrays, **{k: p.arrays[k] + torch.randn(p.arrays[k].shape, generator=g)
                                        for k in (A, B, "classifier.weight")}}, 10, {"loss": 0.5})
               for c, p in payloads.items()}
    res = rule.aggregate_train(1, state, payloads, replies)
    new = res.state
    a0, a1 = _np(replies[0].arrays[A]), _np(replies[1].arrays[A])
    np.testing.assert_allclose(_np(new[A][:2]), (a0 + a1[:2]) / 2, atol=1e-6)
    expect = a1[2:] if padding == "holders" else a1[2:] / 2
    np.testing.assert_allclose(_np(new[A][2:]), expect, atol=1e-6)
    np.testing.assert_allclose(_np(new[B][:, 2:]), _np(replies[1].arrays[B][:, 2:])
                               if padding == "holders" else _np(replies[1].arrays[B][:, 2:]) / 2, atol=1e-6)
    # the padding is exact: the rank-2 client's adapter is the padded one's product
    np.testing.assert_allclose(_np(pad_rank(replies[0].arrays[B], 1, R)) @ _np(pad_rank(replies[0].arrays[A], 0, R)),
                               _np(replies[0].arrays[B]) @ a0, atol=1e-6)
    # a reply at the wrong rank is rejected
    bad = {0: Reply({**replies[0].arrays, A: torch.zeros(3, IN)}, 10, {"loss": 0.5}), 1: replies[1]}
    res = rule.aggregate_train(1, state, payloads, bad)
    assert res.used == [1] and "rank 3, the client's rank is 2" in res.excluded[0]["reason"]


def test_discarded_energy():
    assert discarded_energy(torch.tensor([3.0, 4.0]), 1) == pytest.approx(16 / 25)
    assert discarded_energy(torch.tensor([3.0, 4.0]), 2) == 0.0


# --------------------------------------------------------------------------------------------
# On a model (tiny BERT): one round, the model's update against the clients' products
# --------------------------------------------------------------------------------------------

def _cfg(tiny_cfg_dict, aggregation, **lora):
    d = copy.deepcopy(tiny_cfg_dict)
    d["lora"].update(aggregation=aggregation, **lora)
    d["federation"].update(num_clients=3, clients_per_round=3, rounds=2)
    return d


def _one_round(cfg_dict):
    cfg = validate_config(cfg_dict)
    method, data = setup(cfg)
    sim = Simulation(cfg, method, data)
    state = method.initial_state()
    new, record = sim.run_round(1, state)
    return method, data, state, new, record


def _effective(method, state) -> dict[str, np.ndarray]:
    """Each adapted layer's effective weight W + s B A (out, in) from a global state + model."""
    params = dict(method.model.named_parameters())
    out = {}
    for pair in lora_pairs(state):
        w = state.get(pair.base, params[pair.base]).detach()
        out[pair.module] = _np(w) + method.adapter.scale * _np(state[pair.b]) @ _np(state[pair.a])
    return out


def _client_products(method, state, record, replies_of):
    """The example-weighted mean over the round's clients of s B_c A_c per layer."""
    sizes = {m["client"]: m["num_examples"] for m in record["client_metrics"]}
    total = sum(sizes.values())
    out = {}
    for pair in lora_pairs(state):
        out[pair.module] = sum(n / total * method.adapter.scale *
                               (_np(replies_of[c][pair.b]) @ _np(replies_of[c][pair.a]))
                               for c, n in sizes.items())
    return out


@pytest.fixture
def capture_replies(monkeypatch):
    """The replies of a round, by client (the engine hands them to aggregate_train)."""
    seen = {}
    real = Strategy.aggregate_train

    def spy(self, server_round, state, payloads, replies):
        seen.update({c: dict(r.arrays) for c, r in replies.items()})
        return real(self, server_round, state, payloads, replies)

    monkeypatch.setattr(Strategy, "aggregate_train", spy)
    return seen


def test_fedex_on_a_model_gives_the_exact_mean_of_products(tiny_cfg_dict, capture_replies):
    method, _, state, new, record = _one_round(_cfg(tiny_cfg_dict, "fedex"))
    base = {p.base for p in lora_pairs(state)}
    assert base <= set(new) and base <= set(state)
    before, after = _effective(method, state), _effective(method, new)
    mean = _client_products(method, state, record, capture_replies)
    for m in after:  # round 1 starts from B = 0: the update is the mean of the products
        assert np.abs(after[m] - before[m] - mean[m]).max() < 1e-6, m
    # round 1 sends no base weights (nothing folded yet); round 2 sends them, counted
    assert all(c["bytes_down_frozen"] == 0 for c in record["client_metrics"])
    payload = method.strategy.configure_train(2, new, [0])[0]
    assert base <= set(payload.arrays)
    assert record["aggregate_s"] > 0 and record["aggregate_flops"] > 0


def test_ffa_never_changes_a_and_sends_half(tiny_cfg_dict):
    cfg = validate_config(_cfg(tiny_cfg_dict, "ffa"))
    method, data = setup(cfg)
    a0 = {n: p.detach().clone() for n, p in method.model.named_parameters() if ".lora_A." in n}
    assert a0 and not any(".lora_A." in k for k in method.initial_state())
    state, records, _ = Simulation(cfg, method, data).run()
    method.eval_model(state)
    now = dict(method.model.named_parameters())
    assert all(torch.equal(now[n], t) for n, t in a0.items())  # A never changes
    assert all(not any(".lora_A." in k for k in r) for r in [state])
    # the same A on another process: drawn from the seed and the name, not the RNG
    torch.manual_seed(123)
    again, _ = setup(cfg)
    assert all(torch.equal(dict(again.model.named_parameters())[n], t) for n, t in a0.items())
    fedit = validate_config(_cfg(tiny_cfg_dict, "fedit", train_classifier=False))
    ffa = validate_config(_cfg(tiny_cfg_dict, "ffa", train_classifier=False))
    up = [Simulation(c, *setup(c)).run()[1][0]["bytes_up_mean"] for c in (fedit, ffa)]
    assert up[1] * 2 == pytest.approx(up[0], rel=0.05)  # q, v: B (d, r) + A (r, d): half


def test_flora_on_a_model_merges_the_mean_of_products(tiny_cfg_dict, capture_replies):
    method, _, state, new, record = _one_round(_cfg(tiny_cfg_dict, "flora"))
    before, after = _effective(method, state), _effective(method, new)
    mean = _client_products(method, state, record, capture_replies)
    for pair in lora_pairs(state):
        assert torch.equal(new[pair.b], torch.zeros_like(new[pair.b]))  # a fresh adapter
        assert np.abs(after[pair.module] - before[pair.module] - mean[pair.module]).max() < 1e-6
    assert record["flora_stack_bytes"] > 0


def test_svd_on_a_model_truncates_the_averaged_update(tiny_cfg_dict, capture_replies):
    method, _, state, new, record = _one_round(_cfg(tiny_cfg_dict, "svd"))
    mean = _client_products(method, state, record, capture_replies)
    r = method.cfg.lora.r
    for pair in lora_pairs(state):
        u, sv, vt = np.linalg.svd(mean[pair.module])
        got = method.adapter.scale * _np(new[pair.b]) @ _np(new[pair.a])
        assert np.abs(got - (u[:, :r] * sv[:r]) @ vt[:r]).max() < 1e-5
    assert 0 < record["svd_discarded_energy"] < 1  # 3 clients x rank 4 > 4


@pytest.mark.parametrize("aggregation", ["fedit", "ffa", "fedex", "flora", "svd", "fedsa"])
def test_bytes_up_and_down_per_rule(tiny_cfg_dict, aggregation):
    """What crosses the wire, counted from the tensors: every rule sends the trained tensors up;
    ffa never sends A, fedsa never sends B (either way); from round 2 on, fedex's and flora's
    clients also receive the dense base weights of every adapted layer (the residual / the merged
    stack), counted in bytes_down and reported apart as bytes_down_frozen."""
    d = _cfg(tiny_cfg_dict, aggregation, train_classifier=False)
    d["federation"].update(clients_per_round=2, rounds=2)
    cfg = validate_config(d)
    method, data = setup(cfg)
    params = dict(method.model.named_parameters())
    pairs = lora_pairs({n: p for n, p in params.items() if ".lora_" in n})
    nbytes = lambda names: sum(params[n].numel() * 4 for n in names)  # noqa: E731  (float32)
    a, b = nbytes(p.a for p in pairs), nbytes(p.b for p in pairs)
    base = nbytes(p.base for p in pairs)
    sent = {"ffa": b, "fedsa": a}.get(aggregation, a + b)
    _, records, _ = Simulation(cfg, method, data).run()
    for rnd, record in enumerate(records, 1):
        for c in record["client_metrics"]:
            dense = base if aggregation in ("fedex", "flora") and rnd > 1 else 0
            assert c["bytes_up"] == sent, (rnd, c["bytes_up"], sent)
            assert c["bytes_down_frozen"] == dense
            assert c["bytes_down"] == sent + dense
    if aggregation == "flora":  # the stacked adapter: every client's A and B along the rank
        assert records[0]["flora_stack_bytes"] == 2 * (a + b)


def test_fedsa_keeps_b_on_the_clients_and_reports_personal_metrics(tiny_cfg_dict, capture_replies):
    d = _cfg(tiny_cfg_dict, "fedsa")
    d["federation"].update(clients_per_round=2, rounds=3)
    cfg = validate_config(d)
    method, data = setup(cfg)
    assert isinstance(method.strategy, FedSA) and method.parallel_clients is False
    state = method.initial_state()
    payload = method.strategy.configure_train(1, state, [0])[0]
    assert not any(".lora_B." in k for k in payload.arrays) and any(".lora_A." in k for k in payload.arrays)
    final, records, summary = Simulation(cfg, method, data).run()
    assert not any(".lora_B." in k for r in capture_replies.values() for k in r)
    b0 = {k: t for k, t in state.items() if ".lora_B." in k}
    assert all(torch.equal(final[k], t) for k, t in b0.items())  # the server never learns a B
    trained = sorted(method.personal)
    assert trained and all(any(t.abs().sum() > 0 for t in method.personal[c].values()) for c in trained)
    assert summary["personal_test_accuracy_mean"] is not None and "global_test_accuracy" in summary
    assert "personal_local_accuracy_mean" in summary
    # a client's kept B is what it starts from next time
    c = trained[0]
    kept = method.personal.with_kept(Payload({}, {"client": c})).arrays
    assert kept.keys() == method.personal[c].keys()
    assert all(torch.equal(kept[k], method.personal[c][k]) for k in kept)


def test_heterogeneous_ranks_from_tiers_on_fedpetuning(tiny_cfg_dict):
    """Three memory tiers; the planner gives each the largest rank whose predicted step fits."""
    d = _cfg(tiny_cfg_dict, "fedit", r=8, ranks=[2, 4, 8])
    mem = {}
    for r in (2, 4, 8):  # the planner's own prediction of a client at each rank
        alone = {**d, "lora": {**d["lora"], "ranks": [r]},
                 "budgets": {"tiers": [{"share": 1.0, "memory_mb": 1e6}], "local_work": [1.0],
                             "micro_batches": [1], "checkpointing": False}}
        mem[r] = next(iter(setup(validate_config(alone))[0].plans.values())).memory_mb
    assert mem[2] < mem[4] < mem[8]
    d["budgets"] = {"tiers": [{"share": 1 / 3, "memory_mb": (mem[2] + mem[4]) / 2},
                              {"share": 1 / 3, "memory_mb": (mem[4] + mem[8]) / 2},
                              {"share": 1 / 3, "memory_mb": mem[8] + 1}],
                    "local_work": [1.0], "micro_batches": [1], "checkpointing": False,
                    "enforce_memory": False}  # held budgets train one client at a time
    cfg = validate_config(d)
    method, data = setup(cfg)
    assert isinstance(method.strategy, LoraRanks)
    ranks = {c: method.strategy.client_rank(c) for c in range(3)}
    assert sorted(ranks.values()) == [2, 4, 8]
    state = method.initial_state()
    payloads = method.strategy.configure_train(1, state, [0, 1, 2])
    for c, p in payloads.items():
        a = next(t for k, t in p.arrays.items() if ".lora_A." in k)
        assert a.shape[0] == ranks[c] and p.config["lora_rank"] == ranks[c]
    assert len({method.batch_key(p) for p in payloads.values()}) == 3  # ranks train apart
    final, records, summary = Simulation(cfg, method, data).run()
    assert {g["plan"]["rank"] for g in summary["plans"]} == {2, 4, 8}
    ups = {g["plan"]["rank"]: g["measured"]["upload_mb_mean"] for g in summary["plans"]
           if g["measured"]["upload_mb_mean"]}
    assert all(ups[a] < ups[b] for a, b in zip(sorted(ups), sorted(ups)[1:]))
    assert next(t for k, t in final.items() if ".lora_A." in k).shape[0] == 8
    # a rank-2 client's adapter keeps the global scale alpha / lora.r
    model, params = method.client_model(payloads[min(ranks, key=ranks.get)])
    lora = next(m for m in model.modules() if hasattr(m, "lora_A") and len(m.lora_A))
    assert lora.lora_A["default"].weight.shape[0] == 2 and lora.scaling["default"] == cfg.lora.scale
    assert all(p.shape[1 if ".lora_B." in n else 0] == 2 for n, p in params.items() if ".lora_" in n)


def test_raffm_plans_width_and_rank_together(tiny_cfg_dict):
    d = _cfg(tiny_cfg_dict, "fedit", r=8, ranks=[2, 8])
    d["method"] = {"name": "raffm", "width_steps": 4, "tiers": [{"share": 0.5, "flops": 0.6},
                                                                {"share": 0.5, "flops": 1.0}]}
    cfg = validate_config(d)
    method, data = setup(cfg)
    plans = method.own_strategy.plans
    full = [cp for cp in plans.values() if cp.budget.flops_share == 1.0]
    assert all(cp.knobs.rank == 8 and cp.knobs.spec.is_full for cp in full)
    small = [cp for cp in plans.values() if cp.budget.flops_share == 0.6]
    assert all(cp.flops_share <= 0.6 for cp in small)
    _, records, summary = Simulation(cfg, method, data).run()
    assert records[-1]["train_loss"] is not None


@pytest.mark.parametrize("change, fields", [
    ({"method": {"name": "raffm"}, "lora": {"aggregation": "fedsa"}}, ["lora.aggregation='fedsa'", "raffm"]),
    ({"method": {"name": "heads"}, "lora": {"aggregation": "fedsa"}}, ["lora.aggregation='fedsa'", "heads"]),
    ({"lora": {"aggregation": "fedex"}, "aggregation": {"rule": "median"}}, ["lora.aggregation='fedex'", "aggregation.rule='median'"]),
    ({"lora": {"aggregation": "svd"}, "dp": {"enabled": True, "noise_multiplier": 1.0}}, ["lora.aggregation='svd'", "dp.enabled"]),
    ({"lora": {"aggregation": "flora"}, "method": {"name": "fedpft"}}, ["lora.aggregation='flora'", "fedpft"]),
    ({"lora": {"ranks": [4, 8], "r": 8}}, ["lora.ranks", "method.tiers"]),
    ({"method": {"name": "fedpetuning", "tiers": [{"share": 1.0, "flops": 1.0}]}}, ["method.tiers", "lora.ranks"]),
    ({"method": {"name": "heads"}, "lora": {"ranks": [4, 8], "r": 8}}, ["lora.ranks", "heads"]),
    ({"lora": {"ranks": [4, 32], "r": 16}}, ["lora.ranks", "lora.r=16"]),
    ({"method": {"name": "fedavg"}, "lora": {"aggregation": "ffa"}}, ["lora.aggregation='ffa'", "fedavg", "peft.method='none'"]),
    ({"peft": {"method": "none"}, "lora": {"aggregation": "fedex"}}, ["lora.aggregation='fedex'", "peft.method='none'"]),
    ({"method": {"name": "raffm", "tuning": "full", "tiers": [{"share": 1.0, "flops": 1.0}]},
      "lora": {"ranks": [4, 8], "r": 8}}, ["lora.ranks", "peft.method='none'"]),
])
def test_invalid_combinations_fail_at_load_naming_both(change, fields):
    assert_refused_naming({"federation": {"num_clients": 5, "clients_per_round": 5}}, change, fields)


def test_valid_combinations_build_the_rule_chain():
    cfg = validate_config({"method": {"name": "heads"}, "lora": {"aggregation": "fedex"},
                           "aggregation": {"clip_norm": 1.0}})
    from fedslice.fl.rules import selected_rules
    assert [r.name for r in selected_rules(cfg)] == ["fedex", "clip"]
    cfg = validate_config({"lora": {"aggregation": "fedsa"}, "aggregation": {"rule": "median"}})
    assert [r.name for r in selected_rules(cfg)] == ["median", "fedsa"]
    # LoRA rules apply only when the adapter is LoRA (the default fedit leaves [lora] harmless)
    cfg = validate_config({"method": {"name": "fedavg"}, "lora": {"aggregation": "fedit"}})
    assert selected_rules(cfg) == []
    assert find_rule is not None


# --------------------------------------------------------------------------------------------
# Flower and checkpoints: the same rules, the same results
# --------------------------------------------------------------------------------------------

def _tiered(d, r=4, ranks=(2, 4)):
    """fedpetuning with two FLOPs tiers whose budgets give ranks 2 and 4 (a rank costs more
    FLOPs with every component; the top tier affords everything)."""
    d["lora"].update(r=r, ranks=list(ranks))
    d["method"] = {"name": "fedpetuning", "tiers": [{"share": 0.5, "flops": 0.99999},
                                                    {"share": 0.5, "flops": 1.0}]}
    return d


@pytest.mark.parametrize("aggregation", ["fedex", "flora", "svd", "fedsa", "ffa", "fedex+ranks"])
def test_flower_serverapp_matches_the_simulation(tiny_cfg_dict, tmp_path, aggregation):
    """The ServerApp/ClientApp path gives the in-process engine's weights: FedEx's and FLoRA's
    base weights reach the clients in their payloads, FedSA's B stays in each node's state."""
    from fedslice.flower.server_app import run as server_run
    from test_flower import (InProcessGrid, _assert_same_state, _in_process, _nodes, _settings,
                             _weights, _write_config)

    agg, _, ranks = aggregation.partition("+")
    d = _cfg(tiny_cfg_dict, agg)
    d["federation"].update(clients_per_round=2, rounds=3)
    if ranks:
        _tiered(d)
    state, records, _ = _in_process(d)
    run_dir = server_run(InProcessGrid(_nodes(3)), _settings(_write_config(d, tmp_path / "e.json"),
                                                            tmp_path / "fl"))
    _assert_same_state(_weights(run_dir), state)
    if agg in ("fedex", "flora"):
        assert any(k.endswith("base_layer.weight") for k in state)


@pytest.mark.parametrize("aggregation", ["fedex", "fedsa+ranks"])
def test_resume_is_bit_identical(tiny_cfg_dict, tmp_path, monkeypatch, aggregation):
    """A crash after the round-2 checkpoint: the resumed run ends with the uninterrupted run's
    weights (FedEx's folded base weights; FedSA's clients' kept B, with ranks per tier)."""
    from test_checkpoint import _weights, reference_and_resumed

    agg, _, ranks = aggregation.partition("+")
    d = _cfg(tiny_cfg_dict, agg)
    d["federation"].update(clients_per_round=2, rounds=3)
    if ranks:
        _tiered(d)
    reference, resumed = reference_and_resumed(d, tmp_path, monkeypatch)
    ref_w, res_w = _weights(reference), _weights(resumed)
    assert ref_w.keys() == res_w.keys()
    assert all(torch.equal(ref_w[k], res_w[k]) for k in ref_w)
    import json
    a, b = (json.loads((r / "summary.json").read_text()) for r in (reference, resumed))
    assert a["test_accuracy"] == b["test_accuracy"]
    if agg == "fedsa":
        assert a["personal_test_accuracy_mean"] == b["personal_test_accuracy_mean"]


@pytest.mark.parametrize("method", ["fedpetuning", "heads", "raffm", "fedpft", "fedot"])
def test_ffa_runs_on_every_lora_method_and_keeps_a(tiny_cfg_dict, tmp_path, method):
    """FFA is the adapter's (A drawn from the seed, frozen): every method that trains LoRA runs
    it, nobody sends an A, and the global model's A is its initial one."""
    from conftest import method_options

    d = _cfg(tiny_cfg_dict, "ffa")
    d["federation"].update(clients_per_round=2, rounds=1)
    d["method"] = {"name": method, **method_options(method, tmp_path)}
    cfg = validate_config(d)
    method_, data = setup(cfg)
    a0 = {n: p.detach().clone() for n, p in method_.model.named_parameters() if ".lora_A." in n}
    assert a0  # (fedavg trains no LoRA: ffa with it fails at load, tested above)
    state, records, _ = Simulation(cfg, method_, data).run()
    assert records[-1]["train_loss"] is not None
    if method == "raffm":  # the state holds A as a frozen, permuted tensor: in checkpoint order
        exported = method_.exported(state)
        assert all(torch.equal(exported[n], t) for n, t in a0.items())
        return
    assert not any(".lora_A." in k for k in state)  # never sent, never aggregated
    method_.eval_model(state)
    now = dict(method_.model.named_parameters())
    assert all(torch.equal(now[n], t) for n, t in a0.items())


@pytest.mark.parametrize("case", ["ffa", "fedsa", "fedit+ranks"])
def test_batched_pass_equals_one_after_another(tiny_cfg_dict, tiny_model_dir, tmp_path, case):
    """The batched multi-client pass: FFA's frozen A is shared (not a per-client tensor),
    FedSA's clients bring their own B, clients of different ranks train in separate groups
    (fp32, dropout off: the batched pass draws its masks over the stacked batch)."""
    from test_batched import _no_dropout

    agg, _, ranks = case.partition("+")
    d = _cfg(tiny_cfg_dict, agg)
    d["model"]["name"] = str(_no_dropout(tiny_model_dir, tmp_path / "bert"))
    d["federation"].update(clients_per_round=3, rounds=2)
    if ranks:
        _tiered(d, r=4, ranks=(2, 4))
    finals = []
    for batched in (False, True):
        d["compute"] = {"workers": 1, "batched_clients": batched}
        cfg = validate_config(d)
        method, data = setup(cfg)
        state, records, _ = Simulation(cfg, method, data).run()
        assert {r["client_mode"] for r in records} == {"batched" if batched else "sequential"}
        finals.append((state, getattr(method, "personal", {})))
    (a, pa), (b, pb) = finals
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    assert (agg == "fedsa") == bool(pa) and pa.keys() == pb.keys()
    for c in pa:  # a client's own B trained in both rounds (AdamW: float noise is normalised up)
        assert max((pa[c][k] - pb[c][k]).abs().max().item() for k in pa[c]) < 5e-5
