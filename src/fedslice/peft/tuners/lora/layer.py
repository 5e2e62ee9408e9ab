"""What a peft LoRA layer holds, per wrapped linear map ``W`` (out, in): ``lora_A`` (r, in), whose
columns follow W's input features, and ``lora_B`` (out, r), whose rows follow its outputs, in
both weight layouts (peft's ``fan_in_fan_out`` only transposes the base weight). The effective
weight is ``W + scale * B @ A``."""

from __future__ import annotations

from collections.abc import Mapping

import torch

#: attribute of a LoRA layer -> the side of the wrapped map its tensors follow
LORA_TENSORS: dict[str, str] = {"lora_A": "in", "lora_B": "out"}


def lora_delta(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """``B @ A`` (out, in) from one layer's LoRA tensors by leaf name (``lora_A.default.weight``
    ...); None unless both are there."""
    a = [t for k, t in tensors.items() if k.startswith("lora_A.") and k.endswith("weight")]
    b = [t for k, t in tensors.items() if k.startswith("lora_B.") and k.endswith("weight")]
    if len(a) != 1 or len(b) != 1:
        return None
    return b[0].float() @ a[0].float()  # (out, r) @ (r, in)
