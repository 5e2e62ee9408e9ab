"""(IA)^3 (Liu et al. 2022) through HF peft: ``config`` (``[ia3]``), ``layer`` (its tensors),
``model`` (the adapter)."""

from fedslice.peft.tuners.ia3.config import IA3Config
from fedslice.peft.tuners.ia3.model import IA3Adapter
from fedslice.registry import register_peft_method

register_peft_method(name="ia3", config_cls=IA3Config, adapter_cls=IA3Adapter)

__all__ = ["IA3Adapter", "IA3Config"]
