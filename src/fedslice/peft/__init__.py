"""Adapters as plug-ins (HF PEFT's tuners layout: ``tuners/<name>/{config,layer,model}.py``):
the interface is :class:`Adapter` (:mod:`fedslice.peft.base`); importing this package registers
the built-in ones (``lora``, ``none``, ``dora``, ``ia3``, ``prompt``, ``ptuning``, ``prefix``)."""

from fedslice.peft import tuners  # noqa: F401  (registers the built-in adapters)
from fedslice.peft.base import Adapter, AdapterCost, HeadPositions, adapters_off, make_adapter
from fedslice.peft.tuners.dora import DoraAdapter, DoraConfig
from fedslice.peft.tuners.ia3 import IA3Adapter, IA3Config
from fedslice.peft.tuners.lora import (LoraAdapter, LoraConfig, LoraTarget, apply_lora,
                                       lora_module_names, resolve_targets)
from fedslice.peft.tuners.none import FullFineTuning
from fedslice.peft.tuners.prefix import PrefixAdapter, PrefixConfig
from fedslice.peft.tuners.prompt import PromptAdapter, PromptConfig
from fedslice.peft.tuners.ptuning import PTuningAdapter, PTuningConfig

__all__ = ["Adapter", "AdapterCost", "DoraAdapter", "DoraConfig", "FullFineTuning", "HeadPositions",
           "IA3Adapter", "IA3Config", "LoraAdapter", "LoraConfig", "LoraTarget", "PTuningAdapter",
           "PTuningConfig", "PrefixAdapter", "PrefixConfig", "PromptAdapter", "PromptConfig",
           "adapters_off", "apply_lora", "lora_module_names", "make_adapter", "resolve_targets"]
