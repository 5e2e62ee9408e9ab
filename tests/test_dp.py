"""DP that is sound for every method and selection rule: Flower's central DP averages every method
the config accepts with DP; what would make epsilon wrong is refused at load; the accountant's
sampling rate is that of the clients really sampled from."""

from __future__ import annotations

import pytest
import torch

from conftest import method_options, save_tiny_model
from fedslice.api import setup
from fedslice.config import DPConfig
from fedslice.experiment import validate_config
from fedslice.errors import ConfigError
from fedslice.fl.privacy import Privacy

from test_flower import InProcessGrid, _in_process, _nodes, _settings, _weights, _write_config

DP_METHODS = ("fedavg", "fedpetuning", "fedpft", "fedot")


@pytest.fixture(scope="module")
def model4(tmp_path_factory):
    """4 layers: FedOT keeps a bottom and a top adapter layer around a 1-layer emulator."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-bert4"), num_layers=4)


def _dp_config(tiny_cfg_dict: dict, method: str, model4, tmp_path) -> dict:
    opts = method_options(method, tmp_path)
    if method == "fedot":
        opts.update(bottom_layers=1, top_layers=1, emulator_layers=1)
    if method == "fedpft":
        opts.update(kd="before", whole_layers=[0, -1])
    tiny_cfg_dict["model"]["name"] = str(model4)
    tiny_cfg_dict["method"] = {"name": method, **opts}
    tiny_cfg_dict["federation"].update(num_clients=3, clients_per_round=2, rounds=1)
    # noise far below the updates, a bound above them: the DP mean is the plain fixed-n mean
    tiny_cfg_dict["dp"] = {"enabled": True, "clip_norm": 10.0, "noise_multiplier": 1e-6}
    return tiny_cfg_dict


@pytest.mark.parametrize("method", DP_METHODS)
def test_dp_on_flower_averages_every_method_the_config_accepts(tiny_cfg_dict, model4, tmp_path,
                                                                method):
    """The ServerApp under Flower's DP wrapper: every reply used (none dropped for its tensor
    names: FedPFT's global state holds the proxy, FedOT's replies name the sub-model), the
    global state moves as the simulation's DP run moves it (one round: a second would amplify
    float rounding through Adam), and epsilon is reported."""
    from fedslice.flower.server_app import run as server_run
    from fedslice.output import read_run

    cfg_dict = _dp_config(tiny_cfg_dict, method, model4, tmp_path)
    state, records, _ = _in_process(cfg_dict)
    initial = setup(validate_config(cfg_dict))[0]
    initial = initial.exported(initial.initial_state())
    path = _write_config(cfg_dict, tmp_path / "exp.json")
    run_dir = server_run(InProcessGrid(_nodes(3)), _settings(path, tmp_path / "fl"))
    _, metrics, _ = read_run(run_dir)
    for m, r in zip(metrics, records):
        assert not m["skipped"] and m["rejected"] == 0 and not m["excluded"], m["excluded"]
        assert [c["client"] for c in m["client_metrics"] if c["used"]] == m["clients"]
        assert m["dp_epsilon"] == pytest.approx(r["dp_epsilon"]) and m["dp_epsilon"] > 0
    final = _weights(run_dir)
    moved = max(float((final[k] - initial[k]).abs().max()) for k in initial)
    assert moved > 1e-3
    for k in state:
        torch.testing.assert_close(final[k], state[k], atol=2e-4, rtol=0)


def test_dp_on_flower_survives_a_reply_that_did_not_move(tiny_cfg_dict, tmp_path):
    """Flower 1.41's clipping divides by the update's norm: a client whose update is exactly 0
    (here lr 1e-12: float32 rounds every step away) must not crash the ServerApp."""
    from fedslice.flower.server_app import run as server_run
    from fedslice.output import read_run

    tiny_cfg_dict["federation"].update(num_clients=2, clients_per_round=2, rounds=1, lr=1e-12)
    tiny_cfg_dict["dp"] = {"enabled": True, "clip_norm": 0.05, "noise_multiplier": 1.0}
    path = _write_config(tiny_cfg_dict, tmp_path / "exp.json")
    _, metrics, _ = read_run(server_run(InProcessGrid(_nodes(2)), _settings(path, tmp_path / "fl")))
    assert not metrics[0]["skipped"] and metrics[0]["dp_epsilon"] > 0


@pytest.mark.parametrize("changes, message", [
    ({"federation": {"selection": "loss_gap"}},
     r"dp.enabled with federation.selection='loss_gap'.*uniformly at random.*epsilon would be wrong"),
    ({"federation": {"selection": "loss_gap", "cold_start": "probe"}},
     r"federation.selection='loss_gap'.*cold_start='probe'"),
    ({"method": {"name": "fedpft"}},
     r"dp.enabled with method.kd='both'.*APoZ.*method.kd = 'before'.*without noise"),
    ({"method": {"name": "fedpft", "kd": "during"}}, r"method.kd='during'"),
])
def test_dp_that_would_report_a_wrong_epsilon_is_refused_at_load(tiny_cfg_dict, changes, message):
    cfg = {**tiny_cfg_dict, "dp": {"enabled": True, "noise_multiplier": 1.0}}
    for section, values in changes.items():
        cfg[section] = {**cfg.get(section, {}), **values} if section != "method" else values
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg)
    validate_config({**cfg, "dp": {"enabled": False}})  # without DP: fine
    if changes.get("method", {}).get("name") == "fedpft":
        validate_config({**cfg, "method": {"name": "fedpft", "kd": "before"}})


def test_the_accountant_uses_the_population_really_sampled_from():
    """clients_per_round of the clients with data (or, on Flower, of the connected ones): an
    empty partition or a node that is away raises the sampling rate, and epsilon with it."""
    from opacus.accountants import RDPAccountant

    glob = {"w": torch.zeros(3)}
    deltas = [{"w": torch.ones(3) * 0.01}] * 2
    p = Privacy(DPConfig(enabled=True, clip_norm=1.0, noise_multiplier=1.1), 2, 10, 3, seed=0)
    _, full = p.aggregate(1, glob, deltas, 1.0)
    _, fewer = p.aggregate(2, glob, deltas, 1.0, population=4)
    ref = RDPAccountant()
    ref.step(noise_multiplier=1.1, sample_rate=0.2)
    assert full["dp_epsilon"] == pytest.approx(ref.get_epsilon(1e-5)) and full["dp_sample_rate"] == 0.2
    ref.step(noise_multiplier=1.1, sample_rate=0.5)
    assert fewer["dp_epsilon"] == pytest.approx(ref.get_epsilon(1e-5)) and fewer["dp_sample_rate"] == 0.5


def test_simulation_accounts_for_empty_partitions(tiny_cfg_dict):
    """6 clients, one of them without data (a shard partition that leaves it empty): every round
    samples 2 of the 5 others, and the records say so."""
    from fedslice.run.engine import Simulation

    tiny_cfg_dict["federation"].update(num_clients=6, clients_per_round=2, rounds=1)
    tiny_cfg_dict["dp"] = {"enabled": True, "clip_norm": 0.05, "noise_multiplier": 1.0}
    cfg = validate_config(tiny_cfg_dict)
    m, data = setup(cfg)
    data.partitions[5] = data.partitions[5][:0]
    data.report["empty_partitions"] = [5]
    _, records, _ = Simulation(cfg, m, data).run()
    from opacus.accountants import RDPAccountant
    ref = RDPAccountant()
    ref.step(noise_multiplier=1.0, sample_rate=2 / 5)  # not 2 / 6: client 5 is never sampled
    assert records[0]["dp_epsilon"] == pytest.approx(ref.get_epsilon(1e-5))
    assert records[0]["dp_sample_rate"] == pytest.approx(2 / 5)
