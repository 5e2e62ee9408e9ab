import pytest
import torch

from conftest import padded_batch
from fedslice.errors import ConfigError
from fedslice.slicing.heads import confidence, head_importance, keep_mask


def test_confidence_on_hand_built_attention():
    # 1 example, 1 layer, 2 heads, 3 tokens: [CLS] a [SEP]; [SEP] (index 2) is no valid key.
    att = torch.tensor([[[[0.1, 0.2, 0.7], [0.5, 0.3, 0.2], [0.2, 0.2, 0.6]],
                         [[0.6, 0.3, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]]]])  # (1, 2, 3, 3)
    real = torch.tensor([[1, 1, 1]])
    keys = torch.tensor([[1, 1, 0]])
    conf = confidence([att], real, keys)
    expected_h0 = (0.2 + 0.5 + 0.2) / 3
    expected_h1 = (0.6 + 0.8 + 0.3) / 3
    torch.testing.assert_close(conf, torch.tensor([[[expected_h0, expected_h1]]]))
    # a padding query is not averaged over
    conf = confidence([att], torch.tensor([[1, 1, 0]]), keys)
    torch.testing.assert_close(conf, torch.tensor([[[(0.2 + 0.5) / 2, (0.6 + 0.8) / 2]]]))


@pytest.mark.parametrize("sparsity, scope, per_layer_keep", [
    (0.5, "global", None), (0.9, "global", None), (0.5, "per_layer", 2), (0.74, "per_layer", 1)])
def test_masks_keep_exactly_round_fraction(sparsity, scope, per_layer_keep):
    imp = torch.rand(6, 4, generator=torch.Generator().manual_seed(0))
    m = keep_mask(imp, sparsity, scope=scope)
    if scope == "global":
        assert int(m.sum()) == round((1 - sparsity) * 24)
        kept_min = imp[m].min()
        assert bool((imp[~m] <= kept_min).all())  # the most important ones are kept
    else:
        assert m.sum(1).tolist() == [per_layer_keep] * 6


def test_random_and_none_masks_and_bad_sparsity():
    imp = torch.zeros(2, 4)
    g = torch.Generator().manual_seed(0)
    assert int(keep_mask(imp, 0.5, mode="random", generator=g).sum()) == 4
    assert bool(keep_mask(imp, 0.5, mode="none").all())
    with pytest.raises(ConfigError, match="keeps no head"):
        keep_mask(imp, 0.95)
    with pytest.raises(ConfigError, match=r"\[0, 1\)"):
        keep_mask(imp, 1.0)


def test_head_importance_on_tiny_model(tiny_model_dir, tiny_data_dir):
    from fedslice.config import ModelConfig
    from data_helpers import load_local_splits
    from fedslice.data import tokenize_split
    from fedslice.models import load_model

    loaded = load_model(ModelConfig(name=str(tiny_model_dir)), 2, seed=0)  # sdpa by default
    raw = load_local_splits(tiny_data_dir, text_columns=["sentence"], label_column="label")
    data = tokenize_split(raw["dev"], loaded.tokenizer, 16)
    tok = loaded.tokenizer
    imp = head_importance(loaded.model, data, [tok.sep_token_id, tok.cls_token_id])["encoder.self"]
    assert imp.shape == (2, 4) and bool(((imp > 0) & (imp <= 1)).all())
    assert loaded.model.config._attn_implementation == "sdpa"  # restored


# --------------------------------------------------------------------------------------------
# The client's sliced model
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["bert", "distilbert"])
def tiny_lora(request, tmp_path_factory):
    """A tiny LoRA model (q, k, v, o targets) with non-zero LoRA B and biases."""
    from transformers import AutoModelForSequenceClassification

    from conftest import save_tiny_model
    from fedslice.peft import LoraConfig
    from fedslice.models.arch import arch_for
    from fedslice.peft import apply_lora
    folder = save_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    model = AutoModelForSequenceClassification.from_pretrained(folder)
    arch = arch_for(model)
    model = apply_lora(model, arch, LoraConfig(r=2, alpha=4, targets=["q", "k", "v", "o"]))
    model.eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "lora_B" in n:
                p.normal_(0, 0.1)
    return model, arch


def _batch():
    return padded_batch()


