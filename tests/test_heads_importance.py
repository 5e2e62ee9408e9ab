"""Heads' importance sources (issue 35 part 1): the separate pass (the paper, the default) and
``method.importance_source = "first_step"`` (scores from the first training step's own forward),
on the tiny 2-layer, 4-head BERT."""

import pytest
import torch
from fedslice.errors import ConfigError

from fedslice import measure
from fedslice.api import setup
from fedslice.data.partition import sample_rows
from fedslice.experiment import validate_config
from fedslice.methods.heads import ALPHA, KEPT
from fedslice.slicing.heads import head_importance


def _cfg(tiny_cfg_dict, federation=None, **method):
    d = dict(tiny_cfg_dict)
    d["lora"] = {"r": 4, "alpha": 8, "targets": ["q", "v", "o"]}
    d["federation"] = {**d["federation"], "pack": False, **(federation or {})}  # first_step: unpacked
    d["method"] = {"name": "heads", "sparsity": 0.5, **method}
    return validate_config(d)


def _fit(method, data, client=0, seed=3, examples=None):
    state = method.initial_state()
    payload = method.strategy.configure_train(1, state, [client])[client]
    split = data.client(client)
    if examples is not None:
        split = split.subset(torch.arange(examples))
    return state, payload, method.fit(payload, split, seed)


def _assert_scores_like_the_pass(method, data, payload, reply):
    """The reply's head scores are the pass's on the client's 8 examples, with the payload's
    weights (training moved the model), to float rounding; so are the kept heads."""
    model, _ = method.client_model(payload)
    ref = head_importance(model, data.client(0).subset(torch.arange(8)), method.special_ids)
    ref = torch.cat([ref[f.name] for f in method.arch.attention_outputs])
    got = torch.tensor(reply.metrics["head_importance"]).view_as(ref)
    torch.testing.assert_close(got, ref.float(), atol=2e-6, rtol=0)
    assert torch.equal(reply.arrays[KEPT], method.keep(ref, 3, method.opts.sparsity))


