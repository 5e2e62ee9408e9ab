"""Heads pruned inside RaFFM sub-models under grouped-query attention, in process, with and
without secure aggregation: a tiny LLaMA with SmolLM2's groups (9 query heads over 3 key/value
heads), whose 0.75 tier keeps 4 query heads per layer, 3 + 1 of two groups (not equal blocks of
the sub-model's heads). Every reply is accepted, and the new global state is, on every
coordinate, the mean of the replies of the clients that hold it (weighted by their examples),
the held rows derived here from the query heads each client kept; raffm alone and heads alone
on the same model too."""

from __future__ import annotations

import copy

import pytest
import torch

from fedslice.api import setup
from fedslice.experiment import validate_config
from fedslice.methods.heads import KEPT
from fedslice.models.arch import arch_for
from fedslice.run.engine import Simulation
from fedslice.slicing.keys import key_info
from fedslice.slicing.spec import spec_from_dict, stack_list

H, KV, HD = 9, 3, 4  # SmolLM2's grouped-query attention: 3 query heads per key/value head
TIERS = [{"share": 0.5, "flops": 0.5}, {"share": 0.5, "flops": 0.75}]

pytestmark = pytest.mark.xdist_group("heads_gqa")  # one worker makes the tiny model once


@pytest.fixture(scope="module")
def gqa_dir(tmp_path_factory):
    """2 layers of 9 query heads over 3 key/value heads of 4; a wide FFN, so that a sub-model's
    width moves its FLOPs (SmolLM2's vocabulary's LM head would otherwise be nearly all of them
    and the planner would refuse both tiers)."""
    import transformers as T

    from tests.conftest import smollm2_tokenizer

    folder = tmp_path_factory.mktemp("tiny-llama-gqa")
    tok = smollm2_tokenizer()
    config = T.LlamaConfig(vocab_size=len(tok), hidden_size=H * HD, num_hidden_layers=2,
                           num_attention_heads=H, num_key_value_heads=KV, intermediate_size=16384,
                           max_position_embeddings=64, tie_word_embeddings=True,
                           pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id,
                           eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    T.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _cfg(gqa_dir, tiny_data_dir, tmp_path, method: str, secure: bool, threshold=None):
    method, _, source = method.partition(":")  # "raffm+heads:first_step": scored in training
    opts = {"raffm+heads": {"sparsity": 0.5, "aggregation": "fedavg", "width_steps": 4, "tiers": TIERS},
            "raffm": {"width_steps": 4, "tiers": TIERS},
            "heads": {"sparsity": 0.5, "aggregation": "fedavg"}}[method]
    d = {"seed": 0, "threads": 1, "data": {"path": str(tiny_data_dir), "max_length": 16},
         "model": {"name": str(gqa_dir)},
         "task": {"prompt": "Review: {sentence}\nSentiment:",
                  "label_words": {"0": " negative", "1": " positive"}},
         "lora": {"r": 4, "alpha": 8, "targets": ["q", "v"]},
         "federation": {"num_clients": 4, "clients_per_round": 4, "rounds": 1, "local_steps": 1,
                        "batch_size": 4, "lr": 5e-3},
         "method": {"name": method, "importance_max_examples": 8, **opts,
                    **({"importance_source": source} if source else {})}
         if "heads" in method else {"name": method, **opts},
         "evaluation": {"every": 1, "batch_size": 32},
         "output": {"dir": str(tmp_path / "runs"), "progress": False, "plots": False}}
    if secure:
        d["privacy"] = {"secure_aggregation": True, "secagg_clip_range": 0.5,
                        **({"secagg_threshold": threshold} if threshold else {})}
    return validate_config(copy.deepcopy(d))


def _held_rows(info, heads: list[int]) -> torch.Tensor | None:
    """Full-model rows of a q/v LoRA tensor that a client keeping query heads ``heads`` (its
    slice's order) trains, along its head axis; None: the whole tensor (LoRA A of q/v)."""
    if info.axis is None:
        return None
    if info.kind == "kv":  # a key/value head is read by the query heads of its group
        heads = list(dict.fromkeys(h // (H // KV) for h in heads))
    return (torch.tensor(heads)[:, None] * HD + torch.arange(HD)).flatten()


def _expected_state(state0, sent, arch):
    """Each coordinate: the examples-weighted mean of the replies holding it (else unchanged)."""
    num = {k: torch.zeros_like(t, dtype=torch.float64) for k, t in state0.items()}
    den = {k: torch.zeros_like(t, dtype=torch.float64) for k, t in state0.items()}
    for payload, arrays, n in sent:
        spec = payload.orders.spec
        outer = stack_list(spec_from_dict(spec))[0] if spec else None
        kept = arrays.get(KEPT, torch.ones(2, H, dtype=torch.bool))
        model = {k: t for k, t in arrays.items() if k != KEPT}
        wanted = set()
        for layer in range(2):
            heads = [h for h in (outer.heads[layer] if outer else range(H)) if kept[layer, h]]
            if not heads:
                continue
            for part in ("q", "v"):
                for ab in ("A", "B"):
                    key = f"base_model.model.{arch.part_name(layer, part)}.lora_{ab}.default.weight"
                    wanted.add(key)
                    t, info = model[key].double(), key_info(arch, key)
                    rows = _held_rows(info, heads)
                    if rows is None:
                        assert t.shape == state0[key].shape, key
                        num[key] += n * t
                        den[key] += n
                    else:
                        assert t.shape[info.axis] == len(rows), (key, t.shape, len(rows))
                        num[key].index_add_(info.axis, rows, n * t)
                        den[key].index_add_(info.axis, rows, torch.full_like(t, float(n)))
        assert set(model) == wanted  # exactly the kept heads' tensors, nothing else
    return {k: torch.where(den[k] > 0, num[k] / den[k].clamp_min(1), state0[k].double())
            for k in state0}


@pytest.mark.parametrize("method,secure", [("raffm+heads", False), ("raffm+heads", True),
                                           ("raffm+heads:first_step", False), ("raffm", False),
                                           ("heads", True)])
def test_gqa_sub_models_every_reply_accepted_and_mean_exact(gqa_dir, tiny_data_dir, tmp_path,
                                                             monkeypatch, method, secure):
    cfg = _cfg(gqa_dir, tiny_data_dir, tmp_path, method, secure)
    m, data = setup(cfg)
    arch = arch_for(m.model)
    sent, before = [], {}
    aggregate = type(m.strategy).aggregate_train

    def spy(self, server_round, state, payloads, replies):  # what reaches the server
        before.update({k: t.detach().clone() for k, t in state.items()})
        sent.extend((payloads[c], {k: t.clone() for k, t in r.arrays.items()}, r.num_examples)
                    for c, r in sorted(replies.items()))
        return aggregate(self, server_round, state, payloads, replies)

    monkeypatch.setattr(type(m.strategy), "aggregate_train", spy)
    state, records, _ = Simulation(cfg, m, data).run()
    (rec,) = records
    assert rec["excluded"] == [] and not rec["skipped"] and len(sent) == 4
    assert all(c["used"] for c in rec["client_metrics"])
    if method.startswith("raffm"):  # the 0.75 tier keeps 3 + 1 query heads of two groups
        specs = [stack_list(spec_from_dict(p.orders.spec))[0] for p, _, _ in sent]
        uneven = [s for s in specs if any(len(s.kv_heads(j)) == 2 and len(s.heads[j]) == 4
                                          for j in range(2))]
        assert uneven and len(specs) - len(uneven) == 2
    if method.startswith("raffm+heads"):  # heads pruned inside it read both groups, or one
        assert any(KEPT in a for _, a, _ in sent)
    want = _expected_state(before, sent, arch)
    # secure: the sums are quantized (2c / 2^29 steps of the summed weight, 4 clients)
    tol = 2e-6 if secure else 1e-6
    changed = 0
    for k, t in want.items():
        assert torch.allclose(state[k].double(), t, atol=tol, rtol=0), (k, (state[k].double() - t).abs().max())
        changed += int(not torch.equal(state[k], before[k]))
    assert changed > 0


def test_a_client_trains_the_key_value_heads_its_kept_query_heads_read(gqa_dir, tiny_data_dir, tmp_path):
    """Parameter pruning inside a 0.75-tier sub-model (3 + 1 query heads of two groups): the
    key/value rows that train are those of the groups of the kept query heads, at their
    positions in the sub-model's key/value heads (not the sub-model's head positions cut into
    equal blocks), and the pruned groups' rows stay frozen."""
    from fedslice.slicing.heads import sub_dims
    from fedslice.slicing.partial import PartialLinear

    m, _ = setup(_cfg(gqa_dir, tiny_data_dir, tmp_path, "raffm+heads", False))
    payloads = m.strategy.configure_train(1, m.initial_state(), [0, 1, 2, 3])
    payload = next(p for p in payloads.values()
                   if len(stack_list(spec_from_dict(p.orders.spec))[0].heads[0]) == 4)
    outer = stack_list(spec_from_dict(payload.orders.spec))[0]
    model, _ = m.client_model(payload)
    dims = sub_dims(m.all_dims, outer)
    arch = arch_for(m.model)
    for keep in ((0, 1), (0, 3), (2, 3), (1, 2)):  # sub-model head positions, in both layers
        kept = torch.zeros(2, 4, dtype=torch.bool)
        kept[:, list(keep)] = True
        sub = m.local_model(model, kept, payload, dims)
        modules = dict(sub.named_modules())
        for layer in range(2):
            full = [outer.heads[layer][p] for p in keep]
            groups = list(dict.fromkeys(h // (H // KV) for h in outer.heads[layer]))
            read = list(dict.fromkeys(h // (H // KV) for h in full))
            rows = torch.tensor([groups.index(g) * HD + i for g in read for i in range(HD)])
            name = f"base_model.model.{arch.part_name(layer, 'v')}.lora_B.default"
            v = modules[name]
            if len(read) == len(groups):  # both groups read: the whole tensor trains
                assert not isinstance(v, PartialLinear) and v.weight.requires_grad
            else:
                assert isinstance(v, PartialLinear) and torch.equal(v.idx, rows), (keep, layer)


def test_gqa_sub_models_secure_round_with_dropouts_after_masking(gqa_dir, tiny_data_dir, tmp_path):
    """raffm+heads on the uneven GQA sub-models under secure aggregation, one client dead before
    masking and one gone after: the round completes with the masked vectors that arrived (the
    gone client's private mask rebuilt from the others' shares) and equals the plain
    aggregation of the same replies."""
    from fedslice.run.engine import client_seed

    cfg = _cfg(gqa_dir, tiny_data_dir, tmp_path, "raffm+heads", True, threshold=2)
    m, data = setup(cfg)
    rule, sim = m.strategy, Simulation(cfg, m, data)
    state, clients = m.initial_state(), [0, 1, 2, 3]
    payloads = rule.configure_train(1, state, clients, 4)
    replies = {}
    sim.runner.fit(m, clients, payloads, data.client, {c: client_seed(0, 1, c) for c in clients},
                   lambda c, r: replies.__setitem__(c, r))
    arrived = {c: replies[c] for c in (0, 1, 2)}  # client 3: no masked vector
    plain = rule.inner.aggregate_train(1, state, payloads, dict(arrived))
    assert plain.used == [0, 1, 2]
    rule.sent = clients
    res = rule.secure_round(1, state, payloads, dict(arrived), {2})  # client 2 gone after masking
    assert not res.skipped and res.used == [0, 1, 2] and res.metrics["secagg_recovered"] == 1
    for k in plain.state:
        assert torch.allclose(res.state[k], plain.state[k], atol=2e-6, rtol=0), k
