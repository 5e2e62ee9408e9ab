"""The in-process engine on a tiny random BERT: determinism, costs, exclusions."""

import math

import pytest
import torch

from fedslice.experiment import validate_config
from fedslice.errors import ConfigError, ModelError
from fedslice import measure
from fedslice.api import setup
from fedslice.run.engine import Simulation


def _run(cfg_dict):
    cfg = validate_config(cfg_dict)
    method, data = setup(cfg)
    state, records, summary = Simulation(cfg, method, data).run()
    return method, state, records, summary


@pytest.mark.parametrize("method", ["fedpetuning", "fedavg"])
def test_same_seed_same_weights(tiny_cfg_dict, method):
    tiny_cfg_dict["method"] = {"name": method}
    _, s1, r1, _ = _run(tiny_cfg_dict)
    _, s2, r2, _ = _run(tiny_cfg_dict)
    assert s1.keys() == s2.keys()
    for k in s1:
        assert torch.equal(s1[k], s2[k]), k
    assert [r["clients"] for r in r1] == [r["clients"] for r in r2]
    tiny_cfg_dict["seed"] = 1
    _, s3, _, _ = _run(tiny_cfg_dict)
    assert any(not torch.equal(s1[k], s3[k]) for k in s1)


def test_training_changes_only_trainable_state_and_costs_are_sizes(tiny_cfg_dict):
    method, state, records, summary = _run(tiny_cfg_dict)
    names = list(state)
    assert all("lora_" in n or "classifier" in n for n in names)
    assert sum("lora_A" in n for n in names) == 2 * 2  # 2 layers x (q, v)
    expected = measure.tensor_bytes(method.initial_state())
    for rec in records:
        for m in rec["client_metrics"]:
            assert m["bytes_down"] == expected == m["bytes_up"]
            assert m["params_up"] == sum(t.numel() for t in state.values())
            assert m["flops_measured"] > 0 and m["flops_analytic"] > 0
            # LoRA on sentences of several lengths, packed rows (federation.pack): the measured
            # count is every step's (tests/test_packing.py); the analytic one keeps the first
            # layer's input-gradients autograd skips and takes attention at the mean row length:
            # 3.1% here, where attention is a large share of a 32-wide model's FLOPs
            assert m["flops_measured"] == pytest.approx(m["flops_analytic"], rel=0.05)
    assert summary["rounds"] == 2 and 0 <= summary["test_accuracy"] <= 1
    assert records[0]["dev_accuracy"] is not None


def test_nonfinite_client_is_excluded_and_recorded(tiny_cfg_dict, monkeypatch):
    cfg = validate_config(tiny_cfg_dict)
    method, data = setup(cfg)
    real_fit = method.fit

    def fit(payload, data, seed):
        reply = real_fit(payload, data, seed)
        if payload.config["client"] == min(payload_clients):
            reply.metrics["loss"] = math.nan
        return reply

    sim = Simulation(cfg, method, data)
    real_select = sim.selector.select

    def select(rnd, candidates):
        chosen = real_select(rnd, candidates)
        payload_clients[:] = chosen
        return chosen

    payload_clients: list[int] = []
    monkeypatch.setattr(sim.selector, "select", select)
    monkeypatch.setattr(method, "fit", fit)
    _, records, summary = sim.run()
    for rec in records:
        assert rec["excluded"] == [{"client": min(rec["clients"]), "reason": "non-finite local loss (nan)"}]
    assert summary["excluded_replies"] == 2


def test_lora_target_matching_nothing(tiny_cfg_dict):
    tiny_cfg_dict["lora"]["target_modules"] = ["query", "nonexistent_proj"]
    with pytest.raises(ConfigError, match="nonexistent_proj"):
        setup(validate_config(tiny_cfg_dict))


def test_unknown_model_path(tiny_cfg_dict, tmp_path):
    tiny_cfg_dict["model"]["name"] = str(tmp_path / "no-such-model")
    with pytest.raises(ModelError, match="does not exist"):
        setup(validate_config(tiny_cfg_dict))


def test_unsupported_architecture_lists_supported(tmp_path):
    from transformers import XLNetConfig

    from fedslice.models.arch import arch_for
    with pytest.raises(ModelError, match="'xlnet': supported are bart, bert, deit, dinov2, "
                                         "distilbert, gpt2, llama, mistral, qwen2, roberta, t5, vit"):
        arch_for(XLNetConfig())


def test_empty_partitions_are_reported_and_skipped(tiny_cfg_dict):
    tiny_cfg_dict["data"].update({"partition": "dirichlet", "alpha": 0.02})
    tiny_cfg_dict["federation"].update({"num_clients": 40, "clients_per_round": 5})
    cfg = validate_config(tiny_cfg_dict)
    method, data = setup(cfg)
    empty = data.report["empty_partitions"]
    assert empty, "alpha=0.02 over 40 clients should leave some client without data"
    sim = Simulation(cfg, method, data)
    _, records, summary = sim.run()
    assert not set(empty) & {c for r in records for c in r["clients"]}
    assert summary["empty_partitions"] == len(empty)


def test_fedprox_pulls_towards_global(tiny_cfg_dict):
    _, free, _, _ = _run(tiny_cfg_dict)
    tiny_cfg_dict["federation"]["fedprox_mu"] = 100.0
    _, prox, _, _ = _run(tiny_cfg_dict)
    init = setup(validate_config(tiny_cfg_dict))[0].initial_state()  # the untrained global state
    dist = lambda s: sum(float((s[k] - init[k]).norm()) for k in init)  # noqa: E731
    assert dist(prox) < dist(free)


@pytest.mark.parametrize("model_type", ["roberta", "distilbert"])
def test_other_architectures_lora_targets(tmp_path, model_type, tiny_cfg_dict):
    from conftest import save_tiny_model
    tiny_cfg_dict["model"]["name"] = str(save_tiny_model(tmp_path / model_type, model_type))
    tiny_cfg_dict["lora"]["targets"] = ["q", "k", "v", "o", "ffn_in", "ffn_out"]
    tiny_cfg_dict["federation"]["rounds"] = 1
    method, state, _, _ = _run(tiny_cfg_dict)
    assert sum("lora_A" in k for k in state) == 2 * 6
    assert any("classifier" in k for k in state)
