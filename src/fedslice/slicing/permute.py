"""Function-preserving permutations of heads and FFN neurons, tracked for un-permuting on export.

A :class:`Permutation` gives, per layer, the original index held at each new position, for heads
and for FFN neurons. Applying it moves every tensor that a head or neuron touches (q/k/v rows,
weights + biases + LoRA ``B``; o columns + LoRA ``A``; ffn_in rows + bias; ffn_out columns), so
the model computes the same function: attention is a sum over heads and the FFN a sum over
neurons, and both sums are order-free.

It is a full-size :class:`~fedslice.slicing.spec.SliceSpec` whose index lists are permutations,
so permuting is :func:`~fedslice.slicing.spec.extract_state` (one code path for both).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from fedslice.models.arch import ArchSpec
from fedslice.slicing.spec import SliceSpec, State, extract_state


@dataclass(frozen=True)
class Permutation:
    """Per layer: ``heads[l][p]`` / ``neurons[l][p]`` = the original index now at position p."""

    heads: tuple[tuple[int, ...], ...]
    neurons: tuple[tuple[int, ...], ...]
    head_dim: int

    @classmethod
    def identity(cls, dims: Mapping[str, int]) -> Permutation:
        return cls(tuple(tuple(range(dims["num_heads"])) for _ in range(dims["num_layers"])),
                   tuple(tuple(range(dims["ffn"])) for _ in range(dims["num_layers"])), dims["head_dim"])

    @classmethod
    def from_orders(cls, heads: Sequence[Sequence[int]], neurons: Sequence[Sequence[int]],
                    head_dim: int) -> Permutation:
        perm = cls(tuple(tuple(int(x) for x in h) for h in heads),
                   tuple(tuple(int(x) for x in f) for f in neurons), head_dim)
        for name, orders in (("heads", perm.heads), ("neurons", perm.neurons)):
            for l, order in enumerate(orders):
                if sorted(order) != list(range(len(order))):
                    raise ValueError(f"layer {l}: {name} order {order} is not a permutation")
        return perm

    @property
    def is_identity(self) -> bool:
        return all(h == tuple(range(len(h))) for h in self.heads) and \
            all(f == tuple(range(len(f))) for f in self.neurons)

    def as_spec(self) -> SliceSpec:
        n = len(self.heads)
        return SliceSpec(tuple(range(n)), self.heads, self.neurons, n, len(self.heads[0]),
                         self.head_dim, len(self.neurons[0]))

    def then(self, rel: Permutation) -> Permutation:
        """Apply ``self`` first, then ``rel`` (relative to the order ``self`` produced)."""
        return Permutation(tuple(tuple(a[i] for i in b) for a, b in zip(self.heads, rel.heads)),
                           tuple(tuple(a[i] for i in b) for a, b in zip(self.neurons, rel.neurons)),
                           self.head_dim)

    def inverse(self) -> Permutation:
        def inv(order):
            out = [0] * len(order)
            for p, i in enumerate(order):
                out[i] = p
            return tuple(out)
        return Permutation(tuple(inv(h) for h in self.heads), tuple(inv(f) for f in self.neurons),
                           self.head_dim)

    def to_dict(self) -> dict:
        return {"heads": [list(h) for h in self.heads], "neurons": [list(f) for f in self.neurons],
                "head_dim": self.head_dim}

    @classmethod
    def from_dict(cls, d: Mapping) -> Permutation:
        return cls.from_orders(d["heads"], d["neurons"], d["head_dim"])


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
