"""Per-layer widths from each layer's measured sensitivity: sub-models that cut where cutting costs
least.

The planner's default grid (:func:`~fedslice.slicing.planner.width_candidates`) keeps the same
``round(w*H)`` heads and ``round(w*F)`` FFN units in every layer. On a decoder that loses most of
the function at small ``w`` whatever the order (SmolLM2 at 4 of 9 heads and 608 of 1,536 units
per layer: target NLL 8.5-9.2 against 2.5, BENCHMARKS.md). Allocating widths by salience scores
across layers (a global threshold on the units' scores, raw or as shares of their layer's) was
worse than uniform there; what a layer can lose is measured instead:

* :func:`layer_rise`: the loss of a calibration batch with layer l alone cut to each width level
  (its leading units in the order the sub-models are cut in, the rest masked at the inputs of
  W_o / W_out: :mod:`.masks`), minus the full model's: ``rise[l][k]``, L x K forward passes;
* :func:`allocate`: one level per layer minimising the summed rise within a parameter budget (a
  dynamic programme; rises are assumed to add);
* :func:`measured_width_candidates`: for each width ``w`` of the uniform grid, the allocation at
  the uniform slice's linear parameters (a layer may keep fewer units than the uniform slice, or
  all of them). The planner then measures these candidates' costs as it does the uniform ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch.nn as nn

from fedslice.slicing.masks import Mask
from fedslice.slicing.planner import spec_params
from fedslice.slicing.spec import SliceSpec


def level_sizes(dims: Mapping[str, int], w: float) -> tuple[int, int]:
    """(query heads, FFN units) a layer keeps at width ``w`` (at least one of each)."""
    return max(1, round(w * dims["num_heads"])), max(1, round(w * dims["ffn"]))


def slice_masks(modules: Mapping[tuple[int, int, str], nn.Module], order: SliceSpec,
                sizes: Sequence[tuple[int, int] | None]) -> list[Mask]:
    """Masks keeping, in layer l, the first ``sizes[l]`` = (query heads, FFN units) of ``order``
    (a full-size spec: each layer's heads and units, most important first; None: the whole
    layer); ``modules``: :func:`~.salience.output_modules`."""
    out: list[Mask] = []
    hd = order.head_dim
    for l, size in enumerate(sizes):
        if size is None:
            continue
        h, f = size
        if h < order.num_heads:
            out.append((modules[(0, l, "o")], [x * hd + i for x in order.heads[l][:h] for i in range(hd)]))
        if f < order.ffn:
            out.append((modules[(0, l, "ffn_out")], list(order.neurons[l][:f])))
    return out


def layer_masks(modules, dims: Mapping[str, int], order: SliceSpec, widths: Sequence[float]) -> list[Mask]:
    """:func:`slice_masks` cutting layer l to width ``widths[l]`` (1: whole)."""
    return slice_masks(modules, order, [level_sizes(dims, w) if w < 1 else None for w in widths])


def layer_rise(loss: Callable[[list[Mask], int | None], float], modules, dims: Mapping[str, int],
               order: SliceSpec, levels: Sequence[float]) -> list[list[float]]:
    """(L, K) the loss with layer l alone cut to ``levels[k]``, minus the uncut loss.
    ``loss(masks, l)``: the calibration loss under ``masks``, which cut layer ``l`` only (None:
    the uncut pass, called first), so the blocks below l may be replayed (:mod:`.replay`)."""
    L = dims["num_layers"]
    base = loss([], None)
    return [[loss(layer_masks(modules, dims, order, [w if i == l else 1.0 for i in range(L)]), l) - base
             for w in levels] for l in range(L)]


def allocate(rise: Sequence[Sequence[float]], cost: Sequence[int], budget: int, unit: int) -> list[int]:
    """One level index per layer minimising the summed rise with the summed cost within ``budget``
    (costs rounded up to ``unit``s, so the answer is never over budget); of equal rises, the
    one that keeps more. Level costs ascend."""
    units = [-(-c // unit) for c in cost]
    cap = budget // unit
    if cap < len(rise) * units[0]:
        raise ValueError(f"budget {budget} is below every layer at the smallest level "
                         f"({len(rise)} x {cost[0]})")
    inf = float("inf")
    best = [0.0] + [inf] * cap  # least summed rise of the layers so far at exactly b units
    picks: list[list[int]] = []
    for row in rise:
        new, pick = [inf] * (cap + 1), [-1] * (cap + 1)
        for b, v in enumerate(best):
            if v == inf:
                continue
            for k, (u, r) in enumerate(zip(units, row)):
                if b + u <= cap and v + r < new[b + u]:
                    new[b + u], pick[b + u] = v + r, k
        picks.append(pick)
        best = new
    b = min(range(cap + 1), key=lambda i: (best[i], -i))  # ties: spend the budget
    out = []
    for pick in reversed(picks):
        out.append(pick[b])
        b -= units[pick[b]]
    return out[::-1]


def allocate_spec(rise: Sequence[Sequence[float]], dims: Mapping[str, int], levels: Sequence[float],
                  budget: int) -> SliceSpec:
    """The leading-slice spec of :func:`allocate`'s per-layer widths within ``budget`` linear
    parameters (``levels`` ascending, without 1.0: keeping a layer whole is added, rise 0)."""
    levels = list(levels) + [1.0]
    cost = [spec_params(SliceSpec.leading(dims, *level_sizes(dims, w), layers=[0]), dims) for w in levels]
    picked = allocate([list(r) + [0.0] for r in rise], cost, budget, dims["hidden"] * dims["head_dim"])
    sizes = [level_sizes(dims, levels[k]) for k in picked]
    return SliceSpec.leading(dims, [h for h, _ in sizes], [f for _, f in sizes])


def measured_width_candidates(rise: Sequence[Sequence[float]], dims: Mapping[str, int],
                              levels: Sequence[float], steps: int) -> list[SliceSpec]:
    """Leading-slice specs with measured per-layer widths (:func:`allocate_spec`), one per width
    ``1/steps .. 1`` of the uniform grid at its linear parameters, smallest first; the last is
    the full model. ``levels``: ascending, below 1."""
    L = dims["num_layers"]
    if len(rise) != L or any(len(r) != len(levels) for r in rise):
        raise ValueError(f"rise must be {L} layers x {len(levels)} levels")
    if not all(0 < a < b <= 1 for a, b in zip(levels, list(levels[1:]) + [1.0])):
        raise ValueError(f"levels must ascend within (0, 1), got {list(levels)}")
    smallest = L * spec_params(SliceSpec.leading(dims, *level_sizes(dims, levels[0]), layers=[0]), dims)
    specs = {}
    for j in range(1, steps):
        uniform = SliceSpec.leading(dims, *level_sizes(dims, j / steps))
        budget = spec_params(uniform, dims)
        # below the smallest level everywhere: the uniform slice itself
        specs[uniform if budget < smallest else allocate_spec(rise, dims, levels, budget)] = None
    specs[SliceSpec.full(dims)] = None
    return sorted(specs, key=lambda s: spec_params(s, dims))
