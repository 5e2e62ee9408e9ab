"""LoRA's options: the ``[lora]`` section (like HF PEFT's ``LoraConfig``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedslice.config import AdapterOptions

LoraTarget = Literal["q", "k", "v", "o", "ffn_in", "ffn_out", "all-linear"]


class LoraConfig(AdapterOptions):
    """LoRA settings for the methods that fine-tune with LoRA (like PEFT's ``LoraConfig``)."""

    r: int = Field(16, gt=0)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    targets: list[LoraTarget] = Field(default_factory=lambda: ["q", "v"], min_length=1,
                                      description="Logical modules from the architecture table.")
    target_modules: list[str] | None = Field(None, description="Raw module-name suffixes; overrides "
                                             "`targets`. Each must match at least one module.")
    train_classifier: bool = True

    @property
    def scale(self) -> float:
        """alpha / r: the factor of B A in the effective weight W + (alpha / r) B A."""
        return self.alpha / self.r
