"""Tests for fedslice.fl.costs: sizes, FLOP counting and peak memory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fedslice.measure import (
    ClientCost,
    PeakMemory,
    analytic_train_flops,
    count_flops,
    linear_param_counts,
    measure_step_flops,
    num_params,
    tensor_bytes,
    trainable_state_bytes,
)


class LinearModel(nn.Module):
    """A linear layer behind a trainable element-wise scale, so that autograd computes the
    input-gradient of the linear layer as well (the scale itself costs no counted FLOPs)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d_in))
        self.linear = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        out = self.linear(x * self.scale)
        return SimpleNamespace(loss=nn.functional.mse_loss(out, labels), logits=out)


class MLP(nn.Module):
    def __init__(self, d: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(loss=nn.functional.mse_loss(self.net(x).squeeze(-1), labels))


def _tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=100)
    return cfg, BertForSequenceClassification(cfg)


def _bert_batch(batch: int = 4, seq: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "input_ids": torch.randint(0, 100, (batch, seq), generator=g),
        "attention_mask": torch.ones(batch, seq, dtype=torch.long),
        "labels": torch.randint(0, 2, (batch,), generator=g),
    }


def test_tensor_bytes_mixed_dtypes():
    tensors = {
        "a": torch.zeros(3, 4, dtype=torch.float32),
        "b": torch.zeros(5, dtype=torch.float16),
        "c": torch.zeros(2, 3, dtype=torch.int64),
    }
    assert tensor_bytes(tensors) == 12 * 4 + 5 * 2 + 6 * 8
    assert num_params(tensors) == 12 + 5 + 6
    assert tensor_bytes({}) == 0


def test_trainable_state_bytes():
    m = nn.Linear(10, 5)  # 55 params
    m.bias.requires_grad_(False)
    assert trainable_state_bytes(m, optimizer_slots=2) == 50 * 4 * 3
    assert trainable_state_bytes(m.parameters(), optimizer_slots=0) == 50 * 4


def test_measure_step_flops_linear_is_6NB():
    torch.manual_seed(0)
    d_in, d_out, batch = 64, 32, 8
    model = LinearModel(d_in, d_out)
    inputs = {"x": torch.randn(batch, d_in), "labels": torch.randn(batch, d_out)}
    flops = measure_step_flops(model, inputs)
    expected = 6 * d_in * d_out * batch
    assert abs(flops - expected) / expected < 0.01


@pytest.mark.parametrize("batch, seq", [(4, 16), (2, 32), (8, 8)])
def test_measure_step_flops_bert_matches_analytic(batch, seq):
    """Full fine-tuning on equal-length sequences: the analytic count is exact (every matmul of
    forward and backward, the pooler and classifier once per example), so the measured FLOPs
    equal it, far inside the 2.5% the benchmarks report on real models."""
    cfg, model = _tiny_bert()
    flops = measure_step_flops(model, _bert_batch(batch, seq))
    counts = linear_param_counts(model)
    per_layer = 4 * cfg.hidden_size**2 + 2 * cfg.hidden_size * cfg.intermediate_size
    assert counts["total"] == counts["trainable"] == cfg.num_hidden_layers * per_layer
    analytic = analytic_train_flops(
        num_layers=cfg.num_hidden_layers,
        hidden=cfg.hidden_size,
        ffn=cfg.intermediate_size,
        num_heads=cfg.num_attention_heads,
        tokens=batch * seq,
        seq_len=seq,
        trainable_linear_params=counts["trainable"],
        total_linear_params=counts["total"],
        embedding_backward=True,
        examples=batch,
        head_linear_params=counts["head_total"],
        head_trainable_linear_params=counts["head_trainable"],
    )
    assert analytic["total"] == pytest.approx(analytic["forward"] + analytic["backward"])
    assert flops == pytest.approx(analytic["total"], rel=1e-9)


