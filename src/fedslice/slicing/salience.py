"""L1 / L2 salience of attention heads and FFN neurons, per layer, from a state dict.

Head h of a layer is the group of rows ``h*head_dim:(h+1)*head_dim`` of W_q, W_k, W_v and the same
columns of W_o; its salience is the norm of that whole group (L1: sum of |w|; L2: sqrt of the sum
of w^2). FFN neuron j is row j of W_in and column j of W_out. Biases are not counted.

With LoRA in the state, the effective weight ``W + scale * B @ A`` is scored (``lora_scale``
= alpha / r); without it, the base weight.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fedslice.models.arch import ArchSpec
from fedslice.slicing.permute import Permutation
from fedslice.slicing.spec import key_info


@dataclass
class LayerSalience:
    heads: torch.Tensor  # (H,)
    neurons: torch.Tensor  # (F,)


def part_weights(state: Mapping[str, torch.Tensor], arch: ArchSpec,
                 lora_scale: float | None = None) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, part) -> the effective (out, in) weight of that part, float32."""
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in state.items():
        info = key_info(arch, key)
        if info is None or info.part is None:
            continue
        leaf = info.rest[len(arch.parts[info.part]) + 1:]
        slot = "A" if "lora_A" in leaf else "B" if "lora_B" in leaf else \
            "W" if leaf.rsplit(".", 1)[-1] == "weight" else None
        if slot is not None:
            found.setdefault((info.layer, info.part), {})[slot] = t.float()
    out = {}
    for where, w in found.items():
        if "W" not in w:
            raise KeyError(f"no weight for layer {where[0]} part {where[1]} in the state")
        out[where] = w["W"]
        if "A" in w and "B" in w and lora_scale:
            out[where] = w["W"] + lora_scale * (w["B"] @ w["A"])
    return out


def salience(state: Mapping[str, torch.Tensor], arch: ArchSpec, dims: Mapping[str, int],
             norm: str = "l1", lora_scale: float | None = None) -> list[LayerSalience]:
    """Salience of every head and FFN neuron of every layer (see module doc)."""
    if norm not in ("l1", "l2"):
        raise ValueError(f"norm must be 'l1' or 'l2', got {norm!r}")
    W = part_weights(state, arch, lora_scale)
    H, hd = dims["num_heads"], dims["head_dim"]
    elem = torch.abs if norm == "l1" else torch.square
    out = []
    for l in range(dims["num_layers"]):
        rows = sum(elem(W[l, p]).sum(1) for p in ("q", "k", "v"))  # (H*hd,)
        cols = elem(W[l, "o"]).sum(0)  # (H*hd,)
        heads = (rows + cols).view(H, hd).sum(1)  # (H,)
        neurons = elem(W[l, "ffn_in"]).sum(1) + elem(W[l, "ffn_out"]).sum(0)  # (F,)
        if norm == "l2":
            heads, neurons = heads.sqrt(), neurons.sqrt()
        out.append(LayerSalience(heads, neurons))
    return out


def salience_order(sal: list[LayerSalience], head_dim: int) -> Permutation:
    """The permutation that puts the most salient heads and neurons first (stable on ties)."""
    def desc(x: torch.Tensor) -> list[int]:
        return torch.argsort(x, descending=True, stable=True).tolist()
    return Permutation.from_orders([desc(s.heads) for s in sal], [desc(s.neurons) for s in sal], head_dim)
