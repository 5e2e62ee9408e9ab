"""Prompt tuning's options: the ``[prompt]`` section (like HF PEFT's ``PromptTuningConfig``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fedslice.config import AdapterOptions


class PromptConfig(AdapterOptions):
    """Prompt tuning (Lester et al. 2021): ``num_virtual_tokens`` learned input embeddings
    prepended to every sequence; the model is frozen."""

    num_virtual_tokens: int = Field(20, gt=0, description="Virtual tokens prepended to the input.")
    init: Literal["random", "vocab", "text"] = Field(
        "random", description="Initial prompt: random, embeddings of random vocabulary tokens "
        "('vocab'), or of `init_text` ('text', repeated to the length).")
    init_text: str | None = Field(None, description="The text of init = 'text'.")
    train_classifier: bool = True

    @model_validator(mode="after")
    def _text(self) -> "PromptConfig":
        if (self.init == "text") != (self.init_text is not None):
            raise ValueError("prompt.init = 'text' needs prompt.init_text, and init_text needs init = 'text'")
        return self
