"""Prefix tuning's options: the ``[prefix]`` section (like HF PEFT's ``PrefixTuningConfig``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedslice.config import AdapterOptions


class PrefixConfig(AdapterOptions):
    """Prefix tuning / P-tuning v2 (Li & Liang 2021; Liu et al. 2021b): learned keys and values
    prepended to the self-attention of every layer; the model is frozen."""

    num_virtual_tokens: int = Field(20, gt=0, description="Prefix length: keys/values per layer.")
    projection: bool = Field(False, description="Produce the prefix with a two-layer MLP from P "
                             "embeddings (Li & Liang's reparameterisation) instead of learning it "
                             "directly.")
    encoder_hidden_size: int | None = Field(None, gt=0, description="The MLP's hidden width "
                                            "(default: the model's hidden size).")
    init: Literal["random", "zeros"] = Field(
        "random", description="The prefix's first values: 'random' (peft's: normal keys and values, "
        "which every head then attends to before any training), or 'zeros' (zero keys and values: "
        "the prefix adds nothing to a head's output until trained, only taking a share of its "
        "attention; with projection, the MLP's last layer starts at zero).")
    train_classifier: bool = True
