"""Time as a budget (docs/time.md): devices on the simulated clock, round policies (all,
deadline, async = FedBuff), staleness weights, bad input naming field and row, resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import method_options
from test_checkpoint import reference_and_resumed
from fedslice.api import run_experiment, setup
from fedslice.config import FederationConfig
from fedslice.errors import ConfigError
from fedslice.experiment import load_config, validate_config
from fedslice.fl.clock import SimClock, settle_round, staleness_weight
from fedslice.fl.client import round_flops
from fedslice.fl.devices import Device, Population
from fedslice.fl.strategy import Payload, Reply, Strategy
from fedslice.methods import METHODS
from fedslice.methods.plan_records import RoundCost
from fedslice.run.asynchronous import AsyncSimulation, Buffer, Staleness, simulation_for
from fedslice.run.engine import Simulation

#: two tiers 10x apart in speed, links slow enough to count
DEVICES = {"tiers": [{"share": 0.5, "gflops_per_s": 0.02, "upload_mb_per_s": 1.0,
                      "download_mb_per_s": 2.0},
                     {"share": 0.5, "gflops_per_s": 0.002, "upload_mb_per_s": 0.1,
                      "download_mb_per_s": 0.2}]}


def _cfg(d: dict, **federation) -> dict:
    d = json.loads(json.dumps({**d, "devices": DEVICES}))  # a copy: tests change its tiers
    d["federation"].update(federation)
    return d


def _run(cfg_dict):
    cfg = validate_config(cfg_dict)
    method, data = setup(cfg)
    sim = simulation_for(cfg, method, data)
    state, records, summary = sim.run()
    return sim, state, records, summary


# --- the clock's arithmetic on hand-made devices -------------------------------------------------

def test_client_round_is_flops_over_speed_plus_bytes_over_link():
    d = Device(gflops_per_s=2.0, upload_mb_per_s=1.0, download_mb_per_s=4.0)
    assert d.seconds(4e9, 8e6, 1e6) == pytest.approx(2.0 + 2.0 + 1.0, rel=1e-12)
    assert Device(gflops_per_s=1.0).seconds(3e9, 1e9, 1e9) == pytest.approx(3.0)  # no link: free
    assert d.flops_within(5.0, 8e6, 1e6) == pytest.approx(4e9)  # the inverse: a time budget
    half = Device(speed=0.5)  # a factor of the host's GFLOP/s
    assert half.compute_seconds(1e9, host_gflops_per_s=4.0) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="host"):
        half.compute_seconds(1e9)


def test_a_rounds_predicted_flops_follow_its_batches_and_the_clients_guard():
    """A round predicted from its own steps' units (positions, attention pairs, head positions)
    at a plan's rates; under a FLOPs budget it stops before the first step that would pass it,
    the first step always running (fl.client.train_local's guard)."""
    steps = [[(10, 100, 2)], [(20, 400, 2)], [(5, 25, 1), (5, 25, 1)]]  # the last: two micro-batches
    rates = (2.0, 0.5, 10.0)  # steps of 90, 260 and 65 FLOPs
    assert round_flops(steps, rates) == (415.0, 3)
    assert round_flops(steps, rates, 400.0) == (350.0, 2)  # 415 would pass 400
    assert round_flops(steps, rates, 100.0) == (90.0, 1)
    assert round_flops(steps, rates, 10.0) == (90.0, 1)  # the first step alone passes: it runs
    cost = RoundCost(rates, importance_flops=30.0, download_bytes=2_000_000, upload_bytes=500_000)
    assert cost.flops(steps, 400.0) == (380.0, 2)  # the importance pass spent 30 of the 400
    dev = Device(gflops_per_s=1e-7, upload_mb_per_s=0.5, download_mb_per_s=4.0)  # 100 FLOP/s
    seconds, first = cost.seconds(dev, steps, 400.0)
    assert seconds == pytest.approx(0.5 + 3.8 + 1.0, rel=1e-12)
    assert first == pytest.approx(0.5 + 1.2 + 1.0, rel=1e-12)


def test_round_policies_settle_by_arrival():
    secs = {0: 3.0, 1: 1.0, 2: 2.5}
    s = settle_round("all", secs)
    assert (s.used, s.dropped, s.seconds) == ([0, 1, 2], {}, 3.0)
    s = settle_round("deadline", secs, deadline_s=2.6, needed=3)
    assert s.used == [1, 2] and list(s.dropped) == [0] and s.seconds == 2.6
    assert "past the 2.6 s round deadline" in s.dropped[0]
    s = settle_round("deadline", secs, deadline_s=10, needed=3)  # all in: ends at the last
    assert s.used == [0, 1, 2] and s.seconds == 3.0
    s = settle_round("deadline", secs, deadline_s=10, needed=1)  # over-selected: the first one
    assert s.used == [1] and s.seconds == 1.0 and "over-selected" in s.dropped[2]
    s = settle_round("all", secs, offline_at={0: 2.0})  # offline before its reply: lost
    assert s.used == [1, 2] and "went offline" in s.dropped[0] and s.seconds == 2.5


def test_staleness_weight_is_fedbuffs():
    assert [staleness_weight(s) for s in (0, 1, 3, 8)] == [1.0, 1 / math.sqrt(2), 0.5, 1 / 3]
    with pytest.raises(ValueError):
        staleness_weight(-1)


def test_staleness_exponent_sets_the_polynomial():
    """federation.staleness_exponent a: s(τ) = (1 + τ)^-a; 0 leaves stale replies unscaled."""
    assert [staleness_weight(s, 1.0) for s in (0, 1, 3)] == [1.0, 0.5, 0.25]
    assert [staleness_weight(s, 0.0) for s in (0, 1, 7)] == [1.0, 1.0, 1.0]
    assert staleness_weight(3, 2.0) == 1 / 16
    with pytest.raises(ValueError, match="exponent"):
        staleness_weight(1, -0.5)


def test_availability_share_is_a_seeded_draw_and_a_trace_gives_intervals():
    pop = Population({c: Device(gflops_per_s=1.0, availability=0.7) for c in range(4)}, seed=3)
    draws = [pop.online(c, r, 0.0) for r in range(1, 501) for c in range(4)]
    assert draws == [pop.online(c, r, 5.0) for r in range(1, 501) for c in range(4)]
    assert 0.65 < sum(draws) / len(draws) < 0.75
    trace = Population({0: Device(gflops_per_s=1.0), 1: Device(gflops_per_s=1.0)},
                       trace={0: [(0.0, 10.0), (20.0, 30.0)]})
    assert [trace.online(0, 1, t) for t in (0.0, 9.9, 10.0, 25.0, 30.0)] == [True, True, False, True, False]
    assert trace.online(1, 1, 1e9)  # not in the trace: always online
    assert trace.online_until(0, 21.0) == 30.0 and trace.next_online(10.0) == 20.0
    assert trace.next_online(25.0) is None


def test_stale_updates_are_taken_against_their_base_and_scaled():
    """Version 1 is current; a reply trained from version 0 (staleness 1) counts its delta
    against version 0, times 1/sqrt(2); the method's weights (examples) stay."""
    strategy = Strategy(FederationConfig(num_clients=4, clients_per_round=2))
    v0, v1 = {"w": torch.zeros(3)}, {"w": torch.ones(3)}
    buffer = Buffer(0, SimClock())
    buffer.bases = {0: v0, 1: v1}
    agg = Staleness(strategy, buffer)
    payloads = {0: Payload(dict(v0), {"client": 0}), 1: Payload(dict(v1), {"client": 1})}
    replies = {0: Reply({"w": torch.full((3,), 2.0)}, 1, {"loss": 0.5}),
               1: Reply({"w": torch.full((3,), 1.5)}, 3, {"loss": 0.5})}
    buffer.base_of, buffer.version = {0: 0, 1: 1}, 1
    result = agg.aggregate_train(2, v1, payloads, replies)
    expected = 1.0 + (1 * 2.0 / math.sqrt(2) + 3 * 0.5) / 4
    assert torch.allclose(result.state["w"], torch.full((3,), expected), rtol=0, atol=1e-6)
    buffer.base_of = {0: 0, 1: 1}  # exponent 1: the stale reply's update halved
    halved = Staleness(strategy, buffer, 1.0).aggregate_train(2, v1, payloads, replies)
    assert torch.allclose(halved.state["w"], torch.full((3,), 1.0 + (1 * 2.0 / 2 + 3 * 0.5) / 4),
                          rtol=0, atol=1e-6)
    buffer.base_of = {0: 1, 1: 1}  # both fresh: the method's plain weighted mean
    fresh = agg.aggregate_train(2, v1, {c: Payload(dict(v1), {"client": c}) for c in (0, 1)}, replies)
    assert torch.equal(fresh.state["w"], strategy.aggregate_train(2, v1, {
        c: Payload(dict(v1), {"client": c}) for c in (0, 1)}, replies).state["w"])


# --- bad input: named, before anything trains ------------------------------------------------------

@pytest.mark.parametrize("change, message", [
    ({"devices": {"tiers": [{"share": 1.0, "gflops_per_s": 0}]}}, "devices.tiers.0.gflops_per_s"),
    ({"devices": {"gflops_per_s": 1.0, "upload_mb_per_s": -1}}, "devices.upload_mb_per_s"),
    ({"devices": {"gflops_per_s": 1.0, "availability": 1.5}}, "devices.availability"),
    ({"devices": {"gflops_per_s": 1.0, "speed": 2.0}}, "not both"),
    ({"devices": {"availability": 0.5, "tiers": [{"share": 1.0, "gflops_per_s": 1.0}]}},
     "devices.availability with devices.tiers"),
    ({"federation": {"round_policy": "deadline"}}, "needs round_deadline_s"),
    ({"federation": {"round_deadline_s": 3.0}}, "round_deadline_s = 3.0 applies to round_policy = 'deadline'"),
    ({"federation": {"staleness_exponent": 1.0}},
     "staleness_exponent = 1.0 applies to round_policy = 'async'"),
    ({"federation": {"round_policy": "async", "staleness_exponent": -1}}, "federation.staleness_exponent"),
    ({"federation": {"round_policy": "async", "concurrency": 2, "buffer_size": 3}},
     "buffer_size = 3 is larger than concurrency = 2"),
    ({"federation": {"round_policy": "async"}, "aggregation": {"rule": "krum", "byzantine": 0}},
     "aggregation.rule='krum' cannot combine with federation.round_policy = 'async'"),
    ({"federation": {"round_policy": "async"}, "lora": {"aggregation": "fedex"}},
     "lora.aggregation='fedex' cannot combine with federation.round_policy = 'async'"),
    ({"federation": {"round_policy": "async"}, "lora": {"aggregation": "svd"}},
     "lora.aggregation='svd' cannot combine with federation.round_policy = 'async'"),
    ({"federation": {"round_policy": "async"}, "dp": {"enabled": True, "clip_norm": 0.1, "noise_multiplier": 0.5}},
     "dp.enabled: DP-FedAvg cannot combine with federation.round_policy = 'async'"),
    ({"federation": {"round_policy": "deadline", "round_deadline_s": 5.0},
      "dp": {"enabled": True, "clip_norm": 0.1, "noise_multiplier": 0.5},
      "budgets": {"tiers": [{"share": 1.0, "memory_mb": 1e4}]}},
     "dp.enabled with [budgets] under federation.round_policy='deadline'"),
    ({"federation": {"round_policy": "async"}, "faults": {"dropout": 0.1}}, "faults.dropout"),
    ({"federation": {"round_policy": "async"}, "method": {"name": "raffm", "reorder_every": 1}},
     "method.reorder_every=1"),
])
def test_bad_settings_name_the_fields(tiny_cfg_dict, change, message):
    d = _cfg(tiny_cfg_dict)
    for k, v in change.items():
        d[k] = {**d.get(k, {}), **v} if k in ("federation",) else v
    if "lora" in change:
        d["lora"] = {**tiny_cfg_dict["lora"], **change["lora"]}
    with pytest.raises(ConfigError) as e:
        validate_config(d)
    assert message in str(e.value)


def _load(tmp_path: Path, d: dict) -> None:
    from fedslice.experiment import load_config
    path = tmp_path / "exp.json"
    path.write_text(json.dumps(d))
    load_config(path)


@pytest.mark.parametrize("name, text, message", [
    ("devices.csv", "client,gflops_per_s\n0,1\n1,-2\n2,1\n3,1\n",
     "devices.csv row 3, gflops_per_s: -2.0 is not a positive number"),
    ("devices.csv", "client,gflops_per_s,availability\n0,1,\n1,1,0\n2,1,\n3,1,\n",
     "devices.csv row 3, availability: 0.0 is not a positive number"),
    ("devices.csv", "client,gflops_per_s\n0,1\n1,1\n2,1\n", "no row for client(s) [3]"),
    ("devices.csv", "client,gflops,x\n0,1,2\n", "unknown column(s) ['gflops', 'x']"),
    ("trace.csv", "client,online_from_s,online_to_s\n0,0,10\n9,0,10\n",
     "row 3, client: 9 is not a client of this federation"),
    ("trace.csv", "client,online_from_s,online_to_s\n0,0,10\n1,0,5\n0,5,20\n",
     "rows 2 and 4: client 0's intervals [0, 10) and [5, ...) overlap"),
    ("trace.csv", "client,online_from_s,online_to_s\n0,10,10\n", "row 2, online_to_s: 10 is not after"),
])
def test_bad_device_files_name_file_row_and_field(tiny_cfg_dict, tmp_path, name, text, message):
    d = json.loads(json.dumps(tiny_cfg_dict))
    (tmp_path / name).write_text(text)
    d["devices"] = ({"csv": str(tmp_path / name)} if name == "devices.csv" else
                    {"gflops_per_s": 1.0, "trace": str(tmp_path / name)})
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, d)
    assert message in str(e.value) and name in str(e.value)