def test_engine_flops_match_the_analytic_count(tiny_cfg_dict, one_length_data_dir):
    """Through the engine, on sentences of one length (the first step's count extrapolates
    exactly): the measured FLOPs equal the analytic count, full fine-tuning's and LoRA's (whose
    count leaves out the first layer's input-gradients of LoRA A and of the keys, which autograd
    skips under frozen embeddings: 2% of this 2-layer model, 0.4% of MiniLM-L6)."""
    from fedslice.api import setup
    from fedslice.experiment import validate_config
    from fedslice.run.engine import Simulation

    tiny_cfg_dict["data"]["path"] = str(one_length_data_dir)
    tiny_cfg_dict["federation"]["rounds"] = 1
    # padded: every batch then has one shape (packed rows differ in length from batch to batch)
    tiny_cfg_dict["federation"]["pack"] = False
    for method, tolerance in (("fedavg", 1e-9), ("fedpetuning", 1e-9)):
        tiny_cfg_dict["method"] = {"name": method}
        cfg = validate_config(tiny_cfg_dict)
        m, data = setup(cfg)
        assert len(set(data.train.lengths.tolist())) == 1
        _, records, _ = Simulation(cfg, m, data).run()
        for c in records[0]["client_metrics"]:
            assert c["flops_measured"] == pytest.approx(c["flops_analytic"], rel=tolerance), method


def test_bottom_skips_are_what_autograd_leaves_out():
    """LoRA on q and v under frozen embeddings: the lowest block's key-gradient matmul (its width:
    the hidden size) and its LoRA A input-gradients are not computed; the measured step and the
    analytic count agree exactly. Without attention dropout on the CPU (a fused sdpa kernel
    computes every gradient) no attention matmul is skipped."""
    from peft import LoraConfig, get_peft_model

    from fedslice.measure import bottom_skips
    from fedslice.models.arch import ARCHITECTURES

    cfg, model = _tiny_bert()
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["query", "value"]))
    arch = ARCHITECTURES["bert"]
    skips = bottom_skips(model, arch)
    assert skips == {"bottom_attention_skipped": 32.0, "bottom_adapter_input_params": 2 * 4 * 32}
    batch, seq = 4, 16
    counts = linear_param_counts(model)
    analytic = analytic_train_flops(
        num_layers=2, hidden=32, ffn=64, num_heads=4, tokens=batch * seq, seq_len=seq,
        trainable_linear_params=counts["trainable"], total_linear_params=counts["total"],
        examples=batch, head_linear_params=counts["head_total"],
        head_trainable_linear_params=counts["head_trainable"], **skips)
    model.train()
    assert measure_step_flops(model, _bert_batch(batch, seq)) == pytest.approx(analytic["total"], rel=1e-9)
    model.base_model.model.config.attention_probs_dropout_prob = 0.0
    assert "bottom_attention_skipped" not in bottom_skips(model, arch)


def test_analytic_full_vs_frozen():
    kw = dict(num_layers=2, hidden=32, ffn=64, num_heads=4, tokens=1000, seq_len=0.0, total_linear_params=10_000)
    full = analytic_train_flops(trainable_linear_params=10_000, embedding_backward=True, **kw)
    frozen = analytic_train_flops(trainable_linear_params=0, embedding_backward=True, **kw)
    assert full["total"] == pytest.approx(6 * 10_000 * 1000)
    assert frozen["total"] == pytest.approx(4 * 10_000 * 1000)


def test_measure_step_flops_leaves_training_state_alone():
    _, model = _tiny_bert()
    model.eval()
    rng_before = torch.get_rng_state()
    measure_step_flops(model, _bert_batch())
    assert all(p.grad is None for p in model.parameters())
    assert not model.training
    assert torch.equal(torch.get_rng_state(), rng_before)

    model.train()
    first = next(model.parameters())
    first.grad = torch.ones_like(first)
    measure_step_flops(model, _bert_batch())
    assert model.training
    assert torch.equal(first.grad, torch.ones_like(first))
    assert all(p.grad is None for p in model.parameters() if p is not first)


def _train_step(model: nn.Module, batch: int) -> PeakMemory:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 64, generator=g), torch.randn(batch, generator=g)
    with PeakMemory(model=model, extra_bytes=trainable_state_bytes(model)) as pm:
        model(x=x, labels=y).loss.backward()
    model.zero_grad(set_to_none=True)
    return pm


