"""The ``heads`` method on every generative architecture (issue 15, part 1): importance per
attention family, grouped-query key/value heads, GPT-2's fused q|k|v, both pruning modes, and
head-weighted aggregation with a key/value head shared by two query heads."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from test_slicing_arch import _inputs, _with_lora, _zeroed_reference
from fedslice.api import setup
from fedslice.experiment import validate_config
from fedslice.methods.heads import ALPHA, KEPT
from fedslice.models.arch import arch_for
from fedslice.slicing.head_aggregate import HeadUpdate, aggregate_heads
from fedslice.slicing.heads import confidence, head_importance, mask_rows, mask_spec, num_rows
from fedslice.slicing.head_fill import fill_pruned_heads, output_means
from fedslice.slicing.partial import PartialLinear, partial_model
from fedslice.slicing.keys import key_info
from fedslice.slicing.state import extract_state
from fedslice.slicing.surgery import extract_model

ARCHS = ("gpt2", "llama", "t5", "bart")


def _cfg(tiny_gen_cfg_dict, tiny_lm_dirs, arch, **method):
    d = dict(tiny_gen_cfg_dict)
    d["model"] = {"name": str(tiny_lm_dirs[arch])}
    d["lora"] = {"r": 4, "alpha": 8, "targets": ["q", "k", "v", "o"]}
    d["method"] = {"name": "heads", "sparsity": 0.5, "importance_max_examples": 8, **method}
    return validate_config(d)


def _lm(tiny_lm_dirs, arch):
    import transformers as T
    auto = T.AutoModelForSeq2SeqLM if arch in ("t5", "bart") else T.AutoModelForCausalLM
    return auto.from_pretrained(tiny_lm_dirs[arch], attn_implementation="eager").eval()


def _mask(dims, seed=0, headless=True):
    """A random (R, H) keep-mask; with ``headless`` the last row of every family keeps no head."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(num_rows(dims), dims[0]["num_heads"], generator=g) < 0.5
    m[torch.arange(m.shape[0]), torch.randint(0, m.shape[1], (m.shape[0],), generator=g)] = True
    if headless:
        for (k, f), r in mask_rows(dims).items():
            m[r + dims[k]["num_layers"] - 1] = False
    return m


def test_causal_confidence_skips_the_first_query_and_sees_earlier_keys_only():
    # 1 example, 1 head, 3 tokens: BOS a b; BOS (0) is no valid key
    att = torch.tensor([[[[1.0, 0.0, 0.0], [0.7, 0.3, 0.0], [0.2, 0.5, 0.3]]]])  # (1, 1, 3, 3)
    real, keys = torch.tensor([[1, 1, 1]]), torch.tensor([[0, 1, 1]])
    # query 0 sees one token (and no allowed key): not counted; query 1: max over {a}; query 2: {a, b}
    torch.testing.assert_close(confidence([att], real, keys, causal=True), torch.tensor([[[(0.3 + 0.5) / 2]]]))
    # without BOS the first token attends to itself with probability 1 whatever the head: skipped
    torch.testing.assert_close(confidence([att], real, torch.ones(1, 3), causal=True),
                               torch.tensor([[[(0.7 + 0.5) / 2]]]))


def test_sink_keys_drop_the_first_real_tokens_of_causal_self_attention(tiny_gen_cfg_dict, tiny_lm_dirs):
    from fedslice.slicing.heads import drop_sinks
    keys = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1], [0, 1, 0, 1]])  # right, left, special-holed
    assert drop_sinks(keys, 1).long().tolist() == [[0, 1, 1, 0], [0, 0, 0, 1], [0, 0, 0, 1]]
    assert not drop_sinks(keys, 2)[2].any() and torch.equal(drop_sinks(keys, 0), keys.bool())
    # a head parking 0.9 / 0.8 on the first token looks confident, unless that key is dropped
    att = torch.tensor([[[[1.0, 0.0, 0.0], [0.9, 0.1, 0.0], [0.8, 0.1, 0.1]]]])  # (1, 1, 3, 3)
    real = torch.ones(1, 3)
    torch.testing.assert_close(confidence([att], real, real, causal=True), torch.tensor([[[0.85]]]))
    torch.testing.assert_close(confidence([att], real, drop_sinks(real, 1), causal=True),
                               torch.tensor([[[0.1]]]))
    # wired through the method: causal families only (here the one decoder family)
    alphas = []
    for n in (0, 1):
        method, data = setup(_cfg(tiny_gen_cfg_dict, tiny_lm_dirs, "llama", sink_keys=n))
        alphas.append(method.importance(data.client(0), 0)[0])
    assert not torch.allclose(alphas[0], alphas[1])


