"""Validation of a client's update before any aggregation (pure; simulation and Flower alike).

Flower 1.41 averages whatever comes back, NaN included; fedslice checks every reply against what
the client was sent and is allowed to return, and never averages a rejected one:

- ``num_examples`` is an integer in ``1 .. |D_c|`` (the size of the client's partition, when the
  server knows it): a client over-reporting its data would outweigh the others in FedAvg;
- the local loss is finite;
- every tensor is one the client may return (inside its slice spec: what it was sent of the
  trainable state), with the shape and dtype it was sent, and finite.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

Expected = Mapping[str, torch.Tensor]


def check_num_examples(num_examples, dataset_size: int | None) -> str | None:
    if isinstance(num_examples, bool) or not isinstance(num_examples, int):
        return f"num_examples={num_examples!r} is not an integer"
    if num_examples <= 0:
        return f"num_examples={num_examples} (no training examples)"
    if dataset_size is not None and num_examples > dataset_size:
        return f"num_examples={num_examples} is larger than the client's dataset ({dataset_size})"
    return None


def check_tensors(expected: Expected, arrays: Mapping[str, torch.Tensor]) -> str | None:
    """Why ``arrays`` is not a valid update of the tensors ``expected`` (by name), or None."""
    for k, t in arrays.items():
        if k not in expected:
            return f"tensor {k} is outside the client's slice"
        want = expected[k]
        if not isinstance(t, torch.Tensor):
            return f"tensor {k} is a {type(t).__name__}"
        if t.shape != want.shape:
            return f"tensor {k} has shape {tuple(t.shape)}, expected {tuple(want.shape)}"
        if t.dtype != want.dtype:
            return f"tensor {k} has dtype {t.dtype}, expected {want.dtype}"
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return f"non-finite values in tensor {k}"
    return None


def check_update(expected: Expected, arrays: Mapping[str, torch.Tensor], num_examples,
                 loss: float, dataset_size: int | None) -> str | None:
    """All checks of one reply: the reason to reject it, or None."""
    reason = check_num_examples(num_examples, dataset_size)
    if reason:
        return reason
    if not math.isfinite(loss):
        return f"non-finite local loss ({loss})"
    return check_tensors(expected, arrays)
