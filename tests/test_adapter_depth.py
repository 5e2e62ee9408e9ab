"""Adapter depth (``budgets.adapter_depths``, :mod:`fedslice.slicing.depth`): a planned client
trains the adapters of the top blocks only.

What is checked: the positions of a model's tensors and the tensors a depth freezes; a FLOPs
budget the whole round misses at every block is met by the top blocks' adapters (fedpetuning,
raffm, raffm+heads), the measured FLOPs, memory and upload of such a client are the planner's
predictions; its reply holds none of the frozen tensors and the server averages each of those over
the clients that trained it (exactly, against a hand-computed mean); the shared model's tensors
train again after the client; a reply that sends a frozen tensor is rejected; combinations that
cannot work are refused at load naming the fields.
"""

from __future__ import annotations

import json

import pytest
import torch

from fedslice.api import run_experiment, setup
from fedslice.errors import ConfigError
from fedslice.experiment import validate_config
from fedslice.fl.strategy import Reply
from fedslice.slicing.depth import block_positions, depth_cut, frozen_below

LAYER0 = "base_model.model.bert.encoder.layer.0."


def _cfg(tiny_cfg_dict, data_dir, method="fedpetuning", tiers=None, options=None, **budgets) -> dict:
    d = json.loads(json.dumps(tiny_cfg_dict))
    d["data"]["path"] = str(data_dir)
    d["federation"] = {**d["federation"], "num_clients": 4, "clients_per_round": 4, "rounds": 1,
                       "local_steps": 2, "pack": False}
    d["method"] = {"name": method, **(options or {})}
    d["budgets"] = {"tiers": tiers or [{"share": 1.0, "name": "all", "memory_mb": 1e4}],
                    "micro_batches": [1], "checkpointing": False, "local_work": [1.0], **budgets}
    return d


def test_positions_and_the_tensors_a_depth_freezes(tiny_cfg_dict, one_length_data_dir):
    method, _ = setup(validate_config(_cfg(tiny_cfg_dict, one_length_data_dir)))
    positions, total = block_positions(method.model, method.arch)
    assert total == 2
    names = list(positions)
    assert positions[next(n for n in names if "embeddings" in n)] == 0
    assert {positions[n] for n in names if ".layer.1." in n} == {1}
    assert positions[next(n for n in names if "classifier" in n)] == 2
    assert [depth_cut(s, 6) for s in (1.0, 0.5, 0.34, 0.01)] == [0, 3, 4, 5]
    frozen = frozen_below(method.model, method.arch, 0.5)
    trainable = [n for n, p in method.model.named_parameters() if p.requires_grad]
    assert list(frozen) == [n for n in trainable if n.startswith(LAYER0)] and len(frozen) == 4
    assert frozen_below(method.model, method.arch, 1.0) == () == frozen_below(method.model, method.arch, None)
    with pytest.raises(ValueError, match="not in"):
        depth_cut(0.0, 6)


def _plans(tiny_cfg_dict, data_dir, method, share, options=None):
    """(config, plans by tier name) with a 'tight' tier at ``share`` of the whole round's FLOPs."""
    probe, _ = setup(validate_config(_cfg(tiny_cfg_dict, data_dir, method, options=options)))
    full = next(iter(probe.plans.values()))
    tiers = [{"share": 0.5, "name": "big", "memory_mb": 1e4},
             {"share": 0.5, "name": "tight", "gflops_per_round": round(share * full.gflops_per_round, 6)}]
    d = _cfg(tiny_cfg_dict, data_dir, method, tiers, options, adapter_depths=[1.0, 0.5])
    m, _ = setup(validate_config(d))
    return d, full, {p.budget.name: p for p in m.plans.values()}


FORWARD = {"prune": "forward", "sparsity": 0.5}


@pytest.mark.parametrize("method,share,options", [("fedpetuning", 0.8, None), ("raffm", 0.8, None),
                                                  ("raffm+heads", 0.55, None), ("heads", 0.75, FORWARD)])
