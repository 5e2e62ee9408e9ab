"""``fedpetuning``: LoRA on the full model; FedAvg of the LoRA weights and the classifier
(FedPETuning, Zhang et al. 2023; baseline B1 of the heads paper)."""

import torch.nn as nn

from fedslice.methods.base import Method
from fedslice.peft import apply_lora


class FedPETuning(Method):
    name = "fedpetuning"
    #: every client trains the same LoRA tensors of the one shared backbone
    batched_clients = True

    def prepare_model(self, model: nn.Module) -> nn.Module:
        for p in model.parameters():
            p.requires_grad_(False)
        return apply_lora(model, self.arch, self.cfg.lora)
