"""fedpft on decoders and encoder-decoders (issue 15 part 4): the proxy is the full model with
its dropped neurons zeroed, APoZ counts the gated activation with a threshold, layer-level KD
runs over every stack and its weight term has a real gradient."""

import pytest
import torch
import torch.nn.functional as F

from fedslice.api import setup
from fedslice.experiment import validate_config
from fedslice.data.batching import iter_batches
from fedslice.distill.apoz import count_near_zero
from fedslice.distill.losses import ffn_weight_loss
from fedslice.methods.fedpft import ffn_weights
from fedslice.models.arch import module_at


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(f"a restaurant near {i} serves food for {i % 7} people" for i in range(80)))
    return path


def _method(arch, tiny_gen_cfg_dict, tiny_lm_dirs, corpus_file, tmp_path, **opts):
    d = dict(tiny_gen_cfg_dict)
    d["model"] = {"name": str(tiny_lm_dirs[arch])}
    d["lora"] = {"r": 4, "alpha": 8, "targets": ["q", "k", "v", "o"]}
    distill = {"corpus": str(corpus_file), "steps": 0, "batch_size": 4, "max_length": 16,
               "cache_dir": str(tmp_path / "cache")}
    # 2 layers per stack: layer 1 of every stack is compressed
    d["method"] = {"name": "fedpft", "keep_ratio": 0.5, "whole_layers": [0], "kd": "none",
                   **opts, "distill": {**distill, **opts.pop("distill", {})}}
    return setup(validate_config(d))


def _batch(data):
    batch = next(iter(iter_batches(data.dev, range(4), 4, shuffle=False, generator=None)))
    batch.pop("labels")
    return batch


@pytest.mark.parametrize("arch", ["llama", "t5", "gpt2"])
def test_proxy_equals_full_model_with_dropped_neurons_zeroed(arch, tiny_gen_cfg_dict, tiny_lm_dirs,
                                                              corpus_file, tmp_path):
    method, data = _method(arch, tiny_gen_cfg_dict, tiny_lm_dirs, corpus_file, tmp_path)
    A = method.arch
    assert len(method.compressed) == len(A.stacks)  # layer 1 of each stack
    batch = _batch(data)
    method.proxy.eval(), method.model.eval()
    with torch.no_grad():
        proxy = method.proxy(**batch).logits
        for k, l in method.units.values():  # zero the dropped neurons' down-projection inputs
            kept = torch.tensor(method.spec.stacks[k].neurons[l])
            out = A.ffn_part(method.model, k, l, "ffn_out")
            w = out.weight if A.weight_layout == "linear" else out.weight.T  # (d, F)
            dropped = torch.ones(w.shape[1], dtype=torch.bool)
            dropped[kept] = False
            assert 0 < int(dropped.sum()) < w.shape[1]
            w[:, dropped] = 0.0
        full = method.model(**batch).logits
    assert (proxy - full).abs().max() <= 1e-5


def test_apoz_counts_the_gated_activation_with_a_threshold(tiny_gen_cfg_dict, tiny_lm_dirs,
                                                           corpus_file, tmp_path):
    method, data = _method("llama", tiny_gen_cfg_dict, tiny_lm_dirs, corpus_file, tmp_path)
    A, (g,) = method.arch, method.compressed
    k, l = method.units[g]
    gate, up = A.ffn_part(method.proxy, k, l, "gate"), A.ffn_part(method.proxy, k, l, "ffn_in")
    seen = []  # the FFN's input x, by hand: silu(x W_gate^T) * (x W_up^T)
    mlp = module_at(A.blocks(method.proxy, k)[l], A.stacks[k].ffn.gate.rpartition(".")[0])
    handle = mlp.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
    part = data.client(0)
    try:
        count_near_zero(method.proxy, A, [g], part, 4, tau=0.0)
    finally:
        handle.remove()
    acts = [F.silu(x @ gate.weight.T) * (x @ up.weight.T) for x in seen]  # (B, T, F')
    tau = float(torch.cat([a.abs().flatten() for a in acts]).median())
    seen.clear()
    handle = mlp.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
    try:
        count = count_near_zero(method.proxy, A, [g], part, 4, tau=tau)
    finally:
        handle.remove()
    masks = [b["attention_mask"] for b in iter_batches(part, torch.arange(len(part)), 4,
                                                        shuffle=False, generator=None)]
    hand = sum(((a.abs() <= tau) & m.bool()[..., None]).sum((0, 1)) for a, m in zip(acts, masks))
    assert torch.equal(count.counts[g], hand.float())
    assert 0 < float(hand.sum()) < float(sum(m.sum() for m in masks)) * hand.numel()
    assert count.layer_tokens[g] == count.tokens == int(sum(m.sum() for m in masks))


