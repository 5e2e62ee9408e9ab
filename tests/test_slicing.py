"""Salience, permutations, slice specs, extraction and scatter on tiny BERT / DistilBERT / RoBERTa."""

import copy

import pytest
import torch

from conftest import padded_batch, save_tiny_model
from fedslice.models.arch import arch_for
from fedslice.slicing.aggregate import aggregate_deltas
from fedslice.slicing.permute import Permutation, permute_model, permute_state, unpermute_state
from fedslice.slicing.salience import salience, salience_order
from fedslice.slicing.keys import key_info
from fedslice.slicing.spec import SliceSpec
from fedslice.slicing.state import extract_state, scatter
from fedslice.slicing.surgery import extract_model


@pytest.fixture(scope="module", params=["bert", "distilbert", "roberta"])
def tiny(request, tmp_path_factory):
    from transformers import AutoModelForSequenceClassification
    folder = save_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    model = AutoModelForSequenceClassification.from_pretrained(folder, attn_implementation="eager")
    model.eval()
    torch.manual_seed(1)
    with torch.no_grad():  # non-trivial biases, so that dropped/permuted biases would show
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.1)
    return model


def _batch(seed=0, vocab=1000):
    return padded_batch(seed, vocab, length=11, pad_from=7)


def _logits(model):
    with torch.no_grad():
        return model(**_batch()).logits


def _random_perm(model, seed=0):
    arch = arch_for(model)
    d = arch.dims(model.config)
    g = torch.Generator().manual_seed(seed)
    return Permutation.from_orders(
        [torch.randperm(d["num_heads"], generator=g).tolist() for _ in range(d["num_layers"])],
        [torch.randperm(d["ffn"], generator=g).tolist() for _ in range(d["num_layers"])], d["head_dim"])


def test_permutation_preserves_outputs_and_unpermutes(tiny):
    model = copy.deepcopy(tiny)
    arch = arch_for(model)
    before, state = _logits(model), {k: v.clone() for k, v in model.state_dict().items()}
    perm = _random_perm(model)
    permute_model(model, perm, arch)
    moved = arch.part(model, 0, "q").weight
    assert not torch.equal(moved, state[f"{arch.part_name(0, 'q')}.weight"])
    torch.testing.assert_close(_logits(model), before, atol=1e-5, rtol=0)
    back = unpermute_state(model.state_dict(), perm, arch)
    for k in state:
        assert torch.equal(back[k], state[k]), k


def test_salience_order_preserves_outputs_and_sorts(tiny):
    model = copy.deepcopy(tiny)
    arch, dims = arch_for(model), arch_for(model).dims(model.config)
    before = _logits(model)
    for norm in ("l1", "l2"):
        perm = salience_order(salience(model.state_dict(), arch, dims, norm), dims["head_dim"])
        after = salience(permute_state(model.state_dict(), perm, arch), arch, dims, norm)
        for s in after:
            assert torch.all(s.heads[:-1] >= s.heads[1:]) and torch.all(s.neurons[:-1] >= s.neurons[1:])
    permute_model(model, perm, arch)
    torch.testing.assert_close(_logits(model), before, atol=1e-5, rtol=0)


def test_salience_matches_definition(tiny):
    arch, dims = arch_for(tiny), arch_for(tiny).dims(tiny.config)
    hd = dims["head_dim"]
    sal = salience(tiny.state_dict(), arch, dims, "l1")
    q, k, v, o = (arch.part(tiny, 1, p).weight for p in ("q", "k", "v", "o"))
    h = 2
    rows = slice(h * hd, (h + 1) * hd)
    ref = q[rows].abs().sum() + k[rows].abs().sum() + v[rows].abs().sum() + o[:, rows].abs().sum()
    torch.testing.assert_close(sal[1].heads[h], ref)
    w1, w2 = arch.part(tiny, 0, "ffn_in").weight, arch.part(tiny, 0, "ffn_out").weight
    sal2 = salience(tiny.state_dict(), arch, dims, "l2")
    torch.testing.assert_close(sal2[0].neurons[5], torch.sqrt(w1[5].square().sum() + w2[:, 5].square().sum()))


def test_permutation_compose_and_inverse(tiny):
    a, b = _random_perm(tiny, 0), _random_perm(tiny, 1)
    arch = arch_for(tiny)
    sd = tiny.state_dict()
    two = permute_state(permute_state(sd, a, arch), b, arch)
    one = permute_state(sd, a.then(b), arch)
    for k in sd:
        assert torch.equal(two[k], one[k]), k
    assert a.then(a.inverse()).is_identity
    assert Permutation.from_dict(a.to_dict()) == a


def _spec(model, seed=0, layers=None):
    """Arbitrary (not leading, unsorted) heads and neurons per layer."""
    arch = arch_for(model)
    d = arch.dims(model.config)
    g = torch.Generator().manual_seed(seed)
    layers = list(range(d["num_layers"])) if layers is None else layers
    heads = [torch.randperm(d["num_heads"], generator=g)[: 1 + l % 3].tolist() for l in layers]
    neurons = [torch.randperm(d["ffn"], generator=g)[: 10 + 7 * l].tolist() for l in layers]
    return SliceSpec(tuple(layers), tuple(map(tuple, heads)), tuple(map(tuple, neurons)),
                     d["num_layers"], d["num_heads"], d["head_dim"], d["ffn"])


