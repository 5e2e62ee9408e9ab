"""``fedpetuning``: LoRA on the full model; FedAvg of the LoRA weights and the classifier
(FedPETuning, Zhang et al. 2023; baseline B1 of the heads paper)."""

from typing import Literal

from fedslice.config import ExperimentConfig, MethodOptions
from fedslice.methods.base import Method
from fedslice.registry import ADAPTERS, register_method


class FedPETuningMethod(MethodOptions):
    """LoRA on the full model, FedAvg of the LoRA weights and the classifier."""

    name: Literal["fedpetuning"] = "fedpetuning"


class FedPETuning(Method):
    """The adapter (``peft.method``, LoRA by default) on the full model, everything else frozen:
    any registered adapter with tensors of its own (not ``none``: that is fedavg)."""

    name = "fedpetuning"
    #: every client trains the same LoRA tensors of the one shared backbone
    batched_clients = True

    @classmethod
    def check_config(cls, cfg: ExperimentConfig) -> None:
        super().check_config(cfg)
        name = cls.adapter_name(cfg)
        if ADAPTERS.get(name).adapter_cls.trains_base:
            raise ValueError(f"peft.method={name!r}: method {cfg.method.name} fine-tunes an "
                             "adapter's parameters, not the model's own (use method fedavg)")


register_method(name="fedpetuning", options_cls=FedPETuningMethod, method_cls=FedPETuning)
