"""The plug-in seams (issue 23, part 0): a method, an adapter or an aggregation rule registered
in a test joins the library without touching its code; invalid combinations fail at config
load naming both fields; ``[lora]`` configs keep their meaning beside ``[peft]``."""

from __future__ import annotations

from typing import Any, Literal

import pytest
import torch
import torch.nn as nn

from fedslice.api import setup
from fedslice.config import AdapterOptions, FederationConfig, MethodOptions
from fedslice.errors import ConfigError
from fedslice.experiment import validate_config
from fedslice.run.engine import Simulation
from fedslice.fl.rules import Krum, Median, Rule, find_rule, unwrap, wrap_rules
from fedslice.fl.strategy import Reply, State, Strategy
from fedslice.measure import ClientCost
from fedslice.methods.fedavg import FedAvg
from fedslice.models.arch import CONV1D, LINEAR
from fedslice.peft import Adapter, LoraAdapter, make_adapter
from fedslice.peft.base import freeze, train_classifier
from fedslice.registry import ADAPTERS, METHODS, RULES, register_method, register_peft_method, \
    register_rule

# --------------------------------------------------------------------------------------------
# A toy method: its options, its class, its registration (nothing else)
# --------------------------------------------------------------------------------------------


class ToyOptions(MethodOptions):
    """A toy method (tests)."""

    name: Literal["toy"] = "toy"
    boost: float = 1.0


class ToyMethod(FedAvg):
    name = "toy"
    sends_slices = True  # pretends: rules that need whole vectors must refuse it


@pytest.fixture
def toy_method():
    register_method(name="toy", options_cls=ToyOptions, method_cls=ToyMethod)
    yield
    METHODS.unregister("toy")


def test_a_registered_method_is_validated_built_and_trained(toy_method, tiny_cfg_dict):
    tiny_cfg_dict["method"] = {"name": "toy", "boost": 2.0}
    cfg = validate_config(tiny_cfg_dict)
    assert isinstance(cfg.method, ToyOptions) and cfg.method.boost == 2.0
    assert cfg.model_dump()["method"] == {"name": "toy", "boost": 2.0}
    with pytest.raises(ConfigError, match=r"method\.boost"):
        validate_config({**tiny_cfg_dict, "method": {"name": "toy", "boost": "much"}})
    method, data = setup(cfg)
    assert isinstance(method, ToyMethod) and method.adapter.name == "none"
    _, records, _ = Simulation(cfg, method, data).run()
    assert len(records) == 2 and records[-1]["train_loss"] is not None


def test_unknown_method_lists_registered_ones(toy_method):
    with pytest.raises(ConfigError, match=r"unknown method 'nope' \(known: .*fedavg.*toy\)"):
        validate_config({"method": {"name": "nope"}})


@pytest.mark.parametrize("section, setting", [
    ({"aggregation": {"rule": "krum", "byzantine": 0}}, "aggregation.rule='krum'"),
    ({"aggregation": {"rule": "multi_krum", "byzantine": 0}}, "aggregation.rule='multi_krum'"),
    ({"dp": {"enabled": True, "noise_multiplier": 1.0}}, "dp.enabled"),
])
def test_a_rule_refuses_a_method_that_sends_slices_naming_both(toy_method, section, setting):
    cfg = {"method": {"name": "toy"}, "federation": {"num_clients": 5, "clients_per_round": 5},
           **section}
    with pytest.raises(ConfigError) as e:
        validate_config(cfg)
    assert setting in str(e.value) and "method toy sends slices" in str(e.value)
    validate_config({**cfg, "method": {"name": "fedavg"}})  # same-shaped updates: fine


# --------------------------------------------------------------------------------------------
# A toy rule: registered, selected by aggregation.rule, wraps any method's strategy
# --------------------------------------------------------------------------------------------


class FirstClient(Rule):
    """Takes the first valid client's delta as the step (a toy combining rule)."""

    name = "first_client"

    def combine(self, server_round: int, state: State, deltas: list[State], weights: list,
                replies: dict[int, Reply]) -> tuple[State, dict[str, Any]]:
        eta = self.fed.server_lr
        new = {k: (g.float() + eta * deltas[0].get(k, torch.zeros(()))).to(g.dtype)
               for k, g in state.items()}
        return new, {"first_client": sorted(replies)[0]}


