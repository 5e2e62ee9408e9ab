"""FedPFT: saliency, proxy construction, KD losses, APoZ, neuron-level KD, plug-in, end to end."""

import copy

import pytest
import torch

from conftest import padded_batch, save_tiny_model
from fedslice.experiment import validate_config
from fedslice.distill.apoz import (aggregate_apoz, apoz_report, near_zero_counts, select_neurons,
                                   split_report)
from fedslice.distill.losses import hidden_loss, layer_kd_loss, weight_loss
from fedslice.errors import ConfigError
from fedslice.api import setup
from fedslice.run.engine import Simulation
from fedslice.fl.strategy import Reply
from fedslice.methods.fedpft import compressed_layers, proxy_spec, top_neurons
from fedslice.models.arch import arch_for
from fedslice.slicing.salience import salience

FFN = 64  # the tiny model's FFN width (hidden 32)


@pytest.fixture(scope="module")
def model4_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-bert4"), num_layers=4)


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    lines = [f"the film number {i} tells a story of {i % 7} friends and a plot" for i in range(200)]
    path.write_text("\n\n".join(lines) + "\n")
    return path


@pytest.fixture
def pft_cfg(tiny_cfg_dict, model4_dir, corpus_file, tmp_path):
    tiny_cfg_dict["model"]["name"] = str(model4_dir)
    tiny_cfg_dict["lora"]["targets"] = ["q", "k", "v", "o"]
    tiny_cfg_dict["method"] = {
        "name": "fedpft", "keep_ratio": 0.25, "align_every": 1, "align_steps": 2,
        "distill": {"corpus": str(corpus_file), "steps": 3, "batch_size": 4, "max_length": 16,
                    "cache_dir": str(tmp_path / "cache")}}
    return tiny_cfg_dict


def _batch():
    return padded_batch()


def _logits(model):
    model.eval()
    with torch.no_grad():
        return model(**_batch()).logits


# -- sub-FM construction ----------------------------------------------------------------------

def test_saliency_on_hand_built_ffn(tiny_model_dir):
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir)
    arch, dims = arch_for(model), arch_for(model).dims(model.config)
    w_in = torch.zeros(FFN, 32)  # (F, d): row j = W1's neuron j
    w_out = torch.zeros(32, FFN)  # (d, F): column j = W2's neuron j
    w_in[3, :2] = torch.tensor([3.0, 4.0])  # |row| = 5
    w_out[:, 3] = 0.0
    w_in[10, 0], w_out[0, 10] = 1.0, 2.0  # sqrt(1 + 4)
    w_out[5:7, 20] = torch.tensor([6.0, 8.0])  # |column| = 10
    with torch.no_grad():
        arch.part(model, 0, "ffn_in").weight.copy_(w_in)
        arch.part(model, 0, "ffn_out").weight.copy_(w_out)
    sal = salience(model.state_dict(), arch, dims, "l2")[0].neurons
    expected = torch.zeros(FFN)
    expected[3], expected[10], expected[20] = 5.0, 5.0 ** 0.5, 10.0
    torch.testing.assert_close(sal, expected)
    assert top_neurons(sal, 2) == (3, 20)  # the top 2, in their original order
    spec = proxy_spec([sal, sal], dims, 3 / FFN, [0])
    assert spec.neurons[0] == (3, 10, 20) and spec.neurons[1] == tuple(range(FFN))


def test_compressed_layers_and_whole_layer_errors():
    assert compressed_layers([0, -1], 6) == [1, 2, 3, 4]
    assert compressed_layers([], 3) == [0, 1, 2]
    for bad in ([6], [-7]):
        with pytest.raises(ConfigError, match="method.whole_layers"):
            compressed_layers(bad, 6)


@pytest.mark.parametrize("ratio, msg", [(0, "keep_ratio"), (1.5, "keep_ratio"), (-0.1, "keep_ratio")])
def test_bad_keep_ratio_names_field(pft_cfg, ratio, msg):
    pft_cfg["method"]["keep_ratio"] = ratio
    with pytest.raises(ConfigError, match=f"method.{msg}"):
        validate_config(pft_cfg)


def test_out_of_range_whole_layer(pft_cfg):
    pft_cfg["method"]["whole_layers"] = [0, 4]
    with pytest.raises(ConfigError, match="method.whole_layers: layer 4 is out of range"):
        setup(validate_config(pft_cfg))


