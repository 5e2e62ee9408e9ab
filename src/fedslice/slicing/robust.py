"""Robust aggregation and update clipping, pure functions over client deltas.

Inputs are the same as :func:`fedslice.slicing.aggregate.aggregate_deltas`: full-shape client
deltas and per-client weights (a float, or per key a tensor broadcastable to the parameter); an
element is *held* by a client where its weight is > 0 (sub-model methods send slices).

- **Same-shaped updates** (every client holds every element: FedAvg, FedPETuning, FedPFT,
  FedOT): Flower's own functions (``flwr.server.strategy.aggregate``) on the flattened deltas:
  coordinate median (``aggregate_median``), trimmed mean (``aggregate_trimmed_avg``), Krum and
  Multi-Krum (``aggregate_krum``; Multi-Krum averages the kept clients weighted by examples).
- **Sliced updates** (RaFFM slices, pruned heads): per element, over the clients that hold it:
  median (``np.nanmedian``: the mean of the two middle values for an even count, as
  ``np.median``) or trimmed mean (the ``floor(beta * h)`` lowest and highest of the ``h`` holders
  cut). An element nobody holds keeps its value. Krum needs whole vectors: refused for them.
- **Clipping** (``clip_update``): Flower's FlatClip, ``delta * min(1, C / ||delta||)`` with the
  norm over all elements the client sent.

The result is applied with the server learning rate: ``new = g + eta * robust(deltas)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

State = dict[str, torch.Tensor]
Weight = float | torch.Tensor


def held_masks(global_state: Mapping[str, torch.Tensor], deltas: Sequence[Mapping[str, torch.Tensor]],
               weights: Sequence[Weight | Mapping[str, Weight]]) -> list[dict[str, torch.Tensor]]:
    """Per client and key, a bool tensor of the parameter's shape: where the client's weight > 0."""
    out = []
    for delta, w in zip(deltas, weights):
        masks = {}
        for key, g in global_state.items():
            if key not in delta:
                masks[key] = torch.zeros(g.shape, dtype=torch.bool)
                continue
            wk = w[key] if isinstance(w, Mapping) else w
            masks[key] = torch.broadcast_to(torch.as_tensor(wk, dtype=torch.float32) > 0, g.shape)
        out.append(masks)
    return out


def same_shaped(held: Sequence[Mapping[str, torch.Tensor]]) -> bool:
    return all(bool(m.all()) for h in held for m in h.values())


def clip_update(delta: Mapping[str, torch.Tensor], max_norm: float) -> tuple[State, float]:
    """FlatClip: scale the whole update to L2 norm at most ``max_norm``; also its norm before."""
    norm = float(torch.sqrt(sum((t.float() ** 2).sum() for t in delta.values()))) if delta else 0.0
    scale = min(1.0, max_norm / norm) if norm > 0 else 1.0
    return {k: t * scale for k, t in delta.items()}, norm


def _apply(global_state: Mapping[str, torch.Tensor], step: Mapping[str, torch.Tensor],
           held_any: Mapping[str, torch.Tensor], eta: float) -> State:
    out = {}
    for k, g in global_state.items():
        s = torch.where(held_any[k], step[k], torch.zeros(()))
        out[k] = (g.float() + eta * s).to(g.dtype)
    return out


def _flat(deltas, keys) -> list[list[np.ndarray]]:
    return [[d[k].float().numpy() for k in keys] for d in deltas]


def _masked_stack(deltas, held, key) -> torch.Tensor:
    """(clients, *shape) float64 with NaN where a client does not hold the element."""
    return torch.stack([torch.where(h[key], d[key].double(), torch.tensor(float("nan"), dtype=torch.float64))
                        if key in d else torch.full(h[key].shape, float("nan"), dtype=torch.float64)
                        for d, h in zip(deltas, held)])


def masked_median(stack: torch.Tensor) -> torch.Tensor:
    """Median over axis 0 ignoring NaN (0 where every value is NaN)."""
    a = stack.numpy()
    with np.errstate(all="ignore"):
        held = ~np.isnan(a).all(0)
        med = np.zeros(a.shape[1:])
        if held.any():
            med[held] = np.nanmedian(a[:, held], axis=0)
    return torch.from_numpy(med)


def masked_trimmed_mean(stack: torch.Tensor, beta: float) -> torch.Tensor:
    """Per element: cut floor(beta * h) of the h non-NaN values at each end, mean the rest."""
    h = (~torch.isnan(stack)).sum(0)                           # holders per element
    cut = torch.floor(beta * h.double()).long()
    ordered = torch.sort(stack, dim=0).values                   # NaN sort last
    pos = torch.arange(stack.shape[0]).reshape(-1, *([1] * (stack.dim() - 1)))
    keep = (pos >= cut) & (pos < h - cut)
    total = torch.where(keep, ordered, torch.zeros((), dtype=stack.dtype)).sum(0)
    count = keep.sum(0)
    return torch.where(count > 0, total / count.clamp(min=1), torch.zeros((), dtype=stack.dtype))


def robust_aggregate(global_state: Mapping[str, torch.Tensor], deltas: Sequence[Mapping[str, torch.Tensor]],
                     weights: Sequence[Weight | Mapping[str, Weight]], rule: str, *, eta: float = 1.0,
                     trim_fraction: float = 0.2, byzantine: int = 0, keep: int | None = None,
                     num_examples: Sequence[int] | None = None) -> State:
    """``median`` | ``trimmed_mean`` | ``krum`` | ``multi_krum`` of the client deltas (see the
    module doc), applied to ``global_state`` with server learning rate ``eta``."""
    # Flower is imported only by a run that uses a robust rule (start-up of plain runs)
    from flwr.server.strategy.aggregate import aggregate_krum, aggregate_median, aggregate_trimmed_avg

    held = held_masks(global_state, deltas, weights)
    held_any = {k: torch.stack([h[k] for h in held]).any(0) for k in global_state}
    keys = [k for k in global_state if bool(held_any[k].any())]  # held by nobody: unchanged
    if same_shaped([{k: h[k] for k in keys} for h in held]):
        flat = _flat(deltas, keys)
        n = list(num_examples) if num_examples is not None else [1] * len(flat)
        results = list(zip(flat, n))
        if rule == "median":
            agg = aggregate_median(results)
        elif rule == "trimmed_mean":
            agg = aggregate_trimmed_avg(results, trim_fraction)
        elif rule in ("krum", "multi_krum"):
            agg = aggregate_krum(results, byzantine, 0 if rule == "krum" else (keep or len(flat) - byzantine))
        else:
            raise ValueError(f"unknown robust rule {rule!r}")
        step = {k: torch.zeros(()) for k in global_state}
        step.update({k: torch.as_tensor(np.asarray(a)).float() for k, a in zip(keys, agg)})
        return _apply(global_state, step, held_any, eta)
    if rule not in ("median", "trimmed_mean"):
        raise ValueError(f"{rule} needs same-shaped updates; these clients hold different slices")
    step = {k: torch.zeros(()) for k in global_state}
    for k in keys:
        stack = _masked_stack(deltas, held, k)
        step[k] = (masked_median(stack) if rule == "median"
                   else masked_trimmed_mean(stack, trim_fraction)).float()
    return _apply(global_state, step, held_any, eta)
