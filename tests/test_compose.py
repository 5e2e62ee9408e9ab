"""Methods as stages that compose (issue 34, part 0): ``method.name = "raffm+heads"``.

The six methods are presets of the stage model and keep their results bit for bit
(``tests/test_digest.py``, digests taken before the change). Here: the composition's spelling and
its refusals, and that a composition whose upper stage does nothing *is* its lower stage, bit for
bit (``raffm+heads`` keeping every head = ``raffm``; at full width, without RaFFM's re-ordering,
= ``heads``), so the stages compose rather than run side by side.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import method_options
from fedslice.api import run_experiment
from fedslice.errors import ConfigError
from fedslice.experiment import validate_config
from fedslice.methods import METHODS
from fedslice.registry import method_name


def test_spelling_is_one_string_in_stage_order():
    assert method_name("raffm+heads") == "raffm+heads"
    assert method_name("heads + raffm") == "raffm+heads"
    assert method_name("fedpetuning+heads") == "heads"  # the full model is the implied bottom
    assert METHODS.get("raffm+heads").parts == ("raffm", "heads")


@pytest.mark.parametrize("name,both", [
    ("raffm+fedpft", ("fedpft", "raffm")), ("fedot+raffm", ("fedot", "raffm")),
    ("heads+fedpft", ("fedpft", "heads")), ("fedot+heads", ("fedot", "heads")),
    ("fedavg+heads", ("fedavg", "heads")), ("fedpft+fedot", ("fedpft", "fedot")),
    ("heads+heads", ("heads", "heads")),
])
def test_a_composition_that_cannot_work_names_both_stages_at_load(name, both, tiny_cfg_dict):
    d = {**tiny_cfg_dict, "method": {"name": name}}
    with pytest.raises(ConfigError) as e:
        validate_config(d)
    msg = str(e.value)
    assert "method" in msg and all(p in msg for p in both), msg


def test_an_unknown_part_is_named(tiny_cfg_dict):
    with pytest.raises(ConfigError, match="'raffmm' is not a method"):
        validate_config({**tiny_cfg_dict, "method": {"name": "raffmm+heads"}})


def test_options_of_both_stages_validate_under_their_own_names(tiny_cfg_dict):
    cfg = validate_config({**tiny_cfg_dict, "method": {"name": "heads+raffm", "sparsity": 0.5,
                                                       "width_steps": 4}})
    assert cfg.method.name == "raffm+heads" and cfg.method.sparsity == 0.5
    assert cfg.method.width_steps == 4
    with pytest.raises(ConfigError, match="method.sparsity"):
        validate_config({**tiny_cfg_dict, "method": {"name": "raffm+heads", "sparsity": 1.5}})
    # an option of a method outside the composition is set aside and said, not an error
    cfg = validate_config({**tiny_cfg_dict, "method": {"name": "raffm+heads", "keep_ratio": 0.5}})
    assert cfg.method.set_aside == {"keep_ratio": ["fedpft"]}


def _final(d: dict, tmp_path, name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    d = {**json.loads(json.dumps(d)), "name": name}
    run = run_experiment(validate_config(d), tmp_path / name, progress=False)
    return load_file(str(run / "final_trainable.safetensors"))


def _base(tiny_cfg_dict) -> dict:
    d = json.loads(json.dumps(tiny_cfg_dict))
    d["federation"] = {**d["federation"], "num_clients": 4, "clients_per_round": 2, "rounds": 2,
                       "local_steps": 2, "pack": False}
    return d


def test_raffm_plus_heads_keeping_every_head_is_raffm(tiny_cfg_dict, tmp_path):
    """The head stage with nothing to prune (pruning 'none', FedAvg per head, no epsilon)
    leaves RaFFM's sub-models, payloads and aggregation as they are: bit-identical tensors."""
    d = _base(tiny_cfg_dict)
    raffm = method_options("raffm", tmp_path)
    d["method"] = {"name": "raffm", **raffm}
    want = _final(d, tmp_path, "raffm")
    d["method"] = {"name": "raffm+heads", **raffm, "pruning": "none", "aggregation": "fedavg",
                   "eps": 0.0}
    got = _final(d, tmp_path, "composed")
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_raffm_plus_heads_at_full_width_is_heads(tiny_cfg_dict, tmp_path):
    """Every client's RaFFM sub-model is the whole model and the state is not re-ordered: the
    composition trains and aggregates exactly what ``heads`` does (the same kept heads, Eq. 8)."""
    d = _base(tiny_cfg_dict)
    heads = {"sparsity": 0.5}
    d["method"] = {"name": "heads", **heads}
    want = _final(d, tmp_path, "heads")
    d["method"] = {"name": "raffm+heads", **heads, "reorder": False,
                   "tiers": [{"share": 1.0, "flops": 1.0}], "width_steps": 4}
    got = _final(d, tmp_path, "composed")
    trained = {k: t for k, t in got.items() if k in want}  # raffm also saves frozen slices
    assert sorted(trained) == sorted(want)
    for k in want:
        assert torch.equal(trained[k], want[k]), k


@pytest.mark.parametrize("name", ["heads", "raffm+heads"])
def test_planned_upload_is_what_a_client_sends(name, tiny_cfg_dict, tmp_path):
    """``fedslice validate`` counts the kept heads' tensors, the keep-mask and the importances:
    with one count of heads per layer, exactly the tensors (names, shapes) a client sends."""
    from fedslice.api import setup
    d = _base(tiny_cfg_dict)
    d["lora"] = {**d["lora"], "targets": ["q", "k", "v", "o"]}
    d["method"] = {"name": name, "sparsity": 0.5, "scope": "per_layer",
                   **({"tiers": [{"share": 0.5, "flops": 0.5}, {"share": 0.5, "flops": 1.0}],
                       "width_steps": 4} if "raffm" in name else {})}
    method, data = setup(validate_config(d))
    state = method.initial_state()
    payloads = method.strategy.configure_train(1, state, [0, 1, 2, 3])
    for c, payload in payloads.items():
        planned = {k: tuple(t.shape) for k, t in method.planned_upload(payload).items()}
        sent = {k: tuple(t.shape) for k, t in method.fit(payload, data.client(c), 0).arrays.items()}
        assert planned == sent, c
