"""``none``: full fine-tuning (no adapter: the model's own weights train)."""

from fedslice.peft.tuners.none.model import FullFineTuning
from fedslice.registry import register_peft_method

register_peft_method(name="none", config_cls=None, adapter_cls=FullFineTuning)

__all__ = ["FullFineTuning"]
