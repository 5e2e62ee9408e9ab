"""Sizes: bytes and parameter counts of tensors, modules and a trainable state (gradients and
optimizer slots), and where a model's tensors live."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from fedslice.models.quantize import quantized_parts


def tensor_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Total payload bytes of ``tensors``: the sum of ``numel * element_size`` over all values."""
    return int(sum(t.numel() * t.element_size() for t in tensors.values()))


def num_params(tensors: Mapping[str, torch.Tensor]) -> int:
    """Total number of elements in ``tensors``."""
    return int(sum(t.numel() for t in tensors.values()))


def module_bytes(model: nn.Module) -> int:
    """Bytes of a module's parameters and buffers (each storage once: tied and shared tensors
    count once)."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if not t.is_meta:
            seen.setdefault(storage_ptr(t), storage_nbytes(t))
    return int(sum(seen.values()))


def trainable_state_bytes(params: Iterable[torch.Tensor] | nn.Module, optimizer_slots: int = 2) -> int:
    """Bytes of the gradients plus optimizer state of the trainable parameters.

    ``params`` is a module (its parameters with ``requires_grad``) or an iterable of tensors.
    ``optimizer_slots`` is the number of parameter-sized state tensors the optimizer keeps:
    2 for Adam/AdamW (``exp_avg``, ``exp_avg_sq``), 1 for SGD with momentum, 0 for plain SGD.
    Use the result as ``PeakMemory(extra_bytes=...)``.
    """
    if isinstance(params, nn.Module):
        params = params.parameters()
    total = 0
    for p in params:
        if p.requires_grad:
            total += p.numel() * p.element_size() * (1 + optimizer_slots)
    return int(total)


def model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def storage_ptr(t: torch.Tensor) -> int:
    inner = quantized_parts(t)
    if inner:
        return storage_ptr(inner[0])
    try:
        return int(t.untyped_storage().data_ptr())
    except Exception:  # sparse / nested / tensor subclasses without a plain storage
        return int(t.data_ptr()) if t.layout == torch.strided else 0


def storage_nbytes(t: torch.Tensor) -> int:
    inner = quantized_parts(t)
    if inner is not None:  # a quantized weight: what its int data and scales take
        return int(sum(storage_nbytes(x) for x in inner))
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:
        return int(t.numel() * t.element_size())
