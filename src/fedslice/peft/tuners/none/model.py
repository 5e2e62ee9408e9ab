"""Full fine-tuning as an adapter without tensors of its own: every parameter trains, or, given
``layers``, the parameters of those blocks and the classifier (FedOT's full-tuned adapter
layers)."""

from __future__ import annotations

import torch.nn as nn

from fedslice.peft.base import Adapter, Layers, freeze, train_classifier


class FullFineTuning(Adapter):
    name = "none"
    prefix = None
    trains_base = True

    def apply(self, model: nn.Module, layers: Layers = None) -> nn.Module:
        if layers is None:
            for p in model.parameters():
                p.requires_grad_(True)
            return model
        freeze(model)
        per_stack = layers if layers and not isinstance(layers[0], int) else [layers]
        for k, stack_layers in enumerate(per_stack):
            blocks = self.arch.blocks(model, k)
            for l in stack_layers:
                for p in blocks[l].parameters():
                    p.requires_grad_(True)
        train_classifier(model, self.arch)
        return model

    def tensors(self, model: nn.Module) -> dict[str, nn.Parameter]:
        """No tensors of its own: the model's trainable weights are the model's."""
        return {}