@pytest.mark.parametrize("arch", ["llama", "t5"])
def test_layer_kd_on_every_stack_decreases_the_loss(arch, tiny_gen_cfg_dict, tiny_lm_dirs,
                                                    corpus_file, tmp_path):
    method, _ = _method(arch, tiny_gen_cfg_dict, tiny_lm_dirs, corpus_file, tmp_path, kd="before",
                        distill={"steps": 12, "lr": 1e-2, "mu": 1.0})
    losses = [s["loss"] for s in method.kd_before.losses]
    assert len(losses) == 12 and losses[-1] < losses[0]
    assert all(s["weight"] > 0 for s in method.kd_before.losses)
    # the weight term alone has a gradient in the proxy's compressed FFN tensors
    s_ffn = ffn_weights(method.proxy, method.arch, method.units)
    t_ffn = ffn_weights(method.teacher, method.arch, method.units)
    for p in method.proxy_params.values():
        p.requires_grad_(True)
        p.grad = None
    sum(ffn_weight_loss(s_ffn[g], t_ffn[g]) for g in s_ffn).backward()
    weights = [n for n in method.proxy_params if n.endswith("weight")]
    assert weights and all(float(method.proxy_params[n].grad.abs().sum()) > 0 for n in weights)


def _reference_activation_neurons(method, model):
    """The proxy's kept neurons under ``salience = "activation"``, by hand: each compressed FFN
    unit's mean |input to W_out| over the real tokens of the corpus' first
    ``calibration_examples`` passages (one batch; an encoder-decoder's decoder reads the passage
    shifted right behind its start token) times the L1 norm of its W_out column; the top
    ``keep_ratio``, in their original order."""
    A, split = method.arch, method.corpus.split
    batch = split.collate(list(range(min(method.opts.calibration_examples, len(split)))))
    batch.pop("labels", None)
    ids, mask = batch["input_ids"], batch["attention_mask"]  # (B, T)
    if A.kind == "encoder-decoder":
        start = torch.full_like(ids[:, :1], model.config.decoder_start_token_id)
        batch.update(decoder_input_ids=torch.cat([start, ids[:, :-1]], 1), decoder_attention_mask=mask)
    seen, handles = {}, []
    for g, (k, l) in method.units.items():
        out = A.ffn_part(model, k, l, "ffn_out")
        handles.append(out.register_forward_pre_hook(
            lambda _m, args, g=g: seen.__setitem__(g, args[0].detach().abs())))  # (B, T, F)
    model.eval()
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for h in handles:
            h.remove()
    kept = {}
    for g, (k, l) in method.units.items():
        a = (seen[g] * mask[..., None]).sum((0, 1)) / mask.sum()  # (F,)
        out = A.ffn_part(model, k, l, "ffn_out")
        w = out.weight if A.weight_layout == "linear" else out.weight.T  # (d, F)
        score = a * w.abs().sum(0)
        n = len(method.spec.stacks[k].neurons[l])
        kept[g] = tuple(sorted(torch.argsort(score, descending=True)[:n].tolist()))
    return kept


@pytest.mark.parametrize("arch", ["llama", "t5", "gpt2"])
def test_activation_salience_keeps_the_units_the_corpus_drives(arch, tiny_gen_cfg_dict, tiny_lm_dirs,
                                                               corpus_file, tmp_path):
    """``method.salience = "activation"`` (issue 35 part 5: the weight-norm rule keeps units
    SmolLM2 does not need): the proxy keeps, per compressed layer, the units of largest mean
    |activation| x ||W_out column||_1 over the corpus' first passages, the server's data only;
    not the units Eq. 8's weight norms keep."""
    method, _ = _method(arch, tiny_gen_cfg_dict, tiny_lm_dirs, corpus_file, tmp_path,
                        salience="activation", calibration_examples=6)
    assert method.corpus is not None  # kd = "none": read for the ranking alone
    expected = _reference_activation_neurons(method, method.model)
    got = {g: method.spec.stacks[k].neurons[l] for g, (k, l) in method.units.items()}
    assert got == expected
    l2, _ = _method(arch, tiny_gen_cfg_dict, tiny_lm_dirs, corpus_file, tmp_path)
    assert l2.corpus is None  # l2 with kd = "none" reads no corpus
    assert got != {g: l2.spec.stacks[k].neurons[l] for g, (k, l) in l2.units.items()}
