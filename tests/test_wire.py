"""``federation.upload_dtype``: a reply's floating tensors travel in fp16 and are fp32 again on the
server. Exact invariants: an fp16 run is the fp32 run with every reply's values rounded to fp16
(nothing else changes), its clients send half the bytes, Flower carries fp16 records and ends
where the simulation does, the planner counts upload budgets in the wire's bytes."""

from __future__ import annotations

import copy

import pytest
import torch

from fedslice.api import setup
from fedslice.experiment import validate_config
from fedslice.fl.strategy import Reply
from fedslice.fl.wire import from_wire, received, to_wire, wire_bytes
from fedslice.methods.base import Method
from fedslice.run.engine import Simulation


def _reply() -> Reply:
    g = torch.Generator().manual_seed(0)
    arrays = {"a": torch.randn(4, 8, generator=g), "b": torch.randn(8, generator=g) * 1e-3,
              "mask": torch.tensor([True, False, True])}
    return Reply(arrays, num_examples=12, metrics={"loss": 0.5, "bytes_up": 4 * 40 + 3})


def test_fp16_halves_the_floating_bytes_and_rounds_each_value_once():
    reply = _reply()
    sent = to_wire(reply, "fp16")
    assert sent.arrays["a"].dtype == torch.float16 and sent.arrays["mask"].dtype == torch.bool
    assert sent.metrics["bytes_up"] == 2 * 40 + 3 == wire_bytes(reply.arrays, "fp16")
    assert wire_bytes(reply.arrays, "fp32") == 4 * 40 + 3
    back = received(sent, "fp16")
    for k in ("a", "b"):
        assert back.arrays[k].dtype == torch.float32
        assert torch.equal(back.arrays[k], reply.arrays[k].half().float())
        rel = ((back.arrays[k] - reply.arrays[k]).abs() / reply.arrays[k].abs()).max().item()
        assert 0 < rel <= 2 ** -11
    assert torch.equal(back.arrays["mask"], reply.arrays["mask"])
    assert reply.arrays["a"].dtype == torch.float32 and reply.metrics["bytes_up"] == 163  # not changed


def test_fp32_is_the_reply_itself_and_other_dtypes_are_left_to_validation():
    reply = _reply()
    assert to_wire(reply, "fp32") is reply and received(reply, "fp32") is reply
    odd = {"a": torch.zeros(2, dtype=torch.float64), "b": torch.zeros(2)}
    out = from_wire(odd, "fp16")
    assert out["a"].dtype == torch.float64 and out["b"].dtype == torch.float32  # float64 still rejected later
    with pytest.raises(ValueError, match="upload dtype 'int4'.*fp16"):
        to_wire(reply, "int4")


def test_flower_records_carry_fp16_and_decode_to_fp32():
    from fedslice.flower.codec import decode_reply, encode_reply, reply_size

    reply = _reply()
    content = encode_reply(to_wire(reply, "fp16"))
    assert reply_size(encode_reply(reply)) - reply_size(content) == 2 * 40  # 40 floats, 2 bytes less each
    back = decode_reply(content, upload_dtype="fp16")
    assert back.arrays["a"].dtype == torch.float32
    assert torch.equal(back.arrays["a"], reply.arrays["a"].half().float())


# --------------------------------------------------------------------------------------------
# On a model: the engine, Flower, the planner
# --------------------------------------------------------------------------------------------

def _cfg(tiny_cfg_dict, dtype: str, **fed) -> dict:
    d = copy.deepcopy(tiny_cfg_dict)
    d["federation"].update({"num_clients": 3, "clients_per_round": 2, "rounds": 2,
                            "upload_dtype": dtype, **fed})
    return d


def _run(d: dict):
    cfg = validate_config(d)
    method, data = setup(cfg)
    state, records, _ = Simulation(cfg, method, data).run()
    return state, records


def test_an_fp16_run_is_the_fp32_run_with_each_reply_rounded(tiny_cfg_dict, monkeypatch):
    half_state, half_records = _run(_cfg(tiny_cfg_dict, "fp16"))
    full_state, full_records = _run(_cfg(tiny_cfg_dict, "fp32"))

    fit = Method.fit

    def rounded(self, payload, data, seed):  # what the wire does, by hand
        r = fit(self, payload, data, seed)
        return Reply({k: t.half().float() for k, t in r.arrays.items()}, r.num_examples, r.metrics)

    monkeypatch.setattr(Method, "fit", rounded)
    ref_state, ref_records = _run(_cfg(tiny_cfg_dict, "fp32"))

    assert half_state.keys() == ref_state.keys()
    assert all(torch.equal(half_state[k], ref_state[k]) for k in ref_state)
    assert [r["train_loss"] for r in half_records] == [r["train_loss"] for r in ref_records]
    assert not all(torch.equal(half_state[k], full_state[k]) for k in full_state)  # it did round
    for h, f in zip(half_records, full_records):
        assert h["bytes_up_mean"] * 2 == f["bytes_up_mean"]  # LoRA and classifier: all floating
        assert h["bytes_down_mean"] == f["bytes_down_mean"]  # the state goes down in fp32


