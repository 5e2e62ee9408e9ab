"""Adapters as plug-ins (HF PEFT's tuners layout: ``tuners/<name>/{config,layer,model}.py``):
the interface is :class:`Adapter` (:mod:`fedslice.peft.base`); importing this package registers
the built-in ones (``lora``, ``none``)."""

from fedslice.peft import tuners  # noqa: F401  (registers the built-in adapters)
from fedslice.peft.base import Adapter, AdapterCost, make_adapter
from fedslice.peft.tuners.lora import (LoraAdapter, LoraConfig, LoraTarget, apply_lora,
                                       lora_module_names, resolve_targets)
from fedslice.peft.tuners.none import FullFineTuning

__all__ = ["Adapter", "AdapterCost", "FullFineTuning", "LoraAdapter", "LoraConfig", "LoraTarget",
           "apply_lora", "lora_module_names", "make_adapter", "resolve_targets"]
