"""Prefix tuning through HF ``peft`` (``PrefixTuningConfig``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from fedslice.errors import ConfigError
from fedslice.models.arch import ArchSpec
from fedslice.peft.base import AdapterCost, HeadPositions
from fedslice.peft.prompt_learning import PromptLearningAdapter
from fedslice.peft.tuners.prefix.config import PrefixConfig
from fedslice.peft.tuners.prefix.layer import prefix_positions


class PrefixAdapter(PromptLearningAdapter):
    """Prefix tuning: learned keys/values in every layer's self-attention, passed to the model
    as its key/value cache (so positions start after the prefix). Per-head parameters: each
    key/value head of each layer owns its 2·head_dim columns (:meth:`head_positions`)."""

    name = "prefix"
    head_tied = True
    table6 = "p_tuning"
    options: PrefixConfig

    @classmethod
    def check_supported(cls, arch: ArchSpec, task: Any, options) -> None:
        if arch.kind == "encoder-decoder":
            raise ConfigError(
                f"peft.method='prefix' does not run on {arch.model_type} (an encoder-decoder): "
                "peft 0.21.2 feeds the prefix to the decoder's self-attention only, and its "
                "EncoderDecoderCache split gives decoder layer i the prefix of layer 2i mod L, so "
                "half of the trained tensor is never read. Use lora, dora, ia3, prompt or ptuning")
        if not arch.accepts_past:
            raise ConfigError(f"peft.method='prefix' does not run on {arch.model_type}: its "
                              "attention takes no cached keys/values (past_key_values), which is "
                              "how peft adds the prefix. Use lora, dora, ia3 or prompt")

    def peft_config(self, common: dict[str, Any], model: nn.Module) -> PrefixTuningConfig:
        from peft import PrefixTuningConfig

        o = self.options
        return PrefixTuningConfig(prefix_projection=o.projection,
                                  encoder_hidden_size=o.encoder_hidden_size or common["token_dim"],
                                  **common)

    def apply(self, model: nn.Module, layers=None) -> nn.Module:
        model = super().apply(model, layers)
        if self.options.init == "zeros":
            for name, p in self.tensors(model).items():
                leaf = name.split("prompt_encoder.", 1)[-1].split(".", 1)[-1]
                if leaf in (("transform.2.weight", "transform.2.bias") if self.options.projection
                            else ("embedding.weight",)):
                    with torch.no_grad():
                        p.zero_()
        return model

    def head_positions(self, name: str, shape: torch.Size, dims: Sequence[Mapping[str, int]]
                       ) -> HeadPositions | None:
        """The prefix axis of ``embedding.weight`` (columns; rows of the projection's last
        linear and its bias with ``projection``): layer l is keep-mask row l (one stack, its
        self-attention), and each key/value head owns its columns (layer doc)."""
        leaf = name.split("prompt_encoder.", 1)[-1].split(".", 1)[-1]
        if self.options.projection:
            axis = 0 if leaf in ("transform.2.weight", "transform.2.bias") else None
        else:
            axis = 1 if leaf == "embedding.weight" else None
        if axis is None:
            return None
        d = dims[0]
        layer, kv = prefix_positions(d["num_layers"], d["num_kv_heads"], d["head_dim"])
        if shape[axis] != len(layer):
            raise ValueError(f"{name} has {shape[axis]} entries along axis {axis}, expected "
                             f"{len(layer)} = layers x 2 x key/value heads x head_dim")
        return HeadPositions(axis, layer, kv)

    def cost(self, model: nn.Module) -> AdapterCost:
        """Its parameters; every self-attention reads ``P`` more keys/values at every query
        (4·P·d FLOPs forward, 8·P·d backward per token and layer); a projection costs 6 FLOPs
        per weight per virtual token per sequence."""
        ts = self.tensors(model)
        n = sum(p.numel() for p in ts.values())
        b = sum(p.numel() * p.element_size() for p in ts.values())
        P = self.options.num_virtual_tokens
        return AdapterCost(n, b, 0.0, flops_per_sequence=6.0 * self.encoder_params(model) * P,
                           prefix_keys=P)
