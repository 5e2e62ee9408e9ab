"""Time in the planner (issue 59 part 3): a plan's simulated seconds on the client's device
(download + predicted FLOPs / speed + upload), a tier's ``seconds_per_round`` and a round's
deadline as a budget, ``fedslice plan`` printing the seconds, and each client-round's simulated
seconds recorded against the prediction."""

from __future__ import annotations

import json

import pytest

from fedslice.api import setup
from fedslice.errors import ConfigError
from fedslice.experiment import validate_config
from fedslice.methods.plan_report import render_plans
from fedslice.run.asynchronous import simulation_for

#: a fast and a slow device, 10x apart, links that count
FAST = {"gflops_per_s": 0.05, "upload_mb_per_s": 1.0, "download_mb_per_s": 2.0}
SLOW = {"gflops_per_s": 0.005, "upload_mb_per_s": 0.1, "download_mb_per_s": 0.2}


def _cfg(tiny_cfg_dict, tiers, **federation) -> dict:
    d = json.loads(json.dumps(tiny_cfg_dict))
    d["federation"].update({"num_clients": 4, "clients_per_round": 4, "rounds": 2, "local_steps": 4,
                            **federation})
    d["budgets"] = {"tiers": tiers, "micro_batches": [1], "checkpointing": False,
                    "local_work": [1.0, 0.5, 0.25]}
    return d


def test_a_plans_seconds_are_its_flops_over_speed_plus_its_bytes_over_the_links(tiny_cfg_dict):
    d = _cfg(tiny_cfg_dict, [{"share": 0.5, "memory_mb": 1e4, **FAST},
                             {"share": 0.5, "memory_mb": 1e4, **SLOW}])
    method, _ = setup(validate_config(d))
    for p in method.plans.values():
        dev = FAST if p.tier == 0 else SLOW
        up = p.upload_mb * 1e6  # fp32 upload: the bytes it receives are the same tensors
        want = (p.gflops_per_round / dev["gflops_per_s"] + up / (dev["upload_mb_per_s"] * 1e6)
                + up / (dev["download_mb_per_s"] * 1e6))
        assert p.seconds == pytest.approx(want, rel=1e-9)
    assert any("s/round on its device" in line for line in render_plans(method.plans))


def test_a_deadline_fits_each_clients_work_to_its_device_and_the_clock_agrees(tiny_cfg_dict):
    """The slow tier cannot train the whole round by the deadline: the planner cuts its local
    work; every client-round's simulated seconds are within 10% of the planner's prediction."""
    whole = _cfg(tiny_cfg_dict, [{"share": 0.5, "memory_mb": 1e4, **FAST},
                                 {"share": 0.5, "memory_mb": 1e4, **SLOW}])
    method, _ = setup(validate_config(whole))
    slow_whole = max(p.seconds for p in method.plans.values())
    fast_whole = min(p.seconds for p in method.plans.values())
    deadline = (fast_whole + slow_whole) / 2
    d = _cfg(tiny_cfg_dict, [{"share": 0.5, "memory_mb": 1e4, **FAST},
                             {"share": 0.5, "memory_mb": 1e4, **SLOW}],
             round_policy="deadline", round_deadline_s=deadline)
    cfg = validate_config(d)
    method, data = setup(cfg)
    for p in method.plans.values():
        assert p.seconds <= deadline * (1 + 1e-9)
        if p.tier == 0:
            assert p.knobs.batch is None  # the fast device trains the whole round
        else:
            assert p.knobs.batch is not None and p.knobs.batch < cfg.federation.batch_size
    sim = simulation_for(cfg, method, data)
    _, records, summary = sim.run()
    ratios = [m["sim_s"] / m["sim_s_predicted"] for r in records for m in r["client_metrics"]]
    # each client-round predicted from its own batches, cut where its FLOPs guard cuts them
    # (budgets.enforce_flops: a step that would pass the time limit is not run): no reply
    # arrives after the deadline
    assert len(ratios) == 2 * 4 and all(abs(x - 1) <= 1e-9 for x in ratios), ratios
    assert all(m["sim_s"] <= deadline * (1 + 1e-9) for r in records for m in r["client_metrics"])
    assert all(not r["excluded"] for r in records)  # nobody missed the deadline
    groups = summary["plans"]
    assert all(g["predicted"]["seconds"] is not None and g["measured"]["seconds_mean"] for g in groups)


def test_a_deadline_no_plan_meets_names_the_client_and_what_it_needs(tiny_cfg_dict):
    d = _cfg(tiny_cfg_dict, [{"share": 1.0, "memory_mb": 1e4, **SLOW}], round_policy="deadline",
             round_deadline_s=1e-3)
    with pytest.raises(ConfigError, match=r"client 0 \(budgets\.tiers\[0\].*s/round on its device.*"
                                          r"seconds_per_round 0\.001 is below it: the smallest valid value is"):
        setup(validate_config(d))


