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
    init: Literal["zeros", "random"] = Field(
        "zeros", description="The prefix's first values: 'zeros' (zero keys and values: the prefix "
        "adds nothing to a head's output until trained, only taking a share of its attention; "
        "with projection, the MLP's last layer starts at zero), or 'random' (peft's normal keys "
        "and values, which every head attends to before any training: on E2E an untrained "
        "random prefix scores ROUGE-L 3.9 against the base model's 23.3, and a head pruned by "
        "every client keeps it; runs before 2026-11-26 used it).")
    train_classifier: bool = True
