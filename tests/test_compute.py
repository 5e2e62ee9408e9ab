"""``[compute]``: device and precision resolution, bad input, and the same code on the CPU that
runs on a GPU (the CUDA tests skip without one)."""

import math

import pytest
import torch

from fedslice.api import setup
from fedslice.compute import Compute, check_precision, cpu_has_bf16, resolve_device
from fedslice.experiment import validate_config
from fedslice.errors import ConfigError
from fedslice.run.engine import Simulation

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _run(cfg_dict, **compute):
    cfg = validate_config({**cfg_dict, "compute": compute})
    method, data = setup(cfg)
    state, records, summary = Simulation(cfg, method, data).run()
    return method, state, records, summary


def test_auto_is_the_cpu_without_a_gpu():
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    c = Compute.from_config(validate_config({}).compute, clients_per_round=10)
    assert c.precision == "fp32" and c.workers >= 1
    assert c.batched == torch.cuda.is_available()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_cuda_without_a_gpu_names_the_field():
    with pytest.raises(ConfigError, match=r"compute.device = 'cuda'.*no CUDA GPU"):
        resolve_device("cuda")
    with pytest.raises(ConfigError, match="compute.device"):
        Compute.from_config(validate_config({"compute": {"device": "cuda:0"}}).compute)


def test_bad_device_string_is_refused_at_load():
    with pytest.raises(ConfigError, match="compute.device"):
        validate_config({"compute": {"device": "tpu"}})
    with pytest.raises(ConfigError, match="compute.workers"):
        validate_config({"compute": {"workers": 0}})


def test_fp16_on_the_cpu_says_why():
    with pytest.raises(ConfigError, match="fp16.*needs a GPU"):
        check_precision("fp16", torch.device("cpu"))


def test_bf16_on_the_cpu_follows_the_cpu(monkeypatch):
    monkeypatch.setattr("fedslice.compute.cpu_has_bf16", lambda: False)
    with pytest.raises(ConfigError, match="no native bf16"):
        check_precision("bf16", torch.device("cpu"))
    monkeypatch.setattr("fedslice.compute.cpu_has_bf16", lambda: True)
    check_precision("bf16", torch.device("cpu"))


@pytest.mark.skipif(not cpu_has_bf16(), reason="this CPU has no native bf16")
def test_bf16_training_keeps_fp32_master_weights(tiny_cfg_dict):
    method, state, records, summary = _run(tiny_cfg_dict, precision="bf16", workers=1)
    assert all(t.dtype == torch.float32 for t in state.values())
    assert all(math.isfinite(m["loss"]) for r in records for m in r["client_metrics"])
    assert 0 <= summary["test_accuracy"] <= 1


def test_explicit_cpu_device_is_todays_behaviour(tiny_cfg_dict):
    _, s1, _, _ = _run(tiny_cfg_dict, device="cpu", workers=1)
    _, s2, _, _ = _run(tiny_cfg_dict, workers=1)
    assert all(torch.equal(s1[k], s2[k]) for k in s1)


@needs_cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_training_and_evaluation(tiny_cfg_dict, precision):
    method, state, records, summary = _run(tiny_cfg_dict, device="cuda", precision=precision)
    assert next(method.model.parameters()).device.type == "cuda"
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in state.values())
    assert records[0]["client_mode"] == "batched"
    assert 0 <= summary["test_accuracy"] <= 1


@needs_cuda
def test_cuda_generation(tiny_gen_cfg_dict):
    method, state, records, summary = _run(tiny_gen_cfg_dict, device="cuda", precision="bf16")
    assert all(math.isfinite(m["loss"]) for r in records for m in r["client_metrics"])


def test_gradient_checkpointing_gives_the_same_weights(tiny_cfg_dict):
    """Recomputing activations in the backward pass changes memory, not results."""
    _, s1, _, _ = _run(tiny_cfg_dict, workers=1)
    method, s2, records, _ = _run(tiny_cfg_dict, workers=1, gradient_checkpointing=True)
    assert method.model.get_base_model().is_gradient_checkpointing
    assert all(torch.allclose(s1[k], s2[k], atol=1e-6) for k in s1)
    assert all(m["activation_mb"] >= 0 for r in records for m in r["client_metrics"])


@pytest.mark.parametrize("method,extra", [
    ("fedpetuning", {}), ("raffm", {}), ("fedpft", {}), ("fedot", {}), ("heads", {}),
    ("heads", {"importance_source": "first_step"}), ("heads", {"importance_source": "training"}),
])
def test_every_method_trains_its_clients_under_the_runs_compute(tiny_cfg_dict, tmp_path, monkeypatch,
                                                                method, extra):
    """A client's local training runs under the run's :class:`Compute` (its device, autocast
    precision, loss scaler), never the CPU default: every autocast around a training step is
    the method's compute object's."""
    import fedslice.compute as compute_mod
    from tests.conftest import method_options

    if extra.get("importance_source"):
        tiny_cfg_dict["federation"]["weight_decay"] = 0.0
    tiny_cfg_dict["method"] = {"name": method, **method_options(method, tmp_path), **extra}
    tiny_cfg_dict["federation"].update(rounds=1)
    cfg = validate_config({**tiny_cfg_dict, "compute": {"workers": 1}})
    m, data = setup(cfg)
    seen: list = []
    real = compute_mod.Compute.autocast

    def autocast(self):
        seen.append(self)
        return real(self)

    monkeypatch.setattr(compute_mod.Compute, "autocast", autocast)
    Simulation(cfg, m, data).run()
    assert seen and all(c is m.compute for c in seen), {id(c) for c in seen} - {id(m.compute)}
