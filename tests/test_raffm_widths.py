"""RaFFM's measured per-layer widths (``method.widths = "measured"``, issue 35 part 4): the masks
compute the sub-model exactly, the allocation is the exhaustive optimum, the candidate grid, the
option's checks and a run end to end."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from pydantic import ValidationError

from fedslice.api import setup
from fedslice.errors import ConfigError
from fedslice.experiment import validate_config
from fedslice.methods.raffm import RaFFMMethod
from fedslice.models.arch import arch_for
from fedslice.run.engine import Simulation
from fedslice.slicing.masks import masked_inputs
from fedslice.slicing.permute import permute_model
from fedslice.slicing.planner import spec_params, width_candidates
from fedslice.slicing.salience import model_salience, output_modules, salience_order
from fedslice.slicing.spec import SliceSpec
from fedslice.slicing.surgery import extract_model
from fedslice.slicing.widths import allocate, layer_masks, level_sizes, measured_width_candidates


@pytest.fixture(scope="module")
def llama(tiny_lm_dirs):
    import transformers as T
    model = T.AutoModelForCausalLM.from_pretrained(tiny_lm_dirs["llama"], attn_implementation="eager")
    model.eval()
    return model


def _logits(model):
    ids = torch.randint(5, 400, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_masks_in_salience_order_compute_the_reordered_leading_slice(llama):
    """Layer l cut to widths[l] by masks in a (non-identity) salience order gives exactly the
    logits of the leading slice of the model permuted to that order."""
    arch = arch_for(llama)
    dims = arch.all_dims(llama.config)
    perm = salience_order(model_salience(llama.state_dict(), arch, dims, "l1"), dims, arch)
    order = perm.stacks[0]
    assert not perm.is_identity
    widths = [0.25, 0.75][: dims[0]["num_layers"]]
    with masked_inputs(layer_masks(output_modules(llama, arch), dims[0], order, widths)):
        masked = _logits(llama)
    permuted = copy.deepcopy(llama)
    permute_model(permuted, perm, arch)
    sizes = [level_sizes(dims[0], w) for w in widths]
    spec = SliceSpec.leading(dims[0], [h for h, _ in sizes], [f for _, f in sizes])
    torch.testing.assert_close(masked, _logits(extract_model(permuted, spec, arch)), atol=1e-5, rtol=0)
    assert (masked - _logits(llama)).abs().max() > 1e-3  # and the hooks are gone after the block


def test_replaying_the_blocks_below_a_cut_gives_the_same_loss_without_computing_them(llama):
    """A pass cut at layer 1 with block 0 replayed from the uncut pass: the same logits, bit for
    bit, as computing block 0 again; block 0's attention does not run; outside the context the
    blocks compute again."""
    from fedslice.slicing.replay import BlockReplay

    arch = arch_for(llama)
    dims = arch.all_dims(llama.config)[0]
    blocks = arch.blocks(llama)
    replay = BlockReplay(blocks)
    calls = []
    handle = blocks[0].self_attn.register_forward_hook(lambda *a: calls.append(1))
    masks = layer_masks(output_modules(llama, arch), dims, SliceSpec.full(dims), [1.0, 0.25])
    try:
        with replay(0, 1):  # nothing recorded yet: computes
            _logits(llama)
        assert len(calls) == 1
        with replay(0, None):
            uncut = _logits(llama)
        with masked_inputs(masks):
            computed = _logits(llama)
        calls.clear()
        with masked_inputs(masks), replay(0, 1):
            replayed = _logits(llama)
        assert calls == []
        assert torch.equal(replayed, computed) and not torch.equal(replayed, uncut)
        assert torch.equal(_logits(llama), uncut) and calls == [1]
    finally:
        handle.remove()


def test_allocate_is_the_exhaustive_optimum():
    g = torch.Generator().manual_seed(0)
    cost = [3, 5, 8, 12]
    for trial in range(20):
        rise = (torch.rand(4, 4, generator=g) * torch.tensor([4.0, 2.0, 1.0, 0.0])).tolist()
        budget = 12 + trial * 2
        got = allocate(rise, cost, budget, unit=1)
        feasible = [c for c in itertools.product(range(4), repeat=4) if sum(cost[k] for k in c) <= budget]
        best = min(sum(rise[l][k] for l, k in enumerate(c)) for c in feasible)
        assert sum(cost[k] for k in got) <= budget
        assert sum(rise[l][k] for l, k in enumerate(got)) == pytest.approx(best, abs=1e-12)
    with pytest.raises(ValueError, match="below every layer"):
        allocate(rise, cost, 11, unit=1)


def test_candidates_put_the_units_where_cutting_costs(llama):
    dims = arch_for(llama).all_dims(llama.config)[0]
    levels = [0.25, 0.5, 0.75]
    # layer 0 loses nothing when cut, layer 1 a lot: layer 1 keeps units first
    rise = [[0.0, 0.0, 0.0], [9.0, 5.0, 1.0]]
    specs = measured_width_candidates(rise, dims, levels, 4)
    uniform = width_candidates(dims, 4)
    assert len(specs) == 4 and specs[-1].is_full
    params = [spec_params(s, dims) for s in specs]
    assert params == sorted(params)
    for spec, uni in zip(specs, uniform):  # within each uniform width's linear parameters
        assert spec_params(spec, dims) <= spec_params(uni, dims)
    # the half-width budget (2 x half a layer): layer 0 at a quarter, layer 1 at three quarters;
    # three quarters (2 x 0.75): layer 1 whole and the rest of the budget spent on layer 0
    assert [s.describe()["ffn"] for s in specs] == [[12, 12], [12, 36], [24, 48], [48, 48]]
    assert [s.describe()["heads"] for s in specs] == [[1, 1], [1, 3], [2, 4], [4, 4]]
    with pytest.raises(ValueError, match="rise must be"):
        measured_width_candidates(rise[:1], dims, levels, 4)


def test_option_checks():
    assert RaFFMMethod().widths == "uniform"
    with pytest.raises(ValidationError, match="elastic_depth"):
        RaFFMMethod(widths="measured", elastic_depth=True)
    with pytest.raises(ValidationError, match="sandwich"):
        RaFFMMethod(widths="measured", sandwich=True)
    with pytest.raises(ValidationError, match="at least 2"):
        RaFFMMethod(widths="measured", width_levels=1)
    assert RaFFMMethod(widths="measured", width_levels=[0.0625, 0.25, 0.5]).width_levels == [0.0625, 0.25, 0.5]
    for bad in ([], [0.5, 0.25], [0.25, 0.25], [0.0, 0.5], [0.5, 1.0]):
        with pytest.raises(ValidationError, match="ascend strictly within"):
            RaFFMMethod(widths="measured", width_levels=bad)


def test_encoder_decoder_is_refused(tiny_gen_cfg_dict, tiny_lm_dirs):
    cfg = tiny_gen_cfg_dict
    cfg["model"]["name"] = str(tiny_lm_dirs["t5"])
    cfg["method"] = {"name": "raffm", "widths": "measured"}
    with pytest.raises(ConfigError, match="widths = 'measured' is for one-stack models"):
        setup(validate_config(cfg))


@pytest.mark.parametrize("levels,count", [(4, 3), ([0.125, 0.5], 2)])
def test_run_with_measured_widths(tiny_gen_cfg_dict, levels, count):
    cfg = tiny_gen_cfg_dict
    cfg["federation"].update(num_clients=2, clients_per_round=2)
    cfg["method"] = {"name": "raffm", "widths": "measured", "salience": "activation",
                     "calibration_examples": 6, "width_steps": 4, "width_levels": levels,
                     "tiers": [{"share": 0.5, "flops": 0.985}, {"share": 0.5, "flops": 1.0}],
                     "elastic_sizes": [0.985, 1.0]}
    cfg = validate_config(cfg)
    method, data = setup(cfg)
    rise = method.layer_rise
    assert len(rise) == 2 and all(len(r) == count for r in rise)
    # cutting a layer changes the random model's loss, either way (the masks are active)
    assert all(abs(x) > 1e-6 and x == x for r in rise for x in r)
    assert method.sizes.candidates == method.width_specs(4)
    assert method.layer_rise is rise  # measured once
    state, records, summary = Simulation(cfg, method, data).run()
    assert [e["size"] for e in summary["elastic"]] == [0.985, 1.0]
    assert not any(m.get("sat_out") for r in records for m in r["client_metrics"])


def test_a_flower_client_measures_no_widths(tiny_gen_cfg_dict):
    """A ClientApp process builds the method in the client role for every message: it reads its
    sub-model from the payload and must not pay the server's layers x levels passes."""
    cfg = tiny_gen_cfg_dict
    cfg["method"] = {"name": "raffm", "widths": "measured", "width_steps": 4, "width_levels": 4,
                     "tiers": [{"share": 1.0, "flops": 1.0}], "elastic_sizes": [1.0]}
    client, _ = setup(validate_config(cfg), role="client")
    assert "layer_rise" not in vars(client)  # the cached property never ran
    assert client.width_specs(4) == width_candidates(client.all_dims, 4)
