"""Server aggregation against numpy references."""

import math

import numpy as np
import torch

from fedslice.config import FederationConfig
from fedslice.fl.strategy import Payload, Reply, Strategy
from fedslice.slicing.aggregate import aggregate_deltas, fedavg


def _states(seed=0, n=3):
    g = torch.Generator().manual_seed(seed)
    glob = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(4, generator=g)}
    clients = [{k: v + torch.randn(v.shape, generator=g) for k, v in glob.items()} for _ in range(n)]
    return glob, clients


def test_fedavg_equals_numpy_average():
    glob, clients = _states()
    n = [10, 30, 60]
    out = fedavg(glob, clients, n)
    for k in glob:
        ref = np.average(np.stack([c[k].numpy() for c in clients]), axis=0, weights=n)
        np.testing.assert_allclose(out[k].numpy(), ref, rtol=1e-5, atol=1e-6)


def test_server_lr_scales_the_step():
    glob, clients = _states()
    n = [1, 2, 3]
    full = fedavg(glob, clients, n, eta=1.0)
    half = fedavg(glob, clients, n, eta=0.5)
    for k in glob:
        torch.testing.assert_close(half[k], glob[k] + 0.5 * (full[k] - glob[k]))


def test_one_client_returns_its_own_weights():
    glob, clients = _states(n=1)
    out = fedavg(glob, clients, [7])
    for k in glob:
        torch.testing.assert_close(out[k], clients[0][k])


def test_masked_elements_average_over_holders_and_nobody_keeps_value():
    glob, clients = _states()
    deltas = [{k: c[k] - glob[k] for k in glob} for c in clients]
    n = np.array([10.0, 30.0, 60.0])
    masks = [torch.zeros(4, 1), torch.zeros(4, 1), torch.zeros(4, 1)]
    masks[0][:3] = 1  # rows 0-2 held by client 0
    masks[1][:2] = 1  # rows 0-1 held by client 1
    masks[2][:1] = 1  # row 0 held by client 2; row 3 held by nobody
    weights = [{"w": n[i] * masks[i], "b": n[i] * masks[i][:, 0]} for i in range(3)]
    out = aggregate_deltas(glob, deltas, weights)
    stacked = np.stack([c["w"].numpy() for c in clients])
    for row in range(3):
        holders = [i for i in range(3) if masks[i][row] > 0]
        ref = np.average(stacked[holders, row], axis=0, weights=n[holders])
        np.testing.assert_allclose(out["w"][row].numpy(), ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(out["w"][3], glob["w"][3]) and torch.equal(out["b"][3], glob["b"][3])


def test_key_missing_from_a_client_counts_as_not_held():
    glob, clients = _states()
    deltas = [{k: c[k] - glob[k] for k in glob} for c in clients]
    del deltas[0]["b"]
    out = aggregate_deltas(glob, deltas, [1.0, 1.0, 2.0])
    ref = np.average(np.stack([clients[1]["b"].numpy(), clients[2]["b"].numpy()]), axis=0, weights=[1, 2])
    np.testing.assert_allclose(out["b"].numpy(), ref, rtol=1e-5, atol=1e-6)


def _strategy(**kw):
    return Strategy(FederationConfig(num_clients=3, clients_per_round=3, **kw))


def test_strategy_excludes_nonfinite_and_misshapen_replies():
    glob, clients = _states()
    s = _strategy()
    payloads = s.configure_train(1, glob, [0, 1, 2])
    bad = dict(clients[1], w=clients[1]["w"].clone())
    bad["w"][0, 0] = math.nan
    replies = {0: Reply(clients[0], 10, {"loss": 0.5}),
               1: Reply(bad, 10, {"loss": 0.5}),
               2: Reply({"w": torch.zeros(2, 2)}, 10, {"loss": 0.5})}
    res = s.aggregate_train(1, glob, payloads, replies)
    assert res.used == [0] and [e["client"] for e in res.excluded] == [1, 2]
    assert "non-finite" in res.excluded[0]["reason"] and "shape" in res.excluded[1]["reason"]
    for k in glob:
        torch.testing.assert_close(res.state[k], clients[0][k])
    nan_loss = {0: Reply(clients[0], 10, {"loss": math.inf})}
    res = s.aggregate_train(1, glob, {0: payloads[0]}, nan_loss)
    assert res.skipped and res.state is glob


def test_payloads_share_tensors_not_copies():
    glob, _ = _states()
    payloads = _strategy().configure_train(1, glob, [0, 2])
    assert payloads[0].arrays["w"] is glob["w"] and payloads[2].config["client"] == 2
    assert isinstance(payloads[0], Payload)