def test_peak_memory_activations_grow_with_batch():
    torch.manual_seed(0)
    model = MLP()
    small, large = _train_step(model, 32), _train_step(model, 512)
    assert small.saved_activation_mb > 0
    assert large.saved_activation_mb > small.saved_activation_mb
    # two hidden layers of 256 floats per example are saved at least once each
    assert large.saved_activation_mb * 2**20 >= 512 * 256 * 4 * 2
    assert large.tensor_peak_mb == pytest.approx(large.saved_activation_mb + trainable_state_bytes(model) / 2**20)
    assert large.rss_peak_mb is not None and large.rss_peak_mb >= 0
    assert large.peak_mb == large.rss_peak_mb
    # everything saved was released by backward
    assert large._current == 0


def test_peak_memory_does_not_change_results():
    torch.manual_seed(0)
    model = MLP()
    x, y = torch.randn(16, 64), torch.randn(16)
    model(x=x, labels=y).loss.backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with PeakMemory(model=model):
        model(x=x, labels=y).loss.backward()
    for a, p in zip(plain, model.parameters()):
        assert torch.equal(a, p.grad)


def test_count_flops_context():
    torch.manual_seed(0)
    model = LinearModel(16, 8)
    x, y = torch.randn(4, 16), torch.randn(4, 8)
    with count_flops() as fc:
        model(x=x, labels=y).loss.backward()
    assert fc.total == 6 * 16 * 8 * 4
    with count_flops(enabled=False) as off:
        model(x=x, labels=y).loss.backward()
    assert off.total == 0


def test_peak_memory_excludes_weights_without_model():
    torch.manual_seed(0)
    model = MLP(d=64, hidden=1024)  # ~1M weights (4 MiB), frozen: saved for input-gradients
    for p in model.parameters():
        p.requires_grad_(False)
    x = torch.randn(4, 64, requires_grad=True)
    with PeakMemory() as pm:
        model(x=x, labels=torch.randn(4)).loss.backward()
    assert 0 < pm.activation_mb == pm.saved_activation_mb < 1.0


def test_client_cost_to_dict():
    cost = ClientCost(bytes_down=10, bytes_up=5, examples=3, flops_measured=1e9)
    d = cost.to_dict()
    assert d["bytes_down"] == 10 and d["flops_measured"] == 1e9
    assert set(d) == {
        "bytes_down", "bytes_up", "params_down", "params_up", "trainable_params", "flops_measured",
        "flops_analytic", "examples", "tokens", "peak_rss_mb", "activation_mb", "train_time_s",
        "model_mb", "memory_mb", "tokens_real", "gpu_peak_mb",
    }



_KEEP: list[torch.Tensor] = []


def _churn(n: int, kib: int) -> float:
    """Allocate n tensors of ``kib`` KiB (touched), with a small long-lived tensor every 50 (as
    training leaves optimizer state and Python objects behind), then free the big ones."""
    xs = []
    for i in range(n):
        xs.append(torch.ones(kib * 256))  # float32: 256 elements = 1 KiB
        if i % 50 == 0:
            _KEEP.append(torch.ones(16))
    return float(sum(x[0] for x in xs))


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("n,kib", [(2000, 64), (128, 1024)])
def test_peak_rss_sees_reused_heap(n, kib):
    """A block repeating earlier allocations (heap pages the earlier work freed and malloc kept)
    still reports what it allocated (~125 MiB here), not ~0 MB as a plain RSS delta does."""
    for _ in range(2):
        _churn(n, kib)
    with PeakMemory() as pm:
        _churn(n, kib)
    assert pm.rss_peak_mb is not None and pm.rss_peak_mb >= 100


