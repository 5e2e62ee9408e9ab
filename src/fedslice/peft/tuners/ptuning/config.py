"""P-tuning's options: the ``[ptuning]`` section (like HF PEFT's ``PromptEncoderConfig``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedslice.config import AdapterOptions


class PTuningConfig(AdapterOptions):
    """P-tuning (Liu et al. 2021, "GPT understands, too"): virtual tokens at the input produced
    by a small trainable prompt encoder (an MLP or an LSTM) from their own embeddings."""

    num_virtual_tokens: int = Field(20, gt=0, description="Virtual tokens prepended to the input.")
    encoder: Literal["mlp", "lstm"] = Field("mlp", description="The prompt encoder.")
    encoder_hidden_size: int | None = Field(None, gt=0, description="Its hidden width (default: "
                                            "the model's hidden size).")
    encoder_num_layers: int = Field(2, gt=0, description="LSTM layers (the MLP has 3 linears).")
    encoder_dropout: float = Field(0.0, ge=0, lt=1)
    train_classifier: bool = True
