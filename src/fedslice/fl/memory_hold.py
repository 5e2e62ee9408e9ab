"""A client holding its memory budget as it trains (``budgets.enforce_memory``): each step's
saved tensors predicted from the last measured one, the batch split into the fewest micro-batches
that fit, and the error when not one example does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from fedslice.data.packing import is_packed
from fedslice import measure
from fedslice.tasks.base import batch_rows
from fedslice.fl.orders import Orders, OrdersLike

_MIB = float(1 << 20)


class MemoryBudgetExceeded(Exception):
    """A client's step needs more memory than its budget even one example at a time: the client
    trains nothing this round (:meth:`fedslice.methods.base.Method.train_client` replies
    without an update and says why)."""

    def __init__(self, budget_mb: float, needed_mb: float) -> None:
        super().__init__(f"memory budget {budget_mb:g} MiB; its cheapest step (one example) "
                         f"needs {needed_mb:.1f} MiB")
        self.budget_mb, self.needed_mb = budget_mb, needed_mb


def activation_units(batch: dict[str, torch.Tensor]) -> tuple[int, int]:
    """``(rows x length, rows x length²)`` of a batch's sequences (encoder and decoder; an image
    batch: its rows for both): what the tensors a step saves for backward grow with (linear
    layers, dropout masks and logits with the first, attention's scores with the second)."""
    seqs = [batch[k] for k in ("input_ids", "decoder_input_ids") if k in batch]
    if not seqs:
        rows = batch_rows(batch)
        return rows, rows
    return (sum(int(t.shape[0]) * int(t.shape[1]) for t in seqs),
            sum(int(t.shape[0]) * int(t.shape[1]) ** 2 for t in seqs))


@dataclass(frozen=True)
class ActivationReference:
    """A step's measured saved-tensor peak (bytes) and its batch's :func:`activation_units`:
    a batch of other units saves at most ``bytes`` x the larger ratio of the two (each part of
    the peak grows with one of them), what :func:`predict` returns."""

    bytes: float
    linear: int
    quadratic: int
    planned: bool = False  # the planner's step (else a step the client measured)

    def predict(self, batch: dict[str, torch.Tensor]) -> float:
        linear, quadratic = activation_units(batch)
        return self.bytes * max(linear / max(self.linear, 1), quadratic / max(self.quadratic, 1))

    def to_config(self) -> dict[str, float]:
        return {"bytes": self.bytes, "linear": self.linear, "quadratic": self.quadratic}

    @classmethod
    def from_config(cls, d: dict[str, float] | None) -> ActivationReference | None:
        return None if not d else cls(float(d["bytes"]), int(d["linear"]), int(d["quadratic"]), True)


@dataclass(frozen=True)
class ActivationBound:
    """What a client predicts its steps' saved tensors from: the planner's reference step (the
    worst batch shape it simulated) and its own last measured step. Each reference's prediction
    bounds a step, so the least of them does: the client's own step predicts batches like it
    closely, the planner's those near its worst shape (the larger ratio of a small measured step
    overstates a much longer batch)."""

    references: tuple[ActivationReference, ...]

    def predict(self, batch: dict[str, torch.Tensor]) -> float:
        return min(r.predict(batch) for r in self.references)

    def measured(self, step: ActivationReference) -> ActivationBound:
        """This bound with ``step`` as the client's last measured step."""
        return ActivationBound((*self.references[:1], step) if self.planned else (step,))

    @property
    def planned(self) -> bool:
        return bool(self.references) and self.references[0].planned


def memory_split(rows: torch.Tensor, collate, allowance: float | None,
                 reference: ActivationBound | None, micro: int = 1
                 ) -> tuple[list[dict[str, torch.Tensor]] | None, bool]:
    """A step's batch (``collate(rows)``) as the micro-batches it trains in: the plan's
    ``micro`` (:func:`split_batch` of the batch), or, where one of those would save more bytes
    for backward than ``allowance`` (predicted from ``reference``), the fewest parts of
    consecutive examples, each collated alone, that all fit: 2x, 4x, ... as many, then one
    example each. None when not even one example fits; no allowance or reference: the plan's.
    Returns the parts and whether they are more than the plan's (a downgrade)."""
    batch = collate(rows)
    planned = split_batch(batch, micro) if micro > 1 and not is_packed(batch) else [batch]
    if allowance is None or reference is None or max(map(reference.predict, planned)) <= allowance:
        return planned, False
    n, parts = len(rows), min(len(rows), 2 * len(planned))
    while True:
        bounds = [round(i * n / parts) for i in range(parts + 1)]
        split = [collate(rows[lo:hi]) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
        if max(map(reference.predict, split)) <= allowance:
            return split, True
        if parts >= n:
            return None, True
        parts = min(n, parts * 2)


def memory_allowance(model: nn.Module, cfg: OrdersLike, optimizer_bytes: int
                     ) -> tuple[float | None, ActivationBound | None, int]:
    """``(bytes a step may save for backward, the planner's reference step, 0)`` under the
    plan's ``memory_budget`` (MiB: the model's tensors, gradients and AdamW state, and
    a step's saved tensors, as the run's ``memory_mb`` counts them); ``(None, None, 0)``
    without one. A budget the model and optimizer state alone pass: MemoryBudgetExceeded."""
    o = Orders.of(cfg)
    budget = o.memory_budget
    if budget is None:
        return None, None, 0
    static = measure.module_bytes(model) + optimizer_bytes
    allowance = float(budget) * _MIB - static
    if allowance <= 0:
        raise MemoryBudgetExceeded(float(budget), static / _MIB)
    planned = ActivationReference.from_config(o.memory_reference)
    return allowance, None if planned is None else ActivationBound((planned,)), 0


def cheapest_step_mb(model: nn.Module, optimizer_bytes: int, reference: ActivationBound | None,
                      singles: list[dict[str, torch.Tensor]]) -> float:
    """MiB a step of one example at a time needs (the largest of ``singles``, predicted)."""
    saved = max(map(reference.predict, singles)) if reference is not None else 0.0
    return (measure.module_bytes(model) + optimizer_bytes + saved) / _MIB


def split_batch(batch: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    """An unpacked batch as ``parts`` micro-batches of consecutive rows (fewer when it has fewer
    rows); every tensor's first dimension is the row."""
    rows = batch_rows(batch)
    if parts <= 1 or rows <= 1:
        return [batch]
    bounds = [round(i * rows / parts) for i in range(parts + 1)]
    return [{k: v[lo:hi] for k, v in batch.items()} for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
