"""The stage contract (fedslice.methods.contract): every method keeps to its hooks, and a new
stage written against it (tests/stage_random_mask.py) works over an existing method."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from fedslice.experiment import validate_config
from fedslice.methods import METHODS
from fedslice.methods.base import Method
from fedslice.methods.contract import ALL_HOOKS, HOOKS
from fedslice.methods.fedpetuning.method import FedPETuning
from fedslice.methods.heads.method import HeadStage
from fedslice.methods.raffm.method import RaFFM
from fedslice.methods.stage import Composition, Stage
from fedslice.run.engine import Simulation
from fedslice.run.setup import load_inputs
from stage_random_mask import RandomMaskStage

# the library's own functions of Method: a method that overrides one of these breaks the contract
LIBRARY = {n for n, f in vars(Method).items() if callable(f) or isinstance(f, (classmethod, staticmethod))
           } - ALL_HOOKS - {"__init__"}


def test_hooks_are_methods_of_the_base_class_and_listed_once():
    assert all(callable(getattr(Method, h)) for h in ALL_HOOKS)
    names = [h for hooks in HOOKS.values() for h in hooks]
    assert len(names) == len(set(names)) == len(ALL_HOOKS) == 20  # docs/design.md says so


@pytest.mark.parametrize("name", sorted(METHODS.names()))
def test_every_method_overrides_only_hooks(name):
    cls = METHODS.get(name).method_cls
    parts = cls.parts() if isinstance(cls, Composition) else (cls,)
    for part in parts:
        for klass in part.__mro__:
            if klass in (Method, Stage, object):
                continue
            broken = sorted(set(vars(klass)) & LIBRARY)
            assert not broken, f"{klass.__name__} overrides library functions {broken}"


def test_a_composition_is_its_explicit_list_of_stages():
    """``raffm+heads`` is RaFFM with the head stage over it: the list, bottom first; a method
    built from it is the top stage, whose hooks the bottom's library calls reach."""
    cls = METHODS.get("raffm+heads").method_cls
    assert cls.parts() == (RaFFM, HeadStage) and METHODS.get("heads").method_cls.parts() == (FedPETuning, HeadStage)
    assert cls.sends_slices and cls.lora_aggregations == HeadStage.lora_aggregations  # the stage states them
    assert cls.sub_models and cls.quantizes_slices  # RaFFM's, which the stage does not state
    assert cls.overrides("on_round_end") is False and cls.overrides("plan_axes")
    assert not any(issubclass(p, Stage) for p in (RaFFM, FedPETuning)) and not issubclass(HeadStage, Method)


def test_example_stage_is_short():
    lines = Path(__file__).with_name("stage_random_mask.py").read_text().splitlines()
    assert len(lines) < 80


def _run(tiny_cfg_dict, share: float | None):
    cfg = validate_config({**tiny_cfg_dict, "federation": {**tiny_cfg_dict["federation"], "rounds": 1}})
    inputs = load_inputs(cfg)
    cls = FedPETuning if share is None else Composition(
        "random-mask", FedPETuning, (type("RandomMask", (RandomMaskStage,), {"keep_share": share}),))
    sizes = {c: len(p) for c, p in enumerate(inputs.data.partitions)}
    method = cls(cfg, inputs.loaded, inputs.task, client_sizes=sizes)
    return method, Simulation(cfg, method, inputs.data)


def test_random_mask_clients_send_their_draw_and_the_server_averages_holders(tiny_cfg_dict):
    method, sim = _run(tiny_cfg_dict, 0.5)
    state = method.initial_state()
    strategy = method.own_strategy  # the stage's, under the config's rules
    payloads = method.strategy.configure_train(1, state, [0, 1])
    draws = {c: strategy.kept(1, c) for c in payloads}
    assert draws[0] != draws[1] and len(draws[0]) == round(0.5 * len(state))
    replies = {c: method.train_client(p, sim.data.client(c), c) for c, p in payloads.items()}
    for c, reply in replies.items():
        assert set(reply.arrays) == draws[c] and method.strategy.validate(state, payloads[c], reply) is None
    result = method.strategy.aggregate_train(1, state, payloads, replies)
    assert sorted(result.used) == [0, 1]
    new = result.state
    for k in state:
        holders = [c for c in replies if k in replies[c].arrays]
        if not holders:
            assert torch.equal(new[k], state[k])
        elif len(holders) == 1:
            assert torch.allclose(new[k], replies[holders[0]].arrays[k], atol=1e-6)


def test_random_mask_keeping_everything_is_fedpetuning_bit_for_bit(tiny_cfg_dict):
    final = [_run(tiny_cfg_dict, share)[1].run()[0] for share in (None, 1.0)]
    assert final[0].keys() == final[1].keys()
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])