def test_analytic_frozen_bottom_layers_skip_their_input_gradients():
    """L_f frozen bottom blocks: their linears' and attention's input-gradients go, the skipped
    q/k/v input-gradient moves to the lowest trained block (same size), so with every block
    frozen only the forward and the weight-gradients remain; a backward that must reach the
    bottom (trained embeddings, prefix keys) cannot stop early."""
    kw = dict(num_layers=4, hidden=8, ffn=32, num_heads=2, tokens=100, seq_len=10.0,
              total_linear_params=4 * 768, trainable_linear_params=50)
    dense = analytic_train_flops(**kw)
    half = analytic_train_flops(**kw, frozen_layers=2, frozen_linear_params=2 * 768)
    attn_fwd = 4.0 * 4 * 10.0 * 8 * 100
    assert dense["forward"] == half["forward"]
    assert dense["backward"] - half["backward"] == pytest.approx(2.0 * 2 * 768 * 100 + 2.0 * attn_fwd / 2)
    none = analytic_train_flops(**kw, frozen_layers=4, frozen_linear_params=4 * 768)
    assert none["backward"] == pytest.approx(2.0 * 50 * 100)
    for bad in (dict(embedding_backward=True), dict(prefix_keys=3)):
        with pytest.raises(ValueError, match="frozen_layers"):
            analytic_train_flops(**kw, frozen_layers=1, frozen_linear_params=768, **bad)
    with pytest.raises(ValueError, match="out of range"):
        analytic_train_flops(**kw, frozen_layers=5, frozen_linear_params=768)


_HEAP_PROBE = """
import sys, torch
from fedslice import heap
if sys.argv[1] == "release":
    assert heap.release_freed_memory(heap.RELEASE_THRESHOLD)
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
start = rss()
x = torch.ones(8 << 20); del x  # a 32 MB block freed: glibc raises its mmap threshold to it
small = []
for step in range(8):  # training steps on batches of growing length: 40 tensors of a new size
    held = []
    for _ in range(40):
        held.append(torch.ones((128 + 32 * step) << 10))
        small.append(torch.ones(64))  # a small tensor that outlives the step between them
    del held
print(rss() - start)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_release_freed_memory_keeps_the_heap_at_the_live_size():
    """Steps whose tensors grow a little each time (length-grouped batches) with small tensors
    living on between them: under glibc's own policy (after one large block was freed) the
    tensors come from the heap, the holes they leave are too small for the next step's, and the
    heap holds 28-47 MB here (by run); with ``release_freed_memory`` each tensor has
    its own map and the process holds only what is alive."""
    held = {}
    for mode in ("glibc", "release"):
        out = subprocess.run([sys.executable, "-c", _HEAP_PROBE, mode], capture_output=True, text=True,
                             timeout=120, check=True)
        held[mode] = float(out.stdout.strip().splitlines()[-1])
    assert held["glibc"] > 20, held
    assert held["release"] < 5, held


def test_setup_sets_the_release_policy_only_when_asked(tiny_cfg_dict, monkeypatch):
    from fedslice import heap
    from fedslice.api import setup
    from fedslice.experiment import validate_config

    calls = []
    monkeypatch.setattr(heap, "release_freed_memory", lambda t: calls.append(t) or True)
    setup(validate_config(tiny_cfg_dict))
    assert calls == []  # glibc's own policy by default
    tiny_cfg_dict["compute"] = {"release_memory": True}
    setup(validate_config(tiny_cfg_dict))
    assert calls == [heap.RELEASE_THRESHOLD]


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_count_flops_grouped_query_attention_counts_the_query_heads(kv_heads):
    """SDPA with fewer key/value heads (GQA) counts the products of every query head: 2 score
    products forward, 5 backward, ``2 B H S^2 D`` FLOPs each -- the same with 4, 2 or 1 key/value
    heads (torch before 2.13 refused the shapes on the fused kernels: the GPU check's 1B LLaMA)."""
    b, h, s, d = 2, 4, 8, 16
    q = torch.randn(b, h, s, d, requires_grad=True)
    k = torch.randn(b, kv_heads, s, d, requires_grad=True)
    v = torch.randn(b, kv_heads, s, d, requires_grad=True)
    with count_flops() as fc:
        out = nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=kv_heads != h)
        out.sum().backward()
    assert fc.total == 7 * 2 * b * h * s * s * d
    assert fc.attention == fc.total


