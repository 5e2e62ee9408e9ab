"""Faults injected into the simulation: runs complete, accounting counts only what was used."""

from __future__ import annotations

import pytest
import torch

from fedslice.api import setup
from fedslice.config import FaultsConfig
from fedslice.experiment import validate_config
from fedslice.errors import ConfigError
from fedslice.run.engine import Simulation
from fedslice.fl.faults import plan_faults


def _run(cfg_dict):
    cfg = validate_config(cfg_dict)
    method, data = setup(cfg)
    sim = Simulation(cfg, method, data)
    init = method.initial_state()
    state, records, summary = sim.run()
    return data, init, state, records, summary


def test_plan_is_reproducible_and_rates_hold():
    f = FaultsConfig(dropout=0.3, stragglers=0.2, nan=0.1, overreport=0.1, attack="sign_flip",
                     attackers=0.2)
    clients = list(range(10))
    a = plan_faults(f, 0, 3, clients)
    assert a == plan_faults(f, 0, 3, clients) and a != plan_faults(f, 0, 4, clients)
    plans = [plan_faults(f, 0, r, clients) for r in range(1, 401)]
    assert abs(sum(len(p.dropped) for p in plans) / 4000 - 0.3) < 0.03
    for p in plans:
        assert len(p.attackers) == min(2, 10 - len(p.dropped | p.nan | p.overreport))
        assert not p.attackers & (p.dropped | p.nan | p.overreport)
        assert not p.dropped & (set(p.late) | p.nan | p.overreport)


def test_faulty_run_completes_and_counts_only_what_was_used(tiny_cfg_dict):
    tiny_cfg_dict["federation"].update(num_clients=8, clients_per_round=4, rounds=4, min_replies=1)
    tiny_cfg_dict["faults"] = {"dropout": 0.25, "stragglers": 0.25, "straggler_delay_s": 30,
                               "deadline_s": 10, "nan": 0.2, "overreport": 0.2}
    data, _, state, records, summary = _run(tiny_cfg_dict)
    assert summary["rounds"] == 4 and all(torch.isfinite(t).all() for t in state.values())
    kinds = {"dropped out": 0, "past the 10 s deadline": 0, "non-finite": 0, "larger than": 0}
    for rec in records:
        reasons = {e["client"]: e["reason"] for e in rec["excluded"]}
        for reason in reasons.values():
            kinds[next(k for k in kinds if k in reason)] += 1
        trained = {m["client"]: m for m in rec["client_metrics"]}
        assert not set(trained) & {c for c, r in reasons.items() if "dropped" in r}  # never trained
        used = [c for c, m in trained.items() if m["used"]]
        assert sorted(used) == sorted(set(rec["clients"]) - set(reasons))
        assert rec["examples_used"] == sum(len(data.partitions[c]) for c in used)
        if used:  # costs are means over the used replies only
            assert rec["bytes_up_mean"] == pytest.approx(
                sum(trained[c]["bytes_up"] for c in used) / len(used))
        assert rec["rejected"] == sum("non-finite" in r or "larger" in r for r in reasons.values())
        assert rec["dropped"] == sum("dropped" in r for r in reasons.values())
    assert all(kinds.values()), kinds  # every fault happened at least once in 16 client-rounds
    assert summary["examples_used"] == sum(r["examples_used"] for r in records)


def test_too_few_replies_skip_the_round_with_a_message(tiny_cfg_dict, caplog):
    tiny_cfg_dict["federation"].update(num_clients=4, clients_per_round=4, rounds=3, min_replies=3)
    tiny_cfg_dict["faults"] = {"dropout": 0.5}
    with caplog.at_level("WARNING"):
        _, init, state, records, summary = _run(tiny_cfg_dict)
    skipped = [r for r in records if r["skipped"]]
    assert skipped and summary["skipped_rounds"] == len(skipped)
    assert all(4 - r["dropped"] < 3 for r in skipped)
    assert all(4 - r["dropped"] >= 3 for r in records if not r["skipped"])
    assert "valid replies (< federation.min_replies=3): skipped" in caplog.text
    if len(skipped) == len(records):
        assert all(torch.equal(init[k], state[k]) for k in init)


def test_stragglers_within_the_deadline_are_used(tiny_cfg_dict):
    tiny_cfg_dict["faults"] = {"stragglers": 1.0, "straggler_delay_s": 5, "deadline_s": 10}
    _, _, _, records, _ = _run(tiny_cfg_dict)
    assert all(not r["excluded"] and r["late"] == 0 for r in records)


def test_attack_config_needs_both_fields():
    with pytest.raises(ConfigError, match="faults"):
        validate_config({"faults": {"attack": "sign_flip"}})
    with pytest.raises(ConfigError, match="faults.attackers"):
        validate_config({"faults": {"attack": "gaussian", "attackers": 0.5}})