def _heads_removed(model, arch, mask):
    """A copy of ``model`` in which the pruned heads contribute nothing (o's columns zeroed)."""
    import copy
    ref = copy.deepcopy(model)
    hd = arch.dims(model.config)["head_dim"]
    with torch.no_grad():
        for layer, keep in enumerate(mask):
            o = arch.part(ref, layer, "o")
            cols = (~keep).repeat_interleave(hd)
            o.base_layer.weight[:, cols] = 0
            o.lora_A["default"].weight[:, cols] = 0
    return ref


def test_sliced_model_equals_full_model_without_pruned_heads(tiny_lora):
    from fedslice.slicing.heads import mask_spec
    from fedslice.slicing.state import extract_state
    from fedslice.slicing.surgery import extract_model
    model, arch = tiny_lora
    dims = arch.dims(model.config)
    mask = torch.tensor([[False, True, False, True], [False, False, False, False]])  # layer 1: none
    spec = mask_spec(mask, dims)
    sub = extract_model(model, spec, arch)
    def hidden(m):  # the last hidden states (the tiny classifier's logits barely move)
        with torch.no_grad():
            return m(**_batch(), output_hidden_states=True).hidden_states[-1]
    got, want = hidden(sub), hidden(_heads_removed(model, arch, mask))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert not torch.allclose(got, hidden(model), atol=1e-2)  # the pruned heads did matter
    assert set(sub.state_dict()) == set(extract_state(model.state_dict(), spec, arch))
    names = [n for n, p in sub.named_parameters() if p.requires_grad]
    assert not any(f"{arch.part_name(1, p)}." in n for n in names for p in ("q", "k", "v"))
    q_b = next(n for n in names if f"{arch.part_name(0, 'q')}.lora_B" in n)
    assert dict(sub.named_parameters())[q_b].shape[0] == 2 * dims["head_dim"]
    # it trains: gradients reach the kept LoRA slices, and the FLOPs fall
    from fedslice.measure import measure_step_flops
    batch = {**_batch(), "labels": torch.tensor([0, 1, 0])}
    assert measure_step_flops(sub, batch) < 0.8 * measure_step_flops(model, batch)


# --------------------------------------------------------------------------------------------
# Eq. 8 against a numpy reference
# --------------------------------------------------------------------------------------------

def _lora_state(arch, L, H, hd, r, gen):
    d = H * hd
    p = "base_model.model."
    st = {"base_model.model.classifier.weight": torch.randn(2, d, generator=gen)}
    for l in range(L):
        for part in ("q", "v", "o"):
            st[f"{p}{arch.part_name(l, part)}.lora_A.default.weight"] = torch.randn(r, d, generator=gen)
            st[f"{p}{arch.part_name(l, part)}.lora_B.default.weight"] = torch.randn(d, r, generator=gen)
    return st


