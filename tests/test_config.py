from pathlib import Path

import pytest

from fedslice.config import ExperimentConfig
from fedslice.experiment import load_config, load_variants, validate_config
from fedslice.errors import ConfigError


def _err(data: dict) -> str:
    with pytest.raises(ConfigError) as e:
        validate_config(data)
    return str(e.value)


def test_defaults_are_valid():
    cfg = ExperimentConfig()
    assert cfg.method.name == "fedpetuning" and cfg.federation.clients_per_round == 10


@pytest.mark.parametrize("data, field, value", [
    ({"federation": {"clients_per_round": 11, "num_clients": 10}}, "federation", "clients_per_round=11"),
    ({"data": {"alpha": 0}}, "data.alpha", "0"),
    ({"data": {"alpha": -1.5}}, "data.alpha", "-1.5"),
    ({"federation": {"lr": 0}}, "federation.lr", "0"),
    ({"federation": {"lr": -1e-3}}, "federation.lr", "-0.001"),
    ({"lora": {"r": 0}}, "lora.r", "0"),
    ({"federation": {"rounds": "many"}}, "federation.rounds", "many"),
    ({"lora": {"targets": ["q", "query"]}}, "lora.targets", "query"),
])
def test_bad_values_name_field_and_value(data, field, value):
    msg = _err(data)
    assert field in msg and value in msg


def test_unknown_key_is_named():
    msg = _err({"federation": {"num_client": 5}})
    assert "federation.num_client" in msg and "unknown key" in msg


def test_unknown_method_lists_known_ones():
    msg = _err({"method": {"name": "fedmagic"}})
    assert "fedmagic" in msg and "fedavg" in msg and "fedpetuning" in msg


def test_toml_yaml_and_overrides(tmp_path: Path):
    toml = tmp_path / "a.toml"
    toml.write_text('seed = 3\n[federation]\nrounds = 4\n[method]\nname = "fedavg"\n')
    cfg = load_config(toml, ["federation.rounds=7", "federation.lr=0.01", "data.path=/x"])
    assert (cfg.seed, cfg.federation.rounds, cfg.federation.lr, cfg.data.path) == (3, 7, 0.01, "/x")
    assert cfg.method.name == "fedavg"
    yaml = tmp_path / "a.yaml"
    yaml.write_text("seed: 5\nfederation:\n  rounds: 2\n")
    assert load_config(yaml).federation.rounds == 2


def test_bad_files(tmp_path: Path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[federation\nrounds=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_config(Path(__file__).parents[1] / "configs" / "fedpetuning_sst2.toml", ["rounds"])


def test_variants_merge_and_replace_method(tmp_path: Path):
    f = tmp_path / "suite.toml"
    f.write_text('seed = 1\n[federation]\nrounds = 3\nlr = 0.5\n[method]\nname = "fedavg"\n'
                 '[[variants]]\nname = "a"\n\n[[variants]]\nname = "b"\n'
                 'method = { name = "fedpetuning" }\nfederation = { lr = 0.1 }\n')
    a, b = load_variants(f)
    assert (a.name, a.method.name, a.federation.lr) == ("a", "fedavg", 0.5)
    assert (b.name, b.method.name, b.federation.lr, b.federation.rounds) == ("b", "fedpetuning", 0.1, 3)


def test_shipped_configs_are_valid():
    for f in (Path(__file__).parents[1] / "configs").glob("*.toml"):
        assert load_variants(f)


def test_raffm_example_config_is_valid():
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "raffm_sst2.toml")
    assert cfg.method.name == "raffm" and [t.flops_share for t in cfg.budgets.tiers] == [0.25, 0.5, 0.75, 1.0]


def test_one_config_serves_several_methods(caplog):
    """`--set method.name=...` on a config written for another method: that method's options
    are set aside and said (logged, `set_aside`), not a ConfigError; a key of no method is still
    one (issue 34, part 0)."""
    import logging

    from fedslice.experiment import load_config

    path = Path(__file__).resolve().parents[1] / "configs" / "fmnist_dinov2.toml"
    with caplog.at_level(logging.WARNING, logger="fedslice.experiment"):
        cfg = load_config(path, ["method.name=fedpetuning"])
    assert cfg.method.name == "fedpetuning"
    assert cfg.method.set_aside == {"keep_ratio": ["fedpft"], "whole_layers": ["fedpft"],
                                    "align_every": ["fedpft"], "align_steps": ["fedpft"],
                                    "distill": ["fedpft", "fedot"]}
    assert "method.keep_ratio (fedpft)" in caplog.text and "not used by method 'fedpetuning'" in caplog.text
    assert "keep_ratio" not in cfg.model_dump(mode="json")["method"]  # not in the run's config
    assert load_config(path).method.set_aside == {}
    with pytest.raises(ConfigError, match=r"method\.bogus: unknown key"):
        load_config(path, ["method.name=fedpetuning", "method.bogus=1"])
