"""Function-preserving permutations of heads and FFN neurons, tracked for un-permuting on export.

A :class:`Permutation` gives, per stack and layer, the original index held at each new position,
for self-attention heads, cross-attention heads and FFN neurons. Applying it moves every tensor
that a head or neuron touches (q/k/v rows, weights + biases + LoRA ``B``, inside each section of
a fused q|k|v; o columns + LoRA ``A``; gate and ffn_in rows + bias; ffn_out columns; T5's
relative-bias columns), so the model computes the same function: attention is a sum over heads
and the FFN a sum over neurons, and both sums are order-free. Two constraints keep it so:

* grouped-query attention: query heads move within their key/value group and groups move
  together (the heads order is group-blocked; the key/value heads follow the groups' order);
* T5 reads one relative-bias table in every layer of a stack: every layer of a T5 stack gets the
  same head order (checked by :func:`~fedslice.slicing.spec.stack_specs`).

It is a full-size :class:`~fedslice.slicing.spec.ModelSlice` whose index lists are permutations,
so permuting is :func:`~fedslice.slicing.state.extract_state` (one code path for both).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import torch
import torch.nn as nn

from fedslice.models.arch import ArchSpec
from fedslice.slicing.spec import ModelSlice, SliceSpec, Spec, State
from fedslice.slicing.state import extract_state


def _orders(spec: SliceSpec) -> dict[str, tuple]:
    return {"heads": spec.heads, "neurons": spec.neurons, "cross": spec.cross}


@dataclass(frozen=True)
class Permutation:
    """Per stack, a full-size :class:`SliceSpec` whose ``heads[l][p]`` / ``cross[l][p]`` /
    ``neurons[l][p]`` is the original index now at position p of layer l."""

    stacks: tuple[SliceSpec, ...]

    def __post_init__(self):
        for k, s in enumerate(self.stacks):
            if s.layers != tuple(range(s.num_layers)):
                raise ValueError(f"stack {k}: a permutation keeps every layer")
            for name, orders in _orders(s).items():
                n = s.ffn if name == "neurons" else s.num_heads
                for l, order in enumerate(orders or ()):
                    if sorted(order) != list(range(n)):
                        raise ValueError(f"stack {k} layer {l}: {name} order {order} is not a permutation")
            g = s.queries_per_kv
            for l, order in enumerate(s.heads):
                if any(order[p] // g != order[p - p % g] // g for p in range(len(order))):
                    raise ValueError(f"stack {k} layer {l}: heads order {order} moves query heads "
                                     f"out of their key/value group of {g}")

    # -- constructors ----------------------------------------------------------------------
    @classmethod
    def identity(cls, dims: Mapping[str, int] | Sequence[Mapping[str, int]]) -> Permutation:
        dims = [dims] if isinstance(dims, Mapping) else list(dims)
        return cls(tuple(SliceSpec.full(d) for d in dims))

    @classmethod
    def from_orders(cls, heads: Sequence[Sequence[int]], neurons: Sequence[Sequence[int]],
                    head_dim: int, num_kv_heads: int = 0,
                    cross: Sequence[Sequence[int]] | None = None) -> Permutation:
        """A one-stack permutation from per-layer head and neuron orders."""
        def tup(orders):
            return tuple(tuple(int(x) for x in o) for o in orders)
        n = len(heads)
        spec = SliceSpec(tuple(range(n)), tup(heads), tup(neurons), n, len(heads[0]), head_dim,
                         len(neurons[0]), num_kv_heads, None if cross is None else tup(cross))
        return cls((spec,))

    # -- algebra ---------------------------------------------------------------------------
    @property
    def is_identity(self) -> bool:
        return all(s.is_full for s in self.stacks)

    def as_spec(self) -> ModelSlice:
        return ModelSlice(self.stacks)

    def _map(self, other: Permutation | None, fn) -> Permutation:
        out = []
        for k, s in enumerate(self.stacks):
            o = _orders(other.stacks[k]) if other is not None else None
            new = {}
            for name, orders in _orders(s).items():
                if orders is None:
                    new[name] = None
                else:
                    new[name] = tuple(fn(a, o[name][l] if o else None) for l, a in enumerate(orders))
            out.append(replace(s, **new))
        return Permutation(tuple(out))

    def then(self, rel: Permutation) -> Permutation:
        """Apply ``self`` first, then ``rel`` (relative to the order ``self`` produced)."""
        return self._map(rel, lambda a, b: tuple(a[i] for i in b))

    def inverse(self) -> Permutation:
        def inv(order, _):
            out = [0] * len(order)
            for p, i in enumerate(order):
                out[i] = p
            return tuple(out)
        return self._map(None, inv)

    # -- JSON --------------------------------------------------------------------------------
    @cached_property
    def digest(self) -> str:
        """A short digest of the permutation: equal digests, equal orders (a client over a
        quantized copy of its slice re-quantizes only when the server's order changes)."""
        text = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha1(text).hexdigest()[:16]

    def to_dict(self) -> dict:
        return {"stacks": [s.to_dict() for s in self.stacks]}

    @classmethod
    def from_dict(cls, d: Mapping) -> Permutation:
        return cls(tuple(SliceSpec.from_dict(s) for s in d["stacks"]))


def permute_state(state: Mapping[str, torch.Tensor], perm: Permutation, arch: ArchSpec) -> State:
    """A new state dict with heads and neurons moved by ``perm`` (untouched tensors are shared)."""
    if perm.is_identity:
        return dict(state)
    return extract_state(state, perm.as_spec(), arch)


def unpermute_state(state: Mapping[str, torch.Tensor], perm: Permutation, arch: ArchSpec) -> State:
    """Back to the checkpoint's order: ``permute_state(.., perm.inverse())``."""
    return permute_state(state, perm.inverse(), arch)


@torch.no_grad()
def permute_model(model: nn.Module, perm: Permutation, arch: ArchSpec) -> nn.Module:
    """Permute ``model`` (HF or peft-wrapped) in place; returns it."""
    if not perm.is_identity:
        model.load_state_dict(permute_state(model.state_dict(), perm, arch))
    return model


def in_original_order(spec: Spec, perm: Permutation) -> Spec:
    """``spec`` (indices into the model permuted by ``perm``) as indices into the unpermuted
    model: slicing the unpermuted state with it gives the same sub-model, in the same order."""
    def one(s: SliceSpec | None, p: SliceSpec) -> SliceSpec | None:
        if s is None:
            return None
        def map_(orders, perm_orders):
            if orders is None:
                return None
            return tuple(tuple(perm_orders[l][i] for i in o) for l, o in zip(s.layers, orders))
        return replace(s, heads=map_(s.heads, p.heads), neurons=map_(s.neurons, p.neurons),
                       cross=map_(s.cross, p.cross or tuple(tuple(range(s.num_heads)) for _ in range(s.num_layers))))
    if isinstance(spec, SliceSpec):
        return one(spec, perm.stacks[0])
    return ModelSlice(tuple(one(s, p) for s, p in zip(spec.stacks, perm.stacks)))