@pytest.fixture
def toy_rule():
    register_rule(name="first_client", rule_cls=FirstClient)
    yield
    RULES.unregister("first_client")


def test_a_registered_rule_wraps_a_method_strategy(toy_rule, tiny_cfg_dict):
    tiny_cfg_dict["aggregation"] = {"rule": "first_client", "clip_norm": 1e-3}
    cfg = validate_config(tiny_cfg_dict)
    method, data = setup(cfg)
    s = method.strategy
    assert type(s).__name__ == "Clip" and isinstance(s.inner, FirstClient)  # clipping outermost
    assert find_rule(s, FirstClient) is s.inner and unwrap(s) is method.own_strategy
    state = method.initial_state()
    Simulation(cfg, method, data)
    payloads = s.configure_train(1, state, [0, 1])
    replies = {c: method.fit(payloads[c], data.client(c), c) for c in (0, 1)}
    res = s.aggregate_train(1, state, payloads, replies)
    assert res.metrics["first_client"] == 0 and res.metrics["clipped"] == 2
    for k, g in state.items():  # client 0's delta, clipped to norm 1e-3
        assert float((res.state[k] - g).norm()) <= 1e-3 + 1e-6
    delta0 = {k: replies[0].arrays[k] - g for k, g in state.items()}
    norm = float(torch.sqrt(sum((d ** 2).sum() for d in delta0.values())))
    for k, g in state.items():
        torch.testing.assert_close(res.state[k], g + delta0[k] * (1e-3 / norm), atol=1e-7, rtol=1e-5)


def test_unknown_rule_lists_registered_ones(toy_rule):
    with pytest.raises(ConfigError, match=r"aggregation\.rule: unknown rule 'nope'.*first_client"):
        validate_config({"aggregation": {"rule": "nope"}})


def test_rules_compose_with_a_method_weighting_without_new_classes():
    """Median around any strategy is the coordinate median whatever the strategy's weighting;
    Krum raises the replies a round needs; a strategy overriding a template is refused."""
    fed = FederationConfig(num_clients=5, clients_per_round=5)
    s = Krum(Median(Strategy(fed)), byzantine=1)
    assert s.min_valid() == 5 and "krum needs 2f + 3 = 5" in s.min_valid_reason()
    assert isinstance(s.unwrap(), Strategy) and not isinstance(s.unwrap(), Rule)

    class Overrides(Strategy):
        def aggregate(self, *a, **k):  # a template: rules could not wrap it
            raise AssertionError

    with pytest.raises(TypeError, match="overrides"):
        Median(Overrides(fed))


def test_wrap_rules_builds_the_configured_chain(tiny_cfg_dict):
    tiny_cfg_dict["federation"].update(num_clients=5, clients_per_round=5)
    cfg = validate_config({**tiny_cfg_dict, "aggregation": {"rule": "trimmed_mean",
                                                            "trim_fraction": 0.25, "clip_norm": 1.0}})
    chain = wrap_rules(Strategy(cfg.federation), cfg)
    assert [type(chain).__name__, type(chain.inner).__name__] == ["Clip", "TrimmedMean"]
    assert chain.inner.trim_fraction == 0.25 and chain.clip_norm == 1.0
    assert not isinstance(wrap_rules(Strategy(cfg.federation), validate_config(tiny_cfg_dict)), Rule)


# --------------------------------------------------------------------------------------------
# A toy adapter: a learned per-output scale on q and v (its options, its class, registration)
# --------------------------------------------------------------------------------------------


class ScaleConfig(AdapterOptions):
    """Toy adapter options (tests)."""

    init: float = 1.0


class Scaled(nn.Module):
    def __init__(self, base: nn.Linear, init: float):
        super().__init__()
        self.base_layer = base
        self.toy_scale = nn.Parameter(torch.full((base.out_features,), init))  # follows outputs

    def forward(self, x):
        return self.base_layer(x) * self.toy_scale


