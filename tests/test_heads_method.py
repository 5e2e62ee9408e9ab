"""The ``heads`` method end to end on the tiny 2-layer, 4-head BERT."""

import json
import math

import pytest
import torch

from fedslice.experiment import validate_config
from fedslice.errors import ConfigError, ModelError
from fedslice.api import setup
from fedslice.run.engine import Simulation
from fedslice.methods.client_costs import frozen_bottom
from fedslice.methods.heads import ALPHA, KEPT
from fedslice.fl.strategy import Payload


def _cfg(tiny_cfg_dict, **method):
    d = dict(tiny_cfg_dict)
    d["lora"] = {"r": 4, "alpha": 8, "targets": ["q", "v", "o"]}
    d["method"] = {"name": "heads", "sparsity": 0.5, **method}
    return validate_config(d)


@pytest.fixture
def heads_setup(tiny_cfg_dict):
    cfg = _cfg(tiny_cfg_dict, sparsity=0.75)  # global: keep round(0.25 * 8) = 2 of 8 heads
    method, data = setup(cfg)
    return cfg, method, data


def _fit(method, data, client=0, alpha=None, seed=3):
    state = method.initial_state()
    payload = method.strategy.configure_train(1, state, [client])[client]
    if alpha is not None:
        method.importance = lambda d, s, model=None: (alpha, 0.0)
    return state, payload, method.fit(payload, data.client(client), seed)


@pytest.mark.parametrize("prune", ["parameters", "forward"])
def test_upload_holds_only_kept_heads_and_headless_layer_is_skipped(tiny_cfg_dict, prune):
    method, data = setup(_cfg(tiny_cfg_dict, sparsity=0.75, prune=prune, scope="global"))  # a headless layer
    arch, hd = method.arch, method.dims["head_dim"]
    alpha = torch.tensor([[0.9, 0.1, 0.8, 0.2], [0.3, 0.2, 0.1, 0.05]])  # layer 1 keeps none
    state, payload, reply = _fit(method, data, alpha=alpha)
    kept = reply.arrays[KEPT]
    assert kept.tolist() == [[True, False, True, False], [False, False, False, False]]
    torch.testing.assert_close(reply.arrays[ALPHA], alpha * kept)
    names = [k for k in reply.arrays if k not in (KEPT, ALPHA)]
    for part in ("q", "v", "o"):  # nothing of layer 1's attention is uploaded
        assert not any(f"{arch.part_name(1, part)}." in k for k in names), part
    q_b = next(k for k in names if f"{arch.part_name(0, 'q')}.lora_B" in k)
    o_a = next(k for k in names if f"{arch.part_name(0, 'o')}.lora_A" in k)
    assert reply.arrays[q_b].shape[0] == 2 * hd and reply.arrays[o_a].shape[1] == 2 * hd
    full_qb = state[q_b]
    assert not torch.equal(reply.arrays[q_b], full_qb[[*range(0, hd), *range(2 * hd, 3 * hd)]])
    dense = sum(t.numel() * t.element_size() for t in state.values())
    assert reply.metrics["bytes_up"] == sum(t.numel() * t.element_size() for t in reply.arrays.values())
    assert reply.metrics["bytes_up"] < 0.75 * dense
    assert reply.metrics["sparsity"] == 0.75 and reply.metrics["headless_layers"] == 1
    # the server: valid reply, pruned heads and the headless layer unchanged, kept heads moved
    result = method.strategy.aggregate_train(1, state, {0: payload}, {0: reply})
    assert result.used == [0] and not result.excluded
    new = result.state
    q_b1 = q_b.replace(arch.part_name(0, "q"), arch.part_name(1, "q"))
    assert torch.equal(new[q_b1], state[q_b1])
    assert torch.equal(new[q_b][hd:2 * hd], state[q_b][hd:2 * hd])
    assert not torch.equal(new[q_b][:hd], state[q_b][:hd])


