"""What a peft DoRA layer holds: a LoRA layer (``lora_A``, ``lora_B``) with a magnitude vector
``lora_magnitude_vector.<adapter>.weight`` (out,), one entry per output row of the wrapped map
(:data:`fedslice.peft.tuners.lora.layer.LORA_TENSORS` describes all three). The effective weight
is ``m * (W + s B A) / ||W + s B A||`` with the norm of each output row over the inputs
(:func:`fedslice.peft.tuners.lora.layer.dora_weight`).

Head pruning: the magnitudes of q/k/v follow their output rows, so a head owns its block of
``head_dim`` entries there; o's magnitudes belong to its outputs (the hidden features) and mix
every head."""

from fedslice.peft.tuners.lora.layer import LORA_TENSORS, dora_weight

DORA_TENSORS = LORA_TENSORS

__all__ = ["DORA_TENSORS", "dora_weight"]
