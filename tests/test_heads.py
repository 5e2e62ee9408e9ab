import pytest
import torch

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
    from fedslice.data import load_local_splits, tokenize_split
    from fedslice.models import load_model

    loaded = load_model(ModelConfig(name=str(tiny_model_dir)), 2, seed=0)  # sdpa by default
    raw = load_local_splits(tiny_data_dir, text_columns=["sentence"], label_column="label")
    data = tokenize_split(raw["dev"], loaded.tokenizer, 16)
    tok = loaded.tokenizer
    imp = head_importance(loaded.model, data, [tok.sep_token_id, tok.cls_token_id])["encoder"]
    assert imp.shape == (2, 4) and bool(((imp > 0) & (imp <= 1)).all())
    assert loaded.model.config._attn_implementation == "sdpa"  # restored
