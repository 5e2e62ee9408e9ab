"""Server optimizers (``server_opt``: FedAvgM, FedAdagrad, FedAdam, FedYogi) as a rule around any
strategy: each step against a numpy reference of Reddi et al.'s Algorithm 2, the identity
settings, a tensor no client trained, checkpoints, Flower, and the combinations refused."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from conftest import assert_refused_naming
from fedslice.api import setup
from fedslice.config import FederationConfig, ServerOptConfig
from fedslice.experiment import validate_config
from fedslice.fl.rules import ServerOpt, find_rule
from fedslice.fl.strategy import Reply, Strategy
from fedslice.run.engine import Simulation


def _reference(name, x, deltas, lr, b1, b2, tau):
    """Reddi et al. (2021) Algorithm 2 / Hsu et al. (2019), in float64 numpy; ``deltas``: the
    successive pseudo-gradients (new mean - old state) of one tensor."""
    m, v = np.zeros_like(x), np.zeros_like(x)
    for t, d in enumerate(deltas, start=1):
        if name == "fedavgm":
            m = b1 * m + d
            x = x + lr * m
            continue
        m = b1 * m + (1 - b1) * d
        if name == "fedadagrad":
            v = v + d * d
        elif name == "fedadam":
            v = b2 * v + (1 - b2) * d * d
        else:  # fedyogi
            v = v - (1 - b2) * d * d * np.sign(v - d * d)
        eta = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) if name == "fedadam" else lr
        x = x + eta * m / (np.sqrt(v) + tau)
    return x


def _rounds(rule, n_rounds=4, seed=0):
    """``n_rounds`` of two clients' replies through ``rule``; returns the states and the
    pseudo-gradients (the plain weighted mean minus the state) it stepped along."""
    g = torch.Generator().manual_seed(seed)
    state = {"w": torch.randn(3, 5, generator=g), "b": torch.randn(5, generator=g),
             "steps": torch.tensor([7])}
    states, pgs = [state], []
    for r in range(1, n_rounds + 1):
        replies = {c: Reply({k: state[k] + 0.1 * torch.randn(state[k].shape, generator=g)
                             for k in ("w", "b")}, num_examples=10 + 5 * c) for c in (0, 1)}
        mean = {k: sum(replies[c].arrays[k] * replies[c].num_examples for c in (0, 1)) / 25.0
                for k in ("w", "b")}
        pgs.append({k: (mean[k] - state[k]).double().numpy() for k in ("w", "b")})
        state, _ = rule.aggregate(r, state, {}, replies)
        states.append(state)
    return states, pgs


@pytest.mark.parametrize("name", ["fedavgm", "fedadagrad", "fedadam", "fedyogi"])
def test_each_step_matches_the_papers_algorithm(name):
    opt = ServerOptConfig(name=name, lr=0.05, momentum=0.8, beta2=0.95, tau=1e-2)
    rule = ServerOpt(Strategy(FederationConfig()), opt)
    states, pgs = _rounds(rule)
    assert rule.t == 4
    # every step's pseudo-gradient is the mean over the state the optimizer produced
    for k in ("w", "b"):
        x = states[0][k].double().numpy()
        for t in range(1, 5):
            want = _reference(name, x, [p[k] for p in pgs[:t]], 0.05, 0.8, 0.95, 1e-2)
            np.testing.assert_allclose(states[t][k].double().numpy(), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(states[-1]["steps"], states[0]["steps"])  # non-float tensors untouched


def test_defaults_are_flowers_with_momentum_for_fedavgm():
    assert (ServerOptConfig(name="fedadam").step_size, ServerOptConfig(name="fedadam").beta1) == (0.1, 0.9)
    assert (ServerOptConfig(name="fedyogi").step_size, ServerOptConfig(name="fedadagrad").beta1) == (0.01, 0.0)
    assert (ServerOptConfig(name="fedavgm").step_size, ServerOptConfig(name="fedavgm").beta1) == (1.0, 0.9)


def test_fedavgm_without_momentum_at_lr_one_is_the_mean():
    plain = Strategy(FederationConfig())
    rule = ServerOpt(Strategy(FederationConfig()), ServerOptConfig(name="fedavgm", momentum=0.0))
    a, _ = _rounds(plain)
    b, _ = _rounds(rule)
    for sa, sb in zip(a, b):
        for k in ("w", "b"):
            assert torch.allclose(sa[k], sb[k], rtol=0, atol=1e-6)


def test_a_tensor_no_client_trained_keeps_its_value_and_moments():
    rule = ServerOpt(Strategy(FederationConfig()), ServerOptConfig(name="fedavgm"))
    state = {"w": torch.ones(2), "u": torch.ones(2)}
    new, _ = rule.aggregate(1, state, {}, {0: Reply({"w": torch.full((2,), 2.0), "u": torch.ones(2)}, 1)})
    assert torch.equal(new["w"], torch.full((2,), 2.0)) and set(rule.m) == {"w", "u"}
    m_u = rule.m["u"].clone()
    new2, _ = rule.aggregate(2, new, {}, {0: Reply({"w": new["w"]}, 1)})  # u not sent
    assert torch.equal(new2["u"], new["u"]) and torch.equal(rule.m["u"], m_u)
    # w: no new change, but the momentum keeps moving it (0.9 x the last step)
    assert torch.allclose(new2["w"], torch.full((2,), 2.9))


def test_state_dict_round_trip_continues_the_same_steps():
    opt = ServerOptConfig(name="fedadam", lr=0.05)
    a = ServerOpt(Strategy(FederationConfig()), opt)
    states, _ = _rounds(a, n_rounds=2)
    b = ServerOpt(Strategy(FederationConfig()), opt)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    assert b.t == 2 and all(torch.equal(a.m[k], b.m[k]) and torch.equal(a.v[k], b.v[k]) for k in a.m)


# --------------------------------------------------------------------------------------------
# On a model: config, the engine, checkpoints and Flower
# --------------------------------------------------------------------------------------------

def _cfg(tiny_cfg_dict, **opt):
    d = copy.deepcopy(tiny_cfg_dict)
    d["server_opt"] = {"name": "fedadam", "lr": 0.01, **opt}
    d["federation"].update(num_clients=3, clients_per_round=2, rounds=3)
    return d


def test_a_run_steps_the_global_state_and_clients_carry_no_moments(tiny_cfg_dict):
    cfg = validate_config(_cfg(tiny_cfg_dict))
    method, data = setup(cfg)
    rule = find_rule(method.strategy, ServerOpt)
    assert rule is not None and rule.opt.name == "fedadam"
    state, records, _ = Simulation(cfg, method, data).run()
    assert rule.t == 3 and set(rule.m) == set(method.initial_state())
    assert all(np.isfinite(r["train_loss"]) for r in records if r.get("train_loss") is not None)
    client, _ = setup(validate_config(_cfg(tiny_cfg_dict)), role="client")
    assert find_rule(client.strategy, ServerOpt) is None


def test_resume_is_bit_identical(tiny_cfg_dict, tmp_path, monkeypatch):
    """A crash after the round-2 checkpoint: the resumed run's moments carry on, and it ends with
    the uninterrupted run's weights."""
    from test_checkpoint import _weights, reference_and_resumed

    reference, resumed = reference_and_resumed(_cfg(tiny_cfg_dict, name="fedyogi"), tmp_path,
                                               monkeypatch)
    ref_w, res_w = _weights(reference), _weights(resumed)
    assert ref_w.keys() == res_w.keys()
    assert all(torch.equal(ref_w[k], res_w[k]) for k in ref_w)