def test_time_limits_need_a_device_with_a_known_rate(tiny_cfg_dict):
    d = _cfg(tiny_cfg_dict, [{"share": 1.0, "seconds_per_round": 5.0}])
    with pytest.raises(ConfigError, match=r"budgets\.tiers\[0\]: seconds_per_round needs the client's device"):
        setup(validate_config(d))
    d = _cfg(tiny_cfg_dict, [{"share": 1.0, "seconds_per_round": 5.0, "speed": 0.5}])
    with pytest.raises(ConfigError, match=r"budgets\.tiers\[0\].*speed.*devices\.host_gflops_per_s"):
        setup(validate_config(d))


def test_on_rows_of_one_length_every_client_round_takes_its_predicted_seconds(tiny_cfg_dict, one_length_data_dir):
    """What tells the clock and the planner's costs from the data: where every batch has the
    profile batch's tokens, each client-round's simulated seconds are its plan's predicted
    seconds (the spread bench/time_to_accuracy.py measures on SST-2 is its batches' lengths)."""
    tiny_cfg_dict["data"]["path"] = str(one_length_data_dir)
    tiers = [{"share": 0.5, "memory_mb": 1e4, **FAST}, {"share": 0.5, "memory_mb": 1e4, **SLOW}]
    method, _ = setup(validate_config(_cfg(tiny_cfg_dict, tiers)))
    seconds = sorted(p.seconds for p in method.plans.values())
    d = _cfg(tiny_cfg_dict, tiers, round_policy="deadline",
             round_deadline_s=(seconds[0] + seconds[-1]) / 2)
    cfg = validate_config(d)
    method, data = setup(cfg)
    _, records, _ = simulation_for(cfg, method, data).run()
    ms = [m for r in records for m in r["client_metrics"]]
    assert len(ms) == 2 * 4 and any(method.plans[m["client"]].knobs.batch for m in ms)
    for m in ms:
        assert m["sim_s"] == pytest.approx(m["sim_s_predicted"], rel=5e-3), m


def test_each_client_round_is_predicted_from_its_own_batches(tiny_cfg_dict):
    """The planner predicts each client-round from the batches it will train (their rows, padded
    length and head positions: a client's report of its own coming round) at the plan's measured
    FLOP rates, cut where the client's FLOPs guard cuts: on rows of many lengths the simulated
    seconds are the prediction's, and the FLOPs the client counts are the predicted FLOPs."""
    tiers = [{"share": 0.5, "memory_mb": 1e4, **FAST}, {"share": 0.5, "memory_mb": 1e4, **SLOW}]
    method, _ = setup(validate_config(_cfg(tiny_cfg_dict, tiers)))
    seconds = sorted(p.seconds for p in method.plans.values())
    d = _cfg(tiny_cfg_dict, tiers, round_policy="deadline", round_deadline_s=(seconds[0] + seconds[-1]) / 2,
             rounds=3)
    cfg = validate_config(d)
    method, data = setup(cfg)
    _, records, _ = simulation_for(cfg, method, data).run()
    ms = [m for r in records for m in r["client_metrics"]]
    assert len(ms) == 3 * 4
    planned = [m["sim_s"] / m["sim_s_planned"] for m in ms]
    assert max(planned) / min(planned) > 1.2, planned  # the rounds vary: a mean misses them
    for m in ms:
        assert m["sim_s"] == pytest.approx(m["sim_s_predicted"], rel=1e-9), m


def _run_to(tiny_cfg_dict, tiers, local_steps: int, batch_size: int, fit_rounds: bool = False, **federation):
    """(method, records, summary) of 4 rounds of ``tiers`` at full local work."""
    d = _cfg(tiny_cfg_dict, tiers, local_steps=local_steps, batch_size=batch_size, rounds=4, **federation)
    d["budgets"].update(local_work=[1.0], fit_rounds=fit_rounds)
    cfg = validate_config(d)
    method, data = setup(cfg)
    return method, *simulation_for(cfg, method, data).run()[1:]


def _between_mean_and_longest(method, records) -> float:
    """A deadline the slow plan's mean round fits and its longest round does not."""
    sims = sorted(m["sim_s"] for r in records for m in r["client_metrics"])
    return (max(p.seconds for p in method.plans.values()) + sims[-1]) / 2


