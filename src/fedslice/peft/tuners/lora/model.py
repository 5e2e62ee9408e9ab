"""LoRA through HF ``peft``, with a check that the targets matched what was intended.

Logical targets (``q``, ``v``, ``ffn_in``, ..., or ``all-linear``) are resolved through the
architecture table to the exact module names of every block of every stack (encoder, decoder,
cross-attention); raw ``target_modules`` entries must each match at least one module (peft
silently accepts a list of which only some names match).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model

from fedslice.errors import ConfigError
from fedslice.models.arch import PART_NAMES, ArchSpec, is_linear
from fedslice.peft.base import Adapter, Layers, freeze, train_classifier
from fedslice.peft.tuners.lora.config import LoraConfig
from fedslice.peft.tuners.lora.layer import LORA_TENSORS, lora_delta


def _matching_modules(model: nn.Module, target_modules: list[str]) -> list[str]:
    names = [n for n, m in model.named_modules() if is_linear(m)]
    return [n for n in names if any(n == t or n.endswith("." + t) for t in target_modules)]


def logical_targets(cfg: LoraConfig) -> list[str]:
    """``lora.targets`` with ``all-linear`` expanded to every part of the table."""
    return list(PART_NAMES) if "all-linear" in cfg.targets else list(cfg.targets)


def resolve_targets(model: nn.Module, arch: ArchSpec, cfg: LoraConfig,
                    layers: list[int] | list[list[int]] | None = None) -> list[str]:
    """peft ``target_modules`` for this config, validated against the model's modules.

    ``layers`` restricts the logical targets to those layers (raw ``target_modules`` cannot be
    restricted and are refused then)."""
    if cfg.target_modules is not None and layers is not None:
        raise ConfigError("lora.target_modules cannot be limited to some layers: use lora.targets")
    if cfg.target_modules is not None:
        for t in cfg.target_modules:
            if not _matching_modules(model, [t]):
                raise ConfigError(f"lora.target_modules: {t!r} matches no linear module of the "
                                  f"model (e.g. {arch.parts['q']!r}, {arch.parts['ffn_in']!r})")
        return list(cfg.target_modules)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = arch.module_names(base, logical_targets(cfg), layers)
    modules = dict(base.named_modules())
    missing = [n for n in names if n not in modules or not is_linear(modules[n])]
    if missing or not names:
        raise ConfigError(f"lora.targets {cfg.targets}: no linear module at "
                          f"{missing[:3] or 'any layer'} in this {arch.model_type} model")
    return names


def apply_lora(model: nn.Module, arch: ArchSpec, cfg: LoraConfig,
               layers: list[int] | list[list[int]] | None = None) -> nn.Module:
    """Wrap ``model`` with LoRA adapters (in every layer, or only in ``layers``); the
    sequence-classification head stays trainable if configured.

    The classifier is made trainable in place (not via peft's ``modules_to_save`` copies), so its
    parameter names stay those of the HF checkpoint.
    """
    targets = resolve_targets(model, arch, cfg, layers)
    peft_cfg = PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                              target_modules=targets, bias="none",
                              fan_in_fan_out=arch.layout.transposed)
    model = get_peft_model(model, peft_cfg)
    if cfg.train_classifier:
        train_classifier(model, arch)
    return model


def lora_module_names(model: nn.Module) -> list[str]:
    """Names of modules that carry LoRA adapters (for tests and reports)."""
    return list(LoraAdapter.adapted_modules_of(model))


class LoraAdapter(Adapter):
    """LoRA through HF peft: ``W + (alpha / r) B A`` on the targets of ``[lora]``; everything
    else frozen, the classifier trainable if ``lora.train_classifier``."""

    name = "lora"
    prefix = "lora_"
    module_tensors = LORA_TENSORS
    batched_clients = True
    options: LoraConfig

    def apply(self, model: nn.Module, layers: Layers = None) -> nn.Module:
        freeze(model)
        return apply_lora(model, self.arch, self.options, layers=layers)

    @property
    def scale(self) -> float:
        return self.options.scale

    @classmethod
    def owns_module(cls, module: nn.Module) -> bool:
        """A peft LoRA layer holding at least one adapter."""
        return super().owns_module(module) and len(getattr(module, "lora_A", {})) > 0

    @classmethod
    def adapted_modules_of(cls, model: nn.Module) -> dict[str, nn.Module]:
        return {n: m for n, m in model.named_modules() if cls.owns_module(m)}

    def adapted_modules(self, model: nn.Module) -> dict[str, nn.Module]:
        return self.adapted_modules_of(model)

    def client_tensor_names(self, module: nn.Module) -> list[str]:
        """``lora_A.<adapter>.weight`` and ``lora_B.<adapter>.weight`` of each active adapter."""
        active = getattr(module, "active_adapters", None) or list(module.lora_A)
        return [f"{attr}.{a}.weight" for a in active for attr in self.module_tensors]

    @classmethod
    def delta_weight(cls, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        return lora_delta(tensors)

    def stacked_forward(self, module: nn.Module, names: list[str], stack):
        """``base(x) + scaling * B_k A_k dropout(x_k)`` on the rows of each client k, as peft's
        vanilla LoRA computes it for one client: the frozen base runs once on the whole batch;
        equal-sized clients share one batched matmul over their stacked A and B (``bmm``),
        others get one matmul each."""
        (adapter,) = module.active_adapters
        a_name = next(n for n in names if f"lora_A.{adapter}." in n)
        b_name = next(n for n in names if f"lora_B.{adapter}." in n)
        dropout, scaling = module.lora_dropout[adapter], module.scaling[adapter]

        def forward(x, *args, **kwargs):
            result = module.base_layer(x, *args, **kwargs)  # (N, ..., out)
            dtype = result.dtype
            h = dropout(x)
            if len({hi - lo for lo, hi in stack.rows}) == 1 and len(stack.rows) > 1:
                k = len(stack.rows)
                A = torch.stack([p[a_name] for p in stack.params])  # (K, r, in)
                B = torch.stack([p[b_name] for p in stack.params])  # (K, out, r)
                hk = h.reshape(k, -1, h.shape[-1])                   # (K, n*T, in)
                delta = torch.bmm(torch.bmm(hk, A.transpose(1, 2).to(hk.dtype)),
                                  B.transpose(1, 2).to(hk.dtype)).reshape(*result.shape)
            else:
                delta = torch.cat([nn.functional.linear(nn.functional.linear(h[lo:hi], p[a_name]), p[b_name])
                                   for (lo, hi), p in zip(stack.rows, stack.params)])
            return (result + delta * scaling).to(dtype)

        return forward

    def describe(self) -> dict[str, Any]:
        return {"adapter": self.name, "rank": self.options.r, "alpha": self.options.alpha}