class ScaleAdapter(Adapter):
    name = "toy_scale"
    prefix = "toy_"
    module_tensors = {"toy_scale": "out"}

    def apply(self, model: nn.Module, layers=None) -> nn.Module:
        freeze(model)
        for name in self.arch.module_names(model, ["q", "v"], layers):
            parent, _, child = name.rpartition(".")
            holder = model.get_submodule(parent)
            setattr(holder, child, Scaled(getattr(holder, child), self.options.init))
        train_classifier(model, self.arch)
        return model


@pytest.fixture
def toy_adapter():
    register_peft_method(name="toy_scale", config_cls=ScaleConfig, adapter_cls=ScaleAdapter)
    yield
    ADAPTERS.unregister("toy_scale")


def test_a_registered_adapter_is_configured_applied_asked_and_trained(toy_adapter, tiny_cfg_dict):
    tiny_cfg_dict.update(peft={"method": "toy_scale"}, toy_scale={"init": 0.5})
    cfg = validate_config(tiny_cfg_dict)
    assert cfg.adapter_options("toy_scale").init == 0.5 and cfg.model_dump()["toy_scale"] == {"init": 0.5}
    with pytest.raises(ConfigError, match=r"toy_scale\.init"):
        validate_config({**tiny_cfg_dict, "toy_scale": {"init": "big"}})
    method, data = setup(cfg)
    adapter = method.adapter
    modules = adapter.adapted_modules(method.model)
    assert len(modules) == 4 and all(isinstance(m, Scaled) for m in modules.values())  # 2 layers x q, v
    assert all(adapter.client_tensor_names(m) == ["toy_scale"] for m in modules.values())
    own = adapter.tensors(method.model)
    assert set(own) == {f"{n}.toy_scale" for n in modules}
    assert adapter.cost(method.model).params == sum(p.numel() for p in own.values())
    assert set(method.trainable()) == set(own) | {"classifier.weight", "classifier.bias"}
    assert ScaleAdapter.tensor_axes("toy_scale") == (0, None)
    state0 = method.initial_state()
    state, records, _ = Simulation(cfg, method, data).run()
    assert records[-1]["train_loss"] is not None and set(state) == set(state0)
    assert all(not torch.equal(state[k], state0[k]) for k in own)  # the scales trained


def test_fedpetuning_refuses_an_adapter_without_tensors():
    with pytest.raises(ConfigError, match=r"peft\.method='none'.*fedpetuning.*use method fedavg"):
        validate_config({"peft": {"method": "none"}})
    with pytest.raises(ConfigError, match=r"peft\.method='lora': method fedavg trains 'none'"):
        validate_config({"method": {"name": "fedavg"}, "peft": {"method": "lora"}})
    with pytest.raises(ConfigError, match=r"peft\.method: .*unknown adapter 'nope'"):
        validate_config({"peft": {"method": "nope"}})


# --------------------------------------------------------------------------------------------
# [lora] and [peft]
# --------------------------------------------------------------------------------------------


def test_lora_section_keeps_its_meaning():
    """[lora] holds LoRA's options as always; [peft] chooses the adapter (unset: the method's
    choice), so an existing config means what it meant."""
    cfg = validate_config({"lora": {"r": 8, "alpha": 16, "targets": ["q", "k"]}})
    assert cfg.peft.method is None and cfg.lora.r == 8 and cfg.lora.scale == 2.0
    assert cfg.model_dump()["lora"]["targets"] == ["q", "k"]
    assert validate_config(cfg.model_dump()) == cfg  # config.json round-trips
    with pytest.raises(ConfigError, match=r"lora\.r"):
        validate_config({"lora": {"r": 0}})
    with pytest.raises(ConfigError, match=r"lora\.rank: unknown key"):
        validate_config({"lora": {"rank": 4}})
    with pytest.raises(ConfigError, match=r"loar: unknown key"):
        validate_config({"loar": {"r": 4}})
    explicit = validate_config({"peft": {"method": "lora"}, "lora": {"r": 8, "alpha": 16, "targets": ["q", "k"]}})
    assert explicit.lora == cfg.lora


