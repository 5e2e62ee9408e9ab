"""A client whose loss turns non-finite: it is read once after local training (no per-step host
sync on a GPU), its reply is excluded, and in the batched pass it does not touch the other
clients trained beside it."""

import math

import pytest
import torch

from fedslice.api import setup
from fedslice.experiment import validate_config
from fedslice.fl.client import train_local
from fedslice.run.engine import Simulation


def _client(cfg_dict):
    cfg = validate_config(cfg_dict)
    method, data = setup(cfg)
    params = {n: p for n, p in method.model.named_parameters() if p.requires_grad}
    return method, params, data.client(0), cfg


def test_a_diverged_step_makes_the_loss_nonfinite_and_the_client_runs_its_steps(tiny_cfg_dict):
    method, params, data, cfg = _client(tiny_cfg_dict)
    train = {"lr": 5e-3, "local_steps": 5, "batch_size": 4}
    calls = []

    def loss_fn(model, batch):
        calls.append(1)
        loss = method.task.loss(model, batch)
        return loss * math.inf if len(calls) == 3 else loss  # step 3 of 5 diverges

    healthy = train_local(method.model, params, data, train, seed=0, loss_fn=method.task.loss)
    assert not healthy.nonfinite and math.isfinite(healthy.loss) and healthy.steps == 5
    result = train_local(method.model, params, data, train, seed=0, loss_fn=loss_fn)
    assert result.nonfinite and not math.isfinite(result.loss)
    assert result.steps == 5 and len(calls) == 5  # no step waits to read the loss


def test_a_diverged_client_in_the_batched_pass_is_excluded_and_leaves_the_others_alone(tiny_cfg_dict, monkeypatch):
    """One round of three clients stacked in one pass, with and without the first client's loss
    turned to nan: the others' losses are identical, the first is excluded, the state finite."""
    tiny_cfg_dict["federation"].update(num_clients=3, clients_per_round=3, rounds=1)
    tiny_cfg_dict["data"]["partition"] = "iid"
    tiny_cfg_dict["compute"] = {"workers": 1, "batched_clients": True}

    def run(poison):
        cfg = validate_config(tiny_cfg_dict)
        method, data = setup(cfg)
        if poison:
            client_losses = method.task.client_losses

            def poisoned(model, batch, rows):  # the first client's rows of the stacked batch
                out = client_losses(model, batch, rows)
                return [out[0] * math.nan, *out[1:]]

            monkeypatch.setattr(method.task, "client_losses", poisoned)
        state, records, summary = Simulation(cfg, method, data).run()
        return state, records[0], summary

    _, clean, _ = run(False)
    state, dirty, summary = run(True)
    assert clean["client_mode"] == dirty["client_mode"] == "batched"
    # the diverged client's tensors are not finite: its reply is rejected (not trusted) and
    # excluded; the others' are what they were without it
    used = {m["client"]: m for m in dirty["client_metrics"] if m["used"]}
    unused = [m["client"] for m in dirty["client_metrics"] if not m["used"]]
    assert len(used) == 2 and len(unused) == 1
    assert dirty["excluded"] == [{"client": unused[0], "reason": "non-finite local loss (nan)"}]
    assert summary["excluded_replies"] == 1
    before = {m["client"]: m["loss"] for m in clean["client_metrics"]}
    assert len(before) == 3 and all(math.isfinite(v) for v in before.values())
    for c, m in used.items():
        assert m["loss"] == pytest.approx(before[c], abs=1e-6) and m["batched_clients"] == 3
    assert all(bool(torch.isfinite(t).all()) for t in state.values())


def test_a_diverged_fedsa_client_keeps_the_b_it_had(tiny_cfg_dict, monkeypatch):
    """FedSA keeps each client's B on the client: a round in which the client diverges (its B
    is nan after training on) leaves the B of its last finite round."""
    tiny_cfg_dict["lora"]["aggregation"] = "fedsa"
    method, _, _, cfg = _client(tiny_cfg_dict)
    data = setup(cfg)[1]
    state = method.initial_state()
    payload = method.strategy.configure_train(1, state, [0])[0]
    first = method.fit(payload, data.client(0), seed=0)
    kept = {k: t.clone() for k, t in method.personal[0].items()}
    assert kept and math.isfinite(first.metrics["loss"])
    loss = method.task.loss
    monkeypatch.setattr(method.task, "loss", lambda model, batch: loss(model, batch) * math.nan)
    second = method.fit(method.strategy.configure_train(2, state, [0])[0], data.client(0), seed=1)
    assert not math.isfinite(second.metrics["loss"])
    assert not any(k in second.arrays for k in kept)  # B is never sent
    assert all(torch.equal(method.personal[0][k], kept[k]) for k in kept)