def test_client_with_empty_dataset_is_skipped_not_crashed(heads_setup, caplog):
    cfg, method, data = heads_setup
    state = method.initial_state()
    payload = method.strategy.configure_train(1, state, [0])[0]
    empty = data.client(0).subset([])
    with caplog.at_level("WARNING"):
        reply = method.fit(payload, empty, 0)
    assert "no training data" in caplog.text and reply.num_examples == 0
    ok = method.fit(method.strategy.configure_train(1, state, [1])[1], data.client(1), 0)
    result = method.strategy.aggregate_train(1, state, {0: payload, 1: payload}, {0: reply, 1: ok})
    assert result.used == [1] and result.excluded == [{"client": 0, "reason": "num_examples=0 (no training examples)"}]
    assert result.rejected == 1


def test_strategy_rejects_inconsistent_replies(heads_setup):
    cfg, method, data = heads_setup
    state, payload, reply = _fit(method, data)
    s = method.strategy
    assert s.check_reply(state, payload, reply) is None
    bad = type(reply)(dict(reply.arrays), reply.num_examples, reply.metrics)
    bad.arrays[KEPT] = torch.ones_like(reply.arrays[KEPT])  # more heads than the sparsity keeps
    assert "keeps 8 heads, sparsity 0.75 (global) keeps 2" in s.check_reply(state, payload, bad)
    bad.arrays = {k: v for k, v in reply.arrays.items() if k != ALPHA}
    assert "importance" in s.check_reply(state, payload, bad)


@pytest.mark.parametrize("method, message", [
    ({"sparsity": 1.0}, r"method.sparsity"),
    ({"sparsity": 0.95}, r"method.sparsity=0.95 keeps no head"),
    ({"sparsity": 0.9, "scope": "per_layer"}, r"keeps no head .*per_layer"),
])
def test_bad_sparsity_is_a_clear_config_error(tiny_cfg_dict, method, message):
    with pytest.raises(ConfigError, match=message):
        setup(_cfg(tiny_cfg_dict, **method))


def test_no_attention_lora_and_no_eager_attention_are_clear_errors(tiny_cfg_dict, monkeypatch):
    d = dict(tiny_cfg_dict, lora={"r": 4, "alpha": 8, "targets": ["ffn_in"]},
             method={"name": "heads", "sparsity": 0.5})
    with pytest.raises(ConfigError, match="lora.targets"):
        setup(validate_config(d))
    from transformers import PreTrainedModel

    def refuse(self, *a, **k):
        raise ValueError("eager is not supported")
    monkeypatch.setattr(PreTrainedModel, "set_attn_implementation", refuse)
    with pytest.raises(ModelError, match="eager attention"):
        setup(_cfg(tiny_cfg_dict))


def test_model_without_separable_heads_is_a_model_error(heads_setup):
    _, method, _ = heads_setup
    method.dims = {**method.dims, "hidden": method.dims["hidden"] + 2}
    with pytest.raises(ModelError, match="separable attention heads"):
        method._check_heads()


def test_heads_run_end_to_end_with_loss_gap_selection(tiny_cfg_dict):
    from fedslice.api import run_experiment
    tiny_cfg_dict["federation"].update(rounds=3, selection="loss_gap")
    tiny_cfg_dict["output"]["plots"] = True
    cfg = _cfg(tiny_cfg_dict, sparsity=0.5)
    run = run_experiment(cfg)
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    # loss gap: unseen clients first (rounds 1-2 cover all 4), then the largest last losses
    r1, r2, r3 = (set(r["clients"]) for r in records)
    assert r1.isdisjoint(r2) and r1 | r2 == {0, 1, 2, 3}
    last = {m["client"]: m["loss"] for r in records[:2] for m in r["client_metrics"]}
    assert r3 == set(sorted(last, key=last.get)[-2:])
    for m in records[0]["client_metrics"]:
        assert m["sparsity"] == 0.5 and len(m["head_importance"]) == 8 and sum(m["head_kept"]) == 4
        assert m["flops_importance"] > 0 and m["paper_ops"] < m["paper_ops_dense"]
    assert math.isfinite(summary["test_accuracy"]) and summary["sparsity_mean"] == 0.5
    assert summary["paper_ops_mean"] < summary["paper_ops_dense_mean"]
    for png in ("head_importance.png", "head_distance.png"):
        assert (run / png).stat().st_size > 1000, png


