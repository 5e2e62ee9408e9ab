"""Prefix tuning / P-tuning v2 (Li & Liang 2021; Liu et al. 2021b) through HF peft: ``config``
(``[prefix]``), ``layer`` (its tensors and their heads), ``model`` (the adapter)."""

from fedslice.peft.tuners.prefix.config import PrefixConfig
from fedslice.peft.tuners.prefix.model import PrefixAdapter
from fedslice.registry import register_peft_method

register_peft_method(name="prefix", config_cls=PrefixConfig, adapter_cls=PrefixAdapter)

__all__ = ["PrefixAdapter", "PrefixConfig"]
