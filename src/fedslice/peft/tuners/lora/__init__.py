"""LoRA (Hu et al. 2021) through HF peft: ``config`` (``[lora]``), ``layer`` (its tensors),
``model`` (the adapter)."""

from fedslice.peft.tuners.lora.config import LoraConfig, LoraTarget
from fedslice.peft.tuners.lora.model import (LoraAdapter, apply_lora, lora_module_names,
                                             resolve_targets)
from fedslice.registry import register_peft_method

register_peft_method(name="lora", config_cls=LoraConfig, adapter_cls=LoraAdapter)

__all__ = ["LoraAdapter", "LoraConfig", "LoraTarget", "apply_lora", "lora_module_names",
           "resolve_targets"]