def test_heads_prunes_compute_and_upload_against_dense(tiny_cfg_dict):
    """pruning='none' + fedavg is FedPETuning (B1); 50% pruning costs less compute and upload."""
    sims = {}
    for name, method in (("dense", {"pruning": "none", "aggregation": "fedavg"}),
                         ("pruned", {"sparsity": 0.5, "scope": "per_layer", "prune": "forward"})):
        cfg = _cfg(tiny_cfg_dict, **method)
        tiny_cfg_dict["federation"]["rounds"] = 1
        m, data = setup(_cfg(tiny_cfg_dict, **method))
        _, records, summary = Simulation(cfg, m, data).run()
        sims[name] = summary
    dense, pruned = sims["dense"], sims["pruned"]
    assert pruned["flops_measured_mean"] < 0.9 * dense["flops_measured_mean"]
    assert pruned["bytes_up_mean"] < dense["bytes_up_mean"]
    assert pruned["flops_analytic_mean"] < dense["flops_analytic_mean"]
    assert dense["sparsity_mean"] == 0.0


# --- prune = "parameters" (paper §3.1) vs "forward" --------------------------------------------

def test_partial_model_runs_the_full_forward_and_trains_only_kept_slices(heads_setup):
    from fedslice.slicing.heads import mask_spec
    from fedslice.slicing.partial import PartialLinear, partial_model
    from fedslice.slicing.state import extract_state
    _, method, data = heads_setup
    torch.manual_seed(0)
    for p in method.trainable().values():  # LoRA B is zero at init: make every slice matter
        p.data.normal_(0, 0.2)
    kept = torch.tensor([[True, False, True, False], [False, False, False, False]])
    spec = mask_spec(kept, method.dims)
    sub = partial_model(method.model, spec, method.arch)
    batch = next(iter(__import__("fedslice.data.batching", fromlist=["x"]).iter_batches(
        data.client(0), range(len(data.client(0))), 8, shuffle=False, generator=None)))
    batch.pop("labels")
    method.model.eval(), sub.eval()
    with torch.no_grad():
        full, part = method.model(**batch).logits, sub(**batch).logits
    assert (full - part).abs().max() <= 1e-6
    assert sum(isinstance(m, PartialLinear) for m in sub.modules()) == 2  # layer 0: q, v B rows
    assert sum(hasattr(m, "_partial") for m in sub.modules()) == 1  # and o's A columns
    trainable = {n: p for n, p in sub.named_parameters() if p.requires_grad}
    expected = extract_state(method.initial_state(), spec, method.arch)
    headless = method.arch.part_name(1, "q").rpartition(".")[0].rpartition(".")[0]  # layer 1 attention
    assert not any(headless + "." in n for n in trainable)
    for n, p in trainable.items():
        assert n in expected and p.shape == expected[n].shape, n
    assert set(expected) - set(trainable) == {n for n in expected if headless + "." in n}
    # the full model's tensors are untouched by training the partial one
    before = {n: p.detach().clone() for n, p in method.trainable().items()}
    sum(p.sum() for p in trainable.values()).backward()
    torch.optim.SGD(trainable.values(), lr=1.0).step()
    q_b = next(n for n in before if f"{method.arch.part_name(0, 'q')}.lora_B" in n)
    assert torch.equal(method.trainable()[q_b], before[q_b])