def test_submodel_equals_full_model_with_dropped_units_zeroed(tiny):
    arch = arch_for(tiny)
    spec = _spec(tiny)
    sub = extract_model(tiny, spec, arch)
    ref = copy.deepcopy(tiny)
    with torch.no_grad():
        for j, l in enumerate(spec.layers):
            drop_cols = torch.ones(arch.part(ref, l, "o").weight.shape[1], dtype=torch.bool)
            drop_cols[spec.index(j, "heads")] = False
            arch.part(ref, l, "o").weight[:, drop_cols] = 0
            drop_f = torch.ones(spec.ffn, dtype=torch.bool)
            drop_f[spec.index(j, "ffn")] = False
            arch.part(ref, l, "ffn_out").weight[:, drop_f] = 0
    torch.testing.assert_close(_logits(sub), _logits(ref), atol=1e-5, rtol=0)
    # names and shapes of the sub-model are those of extract_state; the full model is untouched
    sub_state = extract_state(tiny.state_dict(), spec, arch)
    assert {k: v.shape for k, v in sub.state_dict().items()} == {k: v.shape for k, v in sub_state.items()}
    for k, v in sub.state_dict().items():
        assert torch.equal(v, sub_state[k]), k
    attn = arch.attention(sub, 1)
    assert getattr(attn, arch.heads_attr) == len(spec.heads[1])
    assert getattr(arch.attention(tiny, 1), arch.heads_attr) == spec.num_heads
    # unsliced tensors are shared with the full model, not copied
    emb = dict(tiny.named_parameters())
    for n, p in sub.named_parameters():
        if key_info(arch, n) is None or key_info(arch, n).axis is None:
            assert p.data_ptr() == emb[n].data_ptr(), n


def test_depth_spec_keeps_and_renumbers_layers(tiny):
    arch = arch_for(tiny)
    spec = SliceSpec.leading(arch.dims(tiny.config), 2, 20, layers=[1])
    sub = extract_model(tiny, spec, arch)
    assert len(arch.blocks(sub)) == 1 and len(arch.blocks(tiny)) == 2
    ref = copy.deepcopy(tiny)
    blocks = arch.blocks(ref)
    del blocks[0]
    ref_spec = SliceSpec.leading(arch.dims(tiny.config), 2, 20, layers=[0])
    torch.testing.assert_close(_logits(sub), _logits(extract_model(ref, ref_spec, arch)), atol=1e-6, rtol=0)
    assert set(extract_state(tiny.state_dict(), spec, arch)) == set(sub.state_dict())


def test_extract_then_scatter_is_identity(tiny):
    arch = arch_for(tiny)
    state = dict(tiny.named_parameters())
    state = {k: v.detach() for k, v in state.items()}
    for spec in (_spec(tiny, 3), _spec(tiny, 4, layers=[1]), SliceSpec.full(arch.dims(tiny.config))):
        check_extract_scatter(state, spec, arch)


def check_extract_scatter(state, spec, arch) -> None:
    """Scatter inverts extract on the held elements (zeros elsewhere, masks count exactly the
    sent elements) and a zero update weighted by the masks leaves every element unchanged."""
    shapes = {k: v.shape for k, v in state.items()}
    sub = extract_state(state, spec, arch)
    full, masks = scatter(sub, spec, arch, shapes)
    for k, t in full.items():
        m = masks[k].expand_as(t).bool()
        assert torch.equal(t[m], state[k][m]) and torch.all(t[~m] == 0), k
    zero = {k: torch.zeros_like(t) for k, t in full.items()}
    out = aggregate_deltas(state, [zero], [{k: 5.0 * m for k, m in masks.items()}])
    for k in state:
        assert torch.equal(out[k], state[k]), k
    held = sum(int(masks[k].expand(shapes[k]).sum()) for k in masks)
    assert held == sum(t.numel() for t in sub.values())


def with_lora(model, targets=("q", "k", "v", "o", "ffn_in", "ffn_out")):
    """A copy of ``model`` with LoRA r=2 on ``targets`` and non-zero B (so LoRA changes outputs)."""
    from fedslice.peft import LoraConfig
    from fedslice.peft import apply_lora
    out = apply_lora(copy.deepcopy(model), arch_for(model), LoraConfig(r=2, alpha=4, targets=list(targets)))
    out.eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in out.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return out


def test_lora_model_permutes_and_slices(tiny):
    arch = arch_for(tiny)
    model = with_lora(tiny, ["q", "o", "ffn_in", "ffn_out"])
    before = _logits(model)
    perm = _random_perm(tiny, 5)
    permute_model(model, perm, arch)
    torch.testing.assert_close(_logits(model), before, atol=1e-5, rtol=0)
    spec = _spec(tiny, 6)
    sub = extract_model(model, spec, arch)
    sub_state = extract_state(model.state_dict(), spec, arch)
    for k, v in sub.state_dict().items():
        assert torch.equal(v, sub_state[k]), k
    # the sub-model equals the full LoRA model with the dropped units' o / ffn_out columns zeroed
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for j, l in enumerate(spec.layers):
            for part, kind in (("o", "heads"), ("ffn_out", "ffn")):
                layer = arch.part(ref, l, part)
                keep = torch.zeros(layer.base_layer.weight.shape[1], dtype=torch.bool)
                keep[spec.index(j, kind)] = True
                layer.base_layer.weight[:, ~keep] = 0
                layer.lora_A["default"].weight[:, ~keep] = 0
    torch.testing.assert_close(_logits(sub), _logits(ref), atol=1e-5, rtol=0)
    trainable = [n for n, p in sub.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n or "classifier" in n for n in trainable)
