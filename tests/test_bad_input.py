"""Bad input of issue 15: each is a ConfigError naming the field and the bound that works, raised
before any training; a checkpoint of another architecture names both."""

from __future__ import annotations

import json
import logging
import re
import shutil

import pytest

from conftest import save_tiny_model
from fedslice.api import resume_experiment, run_experiment, setup
from fedslice.cli import main
from fedslice.experiment import validate_config
from fedslice.errors import ConfigError
from fedslice.run.engine import Simulation


def _with(d: dict, **method) -> dict:
    return {**d, "method": method}


def _largest(msg: str) -> float:
    return float(re.search(r"largest valid method\.sparsity is ([0-9.]+)", msg).group(1))


# ---- heads: a sparsity that leaves no head -----------------------------------------------------

@pytest.mark.parametrize("scope, sparsity, pool, largest", [
    ("global", 0.95, 8, 0.875),     # 2 layers x 4 heads: round(0.05 * 8) = 0
    ("per_layer", 0.9, 4, 0.75),    # 4 heads per layer: round(0.1 * 4) = 0
])
def test_heads_sparsity_without_heads_names_field_and_largest_valid(tiny_cfg_dict, scope, sparsity,
                                                                    pool, largest):
    d = _with(tiny_cfg_dict, name="heads", sparsity=sparsity, scope=scope)
    with pytest.raises(ConfigError, match=r"method\.sparsity=.*keeps no head") as e:
        setup(validate_config(d))
    assert _largest(str(e.value)) == largest and f"keeps 1 of {pool} heads" in str(e.value)
    # the value the message gives is valid as written: it keeps one head per pool
    method, data = setup(validate_config(_with(tiny_cfg_dict, name="heads", sparsity=largest,
                                               scope=scope)))
    kept = method.keep(None, seed=0, sparsity=method.opts.sparsity)  # no scores: the size only
    assert int(kept.sum()) == (1 if scope == "global" else kept.shape[0])


