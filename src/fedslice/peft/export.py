"""Adapters in a trained state, as HF ``peft`` names and configs them (``fedslice export``).

A global state holds an adapter's tensors under the names of the peft-wrapped model they trained
in (``base_model.model.<module>.lora_A.default.weight``). Each adapter kind is one
:class:`AdapterExport`: the prefix of its tensors (asked, never matched by hand elsewhere), and
the peft config that rebuilds exactly those modules from the tensors themselves (the modules
that carry them, their rank), so a method that put the adapter in some layers only (fedot's
adapter layers) or on a sub-model exports what it trained. A new adapter kind is one subclass
registered in :data:`ADAPTERS`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftConfig

from fedslice.config import ExperimentConfig
from fedslice.errors import FedsliceError
from fedslice.models.arch import ArchSpec

#: What peft's wrapper puts before a module's name.
PEFT_PREFIX = "base_model.model."


def base_name(key: str) -> str:
    """A state key as named in the plain HF model: without peft's wrapper prefix, and a wrapped
    layer's own tensors (``<module>.base_layer.weight``) under the module's name."""
    key = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
    return key.replace(".base_layer.", ".")


class AdapterExport:
    """One adapter kind: which tensors are its own and the peft config they belong to."""

    name = "adapter"
    #: the attribute prefix of the adapter's tensors in peft (``lora_`` for lora_A/lora_B)
    prefix = ""

    def owns(self, key: str) -> bool:
        return f".{self.prefix}" in key

    def modules(self, keys: Sequence[str]) -> list[str]:
        """Names (in the plain HF model) of the modules carrying the adapter."""
        out = {}
        for k in keys:
            if self.owns(k):
                out[base_name(k).split(f".{self.prefix}", 1)[0]] = None
        return list(out)

    def peft_config(self, state: Mapping[str, torch.Tensor], cfg: ExperimentConfig,
                    arch: ArchSpec, modules_to_save: list[str] | None) -> PeftConfig:
        raise NotImplementedError


class LoraExport(AdapterExport):
    name = "lora"
    prefix = "lora_"

    def peft_config(self, state, cfg, arch, modules_to_save):
        ranks = {int(t.shape[0]) for k, t in state.items() if ".lora_A." in k}
        if len(ranks) != 1:
            raise FedsliceError(f"LoRA tensors of several ranks {sorted(ranks)}: not one peft adapter")
        return PeftLoraConfig(r=ranks.pop(), lora_alpha=cfg.lora.alpha, lora_dropout=0.0,
                              target_modules=self.modules(list(state)), bias="none",
                              fan_in_fan_out=arch.weight_layout == "conv1d",
                              modules_to_save=modules_to_save or None)


#: Every adapter kind fedslice trains (its tensors' prefix tells them apart).
ADAPTERS: tuple[AdapterExport, ...] = (LoraExport(),)


def adapter_of(keys: Sequence[str]) -> AdapterExport | None:
    """The adapter kind whose tensors are among ``keys`` (None: no adapter, e.g. full
    fine-tuning); two kinds in one state is an error."""
    found = [a for a in ADAPTERS if any(a.owns(k) for k in keys)]
    if len(found) > 1:
        raise FedsliceError(f"the state holds tensors of several adapters ({[a.name for a in found]})")
    return found[0] if found else None
