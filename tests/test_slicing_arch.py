"""Permutations and slices on every generative architecture of the table (issue 15, part 3):
grouped-query attention (LLaMA), SwiGLU and gated-GELU FFNs, GPT-2's fused Conv1D q|k|v, T5's
relative-position bias (one table per stack), encoder-decoder stacks with cross-attention (T5,
BART). Exactness: max |delta logits| <= 1e-5 after any valid reordering, with or without LoRA."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import GENERATIVE
from fedslice.models.arch import arch_for
from fedslice.slicing.permute import Permutation, permute_model, permute_state, unpermute_state
from fedslice.slicing.salience import model_salience, salience_order
from fedslice.slicing.keys import key_info
from fedslice.slicing.spec import ModelSlice, SliceSpec, spec_from_dict
from fedslice.slicing.state import extract_state
from fedslice.slicing.surgery import extract_model


@pytest.fixture(scope="module", params=GENERATIVE)
def lm(request, tiny_lm_dirs):
    import transformers as T
    folder = tiny_lm_dirs[request.param]
    auto = T.AutoModelForSeq2SeqLM if request.param in ("t5", "t5-gated", "bart") else T.AutoModelForCausalLM
    model = auto.from_pretrained(folder, attn_implementation="eager")
    model.eval()
    torch.manual_seed(1)
    with torch.no_grad():  # non-trivial biases and bias tables, so that misplaced ones would show
        for n, p in model.named_parameters():
            if n.endswith("bias") or "relative_attention_bias" in n:
                p.normal_(0, 0.5)
    return model


def _inputs(model):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 400, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    if model.config.is_encoder_decoder:
        batch["decoder_input_ids"] = torch.randint(5, 400, (2, 5), generator=g)
    return batch


def _logits(model):
    with torch.no_grad():
        return model(**_inputs(model)).logits


def _dims(model):
    return arch_for(model).all_dims(model.config)


def _random_perm(model, seed=0) -> Permutation:
    """A random valid permutation: groups whole under GQA, one head order per T5 stack."""
    arch = arch_for(model)
    g = torch.Generator().manual_seed(seed)
    stacks = []
    for d in _dims(model):
        H, L = d["num_heads"], d["num_layers"]
        qpg = H // d["num_kv_heads"]

        def heads():
            groups = torch.randperm(H // qpg, generator=g).tolist()
            return tuple(grp * qpg + i for grp in groups for i in torch.randperm(qpg, generator=g).tolist())
        hs = [heads()] * L if arch.head_bias else [heads() for _ in range(L)]
        cross = tuple(tuple(torch.randperm(H, generator=g).tolist()) for _ in range(L)) \
            if d["families"] > 1 else None
        neurons = tuple(tuple(torch.randperm(d["ffn"], generator=g).tolist()) for _ in range(L))
        stacks.append(SliceSpec(tuple(range(L)), tuple(hs), neurons, L, H, d["head_dim"], d["ffn"],
                                H // qpg if qpg > 1 else 0, cross))
    return Permutation(tuple(stacks))


def _with_lora(model):
    from test_slicing import with_lora
    return with_lora(model)


@pytest.mark.parametrize("lora", [False, True])
def test_permutation_is_exact_and_unpermutes(lm, lora):
    model = _with_lora(lm) if lora else copy.deepcopy(lm)
    arch = arch_for(model)
    before, state = _logits(model), {k: v.clone() for k, v in model.state_dict().items()}
    perm = _random_perm(lm, 3)
    permute_model(model, perm, arch)
    moved = sum(not torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert moved > 0
    assert (_logits(model) - before).abs().max() <= 1e-5
    back = unpermute_state(model.state_dict(), perm, arch)
    for k in state:
        assert torch.equal(back[k], state[k]), k
    assert Permutation.from_dict(perm.to_dict()) == perm
    assert perm.then(perm.inverse()).is_identity


def test_salience_order_sorts_and_is_exact(lm):
    model = copy.deepcopy(lm)
    arch, dims = arch_for(model), _dims(model)
    before = _logits(model)
    perm = salience_order(model_salience(model.state_dict(), arch, dims, "l2"), dims, arch)
    after = model_salience(permute_state(model.state_dict(), perm, arch), arch, dims, "l2")
    for d, stack in zip(dims, after):
        g = d["num_heads"] // d["num_kv_heads"]
        for s in stack:
            assert torch.all(s.neurons[:-1] >= s.neurons[1:])
            groups = s.heads.view(-1, g)
            assert torch.all(groups.sum(1)[:-1] >= groups.sum(1)[1:]) or arch.head_bias
            if not arch.head_bias:
                assert torch.all(groups[:, :-1] >= groups[:, 1:])
            if s.cross is not None:
                assert torch.all(s.cross[:-1] >= s.cross[1:])
        if arch.head_bias:  # one order per stack: the summed salience is sorted
            total = sum(s.heads for s in stack)
            assert torch.all(total[:-1] >= total[1:])
    permute_model(model, perm, arch)
    assert (_logits(model) - before).abs().max() <= 1e-5


def _spec(model, seed=0, uniform_t5=True) -> ModelSlice:
    """Arbitrary (not leading, unsorted) heads and neurons per layer of every stack; a T5 stack
    keeps the same heads in every layer unless ``uniform_t5`` is False."""
    arch = arch_for(model)
    g = torch.Generator().manual_seed(seed)
    stacks = []
    for d in _dims(model):
        H, L = d["num_heads"], d["num_layers"]
        hs = [tuple(torch.randperm(H, generator=g)[: 1 + l % 3].tolist()) for l in range(L)]
        if arch.head_bias and uniform_t5:
            hs = [hs[1]] * L
        cross = tuple(tuple(torch.randperm(H, generator=g)[:2].tolist()) for _ in range(L)) \
            if d["families"] > 1 else None
        neurons = tuple(tuple(torch.randperm(d["ffn"], generator=g)[: 5 + 7 * l].tolist()) for l in range(L))
        kv = d["num_kv_heads"]
        stacks.append(SliceSpec(tuple(range(L)), tuple(hs), neurons, L, H, d["head_dim"], d["ffn"],
                                kv if kv != H else 0, cross))
    return ModelSlice(tuple(stacks))


def _zeroed_reference(model, spec: ModelSlice):
    """The full model with every dropped head's o columns and dropped neuron's ffn_out column zeroed."""
    arch = arch_for(model)
    ref = copy.deepcopy(model)
    sd = ref.state_dict()
    with torch.no_grad():
        for key, t in sd.items():
            info = key_info(arch, key)
            if info is None or info.part not in ("o", "ffn_out") or info.axis is None:
                continue
            s = spec.stacks[info.stack]
            idx = s.index(info.layer, info.kind, info.family)
            drop = torch.ones(t.shape[info.axis], dtype=torch.bool)
            drop[idx] = False
            t.index_fill_(info.axis, torch.nonzero(drop).flatten(), 0.0)
    return ref


@pytest.mark.parametrize("lora", [False, True])
def test_submodel_equals_full_model_with_dropped_units_zeroed(lm, lora):
    model = _with_lora(lm) if lora else lm
    arch = arch_for(model)
    spec = _spec(lm, 2)
    sub = extract_model(model, spec, arch)
    assert (_logits(sub) - _logits(_zeroed_reference(model, spec))).abs().max() <= 1e-5
    sub_state = extract_state(model.state_dict(), spec, arch)
    assert {k: v.shape for k, v in sub.state_dict().items()} == {k: v.shape for k, v in sub_state.items()}
    for k, v in sub.state_dict().items():
        assert torch.equal(v, sub_state[k]), k
    assert sum(p.numel() for p in sub.parameters()) < sum(p.numel() for p in model.parameters())
    assert spec_from_dict(spec.to_dict()) == spec


def test_grouped_query_submodels(tiny_lm_dirs):
    """LLaMA with 4 query heads in 2 key/value groups: uneven groups (3 + 1 query heads), one whole
    group, and query heads listed out of group order all equal the zeroed full model."""
    import transformers as T
    model = T.AutoModelForCausalLM.from_pretrained(tiny_lm_dirs["llama"], attn_implementation="eager").eval()
    arch = arch_for(model)
    d = _dims(model)[0]
    for heads in ((0, 1, 3), (2, 3), (3, 0), (1,)):
        spec = ModelSlice((SliceSpec.leading(d, 4, d["ffn"])._replace_heads(heads),))
        sub = extract_model(model, spec, arch)
        assert (_logits(sub) - _logits(_zeroed_reference(model, spec))).abs().max() <= 1e-5, heads
        kv = spec.stacks[0].kv_heads(0)
        k_rows = arch.module_names(model, ["k"])[0]
        assert dict(sub.named_parameters())[f"{k_rows}.weight"].shape[0] == len(kv) * d["head_dim"]


@pytest.mark.parametrize("lora", [False, True])
def test_t5_layers_may_keep_different_heads(tiny_lm_dirs, lora):
    """T5's bias table stays whole when layers keep different heads: each layer reads its own
    columns of the stack's bias. Layer 0 (the table's owner) and one cross-attention keep no head;
    the sub-model equals the zeroed full model, in one pass and in cached greedy generation."""
    import transformers as T
    model = T.AutoModelForSeq2SeqLM.from_pretrained(tiny_lm_dirs["t5"], attn_implementation="eager").eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "relative_attention_bias" in n:
                p.normal_(0, 0.5)
    model = _with_lora(model) if lora else model
    arch = arch_for(model)
    spec = _spec(model, 3, uniform_t5=False)
    enc, dec = spec.stacks
    enc = SliceSpec(enc.layers, ((),) + enc.heads[1:], *astuple_rest(enc))
    dec = SliceSpec(dec.layers, dec.heads, dec.neurons, dec.num_layers, dec.num_heads, dec.head_dim,
                    dec.ffn, dec.num_kv_heads, ((),) + dec.cross[1:])
    spec = ModelSlice((enc, dec))
    assert not enc.same_heads and not dec.same_heads
    sub = extract_model(model, spec, arch)
    ref = _zeroed_reference(model, spec)
    assert (_logits(sub) - _logits(ref)).abs().max() <= 1e-5
    table = "relative_attention_bias.weight"
    subs, full = sub.state_dict(), extract_state(model.state_dict(), spec, arch)
    assert {k: v.shape for k, v in subs.items()} == {k: v.shape for k, v in full.items()}
    assert all(v.shape[1] == model.config.num_heads for k, v in subs.items() if k.endswith(table))
    if not lora:
        ids = _inputs(model)["input_ids"][:1]
        kw = dict(max_new_tokens=6, do_sample=False, num_beams=1)
        with torch.no_grad():
            assert torch.equal(sub.generate(input_ids=ids, **kw), ref.generate(input_ids=ids, **kw))


def astuple_rest(s: SliceSpec):
    return (s.neurons, s.num_layers, s.num_heads, s.head_dim, s.ffn, s.num_kv_heads, s.cross)


def test_extract_then_scatter_is_identity(lm):
    from test_slicing import check_extract_scatter
    arch = arch_for(lm)
    state = {k: v.detach() for k, v in lm.named_parameters()}
    for spec in (_spec(lm, 4), ModelSlice.leading(_dims(lm), 0.5), ModelSlice.full(_dims(lm))):
        check_extract_scatter(state, spec, arch)