@pytest.mark.parametrize("method, option, legacy", [("raffm", "tuning", "full"),
                                                     ("fedot", "adapter_tuning", "full")])
def test_peft_method_and_the_older_option_agree_or_fail_naming_both(method, option, legacy):
    from fedslice.methods import method_class
    cls = method_class(method)
    old = validate_config({"method": {"name": method, option: legacy}})
    assert cls.adapter_name(old) == "none"
    new = validate_config({"method": {"name": method}, "peft": {"method": "none"}})
    assert cls.adapter_name(new) == "none"
    assert cls.adapter_name(validate_config({"method": {"name": method}})) == "lora"
    validate_config({"method": {"name": method, option: legacy}, "peft": {"method": "none"}})
    with pytest.raises(ConfigError, match=rf"peft\.method='lora' contradicts method\.{option}='full'"):
        validate_config({"method": {"name": method, option: legacy}, "peft": {"method": "lora"}})


# --------------------------------------------------------------------------------------------
# LoRA through the adapter interface; Conv1D layout; the cost record
# --------------------------------------------------------------------------------------------


def test_lora_adapter_answers_what_batched_training_needs(tiny_cfg_dict):
    cfg = validate_config(tiny_cfg_dict)
    method, _ = setup(cfg)
    adapter = method.adapter
    assert isinstance(adapter, LoraAdapter) and adapter.batched_clients and adapter.prefix == "lora_"
    modules = adapter.adapted_modules(method.model)
    assert len(modules) == 4 and all(n.endswith(("query", "value")) for n in modules)
    for name, m in modules.items():
        names = adapter.client_tensor_names(m)
        assert names == ["lora_A.default.weight", "lora_B.default.weight"]
        for t in names:
            assert f"{name}.{t}" in method.trainable()
    assert LoraAdapter.tensor_axes("lora_A.default.weight") == (None, 1)  # (r, in)
    assert LoraAdapter.tensor_axes("lora_B.default.weight") == (0, None)  # (out, r)
    cost = adapter.cost(method.model)
    lora = {n: p for n, p in method.model.named_parameters() if "lora_" in n}
    assert cost.params == sum(p.numel() for p in lora.values()) == 4 * 4 * (32 + 32)
    assert cost.bytes == 4 * cost.params and cost.train_flops_per_token == 6 * cost.params
    assert adapter.describe() == {"adapter": "lora", "table6": "lora", "rank": 4, "alpha": 8.0}
    again = make_adapter(cfg, "lora", method.arch).replace(r=2)
    assert again.options.r == 2 and adapter.options.r == 4


def test_conv1d_layout_is_one_helper():
    w = torch.arange(6.0).reshape(2, 3)  # a Conv1D weight (in=2, out=3)
    assert torch.equal(CONV1D.as_linear(w), w.T) and CONV1D.transposed and CONV1D.out_features(w) == 3
    assert LINEAR.as_linear(w) is w and not LINEAR.transposed and LINEAR.out_features(w) == 2
    assert (CONV1D.out_axis, CONV1D.in_axis, CONV1D.out_attr) == (1, 0, "nf")


def test_client_cost_is_the_typed_record_of_the_metrics_keys():
    cost = ClientCost(bytes_down=3, bytes_up=2, examples=5, flops_measured=1.0)
    m = cost.to_metrics()
    assert m["examples_trained"] == 5 and "examples" not in m and m["bytes_down"] == 3
    assert set(ClientCost.ROUND_MEANS) <= set(m) and set(ClientCost.PEAKS) <= set(m)


def test_a_checkpoint_from_before_peft_still_resumes():
    """A config saved before ``[peft]`` existed has no peft.method: unset now, not a difference."""
    from fedslice.run.checkpoint import config_diff
    now = validate_config({}).model_dump(mode="json")
    before = {k: v for k, v in now.items() if k != "peft"}
    assert config_diff(before, now) == []
    assert config_diff(before, validate_config({"peft": {"method": "lora"}}).model_dump(mode="json"))
