"""fedslice: federated fine-tuning of transformer foundation models on clients that cannot afford the whole model."""

__version__ = "0.1.0"

import logging as _logging

# torchao (model.quantize = "int8") is imported by transformers whenever it is installed; on a
# CPU-only machine it logs a warning per optional C++/CUDA extension it cannot load, and torch a
# deprecation per enum it registers: noise on every command, nothing the user can act on.
for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)