@pytest.mark.parametrize("arch", ARCHS)
def test_importance_per_family(arch, tiny_gen_cfg_dict, tiny_lm_dirs):
    method, data = setup(_cfg(tiny_gen_cfg_dict, tiny_lm_dirs, arch))
    split = data.client(0)
    scores = head_importance(method.model, split, method.special_ids, 4)
    want = [f.name for f in method.arch.attention_outputs]
    assert list(scores) == want
    assert want == {"gpt2": ["decoder.self"], "llama": ["decoder.self"],
                    "t5": ["encoder.self", "decoder.self", "decoder.cross"],
                    "bart": ["encoder.self", "decoder.self", "decoder.cross"]}[arch]
    for s in scores.values():
        assert s.shape == (2, 4) and bool(((s > 0) & (s <= 1)).all())
        assert not s.requires_grad  # scored without autograd (LoRA tensors do require grad)
    alpha, flops = method.importance(split, 0)
    assert alpha.shape == method.mask_shape == (2 * len(want), 4) and flops > 0
    kept = method.keep(alpha, 0, method.opts.sparsity)
    assert int(kept.sum()) == round(0.5 * kept.numel())


def test_grouped_query_kv_head_kept_iff_a_query_head_of_its_group_is(tiny_lm_dirs):
    model = _with_lora(_lm(tiny_lm_dirs, "llama"))
    arch = arch_for(model)
    dims = arch.all_dims(model.config)  # 4 query heads in 2 key/value groups
    hd = dims[0]["head_dim"]
    kept = torch.tensor([[True, False, False, False], [False, False, True, True]])
    spec = mask_spec(kept, dims).stacks[0]
    assert spec.kv_heads(0) == (0,) and spec.kv_heads(1) == (1,)
    sub = partial_model(model, mask_spec(kept, dims), arch)
    trainable = {n: p for n, p in sub.named_parameters() if p.requires_grad}
    for layer, kv in ((0, 0), (1, 1)):
        k_b = next(n for n in trainable if f"layers.{layer}.self_attn.k_proj.lora_B" in n)
        q_b = next(n for n in trainable if f"layers.{layer}.self_attn.q_proj.lora_B" in n)
        assert trainable[k_b].shape[0] == hd and trainable[q_b].shape[0] == int(kept[layer].sum()) * hd
        full = dict(model.named_parameters())[k_b]
        assert torch.equal(trainable[k_b], full[kv * hd:(kv + 1) * hd])
    both = torch.tensor([[True, False, True, False], [True, True, False, False]])
    s = mask_spec(both, dims).stacks[0]
    assert s.kv_heads(0) == (0, 1) and s.kv_heads(1) == (0,)


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_submodel_equals_full_model_with_pruned_heads_zeroed(arch, tiny_lm_dirs):
    """GPT-2's c_attn sliced in its q, k and v sections, GQA, T5's per-layer columns of the stack's
    bias, cross-attention; one layer of every family keeps no head."""
    model = _with_lora(_lm(tiny_lm_dirs, arch))
    a = arch_for(model)
    dims = a.all_dims(model.config)
    mask = _mask(dims, 1)
    spec = mask_spec(mask, dims)
    sub = extract_model(model, spec, a)
    with torch.no_grad():
        got = sub(**_inputs(model)).logits
        want = _zeroed_reference(model, spec)(**_inputs(model)).logits
    assert (got - want).abs().max() <= 1e-5
    assert {k: v.shape for k, v in sub.state_dict().items()} == \
        {k: v.shape for k, v in extract_state(model.state_dict(), spec, a).items()}
    if arch == "gpt2":
        hd = dims[0]["head_dim"]
        w = dict(sub.named_parameters())["base_model.model.transformer.h.0.attn.c_attn.base_layer.weight"]
        assert w.shape[1] == 3 * int(mask[0].sum()) * hd  # Conv1D (in, out): q|k|v sections