def test_a_policy_without_devices_is_refused_in_process(tiny_cfg_dict):
    d = json.loads(json.dumps(tiny_cfg_dict))
    d["federation"].update(round_policy="deadline", round_deadline_s=1.0)
    cfg = validate_config(d)
    method, data = setup(cfg)
    with pytest.raises(ConfigError, match="needs devices on the simulated clock"):
        Simulation(cfg, method, data)


# --- the policies on the engine -------------------------------------------------------------------

def test_all_policy_trains_as_without_devices_and_records_simulated_time(tiny_cfg_dict):
    """'all' waits for everyone: the clock changes no weight, and each round takes its
    slowest client's simulated seconds."""
    _, plain, plain_records, _ = _run(tiny_cfg_dict)
    sim, state, records, summary = _run(_cfg(tiny_cfg_dict))
    assert all(torch.equal(plain[k], state[k]) for k in plain)
    assert [r["clients"] for r in records] == [r["clients"] for r in plain_records]
    t = 0.0
    for r in records:
        slowest = max(m["sim_s"] for m in r["client_metrics"])
        assert r["sim_round_s"] == slowest and r["sim_time_s"] == pytest.approx(t + slowest)
        t = r["sim_time_s"]
        for m in r["client_metrics"]:  # measured FLOPs / speed + bytes / link
            dev = sim.population.devices[m["client"]]
            assert m["sim_s"] == pytest.approx(dev.seconds(m["flops_measured"], m["bytes_down"],
                                                           m["bytes_up"]), rel=1e-12)
    assert summary["sim_time_s"] == t and summary["wasted_flops"] == 0
    assert "sim_time_s" not in plain_records[-1]  # no devices: no simulated time


