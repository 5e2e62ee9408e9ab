"""RaFFM's activation-aware salience (issue 35, part 4): ``method.salience = "activation"`` ranks
FFN unit j by mean|a_j| x ||W_out[:, j]||_1 over a calibration batch (heads the same over their
W_o input channels). It is a permutation that keeps the full model's function, it keeps a
planted massive-activation FFN unit in the smallest slice where L1 drops it, and the option
runs end to end on the tiny LLaMA."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from pydantic import ValidationError

from fedslice.api import setup
from fedslice.experiment import validate_config
from fedslice.methods.raffm import RaFFMMethod
from fedslice.models.arch import arch_for
from fedslice.run.engine import Simulation
from fedslice.slicing.permute import permute_model, permute_state
from fedslice.slicing.salience import model_salience, output_activations, salience_order


@pytest.fixture(scope="module")
def llama(tiny_lm_dirs):
    import transformers as T
    model = T.AutoModelForCausalLM.from_pretrained(tiny_lm_dirs["llama"], attn_implementation="eager")
    model.eval()
    return model


def _batch(n=4, t=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 400, (n, t), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _logits(model):
    with torch.no_grad():
        return model(**_batch(2, 9, seed=3)).logits


def test_option_is_validated():
    assert RaFFMMethod().salience == "l1"  # the default is unchanged
    assert RaFFMMethod(salience="activation").calibration == "dev"
    with pytest.raises(ValidationError):
        RaFFMMethod(salience="act")
    with pytest.raises(ValidationError):
        RaFFMMethod(salience="activation", calibration="train")
    with pytest.raises(ValidationError):
        RaFFMMethod(calibration_examples=0)


def test_activation_salience_is_a_function_preserving_permutation(llama):
    model = copy.deepcopy(llama)
    arch, dims = arch_for(model), arch_for(model).all_dims(model.config)
    before = _logits(model)
    acts = output_activations(model, arch, [_batch()])
    perm = salience_order(model_salience(model.state_dict(), arch, dims, "activation",
                                         activations=acts), dims, arch)
    assert not perm.is_identity
    permute_model(model, perm, arch)
    assert (_logits(model) - before).abs().max() <= 1e-5
    # re-scored after permuting, the units are sorted (groups whole under GQA)
    after = model_salience(model.state_dict(), arch, dims, "activation",
                           activations=output_activations(model, arch, [_batch()]))
    g = dims[0]["num_heads"] // dims[0]["num_kv_heads"]
    for s in after[0]:
        assert torch.all(s.neurons[:-1] >= s.neurons[1:] - 1e-6)
        assert torch.all(s.heads.view(-1, g).sum(1)[:-1] >= s.heads.view(-1, g).sum(1)[1:] - 1e-6)


def test_output_activations_ignore_padding(llama):
    arch = arch_for(llama)
    b = _batch()
    a = output_activations(llama, arch, [b])
    # the padded positions' values do not count: other token ids there give the same means
    b2 = {k: v.clone() for k, v in b.items()}
    b2["input_ids"][1, 7:] = 11
    a2 = output_activations(llama, arch, [b2])
    assert a.keys() == a2.keys() and len(a) == 2 * llama.config.num_hidden_layers
    for k in a:
        torch.testing.assert_close(a[k], a2[k])


def test_planted_massive_activation_unit_is_kept_by_activation_not_l1(llama):
    """Layer 0's FFN unit J reads one residual channel that the FFN's norm scales by 1000 (a
    massive activation); its weights are the smallest of the layer. L1 puts it last; the
    activation salience first, inside the smallest slice (a quarter of the units)."""
    model = copy.deepcopy(llama)
    arch, dims = arch_for(model), arch_for(model).all_dims(model.config)
    layer = model.model.layers[0]
    J, d = 5, 3
    with torch.no_grad():
        layer.post_attention_layernorm.weight[d] = 1000.0
        for lin in (layer.mlp.gate_proj, layer.mlp.up_proj):
            lin.weight[:, d] = 0.0  # no other unit reads the massive channel
            lin.weight[J] = 0.0
            lin.weight[J, d] = 0.01
        layer.mlp.down_proj.weight[:, J] = 0.001
    keep = max(1, round(0.25 * dims[0]["ffn"]))
    l1 = salience_order(model_salience(model.state_dict(), arch, dims, "l1"), dims, arch)
    assert J not in l1.stacks[0].neurons[0][:keep]
    acts = output_activations(model, arch, [_batch()])
    act = salience_order(model_salience(model.state_dict(), arch, dims, "activation",
                                        activations=acts), dims, arch)
    assert act.stacks[0].neurons[0][0] == J
    # and dropping it matters: the smallest slice's layer-0 FFN output differs by far more
    # without the unit than with it (the function the slice keeps)
    x = torch.randn(1, 6, dims[0]["hidden"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = layer.post_attention_layernorm(x)
        a = torch.nn.functional.silu(layer.mlp.gate_proj(h)) * layer.mlp.up_proj(h)
        full = layer.mlp.down_proj(a)
        def part(units):
            return a[..., list(units)] @ layer.mlp.down_proj.weight[:, list(units)].T
        err_l1 = (part(l1.stacks[0].neurons[0][:keep]) - full).norm()
        err_act = (part(act.stacks[0].neurons[0][:keep]) - full).norm()
    assert err_act < err_l1


@pytest.mark.parametrize("calibration", ["dev", "profile"])
def test_run_with_activation_salience(tiny_gen_cfg_dict, calibration):
    cfg = tiny_gen_cfg_dict
    cfg["federation"].update(rounds=2)
    cfg["method"] = {"name": "raffm", "salience": "activation", "calibration": calibration,
                     "calibration_examples": 6, "reorder_every": 1, "width_steps": 4,
                     # the tiny LLaMA's LM head is most of its FLOPs: its smallest slice is ~0.98x
                     "tiers": [{"share": 0.5, "flops": 0.985}, {"share": 0.5, "flops": 1.0}],
                     "elastic_sizes": [0.985, 1.0]}
    cfg = validate_config(cfg)
    method, data = setup(cfg)
    state, records, summary = Simulation(cfg, method, data).run()
    assert not method.slices.perm.is_identity
    assert [e["size"] for e in summary["elastic"]] == [0.985, 1.0]
    assert not any(m.get("sat_out") for r in records for m in r["client_metrics"])
    batches = method.calibration_batches()
    # dev: 6 of the server's dev rows; profile: the planner's batch (federation.batch_size rows)
    assert sum(len(b["input_ids"]) for b in batches) == (6 if calibration == "dev" else 4)
    # the exported state is the checkpoint's order: re-permuting it by the tracked permutation
    # gives the global state back
    back = permute_state(method.exported(state), method.slices.perm, method.arch)
    for k in state:
        torch.testing.assert_close(back[k], state[k])


def test_a_resumed_run_reorders_by_activations_as_the_uninterrupted_one(tiny_gen_cfg_dict, tmp_path,
                                                                      monkeypatch):
    """The calibration forward is an argument of RaFFM's strategy, not set when the first state
    is made: a run resumed from its round-1 checkpoint (which makes no initial state) re-orders
    after round 2 by activations (before, it failed there: "RaFFMStrategy.activations is unset")
    and ends with the uninterrupted run's weights within 1e-6. (Not to the bit, and why: the
    packed step 0 of a client runs under the FLOP counter only when this process has not yet
    measured the FLOP rates of that sub-model object (``fl.client._RATES``, kept per model); the
    counter's dispatch mode decomposes some ops, other kernels, other float rounding (gradients
    part by ~5e-9, Adam's first step turns that into ~5e-7). The uninterrupted run's round-2
    client reuses the sub-model built in round 1 (rates cached: not counted), the resumed run
    builds it fresh (counted). With the rates cache disabled both runs are bit-identical
    (checked). Why it came out bit-identical after this file's other tests: not looked into.)"""
    from safetensors.torch import load_file
    from test_checkpoint import reference_and_resumed

    cfg = tiny_gen_cfg_dict
    cfg["federation"].update(rounds=2)
    # clients one after another in this process, as test_checkpoint's resumes of every method
    # but fedpetuning (forked = in-process weights: test_workers.py)
    cfg["compute"] = {"workers": 1}
    cfg["method"] = {"name": "raffm", "salience": "activation", "calibration_examples": 6,
                     "reorder_every": 1, "width_steps": 4,
                     "tiers": [{"share": 0.5, "flops": 0.985}, {"share": 0.5, "flops": 1.0}],
                     "elastic_sizes": [0.985, 1.0]}
    reference, resumed = reference_and_resumed(cfg, tmp_path, monkeypatch, crash_round=2)
    ref = load_file(str(reference / "final_trainable.safetensors"))
    res = load_file(str(resumed / "final_trainable.safetensors"))
    assert ref.keys() == res.keys()
    for k in ref:
        torch.testing.assert_close(res[k], ref[k], rtol=0, atol=1e-6, msg=k)
    rounds = [json.loads(line)["round"] for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [1, 2]


def test_sandwich_masked_pass_is_the_smallest_submodel(llama):
    """The sandwich rule's second pass (the client's sub-model with the units past the smallest
    size's masked) computes exactly the smallest size's sub-model."""
    from fedslice.methods.raffm.method import _nested_masks
    from fedslice.slicing.masks import masked_inputs
    from fedslice.slicing.spec import SliceSpec
    from fedslice.slicing.surgery import extract_model
    arch = arch_for(llama)
    d = arch.all_dims(llama.config)[0]
    own = SliceSpec.leading(d, 4, 40)
    small = SliceSpec.leading(d, 2, 12)
    big, little = extract_model(llama, own, arch), extract_model(llama, small, arch)
    masks = _nested_masks(big, arch, own, small)
    assert len(masks) == 2 * d["num_layers"]
    with torch.no_grad(), masked_inputs(masks):
        masked = big(**_batch(2, 9, seed=3)).logits
    torch.testing.assert_close(masked, _logits(little), atol=1e-5, rtol=0)
    assert (_logits(big) - masked).abs().max() > 1e-3  # the hooks are gone after the block
    assert _nested_masks(big, arch, own, SliceSpec.leading(d, 2, 12, layers=[0])) == []


def test_run_with_sandwich(tiny_gen_cfg_dict):
    cfg = tiny_gen_cfg_dict
    cfg["federation"].update(num_clients=2, clients_per_round=2)
    cfg["method"] = {"name": "raffm", "sandwich": True, "width_steps": 4,
                     "tiers": [{"share": 0.5, "flops": 0.985}, {"share": 0.5, "flops": 1.0}],
                     "elastic_sizes": [0.985, 1.0]}
    cfg = validate_config(cfg)
    method, data = setup(cfg)
    state, records, summary = Simulation(cfg, method, data).run()
    small = method.smallest_spec()
    by_tier = {m["tier"]: m for m in records[0]["client_metrics"]}
    assert set(by_tier) == {0, 1} and small is not None
    # the full-size client ran two passes per step: its measured FLOPs are about twice the
    # planned full model's (the nested pass runs on the full width, masked)
    assert by_tier[1]["flops_measured"] > 1.5 * by_tier[1]["flops_analytic"]
