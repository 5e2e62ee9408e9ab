"""What a peft IA3 layer holds, per wrapped linear map ``W`` (out, in): ``ia3_l.<adapter>``, a
vector (out, 1) that scales the outputs, or (1, in) that scales the inputs (peft's
``is_feedforward``; here the modules whose inputs are heads or FFN neurons: o and ffn_out). In
both cases the vector runs along the side that heads or neurons index, so its axis 0 follows
the outputs and its axis 1 the inputs. The effective weight is ``W * l`` (broadcast)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

#: attribute of an IA3 layer (its tensors' axes: :func:`ia3_axes`)
IA3_TENSORS: dict[str, str | None] = {"ia3_l": None}


def ia3_axes(leaf: str) -> tuple[int | None, int | None]:
    """(axis along the outputs, axis along the inputs) of ``ia3_l.<adapter>``: a (out, 1)
    vector uses axis 0, a (1, in) one axis 1; the other axis has size 1."""
    return (0, 1) if leaf.split(".", 1)[0] == "ia3_l" else (None, None)


def ia3_weight(weight: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``W * l`` (out, in) from one layer's IA3 vector (by leaf name)."""
    vecs = [t for k, t in tensors.items() if k.startswith("ia3_l.")]
    out = weight
    for v in vecs:
        out = out * v.float()  # (out, 1) scales rows, (1, in) columns
    return out
