"""IA3's options: the ``[ia3]`` section (like HF PEFT's ``IA3Config``)."""

from __future__ import annotations

from pydantic import Field

from fedslice.config import AdapterOptions
from fedslice.peft.tuners.lora.config import LoraTarget


class IA3Config(AdapterOptions):
    """(IA)^3 (Liu et al. 2022): one learned vector per target that rescales the module's
    head/neuron side: the outputs of q, k, v, ffn_in (and a gate), the inputs of o and ffn_out
    (the FFN's intermediate activations). The paper's choice, the default: keys, values and the
    FFN's intermediate activations."""

    targets: list[LoraTarget] = Field(default_factory=lambda: ["k", "v", "ffn_out"], min_length=1,
                                      description="Logical modules from the architecture table; "
                                      "o and ffn_out are scaled on their input, the others on "
                                      "their output.")
    target_modules: list[str] | None = Field(None, description="Raw module-name suffixes; "
                                             "overrides `targets`. Each must match a module.")
    train_classifier: bool = True
