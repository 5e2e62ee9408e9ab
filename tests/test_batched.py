"""The batched pass (``compute.batched_clients``): a round's clients trained together over the
shared backbone give the weights of training them one after another (fp32, dropout off)."""

import json
import shutil

import pytest
import torch

from fedslice.api import setup
from fedslice.experiment import validate_config
from fedslice.data.batching import stack_batches
from fedslice.run.engine import Simulation


def _no_dropout(src, dst):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k in list(cfg):
        if "dropout" in k or k.endswith("_pdrop"):
            cfg[k] = 0.0
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _run(cfg_dict, batched):
    cfg = validate_config({**cfg_dict, "compute": {"workers": 1, "batched_clients": batched}})
    method, data = setup(cfg)
    state, records, _ = Simulation(cfg, method, data).run()
    return state, records


def _compare(cfg_dict):
    s1, r1 = _run(cfg_dict, False)
    s2, r2 = _run(cfg_dict, True)
    assert [r["client_mode"] for r in r1] == ["sequential"] * len(r1)
    assert [r["client_mode"] for r in r2] == ["batched"] * len(r2)
    assert s1.keys() == s2.keys()
    worst = max(float((s1[k] - s2[k]).abs().max()) for k in s1)
    assert worst <= 1e-5, worst
    moved = max(float((s1[k] - s2[k]).abs().max()) for k in s1)
    for a, b in zip(r1, r2):
        la = {m["client"]: m["loss"] for m in a["client_metrics"]}
        lb = {m["client"]: m["loss"] for m in b["client_metrics"]}
        assert la.keys() == lb.keys()
        assert all(abs(la[c] - lb[c]) <= 1e-5 for c in la), (la, lb)
        # real tokens: sequential training packs its batches (federation.pack), the batched pass pads
        ta = {m["client"]: (m["tokens_real"], m["examples_trained"], m["steps"]) for m in a["client_metrics"]}
        tb = {m["client"]: (m["tokens_real"], m["examples_trained"], m["steps"]) for m in b["client_metrics"]}
        assert ta == tb
    return s1, moved


def test_encoder_lora_batched_equals_sequential(tiny_cfg_dict, tiny_model_dir, tmp_path):
    """LoRA on q/v plus the classifier (trained whole, per client) of a tiny BERT; uneven client
    sizes (local epochs: different step counts) and group-by-length batches of other lengths."""
    tiny_cfg_dict["model"]["name"] = str(_no_dropout(tiny_model_dir, tmp_path / "bert"))
    tiny_cfg_dict["federation"].update(num_clients=6, clients_per_round=4, rounds=2,
                                       local_steps=None, local_epochs=1, batch_size=8)
    tiny_cfg_dict["data"]["partition"] = "dirichlet"
    s, _ = _compare(tiny_cfg_dict)
    assert any("classifier" in k for k in s)


def test_decoder_lora_batched_equals_sequential(tiny_gen_cfg_dict, tiny_lm_dirs, tmp_path):
    """LoRA on every attention and FFN projection of a tiny LLaMA (GQA), generation loss on the
    target tokens only; equal-sized clients take the batched-matmul path."""
    tiny_gen_cfg_dict["lora"]["targets"] = ["all-linear"]
    tiny_gen_cfg_dict["federation"].update(num_clients=3, clients_per_round=3, rounds=2,
                                           local_steps=3, batch_size=4)
    _compare(tiny_gen_cfg_dict)


def test_stack_batches_pads_each_key_with_its_value():
    a = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.tensor([[1, 1, 1]]),
         "labels": torch.tensor([[-100, 6, 7]])}
    b = {"input_ids": torch.tensor([[8], [9]]), "attention_mask": torch.tensor([[1], [1]]),
         "labels": torch.tensor([[8], [9]])}
    out, rows = stack_batches([a, b], pad_token_id=0)
    assert rows == [(0, 1), (1, 3)]
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0], [9, 0, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 0, 0]]
    assert out["labels"].tolist() == [[-100, 6, 7], [8, -100, -100], [9, -100, -100]]
    with pytest.raises(ValueError, match="no pad value"):
        stack_batches([{"x": torch.zeros(1, 2)}, {"x": torch.zeros(1, 3)}], 0)


@pytest.mark.parametrize("method", ["raffm", "fedot"])
def test_submodel_methods_batch_clients_of_one_shape(tiny_cfg_dict, tiny_model_dir, tmp_path, method):
    """RaFFM batches the clients of each sub-model size together (two tiers: two groups); FedOT
    all clients (one adapter + emulator sub-model); both equal one-after-another training."""
    from tests.conftest import method_options

    tiny_cfg_dict["model"]["name"] = str(_no_dropout(tiny_model_dir, tmp_path / "bert"))
    tiny_cfg_dict["method"] = {"name": method, **method_options(method, tmp_path)}
    tiny_cfg_dict["federation"].update(num_clients=6, clients_per_round=5, rounds=2)
    s, _ = _compare(tiny_cfg_dict)
    _, records = _run(tiny_cfg_dict, True)
    sizes = sorted({m.get("batched_clients", 1) for r in records for m in r["client_metrics"]})
    assert max(sizes) > 1


def test_methods_that_train_different_shapes_fall_back(tiny_cfg_dict, tmp_path):
    """Heads (each client its own kept heads) trains one client after another."""
    from tests.conftest import method_options

    tiny_cfg_dict["method"] = {"name": "heads", **method_options("heads", tmp_path)}
    _, records = _run(tiny_cfg_dict, True)
    assert all(r["client_mode"] == "sequential" for r in records)


def test_image_lora_batched_equals_sequential(tiny_img_cfg_dict):
    """Image batches (pixel values + an all-ones token mask) of several clients stack into one
    batched pass over the tiny DINOv2 (no dropout in its config): the sequential weights."""
    tiny_img_cfg_dict["federation"].update(num_clients=4, clients_per_round=3, rounds=2)
    _compare(tiny_img_cfg_dict)


def test_batched_pass_reports_the_activation_peak_of_every_step(tiny_cfg_dict, monkeypatch):
    """The batched pass counts saved tensors on the stacked batches no earlier counted one
    dominates; each client's activation figure is the one counting every step gives."""
    import fedslice.fl.batched as batched

    # one example per client and step, in no order, unpacked: stacked batches of every length
    tiny_cfg_dict["federation"].update(num_clients=6, clients_per_round=2, rounds=1, local_steps=12,
                                       batch_size=1, group_by_length=False, pack=False)

    def activations():
        _, records = _run(tiny_cfg_dict, True)
        assert records[0]["client_mode"] == "batched"
        return {m["client"]: m["activation_mb"] for m in records[0]["client_metrics"]}

    picked = activations()

    class Every:
        def __call__(self, batch):
            return True

    monkeypatch.setattr(batched, "LargestBatches", Every)
    assert picked == activations() and all(v > 0 for v in picked.values())
