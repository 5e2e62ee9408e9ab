"""A client no allowed plan fits sits out (``budgets.on_infeasible = "sit_out"``) for every
method that plans budgets, fedpetuning included: under a time budget the user's floor
(``lora.ranks``, ``budgets.adapter_depths``, ``budgets.local_work`` without the tiny values)
leaves the slow clients nothing to train in the round. Such a client is never selected (as an
offline device: it would take a place of ``clients_per_round`` and train nothing); the log, the
run's summary and ``fedslice plan`` say who and what share of the examples; an error when fewer
eligible clients than ``clients_per_round`` remain, or none."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_cfg
from fedslice.api import setup
from fedslice.errors import ConfigError
from fedslice.experiment import validate_config
from fedslice.methods.plan_records import eligible, sitting_out
from fedslice.methods.plan_report import render_plans
from fedslice.run.asynchronous import simulation_for
from test_checkpoint import reference_and_resumed

#: three fast devices and a slow one, 10x apart, links that count
FAST = {"gflops_per_s": 0.05, "upload_mb_per_s": 1.0, "download_mb_per_s": 2.0}
SLOW = {"gflops_per_s": 0.005, "upload_mb_per_s": 0.1, "download_mb_per_s": 0.2}
POLICY = {"all": {}, "deadline": {"overselect": 0.5}, "async": {"concurrency": 2, "buffer_size": 1}}


def _cfg(tiny_cfg_dict, seconds: float | None = None, slow_share: float = 0.25, policy: str = "all",
         **federation) -> dict:
    """fedpetuning over the four clients, the floor: the whole round (local_work [1.0]) at the
    one LoRA rank; ``seconds``: every client's seconds_per_round."""
    d = json.loads(json.dumps(tiny_cfg_dict))
    limit = {} if seconds is None else {"seconds_per_round": seconds}
    d["federation"].update({"num_clients": 4, "clients_per_round": 2, "rounds": 3,
                            "round_policy": policy, **POLICY[policy], **federation})
    d["budgets"] = {"tiers": [{"share": 1 - slow_share, "memory_mb": 1e4, **FAST, **limit},
                              {"share": slow_share, "memory_mb": 1e4, **SLOW, **limit}],
                    "micro_batches": [1], "checkpointing": False, "local_work": [1.0],
                    "on_infeasible": "sit_out"}
    return d


@pytest.fixture(scope="module")
def between(tiny_cfg_dict_module) -> float:
    """A round's seconds between the fast devices' whole round and the slow one's."""
    d = _cfg(tiny_cfg_dict_module)
    method, _ = setup(validate_config(d))
    seconds = sorted(p.seconds for p in method.plans.values())
    assert seconds[-1] > 5 * seconds[0]
    return (seconds[0] + seconds[-1]) / 2


@pytest.fixture(scope="module")
def tiny_cfg_dict_module(tiny_model_dir, tiny_data_dir, tmp_path_factory) -> dict:
    """conftest's tiny config, once for the module (its plans measured once: ``between``)."""
    return tiny_cfg(tiny_model_dir, tiny_data_dir, tmp_path_factory.mktemp("runs"))


@pytest.mark.parametrize("policy", ["all", "deadline", "async"])
def test_a_client_no_allowed_plan_fits_sits_out_and_is_never_selected(tiny_cfg_dict_module, between,
                                                                       policy, caplog):
    extra = {"deadline": {"round_deadline_s": between}, "async": {"rounds": 6}}.get(policy, {})
    cfg = validate_config(_cfg(tiny_cfg_dict_module, between, policy=policy, **extra))
    with caplog.at_level(logging.WARNING):
        method, data = setup(cfg)
    out = sitting_out(method.plans)
    (slow,) = out
    assert method.plans[slow].tier == 1 and "below the cheapest plan" in out[slow]
    share = 100 * len(data.partitions[slow]) / sum(len(p) for p in data.partitions)
    assert f"1 of 4 clients ({share:.1f}% of the training examples) sit out every round and are " \
           f"never selected" in caplog.text
    sim = simulation_for(cfg, method, data)
    assert sim.candidates == [c for c in range(4) if c != slow]
    _, records, summary = sim.run()
    trained = [m["client"] for r in records for m in r["client_metrics"]]
    assert trained and slow not in trained
    assert set(trained) == set(sim.candidates)  # every other client gets its turns
    assert not any(slow in r["clients"] for r in records)  # no place of a round went to it
    assert summary["sat_out"] == {str(slow): out[slow]}
    assert all(m["sim_s"] <= between * (1 + 1e-9) for r in records for m in r["client_metrics"])


def test_the_plan_report_says_who_sits_out_and_the_share_of_examples(tiny_cfg_dict_module, between):
    method, data = setup(validate_config(_cfg(tiny_cfg_dict_module, between)))
    (slow,) = sitting_out(method.plans)
    lines = render_plans(method.plans, method.client_sizes)
    assert f"    sits out every round, never selected: {method.plans[slow].sits_out}" in lines
    assert lines[-1].startswith("  1 of 4 clients (") and lines[-1].endswith(f"): {slow}")
    assert not any("sit out" in line for line in render_plans(
        setup(validate_config(_cfg(tiny_cfg_dict_module)))[0].plans, method.client_sizes))
    assert eligible([0, 1, 2, 3], method.plans) == [c for c in range(4) if c != slow]


