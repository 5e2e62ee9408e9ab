"""Prefix tuning's options: the ``[prefix]`` section (like HF PEFT's ``PrefixTuningConfig``)."""

from __future__ import annotations

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
    train_classifier: bool = True
