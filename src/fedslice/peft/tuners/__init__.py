"""The built-in adapters; each sub-package registers itself (``register_peft_method``)."""

from fedslice.peft.tuners import lora, none  # noqa: F401
from fedslice.peft.tuners import dora, ia3  # noqa: F401
from fedslice.peft.tuners import prompt, ptuning, prefix  # noqa: F401
