"""The table entries of ViT, DeiT and DINOv2 (issue 26, part 2): permutations and slices are exact
on images, DINOv2's layer scale enters salience, and head importance leaves the class (and
distillation) token out of the keys."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import VISION
from test_slicing_arch import _random_perm, _spec, _zeroed_reference
from fedslice.models.arch import arch_for
from fedslice.models.loading import adapt_image_model
from fedslice.slicing.heads import confidence, head_importance
from fedslice.slicing.permute import permute_model, unpermute_state
from fedslice.slicing.salience import model_salience, salience, scale_tensors
from fedslice.slicing.state import extract_state
from fedslice.slicing.surgery import extract_model


def _vision(tiny_vision_dirs, arch: str):
    import transformers as T
    cls = {"vit": T.ViTForImageClassification, "deit": T.DeiTForImageClassification,
           "dinov2": T.Dinov2ForImageClassification}[arch]
    model = cls.from_pretrained(tiny_vision_dirs[arch], attn_implementation="eager").eval()
    torch.manual_seed(1)
    with torch.no_grad():  # non-trivial biases, so that misplaced ones would show
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.5)
    return adapt_image_model(model, arch_for(model))


def _pixels(size: int = 16, n: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"pixel_values": torch.randn(n, 3, size, size, generator=g)}


def _logits(model, size: int = 16):
    with torch.no_grad():
        return model(**_pixels(size)).logits


@pytest.fixture(scope="module", params=VISION)
def vision(request, tiny_vision_dirs):
    return _vision(tiny_vision_dirs, request.param)


@pytest.mark.parametrize("lora", [False, True])
def test_permutation_is_exact_on_images(vision, lora):
    from test_slicing import with_lora
    model = with_lora(vision) if lora else copy.deepcopy(vision)
    arch = arch_for(model)
    before, state = _logits(model), {k: v.clone() for k, v in model.state_dict().items()}
    perm = _random_perm(vision, 3)
    permute_model(model, perm, arch)
    assert sum(not torch.equal(v, state[k]) for k, v in model.state_dict().items()) > 0
    assert (_logits(model) - before).abs().max() <= 1e-5
    back = unpermute_state(model.state_dict(), perm, arch)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_submodel_equals_full_model_with_dropped_units_zeroed(vision):
    arch = arch_for(vision)
    spec = _spec(vision, 2)
    sub = extract_model(vision, spec, arch)
    assert (_logits(sub) - _logits(_zeroed_reference(vision, spec))).abs().max() <= 1e-5
    sub_state = extract_state(vision.state_dict(), spec, arch)
    assert {k: v.shape for k, v in sub.state_dict().items()} == {k: v.shape for k, v in sub_state.items()}
    # at another image size too (the position table interpolated, 9 patches)
    assert (_logits(sub, 24) - _logits(_zeroed_reference(vision, spec), 24)).abs().max() <= 1e-5


def test_dinov2_layer_scale_enters_salience(tiny_vision_dirs):
    """Salience scores diag(lambda) W_o and diag(lambda) W_out: the same as the salience of the
    equivalent model with the scales folded into those projections (and scales 1), not the
    salience of the raw weights."""
    model = _vision(tiny_vision_dirs, "dinov2")
    arch, dims = arch_for(model), arch_for(model).all_dims(model.config)
    scales = scale_tensors(model, arch)
    assert len(scales) == 2 * dims[0]["num_layers"] and all("lambda1" in k for k in scales)
    folded = copy.deepcopy(model)
    with torch.no_grad():
        for layer in arch.blocks(folded):
            for lam, lin in ((layer.layer_scale1.lambda1, layer.attention.o_proj),
                             (layer.layer_scale2.lambda1, layer.mlp.fc2)):
                lin.weight.mul_(lam[:, None])
                lin.bias.mul_(lam)
                lam.fill_(1.0)
    assert (_logits(folded) - _logits(model)).abs().max() <= 1e-5  # the same function
    for norm in ("l1", "l2"):
        got = salience(model.state_dict(), arch, dims[0], norm)
        want = salience(folded.state_dict(), arch, dims[0], norm)
        raw = salience({k: v for k, v in model.state_dict().items() if k not in scales}, arch, dims[0], norm)
        for g, w, r in zip(got, want, raw):
            torch.testing.assert_close(g.heads, w.heads)
            torch.testing.assert_close(g.neurons, w.neurons)
            assert not torch.allclose(g.neurons, r.neurons)  # the scales matter
    # raffm's strategy reads the frozen scales beside a state that lacks them (LoRA tuning)
    full = model_salience({**scales, **{k: v for k, v in model.state_dict().items() if k not in scales}},
                          arch, dims, "l1")
    torch.testing.assert_close(full[0][1].neurons, salience(model.state_dict(), arch, dims[0])[1].neurons)


@pytest.mark.parametrize("arch_name", VISION)
def test_head_importance_leaves_prefix_tokens_out_of_the_keys(arch_name, tiny_vision_dirs):
    """Eq. 6 on images: every token is a query (the class token too); keys are the patches only,
    not the class token (nor DeiT's distillation token)."""
    from fedslice.data.images import ImageSplit
    model = _vision(tiny_vision_dirs, arch_name)
    arch = arch_for(model)
    prefix = arch.image.prefix_tokens
    assert prefix == (2 if arch_name == "deit" else 1)
    pixels = torch.randint(0, 256, (4, 3, 16, 16), generator=torch.Generator().manual_seed(0),
                           dtype=torch.uint8)
    split = ImageSplit(pixels, torch.arange(4), torch.zeros(4, dtype=torch.int64), 1 / 64,
                       torch.full((3, 1, 1), 2.0), torch.ones(3, 1, 1), 4 + prefix)
    got = head_importance(model, split, [], batch_size=2)["encoder.self"]  # (L, H)
    with torch.no_grad():
        atts = model(pixel_values=pixels.float() / 64 - 2.0, output_attentions=True).attentions
    T = 4 + prefix
    keys = torch.ones(4, T)
    keys[:, :prefix] = 0
    want = confidence(atts, torch.ones(4, T), keys).mean(0)
    with_cls = confidence(atts, torch.ones(4, T), torch.ones(4, T)).mean(0)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, with_cls)
