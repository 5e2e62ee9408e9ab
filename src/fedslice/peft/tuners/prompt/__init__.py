"""Prompt tuning (Lester et al. 2021) through HF peft: ``config`` (``[prompt]``), ``layer`` (its
tensor), ``model`` (the adapter)."""

from fedslice.peft.tuners.prompt.config import PromptConfig
from fedslice.peft.tuners.prompt.model import PromptAdapter
from fedslice.registry import register_peft_method

register_peft_method(name="prompt", config_cls=PromptConfig, adapter_cls=PromptAdapter)

__all__ = ["PromptAdapter", "PromptConfig"]