def _flower_matches_the_simulation(d: dict, nodes: int, tmp_path) -> list[dict]:
    """``d`` run in process and by the ServerApp over ``nodes`` in-process nodes: the same final
    state and bytes up per round; the simulation's records."""
    import json

    from fedslice.flower.server_app import run as server_run
    from test_flower import (InProcessGrid, _assert_same_state, _in_process, _nodes, _settings,
                             _weights, _write_config)

    state, records, _ = _in_process(d)
    run_dir = server_run(InProcessGrid(_nodes(nodes)), _settings(_write_config(d, tmp_path / "e.json"),
                                                                tmp_path / "fl"))
    _assert_same_state(_weights(run_dir), state)
    flower = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["bytes_up_mean"] for r in flower] == [r["bytes_up_mean"] for r in records]
    return records


def test_flower_serverapp_matches_the_simulation(tiny_cfg_dict, tmp_path):
    _flower_matches_the_simulation(_cfg(tiny_cfg_dict, "fp16"), 3, tmp_path)


def test_the_planner_counts_upload_budgets_on_the_wire(tiny_cfg_dict, tmp_path):
    """An upload budget between rank 4's fp16 and fp32 bytes: fp32 clients drop to rank 2, fp16
    clients keep rank 4; each group's measured upload is exactly its prediction, in budget."""
    import json

    from fedslice.api import run_experiment

    def planned(dtype, limits):
        d = _cfg(tiny_cfg_dict, dtype, rounds=1, clients_per_round=3, pack=False)
        d["lora"]["ranks"] = [2, 4]
        d["budgets"] = {"tiers": [{"share": 1.0, **limits}]}
        run = run_experiment(validate_config(d), tmp_path / f"{dtype}-{len(limits)}", progress=False)
        (group,) = json.loads((run / "summary.json").read_text())["plans"]
        assert group["measured"]["upload_mb_mean"] == pytest.approx(group["predicted"]["upload_mb"], rel=1e-9)
        return group

    free = {t: planned(t, {"memory_mb": 1e4}) for t in ("fp32", "fp16")}
    assert free["fp32"]["plan"]["rank"] == free["fp16"]["plan"]["rank"] == 4
    up32, up16 = (free[t]["predicted"]["upload_mb"] for t in ("fp32", "fp16"))
    assert up16 * 2 == pytest.approx(up32, rel=1e-12)
    budget = {"upload_mb_per_round": (up16 + up32) / 2}
    assert planned("fp32", budget)["plan"]["rank"] == 2
    tight16 = planned("fp16", budget)
    assert tight16["plan"]["rank"] == 4 and tight16["measured"]["upload_mb_mean"] <= budget["upload_mb_per_round"]


def _mixed(tiny_cfg_dict, tier1: dict, **budgets) -> dict:
    """Four clients, ranks 2 and 4: tier 0 unlimited, tier 1 under ``tier1``'s limits."""
    d = _cfg(tiny_cfg_dict, "fp32", num_clients=4, clients_per_round=4, pack=False)
    d["lora"]["ranks"] = [2, 4]
    d["budgets"] = {"tiers": [{"share": 0.5, "memory_mb": 1e4}, {"share": 0.5, **tier1}], **budgets}
    return d


def _fp32_upload_mb(tiny_cfg_dict) -> float:
    """What a rank-4 client of :func:`_mixed` sends per round in fp32 (MB)."""
    method, _ = setup(validate_config(_mixed(tiny_cfg_dict, {"memory_mb": 1e4})))
    return next(iter(method.plans.values())).upload_mb