def test_heads_sparsity_error_comes_before_training(tiny_cfg_dict, tmp_path, capsys, monkeypatch):
    trained = []
    monkeypatch.setattr(Simulation, "run", lambda *a, **k: trained.append(1))
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(_with(tiny_cfg_dict, name="heads", sparsity=0.99)))
    assert main(["validate", str(cfg)]) == 2
    assert main(["run", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "largest valid method.sparsity is 0.875" in err and "Traceback" not in err
    assert not trained and not any((tmp_path / "runs").glob("*"))


def test_heads_sparsity_one_is_refused_at_config_load():
    with pytest.raises(ConfigError, match=r"method\.sparsity.*less than 1"):
        validate_config({"method": {"name": "heads", "sparsity": 1.0}})


# ---- raffm: a budget below the smallest sub-model ----------------------------------------------

def _raffm(d: dict, tiers: list[dict], **kw) -> dict:
    d = dict(d, lora={"r": 4, "alpha": 8, "targets": ["q", "v"]})
    d["federation"] = dict(d["federation"], num_clients=4, clients_per_round=2)
    return _with(d, name="raffm", tiers=tiers, width_steps=4, **kw)


def _smallest(msg: str, field: str) -> float:
    """The smallest valid value a message gives for ``field`` ('method.tiers[0].flops': the
    planner names the tier and the [budgets] limit the spelling's field is read as)."""
    tier, kind = field.rsplit(".", 1)
    limit = {"flops": "flops_share"}.get(kind, kind)
    m = re.search(re.escape(tier) + r".*?" + limit + r" [0-9.e-]+ is below it: the smallest "
                  r"valid value is ([0-9.e-]+)", msg)
    assert m, msg
    return float(m.group(1))


@pytest.mark.parametrize("kind, tiny", [("flops", 1e-4), ("memory_mb", 1e-3)])
def test_raffm_every_budget_below_smallest_submodel_names_field_and_smallest_valid(tiny_cfg_dict, kind, tiny):
    """Every client would sit out: a ConfigError at setup naming the tier field and the smallest
    value that fits; that value, as printed, gives every client a sub-model."""
    with pytest.raises(ConfigError, match="every client would sit out") as e:
        setup(validate_config(_raffm(tiny_cfg_dict, [{"share": 1.0, kind: tiny}])))
    smallest = _smallest(str(e.value), f"method.tiers[0].{kind}")
    assert smallest > tiny
    method, _ = setup(validate_config(_raffm(tiny_cfg_dict, [{"share": 1.0, kind: smallest}])))
    assert all(cp.sits_out is None for cp in method.strategy.plans.values())


def test_raffm_one_tier_below_sits_out_or_errors(tiny_cfg_dict, caplog):
    """One weak tier among feasible ones: its clients sit out (the documented default, RaFFM's
    devices that cannot afford any sub-model), with a warning naming the field and the smallest
    valid value; with on_infeasible='error' it is a ConfigError saying the same."""
    tiers = [{"share": 0.5, "flops": 1.0}, {"share": 0.5, "flops": 1e-4}]
    with caplog.at_level(logging.WARNING, logger="fedslice"):
        method, _ = setup(validate_config(_raffm(tiny_cfg_dict, tiers)))
    assert {cp.tier for cp in method.strategy.plans.values() if cp.sits_out is not None} == {1}
    assert _smallest(caplog.text, "method.tiers[1].flops") > 1e-4
    with pytest.raises(ConfigError, match=r"method\.tiers\[1\].*smallest valid value"):
        setup(validate_config(_raffm(tiny_cfg_dict, tiers, on_infeasible="error")))


def test_raffm_budget_distribution_below_smallest_names_field(tiny_cfg_dict):
    d = _raffm(tiny_cfg_dict, [{"share": 1.0, "flops": 1.0}],
               budget_distribution={"low": 1e-5, "high": 2e-5})
    with pytest.raises(ConfigError, match=r"method\.budget_distribution.*smallest valid value"):
        setup(validate_config(d))


# ---- fedpft / fedot: proxy keep-ratio ----------------------------------------------------------

@pytest.mark.parametrize("value, bound", [(0, r"\(0, 1\]: 0 keeps no FFN neuron"),
                                          (-0.5, r"\(0, 1\]: -0\.5 keeps no FFN neuron"),
                                          (1.5, r"\(0, 1\]: 1\.5 .*largest valid value is 1")])
def test_fedpft_keep_ratio_out_of_range_names_field_and_bound(value, bound):
    with pytest.raises(ConfigError, match=r"method\.keep_ratio: keep_ratio must be in " + bound):
        validate_config({"method": {"name": "fedpft", "keep_ratio": value}})


def test_fedot_emulator_layers_out_of_range_names_field_and_bound(tiny_cfg_dict):
    with pytest.raises(ConfigError, match=r"method\.emulator_layers: .*greater than 0"):
        validate_config({"method": {"name": "fedot", "emulator_layers": 0}})
    d = _with(tiny_cfg_dict, name="fedot", bottom_layers=1, top_layers=0, emulator_layers=3)
    with pytest.raises(ConfigError, match=r"method\.emulator_layers=3 is more than the 1 middle layers"):
        setup(validate_config(d))


# ---- a checkpoint of another architecture ------------------------------------------------------

def _crashed_run(tiny_cfg_dict, tmp_path, monkeypatch, model_dir) -> tuple[dict, object]:
    d = dict(tiny_cfg_dict, model={"name": str(model_dir)})
    d["output"] = dict(d["output"], checkpoint_every=1, dir=str(tmp_path / "out"))
    real = Simulation.run_round

    def run_round(self, server_round, state):
        if server_round == 2:
            raise RuntimeError("simulated crash")
        return real(self, server_round, state)

    with monkeypatch.context() as m:
        m.setattr(Simulation, "run_round", run_round)
        with pytest.raises(RuntimeError):
            run_experiment(validate_config(d))
    (staging,) = (tmp_path / "out").iterdir()
    return d, staging


def test_resume_with_another_model_names_both_architectures(tiny_cfg_dict, tmp_path, monkeypatch,
                                                            capsys):
    model = save_tiny_model(tmp_path / "bert2")
    d, staging = _crashed_run(tiny_cfg_dict, tmp_path, monkeypatch, model)
    other = save_tiny_model(tmp_path / "bert3", num_layers=3)
    with pytest.raises(ConfigError) as e:
        resume_experiment(staging, overrides=[f"model.name={other}"])
    msg = str(e.value)
    assert "architecture differs" in msg
    assert f"checkpoint bert (2 layers, 4 heads" in msg and str(model) in msg
    assert f"config bert (3 layers, 4 heads" in msg and str(other) in msg
    roberta = save_tiny_model(tmp_path / "roberta", model_type="roberta")
    assert main(["run", "--resume", str(staging), "--set", f"model.name={roberta}"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint bert (2 layers" in err and "config roberta (2 layers" in err
    assert "Traceback" not in err
    assert staging.is_dir()  # refused: the interrupted run is left as it was


def test_resume_after_the_model_files_changed_names_both_architectures(tiny_cfg_dict, tmp_path,
                                                                       monkeypatch):
    """Same model.name, other files at that path (no config field differs): still refused."""
    model = save_tiny_model(tmp_path / "model")
    d, staging = _crashed_run(tiny_cfg_dict, tmp_path, monkeypatch, model)
    shutil.rmtree(model)
    save_tiny_model(model, num_layers=3)
    with pytest.raises(ConfigError, match=r"checkpoint bert \(2 layers.*config bert \(3 layers"):
        resume_experiment(staging)
    # the same architecture again: resumes to the end
    shutil.rmtree(model)
    save_tiny_model(model)
    assert (resume_experiment(staging) / "summary.json").is_file()


def test_checkpoint_without_recorded_architecture_is_checked_by_shapes(tiny_cfg_dict, tmp_path,
                                                                       monkeypatch):
    """Checkpoints written before the architecture was recorded: tensor shapes decide."""
    from fedslice.run.checkpoint import CHECKPOINT, read_checkpoint, write_checkpoint
    model = save_tiny_model(tmp_path / "model")
    d, staging = _crashed_run(tiny_cfg_dict, tmp_path, monkeypatch, model)
    ckpt = read_checkpoint(staging)
    assert ckpt.architecture["model_type"] == "bert" and ckpt.architecture["num_layers"] == 2
    ckpt.architecture = None
    write_checkpoint(staging, ckpt)
    assert read_checkpoint(staging).architecture is None and (staging / CHECKPOINT).is_file()
    other = save_tiny_model(tmp_path / "wide", num_layers=3)
    with pytest.raises(ConfigError, match=r"does not record.*config bert \(3 layers.*tensors differ"):
        resume_experiment(staging, overrides=[f"model.name={other}"])
