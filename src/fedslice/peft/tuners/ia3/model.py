"""(IA)^3 through HF ``peft``: learned scaling vectors on the targets of ``[ia3]``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

import fedslice.peft.targets as targets
from fedslice.peft.base import Adapter, AdapterCost, Layers, freeze, train_classifier
from fedslice.peft.tuners.ia3.config import IA3Config
from fedslice.peft.tuners.ia3.layer import IA3_TENSORS, ia3_axes, ia3_weight


class IA3Adapter(Adapter):
    """IA3: ``y = l ⊙ W x`` (k, v, ...) or ``y = W (l ⊙ x)`` (o, ffn_out), with ``l``
    initialised to ones; everything else frozen, the classifier trainable if
    ``ia3.train_classifier``. Head pruning: a head owns its ``head_dim`` entries of the k/v (and
    q, o) vectors."""

    name = "ia3"
    prefix = "ia3_"
    module_tensors = IA3_TENSORS
    table6 = "ia3"
    options: IA3Config

    def apply(self, model: nn.Module, layers: Layers = None) -> nn.Module:
        freeze(model)
        o = self.options
        names = targets.resolve(model, self.arch, "ia3", o.targets, o.target_modules, layers)
        from peft import IA3Config as PeftIA3Config, get_peft_model  # peft loads transformers' auto classes: only when used

        peft_cfg = PeftIA3Config(target_modules=names,
                                 feedforward_modules=targets.in_side_modules(model, self.arch, names),
                                 fan_in_fan_out=self.arch.layout.transposed)
        model = get_peft_model(model, peft_cfg)
        if o.train_classifier:
            train_classifier(model, self.arch)
        return model

    @classmethod
    def owns_module(cls, module: nn.Module) -> bool:
        """A peft IA3 layer holding a vector."""
        return len(getattr(module, "ia3_l", {})) > 0

    @classmethod
    def tensor_axes(cls, leaf: str) -> tuple[int | None, int | None]:
        return ia3_axes(leaf)

    @classmethod
    def effective_weight(cls, weight: torch.Tensor, tensors: Mapping[str, torch.Tensor],
                         scale: float | None) -> torch.Tensor:
        return ia3_weight(weight, tensors)

    def cost(self, model: nn.Module) -> AdapterCost:
        """Per token and vector element: 1 FLOP forward (the multiply), 3 backward (the input
        gradient's multiply; the vector gradient's multiply-add). Element-wise: the measured
        FLOPs (matrix products) do not see it."""
        ts = self.tensors(model)
        n = sum(p.numel() for p in ts.values())
        b = sum(p.numel() * p.element_size() for p in ts.values())
        return AdapterCost(n, b, 4.0 * n, flops_per_token=4.0 * n)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "targets": list(self.options.targets)}
