"""DoRA (Liu et al. 2024, weight-decomposed LoRA) through HF peft: ``config`` (``[dora]``),
``layer`` (its tensors), ``model`` (the adapter)."""

from fedslice.peft.tuners.dora.config import DoraConfig
from fedslice.peft.tuners.dora.model import DoraAdapter
from fedslice.registry import register_peft_method

register_peft_method(name="dora", config_cls=DoraConfig, adapter_cls=DoraAdapter)

__all__ = ["DoraAdapter", "DoraConfig"]
