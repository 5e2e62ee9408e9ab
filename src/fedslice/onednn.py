"""Frozen fp32 linear layers of a CPU training step on oneDNN's kernels (``compute.linear_kernels``).

torch's CPU ``addmm``/``mm`` in fp32 call MKL's sgemm, which on AMD CPUs runs its AVX2 code path
(MKL picks AVX-512 by CPU vendor): on this repo's AMD EPYC (Zen 5) machine, 100-115 GFLOP/s at
one thread on a client's matmuls (about 1,000 x 384 x 1536), where oneDNN's fp32 kernels
(torch's ``mkldnn`` build, AVX-512 by CPU features) run the same products at 230-250 GFLOP/s.
The linear layers are about 70% of a MiniLM-L6 + LoRA client step, so the step is 1.5x faster
(BENCHMARKS.md, "Against Flower with length-grouped batches on its side too").

Within :func:`frozen_linears_on_onednn`, every ``F.linear`` whose weight (and bias) is frozen,
fp32, on the CPU, runs :class:`OneDnnLinear`: forward ``x @ W.T + b`` and backward
``grad @ W`` on oneDNN (no weight gradient: the weight is frozen). Trainable weights (LoRA's
factors, a trained head) keep torch's kernels and autograd. The products are the same fp32
products summed in another order: results agree with torch's kernels to float rounding
(``tests/test_onednn.py``), not bit for bit.

oneDNN keeps a primitive per product shape (oneDNN's primitive cache and ideep's, 1,024 each by
default), each holding ~0.3 MB; packed, length-grouped batches give almost every step a new
number of rows, so a worker's caches grew by ~100 MB over a round's clients and, scattered in
its heap, raised every later client's peak too. :func:`fedslice.heap.limit_primitive_caches`
caps both at :data:`fedslice.heap.PRIMITIVE_CACHE_ENTRIES` (BENCHMARKS.md, "Peak memory
(target 4): oneDNN's primitive caches").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from math import prod
from typing import Any

import torch
import torch.nn.functional as F

from fedslice.heap import limit_primitive_caches

KERNELS = ("auto", "onednn", "torch")

#: products of fewer multiply-adds (rows x in x out) keep torch's kernel: oneDNN's ~10 µs per call
#: loses on tiny ones (16 x 64 x 64: 13 µs against MKL's 4), is even at 64 x 128 x 128 and 1.5-2.4x
#: faster from 32 x 384 x 384 up (one thread, this repo's AMD EPYC)
MIN_MULTIPLY_ADDS = 1 << 20


def available() -> bool:
    """Whether this torch build has oneDNN's dense-tensor linear kernel."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def uses_onednn(kernels: str) -> bool:
    """``compute.linear_kernels`` resolved: 'auto' is oneDNN where torch has it."""
    return kernels == "onednn" or (kernels == "auto" and available())


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` on oneDNN (dense, strided tensors; no autograd)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class OneDnnLinear(torch.autograd.Function):
    """``F.linear`` with a frozen weight and bias, forward and backward on oneDNN."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)  # a parameter: no new memory (torch's addmm saves it too)
        return onednn_linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        grad_x = onednn_linear(grad, weight.t(), None) if ctx.needs_input_grad[0] else None
        return grad_x, None, None


def runs_on_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a linear call is one :class:`OneDnnLinear` takes: a frozen 2-D fp32 weight (and
    bias), an fp32 input, all plain strided CPU tensors, no autocast, a product of at least
    :data:`MIN_MULTIPLY_ADDS`."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return (not weight.requires_grad and (bias is None or not bias.requires_grad)
            and weight.dim() == 2 and x.dim() >= 2
            and x.numel() * weight.shape[0] >= MIN_MULTIPLY_ADDS
            and all(t.dtype == torch.float32 and t.device.type == "cpu" and t.layout == torch.strided
                    and type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)
            and not torch.is_autocast_enabled("cpu"))


@contextmanager
def frozen_linears_on_onednn(on: bool = True) -> Iterator[None]:
    """Within the block, ``F.linear`` calls that :func:`runs_on_onednn` takes run
    :class:`OneDnnLinear` (every ``F.linear`` of the process: the block is one client's
    training, as :func:`fedslice.data.packing.packed_training`'s dropout); the others, and
    everything after the block, run torch's own."""
    if not on:
        yield
        return
    limit_primitive_caches()
    real = F.linear

    def linear(x, weight, bias=None):
        if runs_on_onednn(x, weight, bias):
            return OneDnnLinear.apply(x, weight, bias)
        return real(x, weight, bias)

    F.linear = linear
    try:
        yield
    finally:
        F.linear = real


def flop_mapping() -> dict[Any, Any]:
    """FLOP formulas of the oneDNN kernel, for :class:`torch.utils.flop_counter.FlopCounterMode`
    (shapes in): a product of an input of M rows and K columns by a K x N weight, 2·M·K·N (the
    bias is not counted, as torch does not count addmm's)."""
    if not available():
        return {}

    def linear_flops(x_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
        return 2 * prod(x_shape[:-1]) * weight_shape[0] * weight_shape[1]

    return {torch.ops.mkldnn._linear_pointwise: linear_flops}