def test_two_prune_modes_send_the_same_bytes_and_differ_in_flops(tiny_cfg_dict):
    alpha = torch.tensor([[0.9, 0.1, 0.8, 0.2], [0.3, 0.2, 0.1, 0.05]])
    replies = {}
    for name, method_opts in (("dense", {"pruning": "none", "aggregation": "fedavg"}),
                              ("parameters", {"sparsity": 0.75, "prune": "parameters"}),
                              ("forward", {"sparsity": 0.75, "prune": "forward", "scope": "global"})):
        method, data = setup(_cfg(tiny_cfg_dict, **method_opts))
        state, payload, reply = _fit(method, data, alpha=alpha)
        assert method.strategy.check_reply(state, payload, reply) is None
        replies[name] = reply
    dense, par, fwd = (replies[k].metrics for k in ("dense", "parameters", "forward"))
    assert par["bytes_up"] == fwd["bytes_up"] < dense["bytes_up"]
    assert {k: t.shape for k, t in replies["parameters"].arrays.items()} == \
        {k: t.shape for k, t in replies["forward"].arrays.items()}
    # forward drops 6 of 8 heads from both passes; parameters only the pruned slices' weight grads
    assert fwd["flops_measured"] < 0.9 * par["flops_measured"]
    assert par["flops_measured"] < dense["flops_measured"]
    assert fwd["flops_analytic"] < par["flops_analytic"] < dense["flops_analytic"]


@pytest.mark.parametrize("prune", ["parameters", "forward"])
def test_analytic_flops_stop_the_backward_above_a_headless_bottom_layer(tiny_cfg_dict, one_length_data_dir, prune):
    """Layer 0 keeps no head, so nothing in it trains (LoRA on q, v, o only) and autograd's
    backward stops above it: the analytic count leaves out its input-gradients as the measured
    one does. On sentences of one length the two agree exactly, as for the dense run (the
    count also leaves out the lowest trained layer's LoRA A and key input-gradients; without the
    early stop it was 39% over here). Under ``prune="forward"`` the headless layer's sliced o keeps its LoRA B
    (hidden x r, a zero gradient): frozen too, so the backward does not reach layer 0's FFN."""
    tiny_cfg_dict["data"]["path"] = str(one_length_data_dir)
    # padded: every batch then has one shape (packed rows differ in length from batch to batch)
    tiny_cfg_dict["federation"] = {**tiny_cfg_dict["federation"], "pack": False}
    alpha = torch.tensor([[0.1, 0.05, 0.02, 0.01], [0.9, 0.8, 0.3, 0.2]])  # layer 0 keeps none
    ratios = {}
    for name, opts in (("dense", {"pruning": "none", "aggregation": "fedavg"}),
                       ("pruned", {"sparsity": 0.5, "prune": prune, "scope": "global"})):
        method, data = setup(_cfg(tiny_cfg_dict, **opts))
        assert len(set(data.train.lengths.tolist())) == 1
        _, _, reply = _fit(method, data, alpha=alpha)
        m = reply.metrics
        ratios[name] = m["flops_analytic"] / m["flops_measured"]
        if name == "pruned":
            assert m["headless_layers"] == 1
            payload = Payload(arrays=method.initial_state(), config={})
            seen = frozen_bottom(method, method.local_model(method.model, reply.arrays[KEPT], payload))[0]
    assert ratios["dense"] == pytest.approx(1.0, rel=1e-9)
    assert ratios["pruned"] == pytest.approx(1.0, rel=1e-9), ratios
    assert seen == 1


def test_forward_mode_clients_one_after_another_in_one_process(tiny_cfg_dict):
    """A forward-mode client's sub-model is cut after the full model's output-capturing hooks
    are on it; a second client's importance pass then records each layer once (transformers
    marks only the module whose forward first asked, and cutting installed a second set on the
    task model: every layer twice, a (2L, H) score)."""
    d = json.loads(json.dumps(tiny_cfg_dict))
    d["method"] = {"name": "heads", "prune": "forward", "sparsity": 0.5}
    d["federation"].update(num_clients=4, clients_per_round=4, rounds=1)
    d["compute"] = {"workers": 1}
    cfg = validate_config(d)
    method, data = setup(cfg)
    _, records, _ = Simulation(cfg, method, data).run()
    assert records[0]["clients"] == [0, 1, 2, 3] and not records[0].get("excluded")
