"""Robust aggregation, clipping and DP-FedAvg against numpy references, and wired into methods."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import method_options
from fedslice.api import setup
from fedslice.config import DPConfig, FederationConfig
from fedslice.fl.rules import Krum
from fedslice.experiment import validate_config
from fedslice.errors import ConfigError
from fedslice.run.engine import Simulation
from fedslice.fl.privacy import Privacy
from fedslice.fl.strategy import Reply, Strategy
from fedslice.slicing.robust import clip_update, masked_trimmed_mean, robust_aggregate


def _clients(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    glob = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(4, generator=g)}
    deltas = [{k: torch.randn(v.shape, generator=g) for k, v in glob.items()} for _ in range(n)]
    return glob, deltas


def _np_trim(a: np.ndarray, beta: float) -> np.ndarray:
    cut = int(beta * a.shape[0])
    return np.sort(a, axis=0)[cut: a.shape[0] - cut].mean(0)


@pytest.mark.parametrize("rule", ["median", "trimmed_mean"])
def test_same_shaped_rules_equal_numpy(rule):
    glob, deltas = _clients(n=7)
    out = robust_aggregate(glob, deltas, [1.0] * 7, rule, eta=0.5, trim_fraction=0.2)
    for k in glob:
        stack = np.stack([d[k].numpy() for d in deltas])
        ref = np.median(stack, 0) if rule == "median" else _np_trim(stack, 0.2)
        np.testing.assert_allclose(out[k].numpy(), glob[k].numpy() + 0.5 * ref, rtol=1e-5, atol=1e-6)


def test_krum_picks_an_honest_update_and_multi_krum_averages_the_closest():
    glob, deltas = _clients(n=5)
    deltas = [{k: v * 0.01 for k, v in d.items()} for d in deltas]
    deltas[4] = {k: v + 100.0 for k, v in deltas[4].items()}  # the outlier
    out = robust_aggregate(glob, deltas, [1.0] * 5, "krum", byzantine=1)
    assert any(all(torch.allclose(out[k], glob[k] + d[k]) for k in glob) for d in deltas[:4])
    out = robust_aggregate(glob, deltas, [1.0] * 5, "multi_krum", byzantine=1, keep=4,
                           num_examples=[1, 2, 3, 4, 5])
    ref = {k: sum(w * d[k] for w, d in zip([1, 2, 3, 4], deltas[:4])) / 10 for k in glob}
    for k in glob:
        torch.testing.assert_close(out[k], glob[k] + ref[k])


@pytest.mark.parametrize("rule", ["median", "trimmed_mean"])
def test_sliced_rules_per_element_over_holders(rule):
    """Masks as sub-model methods give them: each element's rule runs over its holders only; an
    element held by nobody keeps its value; one holder returns its own value."""
    glob, deltas = _clients(n=4)
    rows = [4, 3, 2, 1]  # client i holds the first rows[i] rows of w, and b only if i < 2
    weights = []
    for i, d in enumerate(deltas):
        m = torch.zeros(4, 1)
        m[:rows[i]] = 1
        weights.append({"w": 3.0 * m, "b": torch.tensor(1.0 if i < 2 else 0.0)})
        if i >= 2:
            del d["b"]
    glob["extra"] = torch.randn(2)  # held by nobody
    out = robust_aggregate(glob, deltas, weights, rule, trim_fraction=0.25)
    for r in range(4):
        holders = np.stack([deltas[i]["w"][r].numpy() for i in range(4) if rows[i] > r])
        ref = np.median(holders, 0) if rule == "median" else _np_trim(holders, 0.25)
        np.testing.assert_allclose(out["w"][r].numpy(), glob["w"][r].numpy() + ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["w"][3], glob["w"][3] + deltas[0]["w"][3])  # one holder
    b = np.stack([deltas[i]["b"].numpy() for i in range(2)])
    np.testing.assert_allclose(out["b"].numpy(), glob["b"].numpy() + np.median(b, 0), rtol=1e-5)
    assert torch.equal(out["extra"], glob["extra"])
    with pytest.raises(ValueError, match="same-shaped"):
        robust_aggregate(glob, deltas, weights, "krum", byzantine=0)


def test_masked_trimmed_mean_matches_flower_when_full():
    from flwr.server.strategy.aggregate import aggregate_trimmed_avg
    a = torch.randn(9, 5, dtype=torch.float64)
    ref = aggregate_trimmed_avg([([row.numpy()], 1) for row in a], 0.3)[0]
    np.testing.assert_allclose(masked_trimmed_mean(a, 0.3).numpy(), ref, rtol=1e-12)


def test_clip_matches_flower_flatclip():
    from flwr.supercore.differential_privacy import clip_inputs_inplace
    _, (d,) = _clients(n=1)
    ref = [d["w"].numpy().copy(), d["b"].numpy().copy()]
    clip_inputs_inplace(ref, 0.5)
    out, norm = clip_update(d, 0.5)
    assert norm == pytest.approx(math.sqrt(sum(float((t ** 2).sum()) for t in d.values())))
    np.testing.assert_allclose(out["w"].numpy(), ref[0], rtol=1e-6)
    np.testing.assert_allclose(out["b"].numpy(), ref[1], rtol=1e-6)
    same, _ = clip_update(d, 1e6)
    assert all(torch.equal(same[k], d[k]) for k in d)


def _krum(byzantine: int, n=5) -> Strategy:
    return Krum(Strategy(FederationConfig(num_clients=n, clients_per_round=n)), byzantine)


def test_krum_needs_2f_plus_3_replies(caplog):
    with pytest.raises(ConfigError, match=r"aggregation.byzantine=2: krum needs .*>= 2f \+ 3 = 7, got 5"):
        validate_config({"federation": {"num_clients": 5, "clients_per_round": 5},
                         "aggregation": {"rule": "krum", "byzantine": 2}})
    glob, deltas = _clients(n=4)
    s = _krum(byzantine=1)
    payloads = s.configure_train(1, glob, [0, 1, 2, 3])
    replies = {c: Reply({k: glob[k] + d[k] for k in glob}, 10, {"loss": 0.1}) for c, d in enumerate(deltas)}
    with caplog.at_level("WARNING"):
        res = s.aggregate_train(1, glob, payloads, replies)  # 4 < 2f + 3 = 5
    assert res.skipped and res.state is glob and "needs 2f + 3 = 5: skipped" in caplog.text


@pytest.mark.parametrize("method", ["raffm", "heads"])
def test_sliced_methods_apply_the_rule_per_element(tiny_cfg_dict, tmp_path, method):
    """raffm / heads with aggregation.rule=median: every element is the median of the deltas of
    the clients whose slice holds it (numpy), elements nobody held are unchanged; Krum refused."""
    tiny_cfg_dict["method"] = {"name": method, **method_options(method, tmp_path)}
    if method == "raffm":
        tiny_cfg_dict["method"]["reorder_every"] = 0  # no re-ordering after the aggregation
    tiny_cfg_dict["federation"].update(num_clients=4, clients_per_round=4)
    tiny_cfg_dict["aggregation"] = {"rule": "median"}
    cfg = validate_config(tiny_cfg_dict)
    m, data = setup(cfg)
    Simulation(cfg, m, data)
    state = m.initial_state()
    clients = [c for c in range(4) if method != "raffm" or m.own_strategy.plans[c].sits_out is None]
    payloads = m.strategy.configure_train(1, state, clients)
    replies = {c: m.fit(payloads[c], data.client(c), c) for c in clients}
    res = m.strategy.aggregate_train(1, state, payloads, replies)
    deltas, weights = m.strategy.client_updates(1, state, payloads, replies)
    held_partly = False
    for k, g in state.items():
        stack = []
        for d, w in zip(deltas, weights):
            wk = w[k] if isinstance(w, dict) and k in w else (0.0 if isinstance(w, dict) else w)
            held = torch.broadcast_to(torch.as_tensor(wk) > 0, g.shape)
            held_partly |= bool(held.any()) and not bool(held.all())
            stack.append(np.where(held.numpy(), d.get(k, torch.zeros(g.shape)).numpy(), np.nan))
        stack = np.stack(stack)
        nobody = np.isnan(stack).all(0)
        with np.errstate(all="ignore"), __import__("warnings").catch_warnings():
            __import__("warnings").simplefilter("ignore")
            ref = g.numpy() + np.where(nobody, 0.0, np.nan_to_num(np.nanmedian(stack, 0)))
        np.testing.assert_allclose(res.state[k].numpy(), ref, rtol=1e-5, atol=1e-6, err_msg=k)
        assert np.array_equal(res.state[k].numpy()[nobody], g.numpy()[nobody])
    assert held_partly, "the clients should hold different slices"
    tiny_cfg_dict["aggregation"] = {"rule": "multi_krum", "byzantine": 0}
    with pytest.raises(ConfigError, match=f"method {method} sends slices"):
        validate_config(tiny_cfg_dict)


def _final(cfg_dict):
    cfg = validate_config(cfg_dict)
    m, data = setup(cfg)
    state, records, summary = Simulation(cfg, m, data).run()
    return state, records, summary


def test_median_survives_an_attacker_that_breaks_the_mean(tiny_cfg_dict):
    tiny_cfg_dict["federation"].update(num_clients=5, clients_per_round=5, rounds=2)
    tiny_cfg_dict["faults"] = {"attack": "gaussian", "attackers": 0.2, "attack_scale": 100.0}
    clean = dict(tiny_cfg_dict, faults={})
    ref, _, _ = _final(clean)
    broken, recs, _ = _final(tiny_cfg_dict)
    assert all(len(r["attackers"]) == 1 for r in recs)
    tiny_cfg_dict["aggregation"] = {"rule": "median"}
    robust, _, _ = _final(tiny_cfg_dict)
    dist = lambda s: max(float((s[k] - ref[k]).abs().max()) for k in ref)  # noqa: E731
    assert dist(broken) > 5 and dist(robust) < 1


def test_dp_fedavg_clips_adds_calibrated_noise_and_accounts():
    from opacus.accountants import RDPAccountant
    glob, deltas = _clients(n=4)
    p = Privacy(DPConfig(enabled=True, clip_norm=0.5, noise_multiplier=1e-9), 4, 16, 3, seed=0)
    out, metrics = p.aggregate(1, glob, deltas, eta=1.0)
    clipped = [clip_update(d, 0.5)[0] for d in deltas]
    for k in glob:
        torch.testing.assert_close(out[k], glob[k] + sum(c[k] for c in clipped) / 4)
    assert metrics["dp_clipped"] == 4
    glob["proxy"] = torch.randn(3)  # no client updates it (FedPFT's proxy): not released, unchanged
    out, _ = p.aggregate(2, glob, deltas, eta=1.0)
    assert torch.equal(out["proxy"], glob["proxy"])
    del glob["proxy"]
    p = Privacy(DPConfig(enabled=True, clip_norm=0.5, noise_multiplier=1.3), 4, 16, 3, seed=0)
    ref = RDPAccountant()
    eps = []
    for rnd in (1, 2, 3):
        out, metrics = p.aggregate(rnd, glob, [{k: torch.zeros_like(v) for k, v in glob.items()}] * 4, 1.0)
        ref.step(noise_multiplier=1.3, sample_rate=0.25)
        assert metrics["dp_epsilon"] == pytest.approx(ref.get_epsilon(1e-5))
        eps.append(metrics["dp_epsilon"])
    assert eps[0] < eps[1] < eps[2]
    noise = torch.cat([(out[k] - glob[k]).flatten() for k in glob])  # zero updates: pure noise
    assert metrics["dp_noise_std"] == pytest.approx(1.3 * 0.5 / 4)
    assert 0.5 < float(noise.std()) / metrics["dp_noise_std"] < 1.6
    calibrated = Privacy(DPConfig(enabled=True, target_epsilon=4.0), 5, 20, 15, seed=0)
    acc = RDPAccountant()
    for _ in range(15):
        acc.step(noise_multiplier=calibrated.z, sample_rate=0.25)
    assert acc.get_epsilon(1e-5) == pytest.approx(4.0, rel=0.05)


def test_dp_run_reports_epsilon_each_round_and_runs_flowers_dp_wrapper(tiny_cfg_dict, tmp_path,
                                                                      monkeypatch):
    """On Flower, DP-FedAvg is Flower's DifferentialPrivacyServerSideFixedClipping around our
    adapter: the same epsilon per round as the simulation, reproducible (numpy's RNG seeded),
    weights off the simulation's by noise of the configured scale (two independent draws)."""
    from test_flower import InProcessGrid, _in_process, _nodes, _settings, _weights, _write_config
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping as FlowerDP
    from fedslice.flower.server_app import run as server_run
    from fedslice.output import read_run

    tiny_cfg_dict["federation"].update(num_clients=3, clients_per_round=2)
    tiny_cfg_dict["dp"] = {"enabled": True, "clip_norm": 0.05, "target_epsilon": 8.0}
    state, records, _ = _in_process(tiny_cfg_dict)
    eps = [r["dp_epsilon"] for r in records]
    assert 0 < eps[0] < eps[1] == pytest.approx(8.0, rel=0.05)
    calls = []
    noise = FlowerDP._add_noise_to_aggregated_arrays
    monkeypatch.setattr(FlowerDP, "_add_noise_to_aggregated_arrays",
                        lambda self, arrays: calls.append(len(arrays)) or noise(self, arrays))
    path = _write_config(tiny_cfg_dict, tmp_path / "exp.json")
    runs = [_weights(server_run(InProcessGrid(_nodes(3)), _settings(path, tmp_path / f"fl{i}")))
            for i in range(2)]
    n_state = len(state)
    assert calls == [n_state] * 4  # Flower's wrapper noised every round (2 runs x 2 rounds)
    for k in state:
        assert torch.equal(runs[0][k], runs[1][k]), k
    _, metrics, _ = read_run(next((tmp_path / "fl0").iterdir()))
    assert [m["dp_epsilon"] for m in metrics] == pytest.approx(eps)
    assert any(not torch.equal(runs[0][k], state[k]) for k in state)  # another draw of noise
    for bad in ({"method": {"name": "raffm"}}, {"aggregation": {"rule": "median"}}):
        with pytest.raises(ConfigError, match="dp.enabled"):
            validate_config({**tiny_cfg_dict, **bad})


def test_flowers_dp_noise_has_the_configured_std(tiny_cfg_dict, tmp_path):
    """Clients that barely move (lr 1e-6: updates of ~3e-6): after 3 rounds the global state is the initial one
    plus 3 draws of Flower's Gaussian noise per element, whose std (over ~5,000 elements) is
    within 10% of sqrt(3) * z * C / n."""
    from test_flower import InProcessGrid, _nodes, _settings, _weights, _write_config
    from fedslice.api import setup
    from fedslice.flower.server_app import run as server_run
    from fedslice.output import read_run

    tiny_cfg_dict["federation"].update(num_clients=3, clients_per_round=2, rounds=3, lr=1e-6)
    tiny_cfg_dict["lora"].update(r=16, alpha=32)  # ~5,000 noised elements
    tiny_cfg_dict["dp"] = {"enabled": True, "clip_norm": 0.05, "noise_multiplier": 1.0}
    initial = setup(validate_config(tiny_cfg_dict))[0].initial_state()
    path = _write_config(tiny_cfg_dict, tmp_path / "exp.json")
    run_dir = server_run(InProcessGrid(_nodes(3)), _settings(path, tmp_path / "fl"))
    final = _weights(run_dir)
    _, metrics, _ = read_run(run_dir)
    std = metrics[0]["dp_noise_std"]
    assert std == pytest.approx(1.0 * 0.05 / 2)
    noise = torch.cat([(final[k] - initial[k]).flatten() for k in initial])
    assert noise.numel() > 4000
    assert float(noise.std()) == pytest.approx(std * 3 ** 0.5, rel=0.10)
    assert abs(float(noise.mean())) < 0.1 * std


def test_dp_on_flower_skips_a_round_with_a_failed_node_and_records_it(tiny_cfg_dict, tmp_path):
    """Flower's DP wrapper does not aggregate a round with an error reply: the round is recorded
    as skipped (the failure named), the state and the privacy spent stay unchanged."""
    from test_flower import InProcessGrid, _assert_same_state, _nodes, _settings, _weights, _write_config
    from fedslice.api import setup
    from fedslice.flower.server_app import run as server_run
    from fedslice.output import read_run

    tiny_cfg_dict["federation"].update(num_clients=2, clients_per_round=2, min_replies=1)
    tiny_cfg_dict["dp"] = {"enabled": True, "clip_norm": 0.05, "noise_multiplier": 1.0}
    path = _write_config(tiny_cfg_dict, tmp_path / "exp.json")
    run_dir = server_run(InProcessGrid(_nodes(2), fail={101}), _settings(path, tmp_path / "fl"))
    _, metrics, _ = read_run(run_dir)
    for m in metrics:
        assert m["skipped"] and m["failed_nodes"] == 1 and m.get("dp_epsilon") is None
        assert {e["client"]: e["reason"] for e in m["excluded"]} == {
            0: "a node failed: Flower's DP wrapper skips rounds with error replies",
            1: "node 101 failed: node down (error code 5)"}
    initial = setup(validate_config(tiny_cfg_dict))[0].initial_state()
    _assert_same_state(_weights(run_dir), initial, atol=0)