def test_flower_serverapp_matches_the_simulation(tiny_cfg_dict, tmp_path):
    from fedslice.flower.server_app import run as server_run
    from test_flower import (InProcessGrid, _assert_same_state, _in_process, _nodes, _settings,
                             _weights, _write_config)

    d = _cfg(tiny_cfg_dict, name="fedavgm", lr=1.0, momentum=0.9)
    state, _, _ = _in_process(d)
    run_dir = server_run(InProcessGrid(_nodes(3)), _settings(_write_config(d, tmp_path / "e.json"),
                                                            tmp_path / "fl"))
    _assert_same_state(_weights(run_dir), state)


@pytest.mark.parametrize("change, fields", [
    ({"federation": {"server_lr": 0.5}}, ["server_opt.name='fedadam'", "federation.server_lr=0.5"]),
    ({"lora": {"aggregation": "flora"}}, ["server_opt.name='fedadam'", "lora.aggregation='flora'"]),
    ({"lora": {"aggregation": "fedex"}}, ["server_opt.name='fedadam'", "lora.aggregation='fedex'"]),
    ({"lora": {"aggregation": "svd"}}, ["server_opt.name='fedadam'", "lora.aggregation='svd'"]),
    ({"method": {"name": "raffm", "reorder_every": 2}}, ["server_opt.name='fedadam'", "method.reorder_every=2"]),
    ({"method": {"name": "raffm+heads", "reorder_every": 1}}, ["server_opt.name='fedadam'", "method.reorder_every=1"]),
    ({"dp": {"enabled": True, "noise_multiplier": 1.0}}, ["server_opt.name='fedadam'", "dp.enabled"]),
    ({"server_opt": {"name": "adam"}}, ["server_opt.name", "fedadam"]),
    ({"server_opt": {"lr": 0}}, ["server_opt.lr"]),
    ({"server_opt": {"momentum": 1.0}}, ["server_opt.momentum"]),
])
def test_combinations_that_cannot_work_fail_at_load_naming_both(change, fields):
    assert_refused_naming({"federation": {"num_clients": 5, "clients_per_round": 5},
                           "server_opt": {"name": "fedadam"}}, change, fields)


def test_validate_says_how_the_server_combines_updates():
    from fedslice.fl.rules import describe_rules
    cfg = validate_config({"server_opt": {"name": "fedadam", "lr": 0.01},
                           "aggregation": {"rule": "median"}})
    assert describe_rules(cfg) == ("the method's weighted mean, then aggregation.rule='median', then "
                                   "server_opt.name='fedadam' (lr 0.01, momentum 0.9, beta2 0.99, "
                                   "tau 0.001)")
    cfg = validate_config({"server_opt": {"name": "fedavgm"}})
    assert describe_rules(cfg).endswith("server_opt.name='fedavgm' (lr 1, momentum 0.9)")


def test_combinations_that_work_build_the_chain_outermost():
    from fedslice.fl.rules import selected_rules
    cfg = validate_config({"method": {"name": "raffm+heads"}, "server_opt": {"name": "fedavgm"},
                           "aggregation": {"clip_norm": 1.0}, "lora": {"aggregation": "ffa"}})
    assert [r.name for r in selected_rules(cfg)] == ["clip", "server_opt"]  # ffa needs no rule
    cfg = validate_config({"server_opt": {"name": "fedadam"}, "aggregation": {"rule": "trimmed_mean"}})
    assert [r.name for r in selected_rules(cfg)] == ["trimmed_mean", "server_opt"]
