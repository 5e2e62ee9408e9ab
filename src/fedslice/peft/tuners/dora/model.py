"""DoRA through HF peft (``LoraConfig(use_dora=True)``) on the targets of ``[dora]``."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from fedslice.peft.base import AdapterCost, Layers, freeze
from fedslice.peft.tuners.dora.config import DoraConfig
from fedslice.peft.tuners.lora.model import LoraAdapter, apply_lora


class DoraAdapter(LoraAdapter):
    """DoRA: LoRA with a trainable magnitude per output row (``lora_magnitude_vector``); the
    tensors share LoRA's prefix and names (peft's own), so slicing, head pruning and aggregation
    treat A, B and the magnitudes alike. Clients train one after another (the batched pass
    computes plain LoRA)."""

    name = "dora"
    batched_clients = False
    use_dora = True
    options: DoraConfig

    def apply(self, model: nn.Module, layers: Layers = None) -> nn.Module:
        freeze(model)
        return apply_lora(model, self.arch, self.options, layers=layers, use_dora=True, section="dora")

    def cost(self, model: nn.Module) -> AdapterCost:
        """LoRA's per-token cost (its A, B are counted with the linears) plus, per optimizer step,
        the weight norm of every adapted map: ``B A`` (2 r·out·in), ``W + s B A`` and the row
        norms (≈ 3 out·in), and as much again backward."""
        base = super().cost(model)
        per_step = 0.0
        for module in self.adapted_modules(model).values():
            w = module.get_base_layer().weight
            r = self.options.r
            per_step += 2.0 * (2.0 * r * w.numel() + 3.0 * w.numel())
        return AdapterCost(base.params, base.bytes, base.train_flops_per_token, flops_per_step=per_step)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "magnitude": True}
