"""A training step measured on the model cut to a few of its blocks, extrapolated per block.

A decoder of 30 identical blocks costs, per measured step, 30 blocks' FLOPs and saved tensors
plus its embeddings, head and loss. Every FLOP of a block and every tensor it saves for backward
is the same in each block of one kind (same modules, parameter shapes, dtypes, what trains,
checkpointing), so a step's FLOPs and its peak of saved bytes are affine in the number of blocks
of each kind: measured on the model cut to ``u`` blocks of each run of equal blocks and to
``2u`` (or ``u`` plus one block of one run), they extrapolate to the whole model exactly
(:func:`extrapolated_step`). The blocks of one kind are told apart by :func:`block_kind`; the
model is cut in place (the very block modules, no copy) and put back after (:func:`cut_to`).

The planner verifies what it chose on the whole model
(:class:`fedslice.methods.planner.BudgetPlanner`): extrapolation saves the search's steps, never
the guarantee that a plan's measured memory is within its budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import reduce

import torch
from torch import nn

from fedslice.models.arch import ArchSpec, module_at, unwrap_model
from fedslice.slicing.planner import StepMeasure, training_state_bytes

#: attributes that number a block rather than shape what it computes
_NUMBERING = frozenset({"layer_idx", "layer_id", "layer_index", "block_idx", "idx"})
#: attributes a measured step sets itself (it trains)
_SET_BY_STEP = frozenset({"training"})
_PLAIN = (bool, int, float, str, type(None))


def _plain(value) -> Hashable | None:
    """A module attribute as a hashable value where it is plain data (numbers, strings, tuples
    of them, dtypes); None for anything else (tensors and modules are compared apart)."""
    if isinstance(value, _PLAIN):
        return (type(value).__name__, value)
    if isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value):
        return tuple(value)
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    return None


def _hooks(module: nn.Module) -> tuple:
    names = []
    for hooks in (module._forward_pre_hooks, module._forward_hooks, module._backward_hooks,
                  getattr(module, "_backward_pre_hooks", {})):
        names.append(tuple(getattr(h, "__qualname__", type(h).__name__) for h in hooks.values()))
    return tuple(names)


def block_kind(block: nn.Module) -> Hashable:
    """What a block computes and saves, as a hashable value: its modules' classes, plain
    attributes (but its number) and hooks, its parameters' and buffers' shapes and dtypes, and
    which parameters train. Two blocks of one kind cost the same step."""
    out = []
    for name, m in block.named_modules():
        attrs = tuple(sorted((k, v) for k, v in ((k, _plain(v)) for k, v in vars(m).items()
                                                  if not k.startswith("_") and k not in _NUMBERING | _SET_BY_STEP)
                             if v is not None))
        patched = getattr(vars(m).get("forward"), "__qualname__", None)
        out.append((name, type(m).__qualname__, attrs, _hooks(m), patched))
    out.append(tuple((n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in block.named_parameters()))
    out.append(tuple((n, tuple(b.shape), str(b.dtype)) for n, b in block.named_buffers()))
    return tuple(out)


def runs(blocks: Sequence[nn.Module]) -> list[tuple[int, int]]:
    """(first block, length) of each run of consecutive blocks of one kind."""
    out: list[tuple[int, int]] = []
    last = object()
    for i, b in enumerate(blocks):
        kind = block_kind(b)
        if out and kind == last:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
        last = kind
    return out


@dataclass(frozen=True)
class Extrapolation:
    """Cut models to measure and how their steps add up to the whole one's: the whole step =
    ``steps[0] + sum(k * (steps[j] - steps[0]) for j, k in enumerate(weights, 1))``, where
    ``steps[j]`` is the step of the model cut to ``counts[j]`` blocks of each run."""

    counts: tuple[tuple[int, ...], ...]
    weights: tuple[int, ...]

    @property
    def blocks(self) -> int:
        """Blocks the cut models run together."""
        return sum(map(sum, self.counts))


def extrapolation(lengths: Sequence[int]) -> Extrapolation | None:
    """The cheapest way to extrapolate a model of runs of ``lengths`` blocks (None: measuring it
    whole runs at most twice as many blocks). Runs of lengths with a common factor ``g`` (30, or
    15 + 15): the model cut to ``u = lengths / g`` and to ``2u``, the difference ``g - 1`` times;
    else one block of each run, and one more of each run in turn."""
    whole = sum(lengths)
    g = reduce(math.gcd, lengths)
    unit = tuple(n // g for n in lengths)
    ways = []
    if g >= 2:
        ways.append(Extrapolation((unit, tuple(2 * u for u in unit)), (g - 1,)))
    ones = tuple(1 for _ in lengths)
    more = tuple(tuple(1 + (i == j) for i in range(len(lengths))) for j in range(len(lengths)))
    ways.append(Extrapolation((ones, *more), tuple(n - 1 for n in lengths)))
    best = min(ways, key=lambda w: w.blocks)
    return best if 2 * best.blocks <= whole else None


@contextmanager
def cut_to(model: nn.Module, arch: ArchSpec, keep: Sequence[int]) -> Iterator[nn.Module]:
    """``model`` with only the blocks numbered ``keep`` (the same modules, in order) in its
    block list, put back after."""
    base = unwrap_model(model)
    parent_path, _, name = arch.stacks[0].layers.rpartition(".")
    parent = module_at(base, parent_path) if parent_path else base
    whole = getattr(parent, name)
    setattr(parent, name, nn.ModuleList([whole[i] for i in keep]))
    try:
        yield model
    finally:
        setattr(parent, name, whole)


def _kept(spans: Sequence[tuple[int, int]], counts: Sequence[int]) -> list[int]:
    return [i for (first, _), c in zip(spans, counts) for i in range(first, first + c)]


def plan_for(model: nn.Module, arch: ArchSpec) -> tuple[list[tuple[int, int]], Extrapolation] | None:
    """The runs of ``model``'s blocks and how to extrapolate them; None where the model is
    measured whole (several stacks, or too few blocks of one kind to save a step's worth)."""
    if len(arch.stacks) != 1:
        return None
    spans = runs(arch.blocks(model))
    way = extrapolation([n for _, n in spans])
    return None if way is None else (spans, way)


def extrapolated_step(model: nn.Module, arch: ArchSpec, step: Callable[[nn.Module], StepMeasure],
                      how: tuple[list[tuple[int, int]], Extrapolation] | None = None) -> StepMeasure:
    """``step(model)`` (a training step measured: :func:`fedslice.slicing.planner.measure_step`
    on fixed rows) of the whole model, from steps of the model cut to a few blocks of each run
    (:func:`plan_for`; measured whole where it says so). FLOPs (and their attention and head
    parts) and the peak of saved bytes extrapolate as affine in the blocks of each kind; the
    training state (parameters, gradients, AdamW moments) and parameter counts are the whole
    model's, counted without a step."""
    how = plan_for(model, arch) if how is None else how
    if how is None:
        return step(model)
    spans, way = how
    measured = []
    for counts in way.counts:
        with cut_to(model, arch, _kept(spans, counts)):
            measured.append(step(model))
    first = measured[0]

    def total(field: str) -> float:
        v0 = getattr(first, field)
        return v0 + sum(k * (getattr(m, field) - v0) for k, m in zip(way.weights, measured[1:]))

    params = {id(p): p for p in model.parameters()}.values()
    return replace(first, flops=total("flops"), saved_mb=total("saved_mb"), attention=total("attention"),
                   head=total("head"), static_bytes=training_state_bytes(model),
                   params=sum(p.numel() for p in params), trainable=sum(p.numel() for p in params if p.requires_grad))
