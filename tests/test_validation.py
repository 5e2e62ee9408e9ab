"""Update validation before aggregation: every case x every method, and on Flower."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import method_options
from fedslice.api import setup
from fedslice.experiment import validate_config
from fedslice.run.engine import Simulation
from fedslice.fl.strategy import Reply
from fedslice.fl.validation import check_num_examples, check_tensors
from fedslice.methods import METHODS

# make test (--dist loadgroup): the module's tests on one worker, so that `fitted` (a round of
# every method) is computed once, not once on each worker
pytestmark = pytest.mark.xdist_group("validation")

CASES = {
    "outside the slice": "is outside the client's slice",
    "shape": "has shape",
    "dtype": "has dtype torch.float64",
    "nan": "non-finite values in tensor",
    "inf": "non-finite values in tensor",
    "zero examples": "num_examples=0 (no training examples)",
    "negative examples": "num_examples=-3",
    "over-reported examples": "is larger than the client's dataset",
    "non-integer examples": "is not an integer",
}


def _corrupt(case: str, reply: Reply, state: dict, expected: dict, size: int) -> Reply:
    arrays = {k: v.clone() for k, v in reply.arrays.items()}
    key = next(k for k in arrays if k in expected and arrays[k].is_floating_point())
    n = reply.num_examples
    if case == "outside the slice":  # a global tensor the client was not given, or a new one
        other = sorted(k for k in state if k not in expected and k not in arrays)
        name = other[0] if other else "bogus.weight"
        arrays[name] = state[other[0]].clone() if other else torch.zeros(3)
    elif case == "shape":
        arrays[key] = torch.cat([arrays[key], arrays[key][:1]])
    elif case == "dtype":
        arrays[key] = arrays[key].double()
    elif case in ("nan", "inf"):
        arrays[key].view(-1)[0] = math.nan if case == "nan" else math.inf
    elif case == "zero examples":
        n = 0
    elif case == "negative examples":
        n = -3
    elif case == "over-reported examples":
        n = size + 1
    elif case == "non-integer examples":
        n = float(n)
    return Reply(arrays, n, dict(reply.metrics))


@pytest.fixture(scope="module")
def fitted(tiny_model_dir, tiny_data_dir, tmp_path_factory):
    """One round of two clients per method (fit once; each case corrupts a copy)."""
    out = {}
    for method in sorted(METHODS):
        tmp = tmp_path_factory.mktemp(method)
        cfg = validate_config({
            "seed": 0, "threads": 1, "data": {"path": str(tiny_data_dir), "max_length": 16},
            "model": {"name": str(tiny_model_dir)}, "lora": {"r": 4, "alpha": 8},
            "federation": {"num_clients": 4, "clients_per_round": 2, "rounds": 1, "local_steps": 2,
                           "batch_size": 8},
            "method": {"name": method, **method_options(method, tmp)},
            "output": {"dir": str(tmp), "progress": False, "plots": False}})
        m, data = setup(cfg)
        Simulation(cfg, m, data)  # tells the strategy the partition sizes
        state = m.initial_state()
        clients = [0, 1] if method != "raffm" else [c for c, p in m.strategy.plans.items()
                                                    if p.sits_out is None][:2]
        payloads = m.strategy.configure_train(1, state, clients)
        replies = {c: m.fit(payloads[c], data.client(c), c) for c in clients}
        out[method] = (m, state, clients, payloads, replies, data)
    return out


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("method", sorted(METHODS))
def test_invalid_update_is_rejected_and_never_averaged(fitted, method, case, caplog):
    m, state, (good, bad), payloads, replies, data = fitted[method]
    s = m.strategy
    expected = s.expected_update(state, payloads[bad], replies[bad])
    corrupted = _corrupt(case, replies[bad], state, expected, len(data.partitions[bad]))
    with caplog.at_level("WARNING"):
        result = s.aggregate_train(1, state, payloads, {good: replies[good], bad: corrupted})
    assert result.used == [good] and result.rejected == 1
    (entry,) = result.excluded
    assert entry["client"] == bad and CASES[case] in entry["reason"], entry["reason"]
    assert f"update of client {bad} rejected" in caplog.text
    alone, _ = s.aggregate(1, state, payloads, {good: replies[good]})
    assert result.state.keys() == alone.keys()
    assert all(torch.equal(result.state[k], alone[k]) for k in alone)
    # the untouched reply passes
    assert s.check_reply(state, payloads[bad], replies[bad]) is None


def test_pure_checks():
    w = {"a": torch.zeros(2, 3)}
    assert check_tensors(w, {"a": torch.ones(2, 3)}) is None
    assert "outside" in check_tensors(w, {"b": torch.ones(2, 3)})
    assert "dtype" in check_tensors(w, {"a": torch.ones(2, 3, dtype=torch.float16)})
    assert check_num_examples(5, 5) is None and check_num_examples(5, None) is None
    assert "larger" in check_num_examples(6, 5) and "integer" in check_num_examples(True, 5)


def test_flower_rejects_an_over_reported_update(tiny_cfg_dict, tmp_path, monkeypatch):
    """On Flower the ServerApp runs the same checks: nodes claiming 1000x their examples are
    rejected and counted; with no valid reply left every round is skipped (weights unchanged)."""
    from test_flower import InProcessGrid, _nodes, _settings, _write_config
    from fedslice.flower import codec
    from fedslice.flower.server_app import run as server_run
    from fedslice.output import read_run

    real = codec.encode_reply

    def lying(reply):
        if reply.num_examples:
            reply = Reply(reply.arrays, reply.num_examples * 1000, reply.metrics)
        return real(reply)

    tiny_cfg_dict["federation"].update(num_clients=2, clients_per_round=2, min_replies=1)
    path = _write_config(tiny_cfg_dict, tmp_path / "exp.json")
    monkeypatch.setattr(codec, "encode_reply", lying)
    run_dir = server_run(InProcessGrid(_nodes(2)), _settings(path, tmp_path / "fl"))
    _, metrics, summary = read_run(run_dir)
    for m in metrics:
        assert m["rejected"] == 2 and m["skipped"]
        assert all("larger than the client's dataset" in e["reason"] for e in m["excluded"])
    assert summary["rejected_replies"] == 4
    from test_flower import _assert_same_state, _weights
    _assert_same_state(_weights(run_dir), setup(validate_config(tiny_cfg_dict))[0].initial_state(), atol=0)