def test_too_few_eligible_clients_train_every_round_and_none_is_an_error(tiny_cfg_dict_module,
                                                                          between, caplog):
    """Fewer eligible clients than clients_per_round: as when fewer are online, every round
    trains all that are left, said in the log and by fedslice plan; none left, or the default
    'error', is a ConfigError naming the clients."""
    d = _cfg(tiny_cfg_dict_module, between, slow_share=0.5, clients_per_round=3, rounds=2)
    cfg = validate_config(d)
    with caplog.at_level(logging.WARNING):
        method, data = setup(cfg)
        sim = simulation_for(cfg, method, data)
    assert "2 of 4 clients sit out every round, leaving 2, fewer than federation.clients_per_round " \
           "= 3: every round trains those 2" in caplog.text
    _, records, _ = sim.run()
    left = [c for c in range(4) if c not in sitting_out(method.plans)]
    assert [sorted(r["clients"]) for r in records] == [left, left]
    d = _cfg(tiny_cfg_dict_module, 1e-4)  # no client meets it
    with pytest.raises(ConfigError, match=r"(?s)no plan fits the budget of some clients:\n  client 0 .*"
                                          r"\n  client 3 .*\(every client would sit out\)"):
        setup(validate_config(d))
    d = _cfg(tiny_cfg_dict_module, between)
    d["budgets"]["on_infeasible"] = "error"  # the default: the run stops naming the slow client
    with pytest.raises(ConfigError, match=r"no plan fits the budget of some clients:\n  client \d "
                                          r"\(budgets\.tiers\[1\]"):
        setup(validate_config(d))


@pytest.mark.parametrize("policy", ["all", "deadline", "async"])
def test_resume_with_a_client_sitting_out_is_bit_identical(tiny_cfg_dict_module, between, tmp_path,
                                                           monkeypatch, policy):
    d = _cfg(tiny_cfg_dict_module, between, policy=policy,
             **({"round_deadline_s": between} if policy == "deadline" else {}))
    d["compute"] = {"workers": 1}
    reference, resumed = reference_and_resumed(d, tmp_path, monkeypatch, crash_round=3)
    a, b = (load_file(str(p / "final_trainable.safetensors")) for p in (reference, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = ([json.loads(x) for x in (p / "metrics.jsonl").read_text().splitlines()]
              for p in (reference, resumed))
    for key in ("clients", "sim_time_s", "train_loss", "excluded"):
        assert [r[key] for r in ra] == [r[key] for r in rb], key
    summary = json.loads((resumed / "summary.json").read_text())
    assert len(summary["sat_out"]) == 1
    assert not set(summary["sat_out"]) & {str(c) for r in ra for c in r["clients"]}


def test_a_client_sent_a_round_anyway_trains_nothing_and_its_reply_is_not_counted(tiny_cfg_dict_module, between):
    """The engines never select it; a caller that asks for its payload (a custom loop, the
    strategy's own hooks) gets no tensors, the client trains nothing, and the aggregation lists it
    as sat out, as raffm's sub-model plans always did."""
    method, data = setup(validate_config(_cfg(tiny_cfg_dict_module, between)))
    (slow,) = sitting_out(method.plans)
    other = next(c for c in range(4) if c != slow)
    state = method.initial_state()
    payloads = method.strategy.configure_train(1, state, [other, slow])
    assert payloads[slow].arrays == {} and payloads[slow].orders.sit_out == method.plans[slow].sits_out
    replies = {c: method.train_client(payloads[c], data.client(c), c) for c in (other, slow)}
    assert replies[slow].num_examples == 0 and replies[slow].arrays == {}
    res = method.strategy.aggregate_train(1, state, payloads, replies)
    assert res.used == [other]
    assert res.excluded == [{"client": slow, "reason": f"sat out: {method.plans[slow].sits_out}"}]


class _Nodes:
    """A grid whose every SuperNode is connected (what the adapter's candidates ask of it)."""

    def __init__(self, nodes):
        self.nodes = nodes

    def get_node_ids(self):
        return list(self.nodes)


def test_on_flower_a_client_that_sits_out_is_not_a_candidate(tiny_cfg_dict_module, between):
    from fedslice.flower.discovery import PartitionMap
    from fedslice.flower.strategy import FlowerAdapter

    cfg = validate_config(_cfg(tiny_cfg_dict_module, between))
    method, data = setup(cfg, role="server")
    (slow,) = sitting_out(method.plans)
    parts = PartitionMap(4)
    parts.nodes = {c: 100 + c for c in range(4)}
    adapter = FlowerAdapter(cfg, method, data, parts, round_timeout=5.0)
    assert adapter.candidates(_Nodes(parts.nodes.values())) == [c for c in range(4) if c != slow]