@pytest.mark.parametrize("arch", ARCHS)
def test_parameters_mode_keeps_outputs_and_trains_only_kept_slices(arch, tiny_lm_dirs):
    model = _with_lora(_lm(tiny_lm_dirs, arch))
    a = arch_for(model)
    dims = a.all_dims(model.config)
    mask = _mask(dims, 2)
    spec = mask_spec(mask, dims)
    sub = partial_model(model, spec, a)
    with torch.no_grad():  # the same function (sums in another order: float rounding)
        diff = float((sub(**_inputs(model)).logits - model(**_inputs(model)).logits).abs().max())
    assert diff <= 1e-5
    assert any(isinstance(m, PartialLinear) for m in sub.modules())
    state = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    expected = extract_state(state, spec, a)
    rows = mask_rows(dims)

    def headless(n):
        info = key_info(a, n)
        return info is not None and info.part in ("q", "k", "v", "qkv", "o") and \
            not bool(mask[rows[(info.stack, info.family)] + info.layer].any())
    trainable = {n: p for n, p in sub.named_parameters() if p.requires_grad}
    assert set(trainable) == {n for n in expected if not headless(n)}
    for n, p in trainable.items():
        assert p.shape == expected[n].shape, n
    model.zero_grad()
    sub(**_inputs(model)).logits.square().mean().backward()
    assert all(p.grad is not None for p in trainable.values())
    # nothing of a pruned slice or of a headless family gets a gradient
    grads = {n for n, p in sub.named_parameters() if p.grad is not None}
    assert grads <= set(trainable)
    model.zero_grad()


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_mode_with_headless_layers_trains_and_aggregates(arch, tiny_gen_cfg_dict, tiny_lm_dirs):
    method, data = setup(_cfg(tiny_gen_cfg_dict, tiny_lm_dirs, arch, prune="forward", sparsity=0.75, scope="global"))
    rows = method.mask_shape[0]
    alpha = torch.linspace(1.0, 0.01, rows * 4).view(rows, 4)  # the last rows keep no head
    method.importance = lambda d, s, model=None: (alpha, 0.0)
    state = method.initial_state()
    payload = method.strategy.configure_train(1, state, [0])[0]
    reply = method.fit(payload, data.client(0), 0)
    kept = reply.arrays[KEPT]
    assert int(kept.sum()) == rows and not bool(kept[-1].any()) and reply.metrics["headless_layers"] >= 1
    assert method.strategy.check_reply(state, payload, reply) is None
    result = method.strategy.aggregate_train(1, state, {0: payload}, {0: reply})
    assert result.used == [0]
    torch.testing.assert_close(reply.arrays[ALPHA], alpha * kept)


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_mode_keeps_heads_in_every_layer_by_default(arch, tiny_gen_cfg_dict, tiny_lm_dirs):
    """``prune = "forward"`` ranks heads per layer unless told otherwise (issue 35, part 2): the
    scores that leave the last layers headless under ``scope = "global"`` keep the same share of
    every layer here; the client trains and its reply aggregates."""
    method, data = setup(_cfg(tiny_gen_cfg_dict, tiny_lm_dirs, arch, prune="forward", sparsity=0.75))
    assert method.opts.scope == "per_layer"
    rows = method.mask_shape[0]
    alpha = torch.linspace(1.0, 0.01, rows * 4).view(rows, 4)  # global ranking: the last rows keep none
    method.importance = lambda d, s, model=None: (alpha, 0.0)
    state = method.initial_state()
    payload = method.strategy.configure_train(1, state, [0])[0]
    reply = method.fit(payload, data.client(0), 0)
    kept = reply.arrays[KEPT]
    assert kept.sum(1).tolist() == [1] * rows and reply.metrics["headless_layers"] == 0
    assert reply.metrics["loss"] == reply.metrics["loss"]  # trained (finite)
    assert method.strategy.check_reply(state, payload, reply) is None
    assert method.strategy.aggregate_train(1, state, {0: payload}, {0: reply}).used == [0]
    parameters = _cfg(tiny_gen_cfg_dict, tiny_lm_dirs, arch, prune="parameters", sparsity=0.75)
    assert parameters.method.scope == "global"  # the paper's rule where heads stay in the forward


def _o_inputs(model, a, batch, part: str = "o"):
    """Each attention output projection's input (``part = "q"``: its query projection's, what
    the linear fill reads), by (stack, family, layer), of one forward."""
    got, hooks = {}, []
    for k, st in enumerate(a.stacks):
        for j, block in enumerate(a.blocks(model, k)):
            for f, att in enumerate(st.attention):
                hooks.append(block.get_submodule(getattr(att, part)).register_forward_pre_hook(
                    lambda _m, args, key=(k, f, j): got.__setitem__(key, args[0].detach().clone())))
    with torch.no_grad():
        model(**batch)
    for h in hooks:
        h.remove()
    return got