def test_saved_tensors_are_counted_on_the_batches_no_earlier_one_dominates():
    """:class:`LargestBatches` picks a batch unless an earlier pick is as large in every
    dimension; ``PeakMemory(saved_tensors=False)`` counts only inside ``track()``."""
    from fedslice.measure import LargestBatches

    pick = LargestBatches()
    small = {"input_ids": torch.zeros(4, 8), "labels": torch.zeros(4)}
    assert pick(small) and not pick(dict(small))  # equal shapes: dominated
    assert pick({"input_ids": torch.zeros(2, 16), "labels": torch.zeros(2)})  # longer rows
    assert not pick({"input_ids": torch.zeros(2, 8), "labels": torch.zeros(2)})
    assert pick({"input_ids": torch.zeros(4, 8), "labels": torch.zeros(4), "extra": torch.zeros(1)})
    x = torch.randn(6, 5)
    layer = nn.Linear(5, 5)
    with PeakMemory(layer, saved_tensors=False) as off:
        layer(x).sum().backward()
    with PeakMemory(layer, saved_tensors=False) as on:
        with on.track():
            layer(x).sum().backward()
    with PeakMemory(layer) as every:
        layer(x).sum().backward()
    assert off.saved_activation_mb == 0 and on.saved_activation_mb == every.saved_activation_mb > 0


def _variable_length_client(tmp_path, pack: bool):
    """A tiny BERT classifier (eval mode: no dropout), 48 examples of 2-29 tokens, a train config
    of 8 steps of 6 without length grouping (batches of every shape), the loss (packed or
    padded) and the classifier's parameters."""
    from conftest import save_tiny_model
    from transformers import AutoModelForSequenceClassification

    from fedslice.data.batching import TokenizedSplit
    from fedslice.tasks.classification import packed_classifier_loss

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(save_tiny_model(tmp_path, "bert")).eval()
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(5, model.config.vocab_size, (int(n),), generator=g)
           for n in torch.randint(2, 30, (48,), generator=g)]
    split = TokenizedSplit(ids, None, torch.randint(0, 2, (48,), generator=g), 0)
    cfg = {"lr": 1e-3, "batch_size": 6, "local_steps": 8, "group_by_length": False}
    loss = (lambda m, b: packed_classifier_loss(m, b, "bert")) if pack else (lambda m, b: m(**b).loss)
    params = {n: p for n, p in model.named_parameters() if "classifier" in n}
    return model, split, cfg, loss, params


@pytest.mark.parametrize("pack", [False, True])
def test_train_local_reports_the_activation_peak_of_every_step(pack, tmp_path, monkeypatch):
    """Counting the dominant batches only gives train_local the same activation peak as
    counting every step (variable lengths, length grouping off: batches of every shape)."""
    import fedslice.fl.client as client

    model, split, cfg, loss, params = _variable_length_client(tmp_path, pack)
    picked = client.train_local(model, params, split, cfg, seed=0, loss_fn=loss, pack=pack)

    class Every:
        def __call__(self, batch):
            return True

    monkeypatch.setattr(client, "LargestBatches", Every)
    monkeypatch.setattr(client, "_SAVED", client._ModelCache(per_model=8))  # measure, not recall
    every = client.train_local(model, params, split, cfg, seed=0, loss_fn=loss, pack=pack)
    assert picked.activation_mb == every.activation_mb > 0


def test_a_block_peak_is_its_own_and_a_recalled_peak_counts_as_measured():
    x = torch.randn(6, 5)
    big, small = nn.Linear(5, 5), nn.Linear(5, 2)
    with PeakMemory(saved_tensors=False) as mem:
        with mem.track_block() as first:
            torch.relu(big(x)).sum().backward()
        with mem.track_block() as second:
            torch.relu(small(x)).sum().backward()
    assert first.peak_bytes > second.peak_bytes > 0  # each block's own peak
    assert mem.saved_activation_mb == first.peak_bytes / 2**20  # the running peak: the larger
    with PeakMemory(saved_tensors=False) as recalled:
        recalled.add_saved_peak(first.peak_bytes)
        with recalled.track_block():
            torch.relu(small(x)).sum().backward()
    assert recalled.saved_activation_mb == mem.saved_activation_mb