def test_empty_corpus_and_client_data_corpus(pft_cfg, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n\n")
    pft_cfg["method"]["distill"]["corpus"] = str(empty)
    with pytest.raises(ConfigError, match="method.distill.corpus.*empty"):
        setup(validate_config(pft_cfg))
    pft_cfg["method"]["distill"]["corpus"] = pft_cfg["data"]["path"]
    with pytest.raises(ConfigError, match="method.distill.corpus.*clients' data"):
        setup(validate_config(pft_cfg))
    pft_cfg["method"]["distill"]["corpus"] = str(tmp_path / "missing.txt")
    with pytest.raises(ConfigError, match="method.distill.corpus.*does not exist"):
        setup(validate_config(pft_cfg))


def test_keep_ratio_one_proxy_equals_full_model(pft_cfg):
    pft_cfg["method"]["keep_ratio"] = 1.0
    method, _ = setup(validate_config(pft_cfg))
    assert method.compressed == [] and method.kd_before is None
    torch.testing.assert_close(_logits(method.proxy), _logits(method.model), rtol=0, atol=0)


def test_proxy_widths_and_sharing(pft_cfg):
    pft_cfg["method"]["kd"] = "none"
    method, _ = setup(validate_config(pft_cfg))
    arch = method.arch
    assert method.compressed == [1, 2]
    widths = [arch.part(method.proxy, l, "ffn_in").weight.shape[0] for l in range(4)]
    assert widths == [FFN, FFN // 4, FFN // 4, FFN]
    # attention (and its LoRA) and the whole layers are the full model's own modules
    assert arch.part(method.proxy, 1, "q") is arch.part(method.model, 1, "q")
    assert arch.part(method.proxy, 0, "ffn_in") is arch.part(method.model, 0, "ffn_in")
    # the compressed b2 is a copy: distilling it never touches the full model
    assert arch.part(method.proxy, 1, "ffn_out").bias is not arch.part(method.model, 1, "ffn_out").bias


# -- losses -----------------------------------------------------------------------------------

def test_kd_loss_has_gradients_for_both_terms():
    torch.manual_seed(0)
    t_in, t_out = torch.randn(8, 4), torch.randn(4, 8)  # teacher FFN: F=8, d=4
    s_in = t_in[:3].clone().requires_grad_(True)  # 3 kept neurons
    s_out = t_out[:, :3].clone().requires_grad_(True)
    teacher_h = [torch.randn(2, 5, 4) for _ in range(2)]
    student_h = [h + 0.1 * torch.randn_like(h) for h in teacher_h]
    student_h = [h.requires_grad_(True) for h in student_h]
    mask = torch.ones(2, 5)
    total, parts = layer_kd_loss(student_h, teacher_h, mask, {1: (s_in, s_out)}, {1: (t_in, t_out)}, mu=0.5)
    assert parts["hidden"] > 0 and parts["weight"] > 0
    total.backward()
    assert all(h.grad is not None and h.grad.abs().sum() > 0 for h in student_h)  # output term
    assert s_in.grad.abs().sum() > 0 and s_out.grad.abs().sum() > 0  # weight term
    # the weight term alone moves W1'W2' towards W1W2 (a real gradient, not built from .data)
    s_in.grad = s_out.grad = None
    wl = weight_loss((s_in, s_out), (t_in, t_out))
    wl.backward()
    with torch.no_grad():
        after = weight_loss((s_in - 0.01 * s_in.grad, s_out - 0.01 * s_out.grad), (t_in, t_out))
    assert after < wl


def test_hidden_loss_ignores_padding():
    t = torch.randn(2, 4, 3)
    s = t.clone()
    s[1, 3] += 100.0  # a padding position
    mask = torch.ones(2, 4)
    mask[1, 3] = 0
    assert float(hidden_loss(s, t, mask)) == 0.0


# -- APoZ -------------------------------------------------------------------------------------

def test_apoz_with_tau_on_known_activations():
    act = torch.tensor([[[0.0, 0.03, -0.2, 1.0],
                         [0.0, -0.04, 0.01, 2.0],
                         [5.0, 5.0, 5.0, 5.0]]])  # (B=1, T=3, F=4); the last token is padding
    mask = torch.tensor([[1, 1, 0]])
    assert near_zero_counts(act, mask, 0.05).tolist() == [2.0, 2.0, 1.0, 0.0]
    assert near_zero_counts(act, mask, 0.0).tolist() == [2.0, 0.0, 0.0, 0.0]  # Eq. 14 exact zeros
    rep = apoz_report({1: near_zero_counts(act, mask, 0.05)}, tokens=2)
    model, apoz = split_report({**rep, "w": torch.ones(1)})
    assert list(model) == ["w"] and apoz[1].tolist() == [1.0, 1.0, 0.5, 0.0]
    pooled = aggregate_apoz([{1: torch.tensor([1.0, 0.0])}, {1: torch.tensor([0.0, 0.0])}], [3, 1])
    assert pooled[1].tolist() == [0.75, 0.0]


def test_select_neurons_highest_apoz_and_seeded_ties():
    apoz = torch.tensor([0.9, 0.1, 0.5, 0.5, 0.5, 0.5, 0.0, 0.2])
    picks = set()
    for seed in range(20):
        mask = select_neurons(apoz, 0.25, torch.Generator().manual_seed(seed))  # 2 of 8
        assert mask.sum() == 2 and mask[0]
        chosen = int(torch.nonzero(mask)[1]) if int(torch.nonzero(mask)[0]) == 0 else int(torch.nonzero(mask)[0])
        assert chosen in (2, 3, 4, 5)
        picks.add(chosen)
        again = select_neurons(apoz, 0.25, torch.Generator().manual_seed(seed))
        assert torch.equal(mask, again)
    assert len(picks) > 1  # ties are not broken by index order


# -- FL ---------------------------------------------------------------------------------------

def _run(cfg_dict, capture=None):
    cfg = validate_config(cfg_dict)
    method, data = setup(cfg)
    if capture is not None:
        real = method.strategy.configure_train

        def configure(rnd, state, clients, population=None):
            payloads = real(rnd, state, clients, population)
            capture.append((rnd, payloads))
            return payloads
        method.strategy.configure_train = configure
    state, records, summary = Simulation(cfg, method, data).run()
    return method, state, records, summary


def test_end_to_end_clients_never_get_the_full_ffn(pft_cfg):
    sent = []
    method, state, records, summary = _run(pft_cfg, sent)
    for rnd, payloads in sent:
        for payload in payloads.values():
            for key, t in payload.arrays.items():
                assert FFN not in t.shape, f"round {rnd}: {key} {tuple(t.shape)} has the full FFN width"
    first = [k for k in sent[0][1][min(sent[0][1])].arrays if "intermediate" in k]
    assert len(first) == 4  # W1 and b1 of the two compressed layers, at first participation
    # the client's model is the proxy: compressed widths in layers 1, 2
    assert summary["proxy_ffn"] == [FFN, FFN // 4, FFN // 4, FFN]
    assert summary["proxy_transformer_params"] < summary["full_transformer_params"]
    assert 0 <= summary["proxy_test_accuracy"] <= 1 and 0 <= summary["test_accuracy"] <= 1
    assert summary["kd_before_steps"] == 3 and summary["kd_during_rounds"] == 1  # not after round 2
    assert records[0]["align_neurons"] == 2 * 8  # p = 0.5 of 16 neurons in 2 layers
    assert "align_neurons" not in records[1]
    apoz_replies = [m for m in records[0]["client_metrics"]]
    assert all(m["apoz_tokens"] > 0 for m in apoz_replies)


def test_neuron_kd_changes_only_selected_neurons(pft_cfg):
    method, _ = setup(validate_config(pft_cfg))
    state = method.initial_state()
    before = {k: v.clone() for k, v in state.items()}
    apoz = {l: torch.linspace(0, 1, FFN // 4) for l in method.compressed}  # the last half is selected
    arrays = {f"apoz.{l}": a for l, a in apoz.items()}
    replies = {0: Reply(arrays, 10, {"apoz_tokens": 100.0})}
    new, metrics = method.on_round_end(1, state, replies)
    assert metrics["align_neurons"] == 16 and method.strategy.version == 1
    assert all(int(m.sum()) == 8 for m in method.strategy.updates[0].values())
    arch = method.arch
    for l in method.compressed:
        w_in = next(k for k in state if f"layer.{l}.intermediate.dense.weight" in k)
        w_out = next(k for k in state if f"layer.{l}.output.dense.weight" in k)
        b_out = next(k for k in state if f"layer.{l}.output.dense.bias" in k)
        half = FFN // 8
        assert torch.equal(new[w_in][:half], before[w_in][:half])  # low APoZ: kept fixed
        assert not torch.equal(new[w_in][half:], before[w_in][half:])
        assert torch.equal(new[w_out][:, :half], before[w_out][:, :half])
        assert torch.equal(new[b_out], before[b_out])
        assert arch.part(method.proxy, l, "ffn_in").weight.shape == (FFN // 4, 32)
    for k in state:  # LoRA and classifier untouched by the server's distillation
        if "lora_" in k or "classifier" in k:
            assert torch.equal(new[k], before[k])


def test_stale_clients_get_only_the_redistilled_neurons(pft_cfg):
    method, _ = setup(validate_config(pft_cfg))
    s, state = method.strategy, method.initial_state()
    has_ffn = lambda p: any("intermediate" in k for k in p.arrays)  # noqa: E731
    assert has_ffn(s.payload_for(1, state, 0, {})) and not has_ffn(s.payload_for(2, state, 0, {}))
    # a re-alignment of neurons 1 and 3 of layer 1, and 0 of layer 2; the server's proxy changes
    update = {1: torch.zeros(16, dtype=torch.bool), 2: torch.zeros(16, dtype=torch.bool)}
    update[1][[1, 3]] = True
    update[2][0] = True
    new = {k: (v + 1.0 if "dense" in k and "lora" not in k else v) for k, v in state.items()}
    s.proxy_changed(update)
    old_client, new_client = s.payload_for(3, new, 0, {}), s.payload_for(3, new, 1, {})
    assert all(k in new_client.arrays for k in method.proxy_params)  # first participation: whole
    delta = {k: t for k, t in old_client.arrays.items() if k.startswith("proxy_update.")}
    assert delta["proxy_update.1.index"].tolist() == [1, 3] and delta["proxy_update.2.index"].tolist() == [0]
    w_in = next(k for k in method.proxy_params if "layer.1.intermediate.dense.weight" in k)
    assert delta["proxy_update." + w_in].shape == (2, 32)
    assert not any(k in old_client.arrays for k in method.proxy_params)
    # the client's copy: old proxy + the update = the server's proxy on the re-distilled neurons
    method._load(state)
    method._load(delta)
    w = method.proxy_params[w_in]
    assert torch.equal(w[[1, 3]], new[w_in][[1, 3]]) and torch.equal(w[[0, 2]], state[w_in][[0, 2]])
    assert not s.payload_for(4, new, 0, {}).arrays.keys() & delta.keys()  # up to date now


def test_worker_copy_is_checked_kept_and_restored(pft_cfg):
    """A deployment runs each message in a fresh ClientApp process: the proxy copy travels in the
    node's state (kept_state/restore_state); an update that does not start from the
    worker's copy is refused, and the server sends that client the whole proxy next time."""
    cfg = validate_config(pft_cfg)
    server, data = setup(cfg)
    s, state = server.strategy, server.initial_state()
    state = {k: (v + 0.5 if k in server.proxy_params else v) for k, v in state.items()}  # not setup's
    worker, _ = setup(cfg)  # another process: its own method instance
    seed, part = 0, data.client(0)
    first = s.configure_train(1, state, [0])[0]
    worker.restore_state("client", {})
    worker.fit(first, part, seed)
    kept = worker.kept_state("client")
    assert int(kept["proxy_version"]) == 0 and set(kept) - {"proxy_version"} == set(server.proxy_params)
    # the server re-distils layer 1's neurons 1 and 3
    update = {l: torch.zeros(16, dtype=torch.bool) for l in server.compressed}
    update[server.compressed[0]][[1, 3]] = True
    new = {k: (v + 1.0 if k in server.proxy_params else v) for k, v in state.items()}
    s.proxy_changed(update)
    delta = s.configure_train(2, new, [0])[0]
    assert delta.config["proxy_base"] == 0 and delta.config["proxy_version"] == 1
    fresh, _ = setup(cfg)  # a fresh process without the node's state: refused, clearly
    fresh.restore_state("client", {})
    with pytest.raises(RuntimeError, match="starts from version 0, this worker holds version None"):
        fresh.fit(delta, part, seed)
    fresh.restore_state("client", kept)  # with the node's state: the copy equals the server's proxy
    fresh.fit(delta, part, seed)
    w_in = next(k for k in server.proxy_params if f"layer.{server.compressed[0]}.intermediate.dense.weight" in k)
    got = fresh.kept_state("client")[w_in]
    assert torch.equal(got[[1, 3]], new[w_in][[1, 3]]) and torch.equal(got[[0, 2]], state[w_in][[0, 2]])
    assert int(fresh.kept_state("client")["proxy_version"]) == 1
    # a client that did not reply (e.g. refused) is sent the whole proxy next time
    s.configure_train(3, new, [0, 1])
    s.aggregate_train(3, new, {}, {})
    again = s.configure_train(4, new, [0])[0]
    assert "proxy_base" not in again.config and all(k in again.arrays for k in server.proxy_params)


def test_cache_skips_layer_kd(pft_cfg):
    pft_cfg["method"]["kd"] = "before"
    m1, _ = setup(validate_config(pft_cfg))
    m2, _ = setup(validate_config(pft_cfg))
    assert not m1.kd_cached and m2.kd_cached
    for k, p in m1.proxy_params.items():
        assert torch.equal(p, m2.proxy_params[k])
    assert m2.kd_before.losses == m1.kd_before.losses
    pft_cfg["method"]["distill"]["mu"] = 0.3  # another setting: another entry
    m3, _ = setup(validate_config(pft_cfg))
    assert not m3.kd_cached


def test_fixed_distill_seed_shares_the_proxy_across_run_seeds(pft_cfg):
    pft_cfg["method"]["kd"] = "before"
    m1, _ = setup(validate_config(pft_cfg))
    pft_cfg["seed"] += 1  # another run seed: the distillation's seed followed it, a new entry
    m2, _ = setup(validate_config(pft_cfg))
    assert not m2.kd_cached and m2.kd_before.losses != m1.kd_before.losses
    pft_cfg["method"]["distill"]["seed"] = pft_cfg["seed"] - 1  # pinned to the first run's
    m3, _ = setup(validate_config(pft_cfg))
    assert m3.kd_cached
    for k, p in m1.proxy_params.items():
        assert torch.equal(p, m3.proxy_params[k])


def _merged_by_hand(model_dir, state, num_labels=2):
    """The full HF model with each LoRA pair merged into its layer's weight by hand (no peft)."""
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=num_labels)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, a in state.items():
            if "lora_A" not in key:
                continue
            b = state[key.replace("lora_A", "lora_B")]
            name = key.replace("base_model.model.", "").replace(".lora_A.default", "")
            params[name].add_(b @ a, alpha=2.0)  # alpha / r = 8 / 4
        for key, t in state.items():
            if "classifier" in key:
                params[key.replace("base_model.model.", "")].copy_(t)
    return model


@pytest.mark.parametrize("method_name", ["fedpft", "fedot"])
def test_plug_in_matches_hand_built_model(pft_cfg, model4_dir, method_name):
    pft_cfg["lora"]["targets"] = ["q", "v"]
    if method_name == "fedot":
        pft_cfg["method"] = {"name": "fedot"}
    method, _ = setup(validate_config(pft_cfg))
    state = method.initial_state()
    g = torch.Generator().manual_seed(3)
    state = {k: (torch.randn(v.shape, generator=g) * 0.1 if ("lora_" in k or "classifier" in k) else v)
             for k, v in state.items()}
    layers = sorted({int(k.split("layer.")[1].split(".")[0]) for k in state if "lora_" in k})
    assert layers == ([0, 1, 2, 3] if method_name == "fedpft" else [0, 3])
    hand = _merged_by_hand(model4_dir, state)
    torch.testing.assert_close(_logits(method.eval_model(state)), _logits(hand), atol=1e-5, rtol=1e-5)


def test_ablations_run(pft_cfg):
    pft_cfg["federation"]["rounds"] = 2
    for kd in ("none", "during"):
        pft_cfg["method"]["kd"] = kd
        method, _, records, summary = _run(copy.deepcopy(pft_cfg))
        assert method.kd_before is None and summary["kd"] == kd
        assert ("align_neurons" in records[0]) == (kd == "during")


def test_run_folder_has_loss_curves(pft_cfg, tmp_path):
    import json

    from fedslice.api import run_experiment
    pft_cfg["output"].update(plots=True, dir=str(tmp_path / "runs"))
    run = run_experiment(validate_config(pft_cfg))
    curves = json.loads((run / "fedpft_distill.json").read_text())
    assert set(curves["phases"]) == {"layer-level KD before FL", "neuron-level KD during FL"}
    assert len(curves["phases"]["layer-level KD before FL"]["losses"]) == 3
    assert curves["alignments"][0]["round"] == 1
    assert (run / "fedpft_distill.png").is_file()


@pytest.mark.parametrize("model_type", ["roberta", "distilbert"])
def test_other_architectures(pft_cfg, tmp_path, model_type):
    pft_cfg["model"]["name"] = str(save_tiny_model(tmp_path / model_type, model_type, num_layers=3))
    pft_cfg["method"].update(keep_ratio=0.5)
    pft_cfg["federation"]["rounds"] = 2
    method, state, records, summary = _run(pft_cfg)
    assert summary["proxy_ffn"] == [FFN, FFN // 2, FFN]
    assert records[0]["align_neurons"] == FFN // 4
    assert summary["kd_before_loss_end"] < summary["kd_before_loss_start"]


def test_count_near_zero_on_the_proxy(pft_cfg):
    from fedslice.distill.apoz import count_near_zero
    pft_cfg["method"]["kd"] = "none"
    method, data = setup(validate_config(pft_cfg))
    part = data.client(0)
    full = count_near_zero(method.proxy, method.arch, method.compressed, part, 8, tau=10.0)
    assert full.tokens == int(part.lengths.sum()) and full.flops > 0
    for l in method.compressed:  # tau above every |activation|: every real token counts
        assert full.counts[l].tolist() == [float(full.tokens)] * (FFN // 4)
    few = count_near_zero(method.proxy, method.arch, method.compressed, part, 8, tau=0.05,
                          max_examples=5, seed=1)
    assert 0 < few.tokens < full.tokens and all(few.counts[l].max() <= few.tokens for l in few.counts)
    for l in method.compressed:  # the temporary hooks are gone
        assert not method.arch.part(method.proxy, l, "ffn_out")._forward_pre_hooks


def test_client_role_skips_distillation_and_trains_the_sent_proxy(pft_cfg):
    """A Flower client (role "client") neither reads the corpus nor distils: its proxy is the one
    in its first payload, so it trains exactly what an in-process client trains."""
    pft_cfg["method"]["distill"]["cache_dir"] = ""  # a client must not depend on a shared cache
    cfg = validate_config(pft_cfg)
    server, data = setup(cfg)
    client, _ = setup(cfg, role="client")
    assert server.kd_before is not None and client.kd_before is None and client.corpus is None
    payload = server.strategy.configure_train(1, server.initial_state(), [0])[0]
    assert not any(torch.equal(p, server.proxy_params[k]) for k, p in client.proxy_params.items())
    ref = server.fit(payload, data.client(0), seed=5)
    got = client.fit(payload, data.client(0), seed=5)
    torch.testing.assert_close(got.arrays, ref.arrays, rtol=0, atol=0)


def test_corpus_fingerprint_follows_content_not_modification_time(tmp_path):
    """A re-synced corpus (same files, new mtimes) keeps its cache key; new text changes it."""
    import os
    import shutil
    from fedslice.distill.corpus import fingerprint
    src = tmp_path / "a"
    (src / "sub").mkdir(parents=True)
    (src / "one.txt").write_text("first passage\n")
    (src / "sub" / "two.txt").write_text("second passage\n")
    key = fingerprint(src)
    copy = tmp_path / "b"
    shutil.copytree(src, copy)
    os.utime(copy / "one.txt", (1, 1))
    assert fingerprint(copy) == key
    (copy / "sub" / "two.txt").write_text("second passage, edited\n")
    assert fingerprint(copy) != key
    assert fingerprint(src / "one.txt") == fingerprint(copy / "one.txt")


def test_keep_ratio_one_without_kd_trains_fedpetunings_model(pft_cfg):
    """Issue 35 part 5: with every neuron kept and no distillation, the proxy is the full model,
    so FedPFT must train exactly FedPETuning's model (same config, seed, partition and sampling):
    the same global LoRA + classifier after every round, and the same plugged-in predictions."""
    pft_cfg["federation"]["rounds"] = 3
    pft_cfg["method"].update(keep_ratio=1.0, kd="none")
    base = copy.deepcopy(pft_cfg)
    base["method"] = {"name": "fedpetuning"}
    pft, pft_state, pft_records, pft_summary = _run(pft_cfg)
    ref, ref_state, ref_records, ref_summary = _run(base)
    assert pft.compressed == [] and not pft.proxy_params
    assert set(pft_state) == set(ref_state)
    worst = max(float((pft_state[k] - ref_state[k]).abs().max()) for k in ref_state)
    assert worst <= 1e-6, f"max |delta| of the global state = {worst:g}"
    start = setup(validate_config(base))[0].initial_state()
    assert any(not torch.equal(ref_state[k], start[k]) for k in ref_state)  # it trained
    torch.testing.assert_close(_logits(pft.eval_model(pft_state)), _logits(ref.eval_model(ref_state)),
                               rtol=0, atol=1e-6)
    assert pft_summary["test_accuracy"] == ref_summary["test_accuracy"]
    assert [r.get("dev_accuracy") for r in pft_records] == [r.get("dev_accuracy") for r in ref_records]


# -- head re-fit after FL (method.head_refit_steps) --------------------------------------------

def _head_keys(state):
    return {k for k in state if "classifier" in k}


def _refit_setup(pft_cfg, steps=30, **opts):
    pft_cfg["method"].update({"kd": "before", "head_refit_steps": steps, "head_refit_lr": 5e-2, **opts})
    method, data = setup(validate_config(pft_cfg))
    return method, data


def test_head_refit_is_off_by_default_and_zero_steps_is_a_noop(pft_cfg):
    from fedslice.methods.fedpft.refit import refit_head
    method, _ = setup(validate_config(pft_cfg))
    assert method.opts.head_refit_steps == 0
    state = method.initial_state()
    new, metrics = method.on_round_end(pft_cfg["federation"]["rounds"], state, {})
    assert new is state and metrics == {} and method.refit_log is None and method.proxy_head == {}
    head = {k: p for k, p in method.trainable(method.model).items() if "classifier" in k}
    before = {k: p.detach().clone() for k, p in head.items()}
    split = method.corpus.split
    log = refit_head(method.model, head, split, torch.zeros(len(split), 2), steps=0, lr=1.0,
                     batch_size=4, temperature=1.0, seed=0)
    assert log.steps == 0 and not log.losses
    assert all(torch.equal(p, before[k]) for k, p in head.items())


def test_head_refit_changes_only_the_head_and_reduces_the_kl_to_the_proxy(pft_cfg):
    from fedslice.methods.fedpft.refit import mean_kl, soft_targets
    method, _ = _refit_setup(pft_cfg)
    g = torch.Generator().manual_seed(5)
    # confident predictions, and a proxy far from the full model (its FFNs perturbed)
    scale = {"lora_": 0.2, "classifier": 3.0, **{k: 2.0 for k in method.proxy_params}}
    state = {k: v + sum(torch.randn(v.shape, generator=g) * s for p, s in scale.items() if p in k)
             for k, v in method.initial_state().items()}
    split, rounds = method.corpus.split, pft_cfg["federation"]["rounds"]
    proxy_logits = _logits(method.proxy_model(state))
    targets, flops, tokens = soft_targets(method.proxy_model(state), split, 4)  # (N, 2)
    assert targets.shape == (len(split), 2) and flops > 0 and tokens > 0
    kl_before = mean_kl(method.eval_model(state), split, targets, 1.0, 4)
    new, metrics = method.on_round_end(rounds, state, {})
    changed = {k for k in state if not torch.equal(new[k], state[k])}
    assert changed == _head_keys(state)  # the classifier only: LoRA and the proxy's FFNs kept
    kl_after = mean_kl(method.eval_model(new), split, targets, 1.0, 4)
    assert kl_before > 1e-3 and kl_after < 0.5 * kl_before, (kl_before, kl_after)
    assert metrics["head_refit_steps"] == 30 and metrics["head_refit_flops"] > flops
    assert metrics["head_refit_examples"] == len(split) and metrics["head_refit_time_s"] > 0
    # the proxy keeps the head FL trained: its predictions are unchanged
    torch.testing.assert_close(_logits(method.proxy_model(new)), proxy_logits, rtol=0, atol=0)
    saved = method.kept_state("server")  # a resumed run keeps the proxy's head and the log
    other, _ = setup(validate_config(pft_cfg))
    other.restore_state("server", saved)
    assert other.refit_log.losses == method.refit_log.losses
    assert all(torch.equal(other.proxy_head[k], state[k]) for k in _head_keys(state))


def test_head_refit_only_after_the_last_round(pft_cfg):
    method, _ = _refit_setup(pft_cfg, kd="none")  # no KD: the corpus is still built for the re-fit
    assert method.corpus is not None
    state = method.initial_state()
    new, metrics = method.on_round_end(1, state, {})  # of 2 rounds
    assert new is state and metrics == {} and method.refit_log is None


def test_head_refit_end_to_end(pft_cfg, tmp_path):
    import json

    from fedslice.api import run_experiment
    pft_cfg["method"].update(head_refit_steps=4)
    pft_cfg["output"].update(dir=str(tmp_path / "runs"))
    run = run_experiment(validate_config(pft_cfg))
    summary = json.loads((run / "summary.json").read_text())
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert summary["head_refit_steps"] == 4 and summary["head_refit_flops"] > 0
    assert "head_refit_loss_start" in records[-1] and "head_refit_steps" not in records[0]
    curves = json.loads((run / "fedpft_distill.json").read_text())
    assert len(curves["phases"]["head re-fit after FL"]["losses"]) == 4


def test_head_refit_needs_a_classifier_head(pft_cfg):
    pft_cfg["method"]["head_refit_steps"] = 5
    pft_cfg["task"] = {"kind": "generation", "prompt": "{sentence}", "target": "{label}"}
    with pytest.raises(ConfigError, match="method.head_refit_steps = 5.*no classifier head"):
        validate_config(pft_cfg)


def test_keep_ratio_one_without_kd_trains_fedpetunings_decoder(tiny_gen_cfg_dict, tmp_path):
    """Issue 35 part 5, second setting (SmolLM2 + E2E): the decoder version of the test above.
    A 4-layer tiny LLaMA (SwiGLU FFN, SmolLM2's family) generating text: with every neuron kept
    and no distillation, FedPFT must train FedPETuning's LoRA bit for bit (both with clients run
    in this process, compute.workers = 1: FedPETuning's worker processes alone move the state by
    ~1 ulp a round), and its plugged-in model and
    its proxy must give FedPETuning's logits, losses and generations; so a plug-in or proxy gap
    on E2E comes from the dropped neurons and the KD budget, not from FedPFT's training or
    evaluation path on decoders. (The tiny random model's ROUGE-L is 0, so logits, losses and
    generated tokens are compared.)"""
    import transformers as T

    from conftest import smollm2_tokenizer, tiny_lm_config
    tok = smollm2_tokenizer()
    config = tiny_lm_config("llama", len(tok), tok.pad_token_id, tok.eos_token_id)
    config.num_hidden_layers = 4
    torch.manual_seed(0)
    folder = tmp_path / "tiny-llama4"
    T.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    cfg = tiny_gen_cfg_dict
    cfg["model"]["name"] = str(folder)
    cfg["federation"]["rounds"] = 3
    cfg["compute"] = {"workers": 1}
    base = copy.deepcopy(cfg)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"a restaurant called {i} near the river" for i in range(50)))
    cfg["method"] = {"name": "fedpft", "keep_ratio": 1.0, "kd": "none", "align_every": 1,
                     "align_steps": 2, "distill": {"corpus": str(corpus), "steps": 2, "batch_size": 4,
                                                   "max_length": 16, "cache_dir": ""}}
    pft, pft_state, pft_records, pft_summary = _run(cfg)
    ref, ref_state, ref_records, ref_summary = _run(base)
    assert pft.compressed == [] and not pft.proxy_params
    assert pft_summary["proxy_ffn"] == [config.intermediate_size] * 4
    assert set(pft_state) == set(ref_state)
    worst = max(float((pft_state[k] - ref_state[k]).abs().max()) for k in ref_state)
    assert worst == 0, f"max |delta| of the global state = {worst:g}"
    start = setup(validate_config(base))[0].initial_state()
    assert any(not torch.equal(ref_state[k], start[k]) for k in ref_state)  # it trained
    ids = tok(["Describe the restaurant: name[Aromi], area[riverside]\n"], return_tensors="pt")
    models = {"plugged-in": pft.eval_model(pft_state), "fedpetuning": ref.eval_model(ref_state)}
    with torch.no_grad():
        logits = {n: m(**ids).logits for n, m in models.items()}
        tokens = {n: m.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
                  for n, m in models.items()}
        proxy = pft.proxy_model(pft_state)
        logits["proxy"] = proxy(**ids).logits
        tokens["proxy"] = proxy.generate(**ids, max_new_tokens=8, do_sample=False,
                                         pad_token_id=tok.pad_token_id)
    for name in ("plugged-in", "proxy"):
        torch.testing.assert_close(logits[name], logits["fedpetuning"], rtol=0, atol=1e-5)
        assert torch.equal(tokens[name], tokens["fedpetuning"]), name
    assert pft_summary["test_loss"] == pytest.approx(ref_summary["test_loss"], abs=1e-5)
    assert [r["dev_loss"] for r in pft_records] == pytest.approx([r["dev_loss"] for r in ref_records], abs=1e-5)
    assert [r["train_loss"] for r in pft_records] == pytest.approx([r["train_loss"] for r in ref_records], abs=1e-5)
    assert pft_summary["test_rougeL"] == ref_summary["test_rougeL"]
    assert pft_summary["proxy_test_rougeL"] == pft_summary["test_rougeL"]


def test_alignment_round_of_a_decoder_accepts_prompt_plus_target_tokens(tiny_gen_cfg_dict, tmp_path):
    """A causal LM's example is its prompt (data.max_length) and its target
    (task.max_target_length) in one sequence, and the APoZ pass counts both: the bound on a
    report's token count must allow it. With the prompt's bound alone every honest client of an
    alignment round was excluded on E2E (apoz_tokens=14703 > 210 x 64) and the round skipped."""
    from conftest import method_options
    cfg = tiny_gen_cfg_dict
    cfg["data"]["max_length"] = 16  # prompts cut to 16 tokens; prompt + target is longer
    cfg["federation"]["rounds"] = 2
    cfg["method"] = {"name": "fedpft", "keep_ratio": 0.5, **method_options("fedpft", tmp_path)}
    method, state, records, summary = _run(cfg)
    first = records[0]
    assert first["excluded"] == [] and first["rejected"] == 0 and not first.get("align_skipped")
    assert method.compressed == [1] and method.strategy.max_tokens == 16 + 24
    assert first["align_neurons"] > 0  # the server re-distilled after the reports
    reply = [c for c in first["client_metrics"] if c["used"]]
    assert len(reply) == 2


@pytest.mark.parametrize("method_name", ["fedpft", "fedot"])
def test_planned_upload_is_what_a_client_sends(pft_cfg, method_name):
    """``fedslice validate`` counts what a client of the proxy (the emulator) sends: exactly the
    model tensors of its reply (names, shapes); FedPFT's APoZ report travels beside them."""
    if method_name == "fedot":
        pft_cfg["method"] = {"name": "fedot"}
    method, data = setup(validate_config(pft_cfg))
    state = method.initial_state()
    payloads = method.strategy.configure_train(1, state, [0, 1])
    for c, payload in payloads.items():
        planned = {k: tuple(t.shape) for k, t in method.planned_upload(payload).items()}
        sent = split_report(method.fit(payload, data.client(c), 0).arrays)[0]
        assert planned == {k: tuple(t.shape) for k, t in sent.items()}, c
