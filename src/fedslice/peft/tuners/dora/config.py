"""DoRA's options: the ``[dora]`` section, LoRA's options (HF PEFT's ``LoraConfig(use_dora=True)``)."""

from __future__ import annotations

from fedslice.peft.tuners.lora.config import LoraConfig


class DoraConfig(LoraConfig):
    """DoRA (Liu et al. 2024): LoRA's rank, alpha, dropout and targets; the weight is split into
    a magnitude (one trainable scalar per output row) and a direction updated by LoRA."""