def test_a_flops_budget_trains_the_top_blocks_adapters_as_predicted(tiny_cfg_dict, one_length_data_dir,
                                                                   tmp_path, method, share, options):
    """The whole round at every block misses the tight tier's FLOPs (raffm+heads: even with
    heads' importance from the first step; heads in forward mode: at every sparsity); the top
    half of the blocks fits at the full width and batch. Measured FLOPs (2%), memory (10%) and
    upload (exactly) are the predictions, and each tight client sends none of the lower block's
    tensors."""
    d, full, got = _plans(tiny_cfg_dict, one_length_data_dir, method, share, options)
    tight = got["tight"]
    assert tight.knobs.depth == 0.5 and tight.knobs.width == 1.0 and tight.knobs.batch is None
    assert got["big"].frozen == () and [n.startswith(LAYER0) for n in tight.frozen] == [True] * 4
    assert "adapters in the top 50% of blocks" in tight.knobs.describe()
    assert tight.gflops_per_round < share * full.gflops_per_round < full.gflops_per_round
    assert tight.upload_mb < full.upload_mb
    run = run_experiment(validate_config(d), tmp_path / "depth", progress=False)
    groups = {g["budget_name"]: g for g in json.loads((run / "summary.json").read_text())["plans"]}
    for g in groups.values():
        meas, pred = g["measured"], g["predicted"]
        assert meas["client_rounds"] == len(g["clients"])  # no reply refused
        assert meas["gflops_per_round_mean"] == pytest.approx(pred["gflops_per_round"], rel=0.02)
        assert meas["memory_mb_max"] == pytest.approx(pred["memory_mb"], rel=0.10)
        assert meas["upload_mb_mean"] == pytest.approx(pred["upload_mb"], rel=1e-9)
    assert groups["tight"]["plan"]["depth"] == 0.5


def test_frozen_tensors_are_averaged_over_the_clients_that_trained_them(tiny_cfg_dict, one_length_data_dir):
    """One round by hand: the tight clients' replies lack the lower block's tensors and leave
    the shared model's requires_grad as it was; the new global value of a lower-block tensor is
    the example-weighted mean over the big clients only, of an upper-block tensor over all four."""
    d, _, _ = _plans(tiny_cfg_dict, one_length_data_dir, "fedpetuning", 0.8)
    method, data = setup(validate_config(d))
    state = {k: t.clone() for k, t in method.initial_state().items()}
    payloads = method.strategy.configure_train(1, state, [0, 1, 2, 3])
    before = {n: p.requires_grad for n, p in method.model.named_parameters()}
    replies = {c: method.train_client(payloads[c], data.client(c), c) for c in payloads}
    assert {n: p.requires_grad for n, p in method.model.named_parameters()} == before
    tight = [c for c in payloads if payloads[c].config.get("frozen_tensors")]
    big = [c for c in payloads if c not in tight]
    assert len(tight) == 2 and len(big) == 2
    lower = payloads[tight[0]].config["frozen_tensors"]
    for c in tight:
        assert not set(lower) & set(replies[c].arrays) and replies[c].arrays
    result = method.strategy.aggregate_train(1, state, payloads, replies)
    assert result.used == [0, 1, 2, 3] and not result.excluded
    upper = next(k for k in replies[tight[0]].arrays if ".layer.1." in k)
    for key, holders in ((lower[1], big), (upper, big + tight)):
        n = torch.tensor([float(replies[c].num_examples) for c in holders], dtype=torch.float64)
        deltas = torch.stack([replies[c].arrays[key].double() - state[key].double() for c in holders])
        want = state[key].double() + (n.view(-1, *[1] * state[key].dim()) * deltas).sum(0) / n.sum()
        assert torch.allclose(result.state[key].double(), want, atol=1e-6, rtol=0)
        assert not torch.equal(result.state[key], state[key])