def test_a_client_whose_first_step_would_pass_the_deadline_sits_the_round_out(tiny_cfg_dict):
    """One local step of two examples: the slow tier's plan fits the deadline in a mean round
    but not in a round of its longer batches, which its guard cannot cut (the first step always
    runs). Under the deadline the server sends those client-rounds no work (each excluded and
    counted, nothing wasted); they are exactly the client-rounds that, sent anyway (the same
    limit as a tier's seconds under round_policy "all"), reply past it."""
    tiers = [{"share": 0.5, "memory_mb": 1e4, **FAST}, {"share": 0.5, "memory_mb": 1e4, **SLOW}]

    def run(tiers, **federation):
        return _run_to(tiny_cfg_dict, tiers, local_steps=1, batch_size=2, **federation)

    method, records, _ = run(tiers)
    deadline = _between_mean_and_longest(method, records)
    _, sent, _ = run([{**t, "seconds_per_round": deadline} for t in tiers])
    late = {(r["round"], m["client"]) for r in sent for m in r["client_metrics"] if m["sim_s"] > deadline}
    assert late and all(method.plans[c].tier == 1 for _, c in late)
    _, records, summary = run(tiers, round_policy="deadline", round_deadline_s=deadline)
    sat = {(r["round"], e["client"]) for r in records for e in r["excluded"]
           if "sat the round out" in e["reason"]}
    assert sat == late
    assert summary["sat_out"] == sum(r["sat_out"] for r in records) == len(late)
    assert summary["wasted_flops"] == 0 and all(r["sim_dropped"] == 0 for r in records)
    assert all(m["sim_s"] <= deadline for r in records for m in r["client_metrics"])
    assert {(r["round"], m["client"]) for r in records for m in r["client_metrics"]} | sat == \
        {(r["round"], c) for r in records for c in r["clients"]}


def test_fit_rounds_sends_a_round_its_guard_would_cut_with_fewer_examples_per_step(tiny_cfg_dict):
    """budgets.fit_rounds: a client-round whose own batches would pass the deadline (its first
    step alone: it would sit out) or lose a step to the guard is sent with the examples per step
    that train the most within the limit; every round then replies by the deadline, as
    predicted, none sits out, and a fitted round trains more examples than it would have."""
    tiers = [{"share": 0.5, "memory_mb": 1e4, **FAST}, {"share": 0.5, "memory_mb": 1e4, **SLOW}]

    def run(fit, **federation):
        return _run_to(tiny_cfg_dict, tiers, local_steps=2, batch_size=4, fit_rounds=fit, **federation)

    method, records, _ = run(False)
    deadline = _between_mean_and_longest(method, records)
    _, plain, plain_summary = run(False, round_policy="deadline", round_deadline_s=deadline)
    lost = {(r["round"], m["client"]) for r in plain for m in r["client_metrics"] if m.get("steps_cut")} \
        | {(r["round"], e["client"]) for r in plain for e in r["excluded"] if "sat the round out" in e["reason"]}
    assert lost
    _, records, summary = run(True, round_policy="deadline", round_deadline_s=deadline)
    fitted = {(r["round"], f["client"]): f["batch_size"] for r in records for f in r.get("rounds_fitted", [])}
    assert set(fitted) == lost and all(0 < b < 4 for b in fitted.values())
    assert summary["sat_out"] == 0 and summary["wasted_flops"] == 0
    ms = {(r["round"], m["client"]): m for r in records for m in r["client_metrics"]}
    before = {(r["round"], m["client"]): m for r in plain for m in r["client_metrics"]}
    for key, m in ms.items():
        assert m["sim_s"] == pytest.approx(m["sim_s_predicted"], rel=1e-9) and m["sim_s"] <= deadline
        if key in fitted:
            assert m["examples_trained"] > (before[key]["examples_trained"] if key in before else 0)
        else:  # the rounds not fitted are the plan's, as without it
            assert m["examples_trained"] == before[key]["examples_trained"]


def test_async_records_each_client_rounds_prediction(tiny_cfg_dict):
    """Under round_policy "async" the planner's tiers (seconds_per_round) are fitted as under the
    others, and each reply records the seconds predicted from its own batches before it was sent
    (``sim_s_predicted``, as the synchronous engine does) and its plan's mean round's
    (``sim_s_planned``): on rows of many lengths, its simulated seconds to rounding."""
    tiers = [{"share": 0.5, "memory_mb": 1e4, **FAST}, {"share": 0.5, "memory_mb": 1e4, **SLOW}]
    method, _ = setup(validate_config(_cfg(tiny_cfg_dict, tiers)))
    seconds = sorted(p.seconds for p in method.plans.values())
    limit = (seconds[0] + seconds[-1]) / 2  # the slow tier's whole round does not fit
    d = _cfg(tiny_cfg_dict, [{**t, "seconds_per_round": limit} for t in tiers], round_policy="async",
             concurrency=3, buffer_size=2, rounds=4)
    cfg = validate_config(d)
    method, data = setup(cfg)
    _, records, _ = simulation_for(cfg, method, data).run()
    ms = [m for r in records for m in r["client_metrics"]]
    assert len(ms) == 4 * 2 and any(m["staleness"] > 0 for m in ms)
    assert any(method.plans[m["client"]].knobs.batch for m in ms)  # a cut plan among them
    for m in ms:
        assert m["sim_s"] == pytest.approx(m["sim_s_predicted"], rel=1e-9), m
        assert m["sim_s_planned"] == method.plans[m["client"]].seconds <= limit * (1 + 1e-9)