def test_deadline_drops_late_replies_as_wasted_work_overselects_and_skips_offline(tiny_cfg_dict):
    d = _cfg(tiny_cfg_dict, round_policy="deadline", round_deadline_s=5.0, overselect=0.5,
             clients_per_round=2, rounds=2)
    d["devices"]["tiers"][1]["availability"] = 0.5
    sim, _, records, summary = _run(d)
    lost = 0.0
    for r in records:
        assert len(r["clients"]) <= 3  # ceil(2 x 1.5)
        # offline clients are never selected (the round's draw: who was online at its start)
        assert all(sim.population.online(c, r["round"], 0.0) for c in r["clients"])
        for m in r["client_metrics"]:
            late = m["sim_s"] > 5.0
            assert not (late and m["used"])  # a late reply is never used
            if late:
                lost += m["flops_measured"]
                assert any(e["client"] == m["client"] and "deadline" in e["reason"]
                           for e in r["excluded"])
        assert r["sim_round_s"] <= 5.0
    assert lost > 0 and summary["wasted_flops"] == pytest.approx(lost)
    assert 0 < summary["wasted_share"] < 1


def test_async_keeps_clients_training_and_weights_stale_replies(tiny_cfg_dict):
    d = _cfg(tiny_cfg_dict, round_policy="async", concurrency=3, buffer_size=1, rounds=4)
    d["devices"]["tiers"][1]["gflops_per_s"] = 0.008  # 2.5x slower: its replies come in stale
    sim, state, records, summary = _run(d)
    assert isinstance(sim, AsyncSimulation) and len(records) == 4
    times = [r["sim_time_s"] for r in records]
    assert times == sorted(times) and times[0] > 0
    stale = [m["staleness"] for r in records for m in r["client_metrics"]]
    assert max(stale) >= 1  # a slow client's reply, aggregated after others' versions
    for r in records:
        assert len(r["clients"]) == 1 and r["in_flight"] <= 3
        for m in r["client_metrics"]:
            assert m["staleness"] == r["round"] - 1 - m["base_version"]
    # federation.staleness_exponent reaches the aggregation: at 0 the same schedule (the clock
    # reads FLOPs and bytes, not weights) aggregates the stale replies unscaled
    d["federation"]["staleness_exponent"] = 0.0
    sim0, state0, records0, _ = _run(d)
    assert sim.aggregator.exponent == 0.5 and sim0.aggregator.exponent == 0.0
    assert [[(m["client"], m["staleness"]) for m in r["client_metrics"]] for r in records0] == \
           [[(m["client"], m["staleness"]) for m in r["client_metrics"]] for r in records]
    first_stale = next(i for i, r in enumerate(records) if r["client_metrics"][0]["staleness"])
    assert records0[first_stale]["train_loss"] == records[first_stale]["train_loss"]
    assert any(not torch.equal(state0[k], state[k]) for k in state)  # ... into another model


