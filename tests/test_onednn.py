"""``compute.linear_kernels``: frozen fp32 linear layers of a CPU training step on oneDNN's
kernels agree with torch's own to float rounding (they sum the same products in another order),
forward and backward, in a whole run; everything else keeps torch's kernels."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from fedslice.api import setup
from fedslice.compute import Compute
from fedslice.errors import ConfigError
from fedslice.experiment import validate_config
from fedslice.measure.flops import count_flops
from fedslice.onednn import OneDnnLinear, available, frozen_linears_on_onednn, runs_on_onednn
from fedslice.run.engine import Simulation

pytestmark = pytest.mark.skipif(not available(), reason="torch without oneDNN")


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within fp32 rounding of a sum of ~K products: relative to the result's scale."""
    return bool((got.double() - want).abs().max() <= 1e-5 * want.abs().max())


@pytest.mark.parametrize("shape,bias,transposed", [((7, 48), True, False), ((3, 5, 48), True, False),
                                                   ((3, 5, 48), False, True), ((1, 48), False, False)])
@pytest.mark.parametrize("strided", [False, True])
def test_forward_and_backward_agree_with_float64(shape, bias, transposed, strided):
    """Contiguous inputs, and inputs that are views with other strides (every other row of a
    larger tensor), with a weight or a transposed weight view, with or without a bias."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape[:-1], 2 * shape[-1], generator=g)[..., ::2] if strided \
        else torch.randn(*shape, generator=g)
    x.requires_grad_()
    w = torch.randn(48, 32, generator=g).t() if transposed else torch.randn(32, 48, generator=g)
    b = torch.randn(32, generator=g) if bias else None
    grad = torch.randn(*shape[:-1], 32, generator=g)
    y = OneDnnLinear.apply(x, w, b)
    y.backward(grad)
    x64 = x.detach().double().requires_grad_()
    y64 = F.linear(x64, w.double(), None if b is None else b.double())
    y64.backward(grad.double())
    assert y.shape == y64.shape and _close(y, y64.detach()) and _close(x.grad, x64.grad)


@pytest.fixture
def every_size(monkeypatch):
    """oneDNN for products of any size (the tiny models' are below its threshold)."""
    from fedslice import onednn

    monkeypatch.setattr(onednn, "MIN_MULTIPLY_ADDS", 1)


def test_small_products_keep_torch_kernels():
    from fedslice.onednn import MIN_MULTIPLY_ADDS

    w = torch.randn(64, 128)
    assert runs_on_onednn(torch.randn(MIN_MULTIPLY_ADDS // (64 * 128), 128), w, None)
    assert not runs_on_onednn(torch.randn(MIN_MULTIPLY_ADDS // (64 * 128) - 1, 128), w, None)


def test_only_frozen_fp32_cpu_linears_are_taken(every_size):
    x, w, b = torch.randn(4, 8), torch.randn(3, 8), torch.randn(3)
    assert runs_on_onednn(x, w, b) and runs_on_onednn(x, w, None)
    assert not runs_on_onednn(x, w.requires_grad_(), b)  # a trained weight: torch's autograd
    w.requires_grad_(False)
    assert not runs_on_onednn(x, w, b.requires_grad_())  # a trained bias (BitFit)
    assert not runs_on_onednn(x.bfloat16(), w.bfloat16(), None)
    assert not runs_on_onednn(torch.randn(8), w, None)
    assert not runs_on_onednn(torch.randn(0, 8), w, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not runs_on_onednn(x, w, None)


def test_the_block_puts_torch_linear_back():
    real = F.linear
    with frozen_linears_on_onednn():
        assert F.linear is not real
    assert F.linear is real
    with pytest.raises(RuntimeError), frozen_linears_on_onednn():
        raise RuntimeError("a client failed")
    assert F.linear is real
    with frozen_linears_on_onednn(on=False):
        assert F.linear is real


def test_flops_are_counted_as_torch_counts_them():
    x, w = torch.randn(6, 16, requires_grad=True), torch.randn(24, 16)
    with count_flops() as ours:
        OneDnnLinear.apply(x, w, None).sum().backward()
    with count_flops() as torchs:
        F.linear(x, w).sum().backward()
    assert ours.total == torchs.total == 2 * 2 * 6 * 16 * 24


def test_onednn_named_without_it_is_refused(monkeypatch):
    from fedslice import onednn

    monkeypatch.setattr(onednn, "available", lambda: False)
    cfg = validate_config({"compute": {"device": "cpu", "linear_kernels": "onednn"}})
    with pytest.raises(ConfigError, match="linear_kernels"):
        Compute.from_config(cfg.compute)


def _run(cfg_dict, kernels):
    cfg = validate_config({**cfg_dict, "compute": {"workers": 1, "linear_kernels": kernels}})
    method, data = setup(cfg)
    state, records, _ = Simulation(cfg, method, data).run()
    return state, records


@pytest.mark.parametrize("pack", [False, True])
def test_a_run_on_onednn_ends_within_float_rounding_of_torch_kernels(tiny_cfg_dict, pack, monkeypatch,
                                                                     every_size):
    """Two rounds of FedPETuning (LoRA on q/v over a frozen BERT): the same trained tensors to
    float rounding, the same FLOPs counted, the same losses to rounding."""
    from fedslice import onednn

    calls = []
    real = onednn.onednn_linear
    monkeypatch.setattr(onednn, "onednn_linear", lambda *a: calls.append(1) or real(*a))
    cfg = {**tiny_cfg_dict, "federation": {**tiny_cfg_dict["federation"], "pack": pack}}
    s_torch, r_torch = _run(cfg, "torch")
    assert not calls
    s_onednn, r_onednn = _run(cfg, "onednn")
    assert calls  # the frozen linears ran there
    for k, t in s_torch.items():
        assert (s_onednn[k] - t).abs().max() <= 1e-5 * t.abs().max(), k
    for a, b in zip(r_torch, r_onednn):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert [m["flops_measured"] for m in a["client_metrics"]] == \
               [m["flops_measured"] for m in b["client_metrics"]]


_CACHE_PROBE = textwrap.dedent("""
    import ctypes, os, sys, torch
    from fedslice.onednn import frozen_linears_on_onednn
    torch.set_num_threads(1)
    libc = ctypes.CDLL("libc.so.6")
    def rss_mb():
        libc.malloc_trim(0)
        return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
    w = torch.randn(384, 384)
    with frozen_linears_on_onednn():
        torch.nn.functional.linear(torch.randn(64, 384, requires_grad=True), w).sum().backward()
        before = rss_mb()
        for rows in range(128, 64 * 42, 64):  # 40 new shapes, forward and backward
            x = torch.randn(rows, 384, requires_grad=True)
            torch.nn.functional.linear(x, w).sum().backward()
            del x
        grown = rss_mb() - before
    print(os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"], os.environ["LRU_CACHE_CAPACITY"], grown)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
def test_primitive_caches_are_bounded_unless_the_environment_sets_them():
    """oneDNN and ideep keep a primitive per product shape (~0.3 MB each, 1,024 of each by
    default): a client's training caps both caches at PRIMITIVE_CACHE_ENTRIES before its first
    oneDNN product, so 40 new shapes (as packed batches' row counts give) leave the process
    about as large as it was; a value in the environment is kept (here the libraries' default,
    under which the same shapes grow it by tens of MB)."""
    from fedslice.heap import PRIMITIVE_CACHE_ENTRIES

    outs = {}
    for preset in (None, "1024"):
        env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY",
                                                                 "LRU_CACHE_CAPACITY")}
        if preset is not None:
            env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = env["LRU_CACHE_CAPACITY"] = preset
        out = subprocess.run([sys.executable, "-c", _CACHE_PROBE], env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        onednn_cap, ideep_cap, grown = out.stdout.split()[-3:]
        outs[preset] = (onednn_cap, ideep_cap, float(grown))
    bounded, unbounded = outs[None], outs["1024"]
    assert bounded[:2] == (str(PRIMITIVE_CACHE_ENTRIES),) * 2 and unbounded[:2] == ("1024", "1024")
    assert bounded[2] < 15, outs
    assert unbounded[2] > 2 * bounded[2] + 10, outs
