"""Prompt tuning through HF ``peft`` (``PromptTuningConfig``)."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from fedslice.peft.prompt_learning import PromptLearningAdapter
from fedslice.peft.tuners.prompt.config import PromptConfig

_INIT = {"random": "RANDOM", "vocab": "SAMPLE_VOCAB", "text": "TEXT"}  # peft's PromptTuningInit members


class PromptAdapter(PromptLearningAdapter):
    """Prompt tuning: learned virtual-token embeddings at the input; no per-head parameter, so
    head pruning (method heads) has nothing of it to leave untrained or unsent."""

    name = "prompt"
    options: PromptConfig

    input_prompts = True

    def peft_config(self, common: dict[str, Any], model: nn.Module) -> PromptTuningConfig:
        """``init = 'text'`` tokenizes ``init_text`` with the tokenizer saved beside the model."""
        from peft import PromptTuningConfig, PromptTuningInit

        o = self.options
        extra = {}
        if o.init == "text":
            extra = {"prompt_tuning_init_text": o.init_text,
                     "tokenizer_name_or_path": model.config.name_or_path}
        return PromptTuningConfig(prompt_tuning_init=PromptTuningInit[_INIT[o.init]], **extra, **common)