@pytest.mark.parametrize("name, rel", [("raffm", 1e-9), ("raffm+heads", 0.1)])
def test_sub_models_and_pruned_heads_are_predicted_per_client_round(tiny_cfg_dict, name, rel):
    """RaFFM's sub-models extrapolate by the same parts: each client-round is its prediction.
    The head stage's importance pass is predicted at the profile's length (an upper bound of a
    pass over the client's own examples) and its kept heads are the client's own: within 10%."""
    tiers = [{"share": 0.5, "memory_mb": 1e4, **FAST}, {"share": 0.5, "memory_mb": 1e4, **SLOW}]
    d = _cfg(tiny_cfg_dict, tiers)
    d["method"] = {"name": name, **({"sparsity": 0.5} if "heads" in name else {})}
    method, _ = setup(validate_config(d))
    seconds = sorted(p.seconds for p in method.plans.values())
    d["federation"].update(round_policy="deadline", round_deadline_s=(seconds[0] + seconds[-1]) / 2)
    cfg = validate_config(d)
    method, data = setup(cfg)
    _, records, _ = simulation_for(cfg, method, data).run()
    ms = [m for r in records for m in r["client_metrics"]]
    assert len(ms) == 2 * 4
    for m in ms:
        assert m["sim_s"] == pytest.approx(m["sim_s_predicted"], rel=rel), m


def test_max_local_work_spends_a_fast_clients_spare_time_on_more_local_steps(tiny_cfg_dict):
    """budgets.max_local_work = 2 with a time limit the fast tier's whole round fits with room
    to spare: the fast tier trains the most local steps (up to 2 x 4) whose predicted round
    still fits (one more would not), the slow tier, which needs a cut, gets no more than before;
    every client-round takes its predicted seconds, within its limit. A memory limit alone adds
    no steps; without federation.local_steps the field is an error naming both."""
    tiers = [{"share": 0.5, "memory_mb": 1e4, **FAST}, {"share": 0.5, "memory_mb": 1e4, **SLOW}]
    whole = setup(validate_config(_cfg(tiny_cfg_dict, tiers)))[0].plans
    fast = min(p.seconds for p in whole.values())
    slow = max(p.seconds for p in whole.values())
    # room for 2 of the fast tier's 4 steps more (its transfers are fixed); the slow tier cut
    limits = (1.6 * fast, (fast + slow) / 2)
    timed = [{**t, "seconds_per_round": s} for t, s in zip(tiers, limits)]

    def planned(max_local_work, tiers=timed):
        d = _cfg(tiny_cfg_dict, tiers)
        d["budgets"]["max_local_work"] = max_local_work
        return validate_config(d)

    before = setup(planned(1.0))[0].plans
    cfg = planned(2.0)
    method, data = setup(cfg)
    steps = {}
    for c, p in method.plans.items():
        limit = limits[p.tier]
        if p.tier == 0:
            assert before[c].knobs.steps is None and 4 < p.knobs.steps < 8
            steps[c] = p.knobs.steps
            assert p.seconds <= limit * (1 + 1e-9) and "budgets.max_local_work" in p.reason
            one = p.gflops_per_round / p.knobs.steps / FAST["gflops_per_s"]  # one more step
            assert p.seconds + one > limit
            assert p.gflops_per_round == pytest.approx(before[c].gflops_per_round * p.knobs.steps / 4, rel=1e-9)
        else:
            assert p.knobs == before[c].knobs and p.knobs.batch is not None  # cut: never more steps
    assert steps
    _, records, summary = simulation_for(cfg, method, data).run()
    ms = [m for r in records for m in r["client_metrics"]]
    assert ms and summary["wasted_flops"] == 0
    for m in ms:
        assert m["sim_s"] == pytest.approx(m["sim_s_predicted"], rel=1e-9)
        assert m["sim_s"] <= limits[method.plans[m["client"]].tier] * (1 + 1e-9)
    memory_only = [{"share": 1.0, "memory_mb": 1e4}]
    assert all(p.knobs.steps is None for p in setup(planned(2.0, memory_only))[0].plans.values())
    d = _cfg(tiny_cfg_dict, timed, local_steps=None, local_epochs=1)
    d["budgets"]["max_local_work"] = 2.0
    with pytest.raises(Exception, match=r"budgets\.max_local_work = 2.*federation\.local_steps"):
        validate_config(d)