# --- every method under each policy --------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_under_deadline_and_async(tiny_cfg_dict, tmp_path, name):
    d = _cfg(tiny_cfg_dict, rounds=2, local_steps=1, round_policy="deadline",
             round_deadline_s=8.0)
    d["devices"] = {"tiers": [{"share": 0.5, "gflops_per_s": 0.02},
                              {"share": 0.5, "gflops_per_s": 0.008}]}
    opts = method_options(name, tmp_path)
    if name.startswith("raffm"):
        opts = {**opts, "reorder_every": 0}  # re-ordering refuses async (a test above)
    d["method"] = {"name": name, **opts}
    d["compute"] = {"workers": 1}
    d["evaluation"] = {"every": 2, "batch_size": 32}
    cfg = validate_config(d)
    method, data = setup(cfg)
    _, records, _ = simulation_for(cfg, method, data).run()
    for r in records:
        for m in r["client_metrics"]:
            assert (m["sim_s"] <= 8.0) == (m["client"] not in
                                           [e["client"] for e in r["excluded"] if "deadline" in e["reason"]])
    # every client training at once on equal devices: the second reply is one version stale
    d["federation"].update(round_policy="async", round_deadline_s=None, concurrency=4,
                           buffer_size=1, rounds=3)
    d["devices"] = {"gflops_per_s": 0.01}
    cfg = validate_config(d)
    state, records, _ = simulation_for(cfg, method, data).run()
    assert all(torch.isfinite(t).all() for t in state.values())
    assert [r["skipped"] for r in records] == [False] * 3
    assert max(m["staleness"] for r in records for m in r["client_metrics"]) >= 1


