"""A client's orders as one typed record (issue 58 part 3): :class:`fedslice.fl.orders.Orders`.

Every key a strategy writes into a payload's config is a field of the record (or a method's own
entry it declares); readers take the record, never the dict by key; "the plan's knob, else the
method's" is decided by one resolver (:meth:`fedslice.methods.base.Method.orders`).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from conftest import method_options
from fedslice.experiment import validate_config
from fedslice.fl.orders import Orders, TRAIN_FIELDS, order_fields
from fedslice.methods.fedpft.orders import ProxyOrders

SRC = Path(__file__).resolve().parents[1] / "src" / "fedslice"


def test_of_reads_the_wire_form_with_its_types_and_keeps_other_keys_apart():
    o = Orders.of({"round": "3", "client": 7, "lr": 1e-3, "local_steps": 0, "local_epochs": None,
                   "batch_size": 8, "micro_batches": None, "frozen_tensors": ["a", "b"],
                   "flops_budget": 5, "sit_out": "", "sparsity": None, "proxy_version": 2})
    assert (o.round, o.client, o.lr, o.batch_size) == (3, 7, 1e-3, 8)
    assert (o.local_steps, o.local_epochs, o.micro_batches) == (0, 1, 1)
    assert o.frozen_tensors == ("a", "b") and o.flops_budget == 5.0 and isinstance(o.flops_budget, float)
    assert o.sit_out is None and o.sparsity is None and o.weight_factor == 1.0
    assert dict(o.extra) == {"proxy_version": 2}
    assert Orders.of(o) is o


def test_resolved_takes_the_plans_knob_else_the_methods():
    defaults = {"sparsity": 0.9, "importance_source": "pass", "base_precision": "int8"}
    planned = Orders.of({"sparsity": 0.5, "importance_source": "first_step"})
    r = planned.resolved(defaults)
    assert (r.sparsity, r.importance_source, r.base_precision) == (0.5, "first_step", "int8")
    assert Orders().resolved(defaults).sparsity == 0.9
    assert planned.resolved({}) is planned
    with pytest.raises(ValueError, match="sparsty"):
        Orders().resolved({"sparsty": 0.5})


def test_order_fields_refuses_a_key_that_is_not_a_field():
    assert order_fields(client=3, lora_rank=4) == {"client": 3, "lora_rank": 4}
    with pytest.raises(ValueError, match="lora_rnk"):
        order_fields(lora_rnk=4)


def test_train_key_and_trains_alone():
    a = Orders.of({"lr": 0.1, "batch_size": 4, "local_steps": 2, "client": 1, "sparsity": 0.5})
    b = Orders.of({"lr": 0.1, "batch_size": 4, "local_steps": 2, "client": 2, "sparsity": 0.7})
    assert a.train_key() == b.train_key() and len(a.train_key()) == len(TRAIN_FIELDS)
    assert a.train_key() != Orders.of({"lr": 0.1, "batch_size": 2, "local_steps": 2}).train_key()
    assert not a.trains_alone()
    for alone in ({"micro_batches": 2}, {"checkpointing": True}, {"frozen_tensors": ["x"]},
                  {"memory_budget": 100.0}):
        assert Orders.of(alone).trains_alone(), alone


def test_no_reader_indexes_a_payload_config_by_key():
    """The engine, runner, rules, methods and Flower apps read a payload's orders through the
    record: no ``payload.config.get(...)`` / ``payload.config[...]`` (or of ``sent``, ``p``)."""
    pattern = re.compile(r"\b(payload|payloads\[[^\]]+\]|sent|p|msg_payload)\.config\s*(\.get\(|\[)")
    hits = [f"{f.relative_to(SRC)}:{i}" for f in SRC.rglob("*.py")
            for i, line in enumerate(f.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []
    # the train loop reads its orders as the record too
    for name in ("fl/client.py", "fl/batched.py", "fl/memory_hold.py"):
        text = (SRC / name).read_text()
        assert not re.search(r"\bcfg(\.get\(|\[)", text), name


def _payloads(cfg_dict: dict) -> tuple[object, dict]:
    from fedslice.run.setup import load_inputs

    cfg = validate_config(cfg_dict)
    method = load_inputs(cfg, "both").method(cfg, "both")
    state = method.initial_state()
    clients = list(range(cfg.federation.num_clients))
    return method, method.strategy.configure_train(1, state, clients)


@pytest.mark.parametrize("name,extra", [
    ("heads", {"budgets": {"tiers": [{"share": 0.5, "flops_share": 0.6},
                                     {"share": 0.5, "flops_share": 1.0}],
                           "sparsities": [0.25, 0.75], "local_work": [0.5, 1.0]}}),
    ("heads", {}),  # no plans: the method's sparsity
    ("raffm+heads", {"budgets": {"tiers": [{"share": 0.5, "flops_share": 0.5},
                                           {"share": 0.5, "flops_share": 1.0}],
                                 "width_steps": 4, "sparsities": [0.5]}}),
    ("fedpft", {}),
])
def test_every_key_a_strategy_writes_is_a_field_and_the_method_resolves_the_rest(
        name, extra, tiny_cfg_dict, tmp_path):
    d = copy.deepcopy(tiny_cfg_dict)
    base = name.split("+")[0]
    opts = {**method_options(base, tmp_path), **(method_options("heads", tmp_path) if "heads" in name else {})}
    opts.pop("tiers", None)
    d["method"] = {"name": name, **opts}
    d.update(extra)
    method, payloads = _payloads(d)
    fields = set(Orders.__dataclass_fields__) - {"extra"}
    own = set(ProxyOrders.KEYS.values())
    for c, p in payloads.items():
        unknown = set(p.config) - fields - own
        assert unknown == set(), (c, unknown)
        o = method.orders(p)
        assert o.client == c and o.round == 1
        if "heads" in name:
            plan = method.plans.get(c)
            planned = None if plan is None else plan.knobs.sparsity
            assert o.sparsity == (method.opts.sparsity if planned is None else planned)
            assert o.importance_source is not None
    if "budgets" in extra and name == "heads":  # no plan's sparsity is the method's 0.5
        assert {method.orders(p).sparsity for p in payloads.values()} <= {0.25, 0.75}
    if name == "heads" and not extra:
        assert {method.orders(p).sparsity for p in payloads.values()} == {0.5}
