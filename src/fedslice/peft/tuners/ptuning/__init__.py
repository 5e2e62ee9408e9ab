"""P-tuning (Liu et al. 2021) through HF peft: ``config`` (``[ptuning]``), ``layer`` (its
tensors), ``model`` (the adapter)."""

from fedslice.peft.tuners.ptuning.config import PTuningConfig
from fedslice.peft.tuners.ptuning.model import PTuningAdapter
from fedslice.registry import register_peft_method

register_peft_method(name="ptuning", config_cls=PTuningConfig, adapter_cls=PTuningAdapter)

__all__ = ["PTuningAdapter", "PTuningConfig"]