# --- resume ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["all", "deadline", "async"])
def test_resume_mid_run_is_bit_identical(tiny_cfg_dict, tmp_path, monkeypatch, policy):
    extra = {"deadline": {"round_deadline_s": 6.0, "overselect": 0.5},
             "async": {"concurrency": 3, "buffer_size": 1}}.get(policy, {})
    d = _cfg(tiny_cfg_dict, round_policy=policy, rounds=3, **extra)
    d["devices"]["tiers"][1]["gflops_per_s"] = 0.008
    d["devices"]["tiers"][0]["availability"] = 0.7
    d["compute"] = {"workers": 1}
    reference, resumed = reference_and_resumed(d, tmp_path, monkeypatch, crash_round=3)
    a, b = (load_file(str(p / "final_trainable.safetensors")) for p in (reference, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = ([json.loads(x) for x in (p / "metrics.jsonl").read_text().splitlines()]
              for p in (reference, resumed))
    for key in ("clients", "sim_time_s", "train_loss", "excluded"):
        assert [r[key] for r in ra] == [r[key] for r in rb], key
    if policy == "async":
        assert [[m["staleness"] for m in r["client_metrics"]] for r in ra] == \
               [[m["staleness"] for m in r["client_metrics"]] for r in rb]
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["sim_time_s"] == ra[-1]["sim_time_s"]


def test_validate_says_the_policy_and_the_devices_spread(tiny_cfg_dict):
    from fedslice.fl.devices import describe_clock

    d = _cfg(tiny_cfg_dict, round_policy="async", concurrency=3, buffer_size=2)
    text = describe_clock(validate_config(d))
    assert text.startswith("round policy 'async' (FedBuff: 3 training, 2 replies per aggregation)")
    assert "4 devices" in text and "GFLOP/s" in text and "online 100% of rounds" in text
    assert describe_clock(validate_config(tiny_cfg_dict)) == ""


def test_budgets_csv_device_columns_give_each_clients_device(tiny_cfg_dict, tmp_path):
    """budgets.csv may carry the device columns beside the budgets (the budget reader taking
    them is the planner's); the devices come from it, per client, errors by row."""
    from fedslice.fl.devices import population

    path = tmp_path / "clients.csv"
    path.write_text("client,memory_mb,gflops_per_s,upload_mb_per_s\n0,300,10,1\n1,,2,\n"
                    "2,300,10,1\n3,,0.5,0.2\n")
    d = json.loads(json.dumps(tiny_cfg_dict))
    d["budgets"] = {"csv": str(path)}
    pop = population(validate_config(d))
    assert [pop.devices[c].gflops_per_s for c in range(4)] == [10, 2, 10, 0.5]
    assert pop.devices[1].upload_mb_per_s is None and pop.devices[3].upload_mb_per_s == 0.2
    path.write_text("client,memory_mb,gflops_per_s\n0,300,10\n1,,-2\n2,1,1\n3,1,1\n")
    with pytest.raises(ConfigError, match="budgets.csv row 3, gflops_per_s: -2.0 is not a positive"):
        population(validate_config(d))


def test_reports_plot_accuracy_against_simulated_time(tiny_cfg_dict, tmp_path):
    from fedslice.html_report import write_compare_report, write_run_report

    d = _cfg(tiny_cfg_dict, round_policy="deadline", round_deadline_s=5.0, rounds=1)
    runs = [run_experiment(validate_config(d), tmp_path / "runs")]
    page = write_run_report(runs[0]).read_text()
    assert "accuracy against simulated time" in page and "wasted on dropped replies" in page
    page = write_compare_report(runs, tmp_path / "compare.html").read_text()
    assert "dev accuracy against simulated time" in page and "s simulated)" in page
