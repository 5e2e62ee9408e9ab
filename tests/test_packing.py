"""Packed batches (examples end to end in rows, block-diagonal attention) give the padded batch's
loss and gradients, to 1e-5 in fp32, for every family that packs."""

from __future__ import annotations

import pytest
import torch

from fedslice.data.batching import Rows, TokenizedSplit
from fedslice.data.packing import block_mask, first_fit, pack_layout, packs
from fedslice.data.pairs import PairSplit
from fedslice.fl.client import train_local
from fedslice.tasks.classification import packed_classifier_loss
from fedslice.tasks.lm import lm_loss

from conftest import tiny_lm_config

TOL = 1e-5


def _lengths(n: int, seed: int, lo: int = 2, hi: int = 17) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, (n,), generator=g).tolist()


def tokenized(n: int, vocab: int, seed: int = 0, types: bool = True) -> TokenizedSplit:
    """``n`` random examples of 2-16 tokens (a first [CLS]-like token 101), labels 0/1."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(_lengths(n, seed))
    flat = torch.randint(5, vocab, (int(lens.sum()),), generator=g)
    flat[torch.cumsum(lens, 0) - lens] = 101
    type_ids = (torch.rand(int(lens.sum()), generator=g) < 0.3).long()
    return TokenizedSplit(Rows.from_lengths(flat, lens),
                          Rows.from_lengths(type_ids, lens) if types else None,
                          torch.randint(0, 2, (n,), generator=g), pad_token_id=0)


def pairs(n: int, vocab: int, pad: int, seed: int = 0) -> PairSplit:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, vocab, (k,), generator=g) for k in _lengths(n, seed, 1, 12)]
    targets = [torch.randint(5, vocab, (k,), generator=g) for k in _lengths(n, seed + 1, 1, 8)]
    return PairSplit(prompts, targets, torch.zeros(n, dtype=torch.int64), torch.arange(n),
                     [""] * n, pad, "causal")


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def loss_and_grads(model, loss_fn, batch):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    return loss.detach(), _grads(model)


def assert_same(a, b):
    (la, ga), (lb, gb) = a, b
    assert abs(float(la) - float(lb)) < TOL, (float(la), float(lb))
    assert ga.keys() == gb.keys() and ga
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], atol=TOL, rtol=0, msg=n)


# -- layout ---------------------------------------------------------------------------------------
def test_first_fit_places_every_example_without_overlap():
    lens = _lengths(40, 3)
    place = first_fit(lens, max(lens))
    used = {}
    for (row, off), n in zip(place, lens):
        assert off + n <= max(lens)
        for t in range(off, off + n):
            assert (row, t) not in used
            used[row, t] = 1
    dest, starts, rows, cap = pack_layout(torch.tensor(lens))
    assert dest.unique().numel() == sum(lens) and rows * cap >= sum(lens)
    assert rows * cap - sum(lens) < 0.1 * sum(lens)  # first fit by decreasing length: little padding


def test_block_mask_keeps_examples_apart():
    split = tokenized(6, 50)
    b = split.collate_packed(range(6))
    m = block_mask(b["attention_mask"], b["position_ids"], causal=False)[:, 0]  # (R, C, C)
    seg = torch.full(b["input_ids"].shape, -1)
    flat = seg.view(-1)
    for i, (s, n) in enumerate(zip(b["example_starts"].tolist(), split.lengths.tolist())):
        flat[s:s + n] = i
    real = seg >= 0
    same = (seg[:, :, None] == seg[:, None, :]) & real[:, :, None]
    assert torch.equal(m & real[:, :, None], same)
    mc = block_mask(b["attention_mask"], b["position_ids"], causal=True)[:, 0]
    assert torch.equal(mc, m & torch.ones_like(m[0]).tril())


def test_packed_batch_holds_the_padded_batch_tokens():
    split = tokenized(9, 50)
    padded, packed = split.collate(range(9)), split.collate_packed(range(9))
    assert int(packed["attention_mask"].sum()) == int(padded["attention_mask"].sum())
    assert packed["input_ids"].numel() <= padded["input_ids"].numel()
    for i, s in enumerate(packed["example_starts"].tolist()):
        n = int(split.lengths[i])
        assert torch.equal(packed["input_ids"].view(-1)[s:s + n], split.input_ids[i])
        assert torch.equal(packed["position_ids"].view(-1)[s:s + n], torch.arange(n))


def test_which_families_pack():
    assert packs("bert", "sequence_classification") and packs("llama", "causal_lm")
    assert not packs("llama", "sequence_classification")  # score head: last non-pad token per row
    assert not packs("t5", "seq2seq_lm") and not packs("vit", "image_classification")
    assert not packs("bert", "sequence_classification", adapter_in_modules=False)  # prompt tuning


# -- equivalence ----------------------------------------------------------------------------------
def _classifier(model_type: str, attn: str, tmp_path_factory):
    from conftest import save_tiny_model
    from transformers import AutoModelForSequenceClassification

    folder = save_tiny_model(tmp_path_factory.mktemp(f"pack-{model_type}"), model_type)
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_pretrained(folder, attn_implementation=attn).eval()


def _padded_loss(model, batch):
    return model(**batch).loss


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", ["bert", "roberta", "distilbert"])
def test_packed_classifier_loss_and_gradients_match_padded(model_type, attn, tmp_path_factory):
    model = _classifier(model_type, attn, tmp_path_factory)
    split = tokenized(12, model.config.vocab_size, types=model_type == "bert")
    if model_type == "roberta":  # its pad id is 1; a pad token inside an example would not matter
        split.pad_token_id = model.config.pad_token_id
    idx = list(range(12))
    padded = loss_and_grads(model, _padded_loss, split.collate(idx))
    packed = loss_and_grads(model, lambda m, b: packed_classifier_loss(m, b, model_type),
                            split.collate_packed(idx))
    assert_same(padded, packed)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_packed_causal_lm_loss_and_gradients_match_padded(model_type, attn):
    from transformers import AutoModelForCausalLM

    config = tiny_lm_config(model_type, 300, pad=0, eos=2)
    config._attn_implementation = attn
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    split = pairs(10, 300, pad=0)
    idx = list(range(10))
    loss = lambda m, b: lm_loss(m, b, "causal")  # noqa: E731
    assert_same(loss_and_grads(model, loss, split.collate(idx)),
                loss_and_grads(model, loss, split.collate_packed(idx)))


def test_local_training_packed_matches_padded(tmp_path_factory):
    """Eight AdamW steps (no dropout) on packed batches end where the padded ones do."""
    split = tokenized(40, 1000)
    cfg = {"lr": 1e-3, "batch_size": 8, "local_steps": 8, "max_grad_norm": 1.0,
           "group_by_length": True}
    out = {}
    for pack in (False, True):
        model = _classifier("bert", "sdpa", tmp_path_factory)
        model.train = lambda mode=True: model  # keep dropout off (eval mode) while training
        # not the keys' biases: softmax ignores them, their gradient is rounding noise, which
        # AdamW's normalisation turns into full-size steps of either sign
        params = {n: p for n, p in model.named_parameters() if not n.endswith("key.bias")}
        loss_fn = (lambda m, b: packed_classifier_loss(m, b, "bert")) if pack else _padded_loss
        res = train_local(model, params, split, cfg, seed=3, loss_fn=loss_fn, pack=pack)
        out[pack] = (res, {n: p.detach().clone() for n, p in params.items()})
    (r0, w0), (r1, w1) = out[False], out[True]
    assert abs(r0.loss - r1.loss) < TOL and r0.examples == r1.examples
    assert r1.tokens_real == r0.tokens_real and r1.tokens < r0.tokens
    for n in w0:
        torch.testing.assert_close(w0[n], w1[n], atol=TOL, rtol=0, msg=n)


# -- measured FLOPs -------------------------------------------------------------------------------
def _counted_every_step(model, loss_fn, split, cfg, seed):
    """The FLOPs of every step of ``train_local``'s batches, each counted (what the first step's
    count is extrapolated to)."""
    from fedslice.fl.client import local_batches
    from fedslice.measure import count_flops

    total, shapes = 0, set()
    model.train()  # as train_local: dropout on (torch's CPU attention then takes its math path)
    for batch in local_batches(split, cfg, torch.Generator().manual_seed(seed), pack=True):
        with count_flops() as fc:
            loss_fn(model, batch).backward()
        model.zero_grad(set_to_none=True)
        total += fc.total
        shapes.add(tuple(batch["input_ids"].shape))
    return total, shapes


def _lora(model, targets):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))


@pytest.mark.parametrize("model_type", ["bert", "roberta", "distilbert", "llama", "gpt2"])
def test_packed_measured_flops_extrapolate_exactly(model_type, tmp_path_factory):
    """The first step's count, extrapolated (attention by rows x row length², the head by head
    positions, the rest by positions), is every step's count summed, to 1e-6, on packed rows of
    differing shapes (LoRA, the classifier or LM head)."""
    cfg = {"lr": 1e-3, "batch_size": 8, "local_steps": 6, "max_grad_norm": 1.0,
           "group_by_length": False}
    if model_type in ("llama", "gpt2"):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_lm_config(model_type, 300, pad=0, eos=2))
        model = _lora(model, ["q_proj", "v_proj"] if model_type == "llama" else ["c_attn"])
        split = pairs(30, 300, pad=0)
        loss_fn = lambda m, b: lm_loss(m, b, "causal")  # noqa: E731
    else:
        model = _classifier(model_type, "sdpa", tmp_path_factory)
        split = tokenized(40, model.config.vocab_size, types=model_type == "bert")
        if model_type == "roberta":
            split.pad_token_id = model.config.pad_token_id
        model = _lora(model, ["q_lin", "v_lin"] if model_type == "distilbert" else ["query", "value"])
        loss_fn = lambda m, b: packed_classifier_loss(m, b, model_type)  # noqa: E731
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    want, shapes = _counted_every_step(model, loss_fn, split, cfg, seed=3)
    assert len(shapes) > 1  # rows of other lengths than the first step's
    res = train_local(model, params, split, cfg, seed=3, loss_fn=loss_fn, pack=True)
    assert res.flops_measured == pytest.approx(want, rel=1e-6)


def test_later_clients_reuse_the_packed_rates_and_a_changed_structure_recounts(monkeypatch):
    """A second client of the same shared model counts no FLOPs (the first's per-unit rates hold
    for its packed batches: its figure is still every step's count summed, to 1e-6); a model
    whose trainable set changed, or another loss, is counted again."""
    import fedslice.fl.client as client
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = _lora(AutoModelForCausalLM.from_config(tiny_lm_config("llama", 300, pad=0, eos=2)),
                  ["q_proj", "v_proj"])
    loss_fn = lambda m, b: lm_loss(m, b, "causal")  # noqa: E731
    cfg = {"lr": 1e-3, "batch_size": 8, "local_steps": 4, "max_grad_norm": 1.0,
           "group_by_length": False}
    counted = []
    real = client.count_flops

    def recording(enabled=True, head=()):
        counted.append(enabled)
        return real(enabled=enabled, head=head)

    monkeypatch.setattr(client, "count_flops", recording)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    train_local(model, params, pairs(30, 300, pad=0), cfg, seed=3, loss_fn=loss_fn, pack=True)
    assert counted == [True, False, False, False]
    counted.clear()
    other = pairs(24, 300, pad=0, seed=7)
    want, _ = _counted_every_step(model, loss_fn, other, cfg, seed=5)
    res = train_local(model, params, other, cfg, seed=5, loss_fn=loss_fn, pack=True)
    assert not any(counted) and res.flops_measured == pytest.approx(want, rel=1e-6)
    for changed in ("trainable", "loss"):
        counted.clear()
        if changed == "trainable":
            next(p for n, p in model.named_parameters() if "embed" in n).requires_grad_(True)
        else:
            loss_fn = lambda m, b: lm_loss(m, b, "causal")  # noqa: E731
        train_local(model, params, other, cfg, seed=5, loss_fn=loss_fn, pack=True)
        assert counted[0] is True, changed


# -- the packed step's attention and dropout ------------------------------------------------------
def test_uniform_dropout_keeps_the_distribution_and_its_gradient():
    from fedslice.data.packing import uniform_dropout

    torch.manual_seed(0)
    x = torch.ones(200_000, requires_grad=True)
    y = uniform_dropout(x, 0.1)
    kept = y != 0
    assert abs(float(kept.float().mean()) - 0.9) < 0.005  # keep probability 1 - p
    assert torch.allclose(y[kept], torch.full_like(y[kept], 1 / 0.9))  # scaled by 1 / (1 - p)
    y.sum().backward()
    assert torch.equal(x.grad, y.detach())  # d(x * mask) / dx = mask
    assert uniform_dropout(x, 0.1, training=False) is x and uniform_dropout(x, 0.0) is x


def test_packed_training_runs_eager_attention_with_uniform_masks_and_restores(tmp_path_factory):
    import torch.nn.functional as F

    from fedslice.data.packing import packed_training, uniform_dropout

    model = _classifier("bert", "sdpa", tmp_path_factory)
    assert model.config.attention_probs_dropout_prob > 0
    real = F.dropout
    with packed_training(_lora(model, ["query", "value"])):
        assert model.config._attn_implementation == "eager" and F.dropout is uniform_dropout
    assert model.config._attn_implementation == "sdpa" and F.dropout is real
    model.config.attention_probs_dropout_prob = 0.0  # no attention dropout: sdpa as it is
    with packed_training(model):
        assert model.config._attn_implementation == "sdpa" and F.dropout is real


class _HostReads:
    """Records, by dispatch, the ops that on a GPU copy host data to the device or read a device
    value back (each a host sync): a tensor made from Python data, ``.item()``, ``nonzero``."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        seen = self.seen = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if any(k in str(func) for k in ("lift_fresh", "_local_scalar_dense", "nonzero")):
                    seen.append(str(func))
                return func(*args, **(kwargs or {}))

        self.mode = Mode()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", ["bert", "roberta", "distilbert"])
def test_packed_classifier_loss_makes_no_tensor_from_host_data(model_type, attn, tmp_path_factory):
    """The packed batch is built on the host; its loss (which moves it to the model's device)
    then makes no tensor from Python data and reads no value back: on a GPU each would be a host
    sync per step (the mask's ``position_ids.new_tensor(0)`` was, found by the GPU check)."""
    model = _classifier(model_type, attn, tmp_path_factory)
    split = tokenized(12, model.config.vocab_size, types=model_type == "bert")
    if model_type == "roberta":
        split.pad_token_id = model.config.pad_token_id
    batch = split.collate_packed(list(range(12)))
    reads = _HostReads()
    with reads.mode:
        loss = packed_classifier_loss(model, batch, model_type)
        loss.backward()
    assert reads.seen == []