def _no_attention_dropout(model):
    """Attention dropout off (the eager kernel reads ``self.dropout.p`` in training mode)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0


# -- options ---------------------------------------------------------------------------------
def test_bad_importance_source_names_the_field(tiny_cfg_dict):
    with pytest.raises(ConfigError, match="method.importance_source"):
        _cfg(tiny_cfg_dict, importance_source="bogus")


@pytest.mark.parametrize("extra,federation,why", [
    ({"prune": "forward"}, None, "prune='forward'"),
    ({}, {"weight_decay": 0.01}, "weight_decay"),
])
def test_first_step_refuses_what_it_cannot_run_naming_the_fields(tiny_cfg_dict, extra, federation, why):
    with pytest.raises(ConfigError, match="importance_source=.first_step.") as e:
        _cfg(tiny_cfg_dict, federation, importance_source="first_step", **extra)
    assert why in str(e.value)


# -- the default is today's behaviour -----------------------------------------------------------
def test_default_is_the_pass_and_explicit_pass_gives_the_same_reply(tiny_cfg_dict):
    """``importance_source`` defaults to 'pass', and naming it changes nothing (bit for bit); the
    stored-digest test (tests/test_digest.py, heads on bert/llama/vit) pins the default's results
    to those taken before the option existed."""
    replies = []
    for extra in ({}, {"importance_source": "pass"}):
        method, data = setup(_cfg(tiny_cfg_dict, sparsity=0.75, **extra))
        assert method.opts.importance_source == "pass"
        replies.append(_fit(method, data)[2])
    a, b = replies
    assert a.arrays.keys() == b.arrays.keys()
    for k in a.arrays:
        assert torch.equal(a.arrays[k], b.arrays[k]), k
    assert a.metrics["flops_importance"] == b.metrics["flops_importance"] > 0


# -- FLOPs accounting --------------------------------------------------------------------------
def test_pass_flops_are_the_counted_importance_pass(tiny_cfg_dict):
    """``flops_importance`` is what the counter gives around the pass that ran, on the seeded
    sample of ``importance_max_examples``."""
    method, data = setup(_cfg(tiny_cfg_dict, sparsity=0.75, importance_max_examples=5))
    _, _, reply = _fit(method, data, seed=3)
    split = data.client(0)
    sample = split.subset(sample_rows(len(split), 5, 3))
    with measure.count_flops() as fc:
        head_importance(method.model, sample, method.special_ids, method.opts.importance_batch_size)
    assert reply.metrics["flops_importance"] == float(fc.total) > 0


def test_first_step_runs_no_extra_forward(tiny_cfg_dict):
    """first_step: no importance FLOPs, and the training FLOPs are exactly a dense client's
    (same client, seed and batches; the eager first step is counted like sdpa's)."""
    method, data = setup(_cfg(tiny_cfg_dict, sparsity=0.75, importance_source="first_step"))
    _, _, reply = _fit(method, data)
    dense, ddata = setup(_cfg(tiny_cfg_dict, sparsity=0.0, pruning="none", aggregation="fedavg"))
    _, _, dreply = _fit(dense, ddata)
    assert reply.metrics["flops_importance"] == 0.0
    assert reply.metrics["flops_measured"] == dreply.metrics["flops_measured"] > 0
    assert reply.metrics["tokens"] == dreply.metrics["tokens"]


# -- the capture -------------------------------------------------------------------------------
def test_first_step_scores_equal_the_pass_on_the_same_batch(tiny_cfg_dict):
    """Without attention dropout, the scores captured from the first training batch (all of the
    client's 8 examples: batch_size 8) are the pass's scores on those examples (to float
    rounding), so the kept heads are the same."""
    method, data = setup(_cfg(tiny_cfg_dict, sparsity=0.5, importance_source="first_step"))
    _no_attention_dropout(method.model)
    _, payload, reply = _fit(method, data, examples=8)
    _assert_scores_like_the_pass(method, data, payload, reply)


def test_first_step_keeps_pruned_tensors_exactly_and_trains_like_the_pass(tiny_cfg_dict):
    """Given the same keep-mask, first_step's upload equals the parameter-pruned training's (to
    float rounding), and the full model's pruned rows (and a headless layer's adapter) keep
    exactly the payload's values."""
    fixed = torch.tensor([[True, False, True, False], [False, False, False, False]])
    replies, methods = {}, {}
    for src in ("pass", "first_step"):
        method, data = setup(_cfg(tiny_cfg_dict, sparsity=0.75, importance_source=src))
        _no_attention_dropout(method.model)
        method.keep = lambda alpha, seed, dims=None, sparsity=None: fixed.clone()
        state, payload, replies[src] = _fit(method, data)
        methods[src] = (method, state)
    a, b = replies["pass"], replies["first_step"]
    assert torch.equal(b.arrays[KEPT], fixed)
    assert a.arrays.keys() == b.arrays.keys()
    for k in a.arrays:
        if k not in (KEPT, ALPHA):
            assert a.arrays[k].shape == b.arrays[k].shape, k
            torch.testing.assert_close(a.arrays[k], b.arrays[k], atol=1e-5, rtol=1e-4)
    method, state = methods["first_step"]
    arch, hd = method.arch, method.dims["head_dim"]
    params = dict(method.model.named_parameters())
    q_b = next(n for n in state if f"{arch.part_name(0, 'q')}.lora_B" in n)
    o_a = next(n for n in state if f"{arch.part_name(0, 'o')}.lora_A" in n)
    pruned = [*range(hd, 2 * hd), *range(3 * hd, 4 * hd)]
    assert torch.equal(params[q_b].detach()[pruned], state[q_b][pruned])
    assert torch.equal(params[o_a].detach()[:, pruned], state[o_a][:, pruned])
    assert not torch.equal(params[q_b].detach()[:hd], state[q_b][:hd])  # a kept head trained
    for n in state:  # layer 1 keeps no head: its attention adapter never moved
        if f"{arch.part_name(1, 'q')}." in n or f"{arch.part_name(1, 'v')}." in n \
                or f"{arch.part_name(1, 'o')}." in n:
            assert torch.equal(params[n].detach(), state[n]), n


@pytest.mark.parametrize("source", ["first_step", "training"])
def test_captured_steps_run_under_gradient_checkpointing(tiny_cfg_dict, source):
    """A client the planner gives checkpointing: the backward recomputes the captured step's
    forward, which must run with the eager attention it ran with (sdpa there: the recomputed
    tensors differ and torch raises); the run's attention is back after training, and the
    scores are the unchecked client's."""
    replies = {}
    for ckpt in (False, True):
        method, data = setup(_cfg(tiny_cfg_dict, sparsity=0.5, importance_source=source))
        _no_attention_dropout(method.model)
        base = method.model.get_base_model() if hasattr(method.model, "get_base_model") else method.model
        assert base.config._attn_implementation == "sdpa"
        state = method.initial_state()
        payload = method.strategy.configure_train(1, state, [0])[0]
        payload.config["checkpointing"] = ckpt
        replies[ckpt] = method.fit(payload, data.client(0), 3)
        assert base.config._attn_implementation == "sdpa"
    torch.testing.assert_close(torch.tensor(replies[True].metrics["head_importance"]),
                               torch.tensor(replies[False].metrics["head_importance"]))


def test_first_step_runs_end_to_end(tiny_cfg_dict):
    from fedslice.api import run_experiment
    import json
    run = run_experiment(_cfg(tiny_cfg_dict, sparsity=0.75, importance_source="first_step"))
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    ms = [m for r in recs for m in r["client_metrics"]]
    assert ms and all(m["flops_importance"] == 0.0 and m["heads_kept"] == 2 for m in ms)


def test_first_step_under_raffm_scores_the_sub_model(tiny_cfg_dict, tmp_path):
    """raffm+heads: a sliced client captures its sub-model's scores; the masks travel in the full
    model's layout."""
    import json
    from conftest import method_options
    from fedslice.api import run_experiment
    d = json.loads(json.dumps(tiny_cfg_dict))
    d["federation"] = {**d["federation"], "num_clients": 4, "clients_per_round": 2, "rounds": 2,
                       "local_steps": 2, "pack": False}
    d["method"] = {"name": "raffm+heads", **method_options("raffm", tmp_path), "sparsity": 0.5,
                   "importance_source": "first_step"}
    run = run_experiment(validate_config(d), tmp_path / "composed", progress=False)
    ms = [m for line in (run / "metrics.jsonl").read_text().splitlines()
          for m in json.loads(line)["client_metrics"] if m.get("num_examples")]
    assert ms and all(m["flops_importance"] == 0.0 for m in ms)
    assert all(len(m["head_kept"]) == 8 for m in ms)


def test_training_source_keeps_the_top_heads_of_all_training_batches(tiny_cfg_dict):
    """importance_source='training': no importance FLOPs, dense's training FLOPs, and the kept
    heads are the top heads of the scores over every training batch (without dropout: the pass
    over the examples those batches drew, here every example once: 8 examples, 1 step of 8)."""
    method, data = setup(_cfg(tiny_cfg_dict, {"local_steps": 1}, sparsity=0.5,
                              importance_source="training"))
    _no_attention_dropout(method.model)
    _, payload, reply = _fit(method, data, examples=8)
    assert reply.metrics["flops_importance"] == 0.0
    _assert_scores_like_the_pass(method, data, payload, reply)
    with pytest.raises(ConfigError, match="importance_source='training'"):
        _cfg(tiny_cfg_dict, importance_source="training", prune="forward")


# -- packed batches -------------------------------------------------------------------------------
@pytest.mark.parametrize("family,sinks", [("bert", 0), ("llama", 0), ("llama", 1)])
def test_packed_batch_scores_equal_the_padded_batchs(family, sinks, tiny_model_dir, tiny_lm_dirs):
    """The confidence summed over a packed batch's examples (each query's keys its own
    example's) equals the padded batch's, for an encoder and a causal decoder (with sink keys
    dropped per example), to float rounding."""
    from transformers import AutoModel

    from fedslice.data.batching import TokenizedSplit
    from fedslice.data.packing import model_inputs
    from fedslice.slicing.heads import batch_confidence_sums, ensure_eager_attention

    folder = tiny_model_dir if family == "bert" else tiny_lm_dirs["llama"]
    model = AutoModel.from_pretrained(folder).eval()
    ensure_eager_attention(model)
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(5, 200, (int(n),), generator=g) for n in torch.randint(2, 12, (9,), generator=g)]
    split = TokenizedSplit(ids, None, torch.zeros(9, dtype=torch.int64), 0)
    special = torch.tensor([0, 1, 2])
    padded, packed = split.collate(list(range(9))), split.collate_packed(list(range(9)))
    assert packed["input_ids"].shape[0] < 9  # rows hold several examples
    with torch.no_grad():
        out_p = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"],
                      output_attentions=True)
        inputs = model_inputs(packed, model, causal=family == "llama")
        out_k = model(**{k: v for k, v in inputs.items() if k != "token_type_ids"}, output_attentions=True)
    ref = batch_confidence_sums(out_p, padded, model, special, sinks)
    got = batch_confidence_sums(out_k, packed, model, special, sinks)
    assert ref.keys() == got.keys() and ref
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=1e-5, rtol=0)


