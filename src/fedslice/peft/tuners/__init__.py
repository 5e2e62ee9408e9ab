"""The built-in adapters; each sub-package registers itself (``register_peft_method``)."""

from fedslice.peft.tuners import lora, none  # noqa: F401