@pytest.mark.parametrize("arch", ARCHS)
def test_mean_fill_equals_full_model_with_pruned_heads_replaced_by_their_means(arch, tiny_lm_dirs):
    """``method.fill = "mean"`` (issue 35 part 2): the mean of each output projection's input is
    taken over the real tokens only, and the mean-filled sub-model computes exactly the full model
    whose pruned heads' columns of that input hold their means (LoRA on o included; T5/BART's
    cross-attention and decoder, LLaMA's grouped queries; a headless layer of every family except
    GPT-2's, whose transposed o does not run there)."""
    model = _with_lora(_lm(tiny_lm_dirs, arch)).eval()
    a = arch_for(model)
    dims = a.all_dims(model.config)
    batch = _inputs(model)
    with output_means(model, a) as means:
        with torch.no_grad():
            model(**batch)
    inputs = _o_inputs(model, a, batch)
    assert set(means) == set(inputs)
    for key, x in inputs.items():  # encoder side: example 1's padding does not count
        w = batch["attention_mask"].float() if x.shape[1] == batch["attention_mask"].shape[1] \
            else torch.ones(x.shape[:2])
        torch.testing.assert_close(means[key], (x * w[..., None]).sum((0, 1)) / w.sum())
    mask = _mask(dims, 3, headless=arch != "gpt2")
    sub = extract_model(model, mask_spec(mask, dims), a).eval()
    assert fill_pruned_heads(sub, model, mask, dims, means, a) == int((~mask.all(1)).sum())
    ref, rows, hooks = copy.deepcopy(model), mask_rows(dims), []
    for (k, f), r0 in rows.items():
        for j, block in enumerate(a.blocks(ref, k)):
            pruned = ~mask[r0 + j].repeat_interleave(dims[k]["head_dim"])
            hooks.append(block.get_submodule(a.stacks[k].attention[f].o).register_forward_pre_hook(
                lambda _m, args, p=pruned, m=means[(k, f, j)]: (torch.where(p, m, args[0]),)))
    with torch.no_grad():
        got, want, zero = sub(**batch).logits, ref(**batch).logits, model(**batch).logits
    assert (got - want).abs().max() <= 1e-5
    assert (got - zero).abs().max() > 1e-3  # the fill changes the sub-model