def test_first_step_on_packed_batches_scores_like_the_pass(tiny_cfg_dict):
    """federation.pack = true: the first step's packed forward scores the heads as the pass
    does on those examples (without attention dropout), so the kept heads are the same."""
    method, data = setup(_cfg(tiny_cfg_dict, {"pack": True}, sparsity=0.5, importance_source="first_step"))
    _no_attention_dropout(method.model)
    _, payload, reply = _fit(method, data, examples=8)
    _assert_scores_like_the_pass(method, data, payload, reply)


@pytest.mark.parametrize("source", ["first_step", "training"])
def test_captured_clients_reuse_the_first_clients_flop_rates(tiny_cfg_dict, monkeypatch, source):
    """Each client builds its own capturing loss, but the step it computes is the same: on packed
    batches the counter runs on the first client's first step only, as for dense clients, and
    every client's FLOPs are a dense client's on the same batches (to the scoring's own einsum
    over packed examples, counted in the first client's step: 0.1% here)."""
    from fedslice.fl import client as client_mod
    from fedslice.methods.heads.capture import CapturingLoss

    method, data = setup(_cfg(tiny_cfg_dict, {"pack": True}, sparsity=0.5, importance_source=source))
    a = CapturingLoss(method.task.loss, ["x"], [], 0, print, source == "training")
    b = CapturingLoss(method.task.loss, ["x"], [], 0, len, source == "training")
    key = lambda loss: client_mod.structure(method.model, loss, False, ())  # noqa: E731
    assert key(a) == key(b) != key(method.task.loss)
    counted = []
    real = client_mod.count_flops

    def spy(enabled=True, **kw):
        counted.append(enabled)
        return real(enabled=enabled, **kw)

    monkeypatch.setattr(client_mod, "count_flops", spy)
    flops = [_fit(method, data, client=c)[2].metrics["flops_measured"] for c in (0, 1, 2)]
    assert sum(counted) == 1  # the first client's first step
    dense, ddata = setup(_cfg(tiny_cfg_dict, {"pack": True}, sparsity=0.0, pruning="none",
                              aggregation="fedavg"))
    ref = [_fit(dense, ddata, client=c)[2].metrics["flops_measured"] for c in (0, 1, 2)]
    assert flops == pytest.approx(ref, rel=2e-3)
