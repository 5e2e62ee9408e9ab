"""P-tuning through HF ``peft`` (``PromptEncoderConfig``)."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from fedslice.peft.prompt_learning import PromptLearningAdapter
from fedslice.peft.tuners.ptuning.config import PTuningConfig

_ENCODER = {"mlp": "MLP", "lstm": "LSTM"}  # peft's PromptEncoderReparameterizationType members


class PTuningAdapter(PromptLearningAdapter):
    """P-tuning: virtual tokens at the input from a trained prompt encoder; no per-head
    parameter (its encoder is sent whole, more bytes than prompt tuning's table)."""

    name = "ptuning"
    options: PTuningConfig

    input_prompts = True

    def peft_config(self, common: dict[str, Any], model: nn.Module) -> PromptEncoderConfig:
        from peft import PromptEncoderConfig, PromptEncoderReparameterizationType

        o = self.options
        encoder = PromptEncoderReparameterizationType[_ENCODER[o.encoder]]
        return PromptEncoderConfig(encoder_reparameterization_type=encoder,
                                   encoder_hidden_size=o.encoder_hidden_size or common["token_dim"],
                                   encoder_num_layers=o.encoder_num_layers,
                                   encoder_dropout=o.encoder_dropout, **common)
