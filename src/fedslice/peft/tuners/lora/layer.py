"""What a peft LoRA layer holds, per wrapped linear map ``W`` (out, in): ``lora_A`` (r, in), whose
columns follow W's input features, and ``lora_B`` (out, r), whose rows follow its outputs, in
both weight layouts (peft's ``fan_in_fan_out`` only transposes the base weight); with DoRA
(``use_dora``) also ``lora_magnitude_vector`` (out,), one magnitude per output row. The
effective weight is ``W + scale * B @ A``; with DoRA ``m * (W + s B A) / ||W + s B A||`` (the
norm of each output row, over the inputs)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

#: attribute of a LoRA layer -> the side of the wrapped map its tensors follow
LORA_TENSORS: dict[str, str] = {"lora_A": "in", "lora_B": "out", "lora_magnitude_vector": "out"}


def lora_delta(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """``B @ A`` (out, in) from one layer's LoRA tensors by leaf name (``lora_A.default.weight``
    ...); None unless both are there."""
    a = [t for k, t in tensors.items() if k.startswith("lora_A.") and k.endswith("weight")]
    b = [t for k, t in tensors.items() if k.startswith("lora_B.") and k.endswith("weight")]
    if len(a) != 1 or len(b) != 1:
        return None
    return b[0].float() @ a[0].float()  # (out, r) @ (r, in)


def dora_weight(weight: torch.Tensor, tensors: Mapping[str, torch.Tensor], scale: float
                ) -> torch.Tensor | None:
    """DoRA's effective weight ``m * V / ||V||_row`` with ``V = W + scale * B A`` (out, in), from
    one layer's tensors by leaf name; None without a magnitude vector (plain LoRA)."""
    mag = [t for k, t in tensors.items() if k.startswith("lora_magnitude_vector.")]
    delta = lora_delta(tensors)
    if len(mag) != 1 or delta is None:
        return None
    v = weight.float() + scale * delta                        # (out, in)
    return mag[0].float()[:, None] * v / v.norm(dim=1, keepdim=True)