@pytest.mark.parametrize("pack", [False, True])
def test_a_later_client_recalls_the_saved_tensor_peaks_of_shapes_already_measured(pack, tmp_path, monkeypatch):
    """A second client of the same model on batches of shapes already measured installs no
    saved-tensor hooks and reports the same activation peak; a changed trainable set measures
    again."""
    import fedslice.fl.client as client

    model, split, cfg, loss, params = _variable_length_client(tmp_path, pack)
    first = client.train_local(model, params, split, cfg, seed=0, loss_fn=loss, pack=pack)
    blocks = []
    real = PeakMemory.track_block

    def recording(self):
        blocks.append(1)
        return real(self)

    monkeypatch.setattr(PeakMemory, "track_block", recording)
    again = client.train_local(model, params, split, cfg, seed=0, loss_fn=loss, pack=pack)
    assert not blocks and again.activation_mb == first.activation_mb > 0
    next(p for n, p in model.named_parameters() if "word_embeddings" in n).requires_grad_(False)
    client.train_local(model, params, split, cfg, seed=0, loss_fn=loss, pack=pack)
    assert blocks  # another structure: measured again


@pytest.mark.parametrize("arch", ["bert", "roberta", "distilbert", "vit", "deit", "dinov2", "gpt2",
                                  "llama", "t5", "bart"])
def test_the_lean_counter_counts_what_torchs_counter_counts(arch, model_dirs):
    """``count_flops`` without a count by module runs a lean dispatch mode, not
    ``FlopCounterMode``: on a training step (forward, loss, backward) of every architecture of
    the table, with LoRA, the total and the attention share are the same, exactly."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoConfig, AutoModelForImageClassification

    from fedslice.measure.flops import _attention_flop_mapping, _is_attention_op

    torch.manual_seed(0)
    folder = model_dirs[arch]
    config = AutoConfig.from_pretrained(folder)
    if arch in ("vit", "deit", "dinov2"):
        model = AutoModelForImageClassification.from_pretrained(folder)
        size = config.image_size
        batch = {"pixel_values": torch.randn(2, 3, size, size), "labels": torch.tensor([0, 1])}
    else:
        from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModelForSequenceClassification

        ids = torch.randint(5, 100, (2, 7))
        if arch in ("t5", "bart"):
            model = AutoModelForSeq2SeqLM.from_pretrained(folder)
            batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids[:, :5].clone()}
        elif arch in ("gpt2", "llama"):
            model = AutoModelForCausalLM.from_pretrained(folder)
            batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        else:
            model = AutoModelForSequenceClassification.from_pretrained(folder)
            batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 1])}
    from fedslice.models.arch import arch_for
    from fedslice.peft import LoraAdapter, LoraConfig

    model = LoraAdapter(LoraConfig(r=2, alpha=4, targets=["q", "v"]), arch_for(config)).apply(model)

    def step():
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)

    with count_flops() as lean:
        step()
    torchs = FlopCounterMode(display=False, custom_mapping=_attention_flop_mapping())
    with torchs:
        step()
    attention = sum(n for op, n in torchs.get_flop_counts()["Global"].items() if _is_attention_op(op))
    assert lean.total == torchs.get_total_flops() > 0 and lean.attention == attention


def test_peak_memory_without_rss_counts_the_same_saved_tensors():
    """rss=False (the planner's measured steps) trims no heap and samples no RSS: the saved
    tensors' peak is the same, the RSS peak None."""
    from fedslice.measure import PeakMemory

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    x = torch.randn(4, 8)
    got = []
    for rss in (True, False):
        with PeakMemory(model, rss=rss) as pm:
            model(x).sum().backward()
        got.append((pm.saved_activation_mb, pm.rss_peak_mb))
    assert got[0][0] == got[1][0] > 0 and got[0][1] is not None and got[1][1] is None
