"""Per-layer widths from salience: sub-models that cut where a layer's salience is flat.

The planner's default grid (:func:`~fedslice.slicing.planner.width_candidates`) keeps the same
``round(w*H)`` heads and ``round(w*F)`` FFN units in every layer. On a decoder that loses most of
the function at small ``w`` whatever the order (SmolLM2 at 4 of 9 heads and 608 of 1,536 units
per layer: target NLL 9.2 against 2.6 in activation order, BENCHMARKS.md): a few layers hold
units the model cannot lose, others hold many units of little use.

:func:`salience_width_candidates` keeps, at width ``w``, ``round(w * total)`` heads and
``round(w * total)`` FFN units of the whole stack (at least one of each per layer), taken
greedily by each unit's **share of its layer's salience** (its score over the layer's sum), so a
layer whose salience sits in a few units keeps those few and a layer whose salience is spread
keeps more. Units are taken in the salience order the sub-model uses (heads under grouped-query
attention: groups whole, query heads within their group, as :func:`~.salience.stack_order`), so
every layer keeps a leading prefix and the spec is a leading slice of the reordered state.
Shares are made non-increasing along that order (a running minimum) so that the greedy choice is
one global threshold: a unit is kept only when every unit before it in its layer is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from fedslice.slicing.planner import spec_params
from fedslice.slicing.salience import LayerSalience, stack_order
from fedslice.slicing.spec import ModelSlice, SliceSpec, Spec


def shares_in_order(scores: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
    """(n,) each unit's share of its layer's salience, in ``order``, made non-increasing."""
    s = scores.double().clamp_min(0)[list(order)]  # (n,)
    share = s / s.sum() if s.sum() > 0 else torch.full_like(s, 1.0 / len(s))
    return torch.cummin(share, 0).values


def allocate(shares: Sequence[torch.Tensor], width: float) -> list[int]:
    """Units kept per layer: the ``max(L, round(width * total))`` largest shares over all layers,
    at least one per layer, a prefix of every layer (``shares`` non-increasing per layer)."""
    sizes = [len(s) for s in shares]
    keep = min(sum(sizes), max(len(sizes), round(width * sum(sizes))))
    forced = [torch.cat([torch.full((1,), float("inf"), dtype=s.dtype), s[1:]]) for s in shares]
    values = torch.cat(forced)  # (total,) layer-major, position ascending
    layer = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    top = torch.argsort(-values, stable=True)[:keep]  # ties: the earlier position first
    return torch.bincount(layer[top], minlength=len(sizes)).tolist()


def stack_widths(sal: Sequence[LayerSalience], dims: Mapping[str, int], widths: Sequence[float],
                 shared_heads: bool = False) -> list[SliceSpec]:
    """One stack's salience-allocated leading slices, one per ``widths`` entry (``shared_heads``:
    one head order for every layer, as the reorder gives T5's stacks)."""
    order = stack_order(list(sal), dims, shared_heads)
    heads = [shares_in_order(s.heads, o) for s, o in zip(sal, order.heads)]
    ffn = [shares_in_order(s.neurons, o) for s, o in zip(sal, order.neurons)]
    return [SliceSpec.leading(dims, allocate(heads, w), allocate(ffn, w)) for w in widths]


def salience_width_candidates(sal: Sequence[Sequence[LayerSalience]],
                              dims: Sequence[Mapping[str, int]], steps: int,
                              shared_heads: bool = False) -> list[Spec]:
    """Salience-allocated specs at widths ``1/steps .. 1``, smallest first (by linear
    parameters); the last is the full model. ``sal``: :func:`~.salience.model_salience` of the
    state the sub-models will be cut from (before its salience reorder), one list per stack;
    ``shared_heads`` as :func:`~.salience.salience_order` takes it (``arch.head_bias``)."""
    if len(sal) != len(dims):
        raise ValueError(f"salience of {len(sal)} stack(s) for {len(dims)} stack(s) of dims")
    widths = [j / steps for j in range(1, steps + 1)]
    per_stack = [stack_widths(s, d, widths, shared_heads) for s, d in zip(sal, dims)]
    specs: list[Spec] = (per_stack[0] if len(dims) == 1
                         else [ModelSlice(tuple(col)) for col in zip(*per_stack)])
    one = dims[0] if len(dims) == 1 else list(dims)
    return sorted(dict.fromkeys(specs), key=lambda s: spec_params(s, one))
