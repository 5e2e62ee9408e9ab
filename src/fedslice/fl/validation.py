"""Validation of a client's reply before any aggregation (pure; simulation and Flower alike).

Flower 1.41 averages whatever comes back, NaN included; fedslice checks every reply against what
the client was sent and is allowed to return, and never averages a rejected one. Each check
returns the reason to reject, or None; none of them raises, whatever the reply holds:

- ``num_examples`` is an integer in ``1 .. |D_c|`` (the size of the client's partition, when the
  server knows it): a client over-reporting its data would outweigh the others in FedAvg;
- ``metrics`` is a mapping of names to finite numbers (or lists of them); the loss is there,
  and it and the costs the server averages are non-negative numbers;
- the tensors are exactly the ones the client must return (its slice of the trainable state, by
  name: a missing or an extra tensor is rejected), each with the shape and dtype it was sent,
  and finite. A tensor of an absurd size is rejected by its shape, before any of it is read.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from fedslice.measure.cost import ClientCost

Expected = Mapping[str, torch.Tensor]

#: Metrics every reply must hold: a finite number >= 0.
REQUIRED_METRICS = ("loss",)
#: Metrics the server averages or maximises when a reply holds them (round records, summary): >= 0.
COST_METRICS = ClientCost.AGGREGATED
#: Bounds on what a reply's metrics may hold (names, list lengths): far above any method's.
MAX_METRICS, MAX_LIST = 1024, 1 << 20


def _number(value: Any) -> bool:
    """A real number (bool, int, float, numpy's scalars; not a string, tensor or complex)."""
    return isinstance(value, numbers.Real)


def check_num_examples(num_examples, dataset_size: int | None) -> str | None:
    if isinstance(num_examples, bool) or not isinstance(num_examples, int):
        return f"num_examples={num_examples!r} is not an integer"
    if num_examples <= 0:
        return f"num_examples={num_examples} (no training examples)"
    if dataset_size is not None and num_examples > dataset_size:
        return f"num_examples={num_examples} is larger than the client's dataset ({dataset_size})"
    return None


def _finite_list(values: Any, depth: int = 0) -> bool:
    if depth > 4 or len(values) > MAX_LIST:
        return False
    for v in values:
        if isinstance(v, (list, tuple)):
            if not _finite_list(v, depth + 1):
                return False
        elif not _number(v) or not math.isfinite(float(v)):
            return False
    return True


def check_metrics(metrics: Any, required: tuple[str, ...] = REQUIRED_METRICS) -> str | None:
    """Why a reply's ``metrics`` cannot be used, or None: not a mapping of string names; a value
    that is not a number, None or a (nested) list of numbers; NaN or infinity anywhere; a
    ``required`` one missing; a required one or a cost (:data:`COST_METRICS`) negative."""
    if not isinstance(metrics, Mapping):
        return f"metrics is a {type(metrics).__name__}, not a mapping"
    if len(metrics) > MAX_METRICS:
        return f"{len(metrics)} metrics (at most {MAX_METRICS})"
    for k, v in metrics.items():
        if not isinstance(k, str):
            return f"metric name {k!r} is not a string"
        if v is None:
            continue
        if isinstance(v, (list, tuple)):
            if not _finite_list(v):
                return f"metric {k} is not a list of finite numbers"
        elif not _number(v):
            return f"metric {k}={_short(v)} is not a number"
        elif not math.isfinite(float(v)):
            return f"non-finite metric {k}={v}" if k != "loss" else f"non-finite local loss ({v})"
    for k in (*required, *COST_METRICS):
        v = metrics.get(k)
        if v is None:
            if k in required:
                return f"metric {k} is missing"
            continue
        if isinstance(v, (list, tuple)):
            return f"metric {k} is not a number"
        if float(v) < 0:
            return f"metric {k}={v} is negative"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_tensors(expected: Expected, arrays: Any, exact: bool = True) -> str | None:
    """Why ``arrays`` is not a valid update of the tensors ``expected`` (by name), or None.
    ``exact``: every expected tensor must be there (a reply missing one is rejected)."""
    if not isinstance(arrays, Mapping):
        return f"the tensors are a {type(arrays).__name__}, not a mapping of names"
    for k, t in arrays.items():
        if k not in expected:
            return f"tensor {_short(k)} is outside the client's slice"
        want = expected[k]
        if not isinstance(t, torch.Tensor):
            return f"tensor {k} is a {type(t).__name__}"
        if t.shape != want.shape:
            return f"tensor {k} has shape {tuple(t.shape)}, expected {tuple(want.shape)}"
        if t.dtype != want.dtype:
            return f"tensor {k} has dtype {t.dtype}, expected {want.dtype}"
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return f"non-finite values in tensor {k}"
    if exact:
        missing = [k for k in expected if k not in arrays]
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            return f"tensor(s) {', '.join(missing[:3])}{more} missing from the reply"
    return None


def check_update(expected: Expected, arrays: Any, num_examples, metrics: Any,
                 dataset_size: int | None, required: tuple[str, ...] = REQUIRED_METRICS) -> str | None:
    """All generic checks of one reply: the reason to reject it, or None."""
    return (check_num_examples(num_examples, dataset_size) or check_metrics(metrics, required)
            or check_tensors(expected, arrays))