def test_eq8_against_numpy_reference():
    import numpy as np

    from fedslice.models.arch import ARCHITECTURES
    from fedslice.slicing.head_aggregate import HeadUpdate, aggregate_heads
    from fedslice.slicing.heads import mask_spec
    from fedslice.slicing.state import extract_state
    arch = ARCHITECTURES["bert"]
    L, H, hd, r = 2, 4, 2, 3
    dims = {"num_layers": L, "num_heads": H, "head_dim": hd, "hidden": H * hd, "ffn": 5}
    gen = torch.Generator().manual_seed(0)
    g = _lora_state(arch, L, H, hd, r, gen)
    # head (0, 2) is kept by nobody; client 1 keeps no head of layer 1
    kept = [torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]]), torch.tensor([[0, 1, 0, 1], [0, 0, 0, 0]]),
            torch.tensor([[1, 0, 0, 1], [1, 1, 1, 1]])]
    alphas = [torch.rand(L, H, generator=gen) * k for k in kept]
    sizes = [10, 30, 7]
    locals_ = [{k: v + torch.randn(v.shape, generator=gen) for k, v in g.items()} for _ in kept]
    updates = []
    for loc, m, a, n in zip(locals_, kept, alphas, sizes):
        sub = extract_state(loc, mask_spec(m, dims), arch)
        updates.append(HeadUpdate(sub, m.bool(), a, n))
    assert all(f"{arch.part_name(1, 'q')}." not in k for k in updates[1].arrays)  # not uploaded
    eta, eps = 0.7, 1e-3
    out = aggregate_heads(g, updates, arch, dims, mode="head_weighted", eta=eta, eps=eps)

    # reference: loops over heads and clients, in numpy
    for key, g0 in g.items():
        G = g0.numpy().astype(np.float64)
        ref = G.copy()
        deltas = [loc[key].numpy() - G for loc in locals_]
        layer = int(key.split("layer.")[1].split(".")[0]) if "layer." in key else None
        tied_rows = "lora_B" in key and ("query" in key or "value" in key)
        tied_cols = "lora_A" in key and "output.dense" in key
        if tied_rows or tied_cols:
            for h in range(H):
                sl = slice(h * hd, (h + 1) * hd)
                a = [float(alphas[c][layer, h]) if kept[c][layer, h] else 0.0 for c in range(3)]
                if sum(a) == 0:
                    continue  # nobody kept the head: unchanged
                num = sum(a[c] * (deltas[c][sl] if tied_rows else deltas[c][:, sl]) for c in range(3))
                if tied_rows:
                    ref[sl] = G[sl] + eta * num / (sum(a) + eps)
                else:
                    ref[:, sl] = G[:, sl] + eta * num / (sum(a) + eps)
        else:  # Eq. 5 over the clients that hold the tensor (client 1 lacks q/v of layer 1)
            holders = [c for c in range(3) if key in updates[c].arrays]
            n = [sizes[c] for c in holders]
            ref = G + eta * sum(nc * deltas[c] for nc, c in zip(n, holders)) / sum(n)
        np.testing.assert_allclose(out[key].numpy(), ref, rtol=1e-5, atol=1e-5, err_msg=key)
    qB0 = f"base_model.model.{arch.part_name(0, 'q')}.lora_B.default.weight"
    assert torch.equal(out[qB0][2 * hd:3 * hd], g[qB0][2 * hd:3 * hd])  # head 2 of layer 0


def test_fedavg_mode_averages_kept_heads_by_examples():
    from fedslice.models.arch import ARCHITECTURES
    from fedslice.slicing.head_aggregate import HeadUpdate, aggregate_heads
    from fedslice.slicing.heads import mask_spec
    from fedslice.slicing.state import extract_state
    arch = ARCHITECTURES["bert"]
    dims = {"num_layers": 1, "num_heads": 2, "head_dim": 1, "hidden": 2, "ffn": 3}
    g = _lora_state(arch, 1, 2, 1, 1, torch.Generator().manual_seed(0))
    key = f"base_model.model.{arch.part_name(0, 'q')}.lora_B.default.weight"
    kept = [torch.tensor([[True, False]]), torch.tensor([[True, True]])]
    locs = [{k: v + 1.0 for k, v in g.items()}, {k: v + 4.0 for k, v in g.items()}]
    ups = [HeadUpdate(extract_state(l, mask_spec(m, dims), arch), m, None, n)
           for l, m, n in zip(locs, kept, (1, 2))]
    out = aggregate_heads(g, ups, arch, dims, mode="fedavg")
    torch.testing.assert_close(out[key] - g[key], torch.tensor([[3.0], [4.0]]))  # (1+8)/3, 4/1
    with pytest.raises(ValueError, match="alpha"):
        aggregate_heads(g, ups, arch, dims, mode="head_weighted")


def test_paper_ops_is_table6_as_printed():
    from fedslice.methods.heads import paper_ops
    L, d, T, r = 2, 3, 5, 2
    qkv = T * d**3 + T * d**3 + T * d**2
    att = T**2 * d**2 + T**3 * d + T**2 * d**2 + 3 * T**3 * d
    fc = qkv
    lora = T * d**2 * r + T * r**2 * d + T * d**2 * r + 2 * T * r * d + T * r**2 * d + T * d**3
    assert paper_ops(L, d, T, rank=r)["total"] == L * (qkv + att + fc + lora)
    # head pruning scales the per-head rows of each layer by its kept fraction, not FC
    half = paper_ops(L, d, T, rank=r, kept=[0.5, 0.0])
    assert half["total"] == 0.5 * (qkv + att + lora) + L * fc
    # T5-small (Table 7) at T = 512: 3.8x fewer OPs at 90% (the paper reports 3.9x)
    ratio = paper_ops(18, 512, 512, rank=16)["total"] / paper_ops(18, 512, 512, rank=16, kept=0.1)["total"]
    assert round(ratio, 2) == 3.81