def test_a_reply_with_a_frozen_tensor_is_rejected_and_the_upload_is_predicted(tiny_cfg_dict, one_length_data_dir):
    d, _, _ = _plans(tiny_cfg_dict, one_length_data_dir, "fedpetuning", 0.8)
    method, data = setup(validate_config(d))
    state = method.initial_state()
    payloads = method.strategy.configure_train(1, state, [0, 1, 2, 3])
    c = next(c for c in payloads if payloads[c].config.get("frozen_tensors"))
    reply = method.train_client(payloads[c], data.client(c), c)
    assert method.strategy.validate(state, payloads[c], reply) is None
    # what `fedslice validate` counts: the reply's tensors; the next client's model trains all
    assert set(method.planned_upload(payloads[c])) == set(reply.arrays)
    big = next(b for b in payloads if not payloads[b].config.get("frozen_tensors"))
    _, params = method.client_model(payloads[big])
    assert set(payloads[c].config["frozen_tensors"]) <= set(params)
    lower = payloads[c].config["frozen_tensors"][0]
    bad = Reply({**reply.arrays, lower: state[lower].clone()}, reply.num_examples, reply.metrics)
    assert "below the client's adapter depth" in method.strategy.validate(state, payloads[c], bad)
    upper = next(iter(reply.arrays))
    short = Reply({k: t for k, t in reply.arrays.items() if k != upper}, reply.num_examples, reply.metrics)
    assert "missing from the reply" in method.strategy.validate(state, payloads[c], short)


@pytest.mark.parametrize("extra,message", [
    ({"budgets": {"adapter_depths": [0.0]}}, "budgets.adapter_depths"),
    ({"budgets": {"adapter_depths": [1.5]}}, "budgets.adapter_depths"),
    ({"peft": {"method": "prompt"}}, "adapter's tensors sit at the input"),
    ({"lora": {"aggregation": "fedex"}}, "lora.aggregation='fedex'"),
    ({"aggregation": {"rule": "krum"}}, "krum"),
    ({"method": {"name": "raffm", "elastic_depth": True}}, "method.elastic_depth"),
])
def test_what_cannot_train_the_top_blocks_only_is_refused_at_load(tiny_cfg_dict, one_length_data_dir,
                                                                  extra, message):
    d = _cfg(tiny_cfg_dict, one_length_data_dir, adapter_depths=[1.0, 0.5])
    for k, v in extra.items():
        d[k] = {**d.get(k, {}), **v}
    with pytest.raises(ConfigError) as e:
        validate_config(d)
    assert message in str(e.value) and "adapter_depths" in str(e.value), str(e.value)


@pytest.mark.parametrize("method", ["fedpetuning", "raffm+heads"])
def test_flower_serverapp_matches_in_process_with_adapter_depths(tiny_cfg_dict, one_length_data_dir,
                                                                 tmp_path, monkeypatch, method):
    """A ServerApp with ClientApps (each freezing the tensors its payload names) ends at the
    in-process run's state, 2 rounds."""
    from fedslice.flower.server_app import run as server_run
    from fedslice.run.engine import Simulation
    from test_flower import InProcessGrid, _assert_same_state, _nodes, _settings, _weights, _write_config

    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    d, _, got = _plans(tiny_cfg_dict, one_length_data_dir, method, 0.55 if "heads" in method else 0.8)
    assert got["tight"].knobs.depth == 0.5
    d["federation"].update(num_clients=4, clients_per_round=3, rounds=2)
    cfg = validate_config(d)
    m, data = setup(cfg)
    m.start = m.initial_state()
    state, records, _ = Simulation(cfg, m, data).run()
    assert any(set(m.plans[c["client"]].frozen) for r in records for c in r["client_metrics"])
    path = _write_config(d, tmp_path / "exp.json")
    run_dir = server_run(InProcessGrid(_nodes(4)), _settings(path, tmp_path / "fl"))
    _assert_same_state(_weights(run_dir), m.exported(state))
