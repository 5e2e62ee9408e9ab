import math

from fedslice.fl.selection import LossGapSelector, UniformSelector, make_selector
from fedslice.methods.probe import probe_loss


def test_uniform_is_seeded_and_without_replacement():
    a, b = UniformSelector(3, seed=1), UniformSelector(3, seed=1)
    picks = [a.select(r, range(10)) for r in range(5)]
    assert picks == [b.select(r, range(10)) for r in range(5)]
    assert all(len(set(p)) == 3 for p in picks)


def test_loss_gap_tries_unseen_clients_first_then_largest_gaps():
    s = LossGapSelector(2, seed=0)
    seen: set[int] = set()
    for r in range(3):  # 6 clients, 2 per round: three rounds cover everyone once
        chosen = s.select(r, range(6))
        assert not seen & set(chosen)
        seen |= set(chosen)
        s.observe(r, {c: float(c) for c in chosen}, None)
    assert seen == set(range(6))
    s.observe(3, {}, global_loss=1.5)
    assert s.select(4, range(6)) == [4, 5]  # gaps 5-1.5 and 4-1.5 are the largest
    s.observe(4, {5: 0.1}, global_loss=1.5)
    assert s.select(5, range(6)) == [3, 4]


def test_loss_gap_ties_broken_by_seed_and_nan_ignored():
    picks = {tuple(LossGapSelector(2, seed=k).select(0, range(8))) for k in range(6)}
    assert len(picks) > 1  # unseen clients tie: the seed decides
    s = LossGapSelector(1, seed=0)
    s.observe(0, {0: math.nan, 1: 2.0}, None)
    assert 0 not in s.last_loss and s.global_loss == 2.0
    assert isinstance(make_selector("random", 2, 0), UniformSelector)


def test_probe_cold_start_ranks_by_eq9_from_round_one():
    s = LossGapSelector(2, seed=0)
    assert s.unknown(range(4)) == [0, 1, 2, 3]
    s.observe_probe({0: 0.5, 1: 2.0, 2: 1.0, 3: 3.0})
    assert s.unknown(range(4)) == [] and s.global_loss == 1.625
    assert s.select(1, range(4)) == [1, 3]
    assert UniformSelector(2, seed=0).unknown(range(4)) == []


def test_engine_probes_unknown_clients_once_with_the_global_model(tiny_cfg_dict):
    from fedslice.api import setup
    from fedslice.experiment import validate_config
    from fedslice.run.engine import Simulation, client_seed
    tiny_cfg_dict["federation"].update(rounds=2, selection="loss_gap", cold_start="probe",
                                       probe_examples=4)
    cfg = validate_config(tiny_cfg_dict)
    method, data = setup(cfg)
    sim = Simulation(cfg, method, data)
    state = method.initial_state()
    expected = {c: probe_loss(method, state, data.client(c), 4, client_seed(0, 0, c))[0] for c in range(4)}
    state, r1 = sim.run_round(1, state)
    assert r1["probe_clients"] == 4 and r1["probe_flops"] > 0
    probed = {c: sim.selector.last_loss[c] for c in range(4) if c not in r1["clients"]}
    for c, loss in probed.items():  # not selected: still the probe's loss
        assert math.isclose(loss, expected[c], rel_tol=1e-6)
    top2 = sorted(expected, key=expected.get)[-2:]
    assert r1["clients"] == sorted(top2)  # Eq. 9 in round 1: the largest probe losses
    _, r2 = sim.run_round(2, state)
    assert "probe_clients" not in r2