@pytest.mark.parametrize("arch", ARCHS)
def test_linear_fill_is_the_ridge_regression_of_the_pruned_heads_on_the_attention_input(arch, tiny_lm_dirs):
    """``method.fill = "linear"`` at full rank: each layer that keeps some heads adds to its output
    projection the ridge least-squares map (numpy, float64) from its attention input (plus a
    constant) to what its pruned heads add in the full model, over the real tokens of the
    forwards it was fitted on; the sub-model computes exactly the full model with each such
    layer's pruned heads replaced by that map (headless layers: the mean fill). A lower rank
    fits worse on the same tokens, but better than the mean alone."""
    from fedslice.slicing.head_fill import FILL_RIDGE, linear_fill

    model = _with_lora(_lm(tiny_lm_dirs, arch)).eval()
    a = arch_for(model)
    dims = a.all_dims(model.config)
    batch = _inputs(model)
    with output_means(model, a, regression=True) as means:
        with torch.no_grad():
            model(**batch)
    xs, hs = _o_inputs(model, a, batch), _o_inputs(model, a, batch, "q")
    mask = _mask(dims, 3, headless=arch != "gpt2")
    mask[mask.all(1), -1] = False  # every layer prunes some head
    rows = mask_rows(dims)
    maps = {}
    for (k, f), r0 in rows.items():
        for j, block in enumerate(a.blocks(model, k)):
            key, row = (k, f, j), mask[r0 + j]
            x, h = xs[key], hs[key]
            w = batch["attention_mask"] if x.shape[1] == batch["attention_mask"].shape[1] else None
            real = (w.bool() if w is not None else torch.ones(x.shape[:2], dtype=torch.bool)).numpy()
            o = block.get_submodule(a.stacks[k].attention[f].o)
            pruned = ~row.repeat_interleave(dims[k]["head_dim"])
            with torch.no_grad():
                y = (o(x * pruned) - o(torch.zeros_like(x))).double().numpy()[real]   # (N, D)
            hb = np.concatenate([h.double().numpy()[real], np.ones((int(real.sum()), 1))], 1)
            gram = hb.T @ hb
            ref = np.linalg.solve(gram + FILL_RIDGE * np.diag(gram).mean() * np.eye(len(gram)), hb.T @ y)
            mom = means.moments[key]
            np.testing.assert_allclose(mom.gram.numpy(), gram, rtol=1e-9, atol=1e-9)
            if bool(row.any()) and not bool(row.all()):
                basis = torch.diag(pruned.float())
                with torch.no_grad():
                    pmap = o(basis) - o(torch.zeros_like(basis[:1]))
                p, q = linear_fill(mom, pmap, rank=10**6, ridge=FILL_RIDGE)  # full rank: the map, no Q
                assert q is None
                np.testing.assert_allclose(p.double().numpy(), ref, rtol=1e-4, atol=1e-5)
                fit = lambda m: float(((hb @ m - y) ** 2).sum())  # noqa: E731
                p2, q2 = linear_fill(mom, pmap, rank=2, ridge=FILL_RIDGE)
                mean_only = np.zeros_like(ref)
                mean_only[-1] = y.mean(0)
                assert fit(ref) <= fit((p2 @ q2).double().numpy()) <= fit(mean_only) + 1e-9
                maps[key] = torch.from_numpy(ref).float()
    sub = extract_model(model, mask_spec(mask, dims), a).eval()
    assert fill_pruned_heads(sub, model, mask, dims, means, a, rank=10**6,
                             ridge=FILL_RIDGE) == int((~mask.all(1)).sum())
    ref_model, hooks, seen = copy.deepcopy(model), [], {}
    for (k, f), r0 in rows.items():
        for j, block in enumerate(a.blocks(ref_model, k)):
            key, att = (k, f, j), a.stacks[k].attention[f]
            pruned = ~mask[r0 + j].repeat_interleave(dims[k]["head_dim"])
            if key in maps:  # the kept heads, plus the map of the attention input
                hooks.append(block.get_submodule(att.q).register_forward_pre_hook(
                    lambda _m, args, key=key: seen.__setitem__(key, args[0])))
                hooks.append(block.get_submodule(att.o).register_forward_pre_hook(
                    lambda _m, args, p=pruned: (args[0] * ~p,)))
                hooks.append(block.get_submodule(att.o).register_forward_hook(
                    lambda _m, _a, out, key=key: out + torch.cat(
                        [seen[key], torch.ones_like(seen[key][..., :1])], -1) @ maps[key]))
            elif not bool(mask[r0 + j].all()):  # headless: the mean fill
                hooks.append(block.get_submodule(att.o).register_forward_pre_hook(
                    lambda _m, args, p=pruned, m=means[key]: (torch.where(p, m, args[0]),)))
    mean_sub = extract_model(model, mask_spec(mask, dims), a).eval()
    fill_pruned_heads(mean_sub, model, mask, dims, means, a)
    with torch.no_grad():
        got, want, mean = sub(**batch).logits, ref_model(**batch).logits, mean_sub(**batch).logits
    assert (got - want).abs().max() <= 1e-4, float((got - want).abs().max())
    assert maps and (got - mean).abs().max() > 1e-3  # not the mean fill


