"""Sizes: bytes and parameter counts of tensors, modules and a trainable state (gradients and
optimizer slots), and where a model's tensors live."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn


def tensor_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Total payload bytes of ``tensors``: the sum of ``numel * element_size`` over all values."""
    return int(sum(t.numel() * t.element_size() for t in tensors.values()))


def held_bytes(t: torch.Tensor) -> int:
    """Bytes that hold ``t``: a quantized weight's int data and scales (a torchao tensor
    subclass, whose dtype is the high-precision one; a bitsandbytes 4-bit parameter and its
    quantization state), a plain tensor's ``numel * element_size``."""
    inner = _inner(t)
    if inner is not None:
        return int(sum(held_bytes(x) for x in inner))
    if type(t).__name__ == "Params4bit" and getattr(t, "quant_state", None) is not None:
        qs = t.quant_state
        extra = sum(x.numel() * x.element_size() for x in (qs.absmax, getattr(qs, "code", None))
                    if isinstance(x, torch.Tensor))
        return int(t.data.numel() * t.data.element_size() + extra)
    return int(t.numel() * t.element_size())


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


def _inner(t: torch.Tensor) -> list[torch.Tensor] | None:
    """The plain tensors that hold a tensor subclass of torchao's (a quantized weight: int8 data
    and scales), None for any other tensor."""
    names = getattr(type(t), "tensor_data_names", None)
    if names is None:
        return None
    names = [*names, *(getattr(type(t), "optional_tensor_data_names", None) or [])]
    return [x for x in (getattr(t, n, None) for n in names) if isinstance(x, torch.Tensor)]


def storage_ptr(t: torch.Tensor) -> int:
    inner = _inner(t)
    if inner:
        return storage_ptr(inner[0])
    try:
        return int(t.untyped_storage().data_ptr())
    except Exception:  # sparse / nested / tensor subclasses without a plain storage
        return int(t.data_ptr()) if t.layout == torch.strided else 0


def storage_nbytes(t: torch.Tensor) -> int:
    inner = _inner(t)
    if inner is not None:  # a quantized weight: what its int data and scales take
        return int(sum(storage_nbytes(x) for x in inner))
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:
        return int(t.numel() * t.element_size())
