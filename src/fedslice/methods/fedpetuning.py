"""``fedpetuning``: LoRA on the full model; FedAvg of the LoRA weights and the classifier
(FedPETuning, Zhang et al. 2023; baseline B1 of the heads paper)."""

from typing import Literal

from fedslice.config import MethodOptions
from fedslice.methods.base import Method
from fedslice.registry import register_method


class FedPETuningMethod(MethodOptions):
    """LoRA on the full model, FedAvg of the LoRA weights and the classifier."""

    name: Literal["fedpetuning"] = "fedpetuning"


class FedPETuning(Method):
    """The adapter (``peft.method``, LoRA by default) on the full model, everything else frozen."""

    name = "fedpetuning"
    adapters = ("lora",)


register_method(name="fedpetuning", options_cls=FedPETuningMethod, method_cls=FedPETuning)