@pytest.mark.parametrize("arch", ["llama", "t5"])
def test_linear_fill_chooses_its_ridge_by_two_fold_cross_validation_over_examples(arch, tiny_lm_dirs):
    """The moments' half holds every other example across forwards (the 1st, 3rd, 5th of two
    calls of 3 and 2 examples); :func:`fill_ridge` picks the ridge whose fit on one half has the
    least squared error on the other, both ways round (numpy, from the tokens); the default fill
    is fitted at that ridge; fewer than two examples: FILL_RIDGE."""
    from fedslice.slicing.head_fill import FILL_RIDGE, fill_ridge, linear_fill

    model = _with_lora(_lm(tiny_lm_dirs, arch)).eval()
    a = arch_for(model)
    dims = a.all_dims(model.config)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 400, (5, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:], mask[4, 3:] = 0, 0
    batch = {"input_ids": ids, "attention_mask": mask}
    if model.config.is_encoder_decoder:
        batch["decoder_input_ids"] = torch.randint(5, 400, (5, 6), generator=g)
    with output_means(model, a, regression=True) as means, torch.no_grad():
        for rows in (slice(0, 3), slice(3, 5)):
            model(**{k: v[rows] for k, v in batch.items()})
    xs, hs = _o_inputs(model, a, batch), _o_inputs(model, a, batch, "q")
    in_half = np.array([True, False, True, False, True])
    grid = tuple(10.0 ** np.arange(-6, 3))
    mask_heads = _mask(dims, 3, headless=False)
    mask_heads[mask_heads.all(1), -1] = False
    rows, interior = mask_rows(dims), 0
    for (k, f), r0 in rows.items():
        for j, block in enumerate(a.blocks(model, k)):
            key = (k, f, j)
            x, h, mom = xs[key], hs[key], means.moments[key]
            real = (mask.bool() if x.shape[1] == mask.shape[1] else torch.ones(x.shape[:2], dtype=torch.bool)).numpy()
            hb = np.concatenate([h.double().numpy(), np.ones(h.shape[:2] + (1,))], -1)
            o = block.get_submodule(a.stacks[k].attention[f].o)
            basis = torch.diag((~mask_heads[r0 + j].repeat_interleave(dims[k]["head_dim"])).float())
            with torch.no_grad():
                pmap = o(basis) - o(torch.zeros_like(basis[:1]))
            y = x.double().numpy() @ pmap.double().numpy()
            half = real & in_half[:, None]
            np.testing.assert_allclose(mom.half_gram.numpy(), hb[half].T @ hb[half], rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(mom.half_cross.numpy(), hb[half].T @ x.double().numpy()[half],
                                       rtol=1e-6, atol=1e-6)
            assert mom.examples == 5
            parts = [half, real & ~in_half[:, None]]

            def error(ridge):
                err = 0.0
                for fit, held in (parts, parts[::-1]):
                    gram = hb[fit].T @ hb[fit]
                    w = np.linalg.solve(gram + ridge * np.diag(gram).mean() * np.eye(len(gram)), hb[fit].T @ y[fit])
                    err += float(((hb[held] @ w - y[held]) ** 2).sum())
                return err
            errors = [error(r) for r in grid]
            best = grid[int(np.argmin(errors))]
            assert fill_ridge(mom, pmap, grid) == best
            interior += best not in (grid[0], grid[-1])
            assert fill_ridge(mom, pmap, (grid[0], grid[-1])) == (grid[0] if errors[0] < errors[-1] else grid[-1])
            chosen = fill_ridge(mom, pmap)
            p, _ = linear_fill(mom, pmap, rank=10**6)
            assert torch.equal(p, linear_fill(mom, pmap, rank=10**6, ridge=chosen)[0])
    assert interior  # the grid's ends are not all it ever picks
    with output_means(model, a, regression=True) as one, torch.no_grad():
        model(**{k: v[:1] for k, v in batch.items()})
    single = one.moments[(0, 0, 0)]
    assert single.examples == 1 and fill_ridge(single, torch.eye(single.cross.shape[1]), grid) == FILL_RIDGE


def test_mean_fill_without_pruned_heads_is_the_model_bit_for_bit(tiny_lm_dirs):
    model = _with_lora(_lm(tiny_lm_dirs, "llama")).eval()
    a = arch_for(model)
    dims = a.all_dims(model.config)
    batch = _inputs(model)
    with torch.no_grad():
        before = model(**batch).logits
    with output_means(model, a) as means:
        with torch.no_grad():
            model(**batch)
    assert fill_pruned_heads(model, model, torch.ones(num_rows(dims), dims[0]["num_heads"], dtype=torch.bool),
                             dims, means, a) == 0
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, before)  # and the capture's hooks are gone
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("pruning", ["importance", "random"])
def test_forward_mode_fills_train_and_are_no_ops_at_sparsity_zero(pruning, tiny_gen_cfg_dict, tiny_lm_dirs):
    agg = "head_weighted" if pruning == "importance" else "fedavg"  # B2: no importance pass

    def fit(**opts):
        method, data = setup(_cfg(tiny_gen_cfg_dict, tiny_lm_dirs, "llama", prune="forward", pruning=pruning,
                                  aggregation=agg, **opts))
        state = method.initial_state()
        payload = method.strategy.configure_train(1, state, [0])[0]
        reply = method.fit(payload, data.client(0), 0)
        # the budget planner counts the pass the client runs (random pruning: only for the means)
        assert method.importance_examples(100) == (8 if reply.metrics["flops_importance"] else 0)
        return reply

    zero, mean = fit(sparsity=0.75), fit(sparsity=0.75, fill="mean")
    assert torch.equal(zero.arrays[KEPT], mean.arrays[KEPT]) and mean.metrics["loss"] == mean.metrics["loss"]
    assert zero.metrics["loss"] != mean.metrics["loss"]
    if pruning == "random":  # the means need a forward of their own, counted
        assert zero.metrics["flops_importance"] == 0 < mean.metrics["flops_importance"]
    else:
        assert zero.metrics["flops_importance"] == mean.metrics["flops_importance"] > 0
    linear = fit(sparsity=0.75, fill="linear", fill_rank=4)
    assert torch.equal(zero.arrays[KEPT], linear.arrays[KEPT]) and math.isfinite(linear.metrics["loss"])
    assert linear.metrics["loss"] not in (zero.metrics["loss"], mean.metrics["loss"])
    # the fill's matmuls run in every training forward (counted), its moments in the pass
    assert linear.metrics["flops_measured"] > mean.metrics["flops_measured"]
    assert linear.metrics["flops_importance"] >= mean.metrics["flops_importance"]
    dense_zero, dense_mean = fit(sparsity=0.0), fit(sparsity=0.0, fill="mean")
    dense_linear = fit(sparsity=0.0, fill="linear")
    assert dense_zero.arrays.keys() == dense_mean.arrays.keys() == dense_linear.arrays.keys()
    assert all(torch.equal(dense_zero.arrays[k], dense_mean.arrays[k]) for k in dense_zero.arrays)
    assert all(torch.equal(dense_zero.arrays[k], dense_linear.arrays[k]) for k in dense_zero.arrays)