def test_the_planner_sends_a_reply_in_fp16_before_it_cuts_the_rank(tiny_cfg_dict, monkeypatch):
    """``budgets.upload_dtypes = ["fp32", "fp16"]``: under an upload budget between rank 4's fp16
    and fp32 bytes, the tier's clients keep rank 4 and send in fp16 (without the option they
    drop to rank 2), the other tier sends fp32; the run is exactly the fp32 run with those
    clients' replies rounded to fp16 by hand, and each client's upload is its prediction."""
    up32 = _fp32_upload_mb(tiny_cfg_dict)
    budget = {"upload_mb_per_round": 0.75 * up32}  # rank 4 in fp16 (0.5x) fits, in fp32 not
    without = setup(validate_config(_mixed(tiny_cfg_dict, budget)))[0].plans
    assert {c: p.knobs.rank for c, p in without.items() if p.tier == 1} == {c: 2 for c in without if without[c].tier == 1}

    cfg = validate_config(_mixed(tiny_cfg_dict, budget, upload_dtypes=["fp16", "fp32"]))
    assert cfg.budgets.upload_dtypes == ["fp32", "fp16"]  # most precise first, as given or not
    method, data = setup(cfg)
    plans = method.plans
    half = {c for c, p in plans.items() if p.tier == 1}
    assert half and all(p.knobs.rank == 4 for p in plans.values())
    assert all(p.knobs.upload == ("fp16" if c in half else "fp32") for c, p in plans.items())
    assert all(p.upload_mb == pytest.approx(up32 / 2 if c in half else up32, rel=1e-12) for c, p in plans.items())
    assert all("fp16 upload" in plans[c].knobs.describe() for c in half)
    state, records, _ = Simulation(cfg, method, data).run()
    for r in records:
        for m in r["client_metrics"]:
            assert m["bytes_up"] == pytest.approx(plans[m["client"]].upload_mb * 1e6, rel=1e-12)

    fit = Method.fit

    def rounded(self, payload, data, seed):  # what the wire does to tier 1's replies, by hand
        r = fit(self, payload, data, seed)
        if payload.orders.client not in half:
            return r
        return Reply({k: t.half().float() for k, t in r.arrays.items()}, r.num_examples, r.metrics)

    monkeypatch.setattr(Method, "fit", rounded)
    ref_cfg = validate_config(_mixed(tiny_cfg_dict, {"memory_mb": 1e4}))  # rank 4, fp32, everyone
    ref_method, ref_data = setup(ref_cfg)
    ref_state, ref_records, _ = Simulation(ref_cfg, ref_method, ref_data).run()
    assert state.keys() == ref_state.keys()
    assert all(torch.equal(state[k], ref_state[k]) for k in state)
    assert [r["train_loss"] for r in records] == [r["train_loss"] for r in ref_records]


def test_flower_decodes_each_reply_in_its_plans_upload_dtype(tiny_cfg_dict, tmp_path):
    """A planned run whose tiers send fp32 and fp16 replies ends on Flower where the simulation
    does, with the same bytes up."""
    up32 = _fp32_upload_mb(tiny_cfg_dict)
    d = _mixed(tiny_cfg_dict, {"upload_mb_per_round": 0.75 * up32}, upload_dtypes=["fp32", "fp16"])
    records = _flower_matches_the_simulation(d, 4, tmp_path)
    assert records[0]["bytes_up_mean"] == pytest.approx(0.75 * up32 * 1e6, rel=1e-12)  # half of them in fp16


@pytest.mark.parametrize("method", ["fedpetuning", "heads", "raffm"])
def test_each_planning_method_sends_what_its_plan_predicts_in_its_upload_dtype(tiny_cfg_dict, method):
    """Under an upload budget that only fp16 meets at the tier's plan, every method that plans
    budgets gives some client an fp16 upload, and every client-round sends exactly the bytes its
    plan predicts (the payload's orders carry the dtype to the client; RaFFM and heads build
    their own payloads)."""
    d = _mixed(tiny_cfg_dict, {"memory_mb": 1e4}, local_work=[1.0], micro_batches=[1], checkpointing=False)
    d["method"] = {"name": method, **({"sparsity": 0.5} if method == "heads" else {})}
    if method == "raffm":
        d["budgets"].update(width_steps=2, on_infeasible="error")
    up32 = min(p.upload_mb for p in setup(validate_config(d))[0].plans.values())
    d["budgets"]["tiers"][1] = {"share": 0.5, "upload_mb_per_round": 0.75 * up32}
    d["budgets"]["upload_dtypes"] = ["fp32", "fp16"]
    cfg = validate_config(d)
    method_, data = setup(cfg)
    plans = method_.plans
    assert {p.knobs.upload for p in plans.values()} == {"fp32", "fp16"}
    _, records, _ = Simulation(cfg, method_, data).run()
    sent = [m for r in records for m in r["client_metrics"]]
    assert sent
    for m in sent:
        assert m["bytes_up"] == pytest.approx(plans[m["client"]].upload_mb * 1e6, rel=1e-12), m["client"]