def _gqa_state(arch, dims, r, gen):
    d, hd = dims["hidden"], dims["head_dim"]
    rows = {"q": dims["num_heads"] * hd, "k": dims["num_kv_heads"] * hd, "v": dims["num_kv_heads"] * hd}
    st = {}
    for l in range(dims["num_layers"]):
        for part, out in (*rows.items(), ("o", d)):
            name = f"base_model.model.{arch.part_name(l, part)}"
            width = d if part != "o" else dims["num_heads"] * hd
            st[f"{name}.lora_A.default.weight"] = torch.randn(r, width, generator=gen)
            st[f"{name}.lora_B.default.weight"] = torch.randn(out, r, generator=gen)
    return st


@pytest.mark.parametrize("mode", ["head_weighted", "fedavg"])
def test_gqa_aggregation_against_numpy_reference(mode):
    """Key/value head 0 is shared by query heads 0 and 1: its rows get the sum of their α (or
    |D_c| while either is kept)."""
    from fedslice.models.arch import ARCHITECTURES
    arch = ARCHITECTURES["llama"]
    H, KV, hd, r = 4, 2, 2, 3
    dims = {"num_layers": 2, "num_heads": H, "num_kv_heads": KV, "head_dim": hd, "hidden": 8,
            "ffn": 5, "families": 1}
    gen = torch.Generator().manual_seed(0)
    g = _gqa_state(arch, dims, r, gen)
    kept = [torch.tensor([[1, 1, 0, 0], [0, 0, 1, 0]]).bool(),  # kv 0 by two query heads
            torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]]).bool(),  # layer 1 headless
            torch.tensor([[0, 1, 0, 0], [1, 0, 0, 1]]).bool()]  # kv head 1 of layer 0: nobody
    alphas = [torch.rand(2, H, generator=gen) * k for k in kept]
    sizes = [10, 30, 7]
    locs = [{k: v + torch.randn(v.shape, generator=gen) for k, v in g.items()} for _ in kept]
    ups = [HeadUpdate(extract_state(l, mask_spec(m, [dims]), arch), m, a if mode == "head_weighted" else None, n)
           for l, m, a, n in zip(locs, kept, alphas, sizes)]
    # the headless layer's attention LoRA is not sent (Heads.local_params)
    ups[1] = HeadUpdate({k: v for k, v in ups[1].arrays.items() if "layers.1.self_attn" not in k},
                        kept[1], ups[1].alpha, 30)
    out = aggregate_heads(g, ups, arch, dims, mode=mode, eta=1.0, eps=1e-3 if mode == "head_weighted" else 1e-8)

    def weight(c, layer, heads):  # client c's weight of a block shared by query heads ``heads``
        if not any(bool(kept[c][layer, h]) for h in heads):
            return 0.0
        if mode == "fedavg":
            return float(sizes[c])
        return sum(float(alphas[c][layer, h]) for h in heads if kept[c][layer, h])
    eps = 1e-3 if mode == "head_weighted" else 1e-8
    for key, g0 in g.items():
        G = g0.numpy().astype(np.float64)
        ref = G.copy()
        deltas = [l[key].numpy() - G for l in locs]
        layer = int(key.split("layers.")[1].split(".")[0])
        part = next(p for p in ("q_proj", "k_proj", "v_proj", "o_proj") if p in key)
        tied = ("lora_B" in key and part != "o_proj") or ("lora_A" in key and part == "o_proj")
        if tied:
            groups = [(h, (h,)) for h in range(H)] if part in ("q_proj", "o_proj") else \
                [(j, tuple(range(j * H // KV, (j + 1) * H // KV))) for j in range(KV)]
            for blk, heads in groups:
                sl = slice(blk * hd, (blk + 1) * hd)
                w = [weight(c, layer, heads) for c in range(3)]
                if sum(w) == 0:
                    continue
                e = eps if mode == "head_weighted" else 0.0
                if part == "o_proj":
                    ref[:, sl] = G[:, sl] + sum(w[c] * deltas[c][:, sl] for c in range(3)) / (sum(w) + e)
                else:
                    ref[sl] = G[sl] + sum(w[c] * deltas[c][sl] for c in range(3)) / (sum(w) + e)
        else:
            holders = [c for c in range(3) if key in ups[c].arrays]
            n = [sizes[c] for c in holders]
            ref = G + sum(nc * deltas[c] for nc, c in zip(n, holders)) / sum(n)
        np.testing.assert_allclose(out[key].numpy(), ref, rtol=1e-5, atol=1e-5, err_msg=key)
    k0 = f"base_model.model.{arch.part_name(0, 'k')}.lora_B.default.weight"
    assert torch.equal(out[k0][hd:], g[k0][hd:])  # kv head 1 of layer 0: no query head kept


@pytest.mark.parametrize("prune", ["parameters", "forward"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_decoder_classification_head_runs_a_round(arch, prune, tmp_path, tiny_lm_dirs, tiny_data_dir):
    from fedslice.run.engine import Simulation
    cfg = validate_config({"seed": 0, "threads": 1, "data": {"path": str(tiny_data_dir), "max_length": 16},
                           "model": {"name": str(tiny_lm_dirs[arch])},
                           "lora": {"r": 4, "alpha": 8, "targets": ["q", "k", "v", "o"]},
                           "method": {"name": "heads", "sparsity": 0.75, "prune": prune},
                           "federation": {"num_clients": 2, "clients_per_round": 2, "rounds": 1,
                                          "local_steps": 2, "batch_size": 8},
                           "output": {"dir": str(tmp_path), "progress": False, "plots": False}})
    method, data = setup(cfg)
    assert method.task.head == "sequence_classification"
    _, records, summary = Simulation(cfg, method, data).run()
    assert 0 <= summary["test_accuracy"] <= 1 and summary["sparsity_mean"] == 0.75
    assert not records[0].get("excluded")


def test_bart_classifier_importance_reads_the_shifted_decoder_input(tiny_lm_dirs):
    """BART's sequence classifier has no decoder_input_ids in its batch: the decoder reads the
    input shifted right after the start token, and its families are scored on those tokens."""
    import transformers as T
    from conftest import smollm2_tokenizer, tiny_lm_config
    from fedslice.data.batching import TokenizedSplit
    tok = smollm2_tokenizer()
    model = T.BartForSequenceClassification(tiny_lm_config("bart", len(tok), tok.pad_token_id,
                                                           tok.eos_token_id)).eval()
    g = torch.Generator().manual_seed(0)
    ids = [torch.cat([torch.randint(5, 400, (n,), generator=g), torch.tensor([tok.eos_token_id])])
           for n in (6, 6, 6)]  # one <eos> per row: the classifier reads it (pad may be <eos>)
    split = TokenizedSplit(ids, None, torch.tensor([0, 1, 0]), tok.pad_token_id)
    scores = head_importance(model, split, [tok.eos_token_id, tok.pad_token_id], 2)
    assert set(scores) == {"encoder.self", "decoder.self", "decoder.cross"}
    assert all(s.shape == (2, 4) and bool(((s > 0) & (s <= 1)).all()) for s in scores.values())
