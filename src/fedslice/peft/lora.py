"""HF ``peft`` LoRA wiring, with a check that the targets matched what was intended.

peft silently accepts a target list of which only some names match; here every logical target
must match exactly one module per layer, and every raw ``target_modules`` entry at least one.
"""

from __future__ import annotations

import re

import torch.nn as nn
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model

from fedslice.config import LoraConfig
from fedslice.errors import ConfigError
from fedslice.models.arch import ArchSpec


def _matching_modules(model: nn.Module, target_modules: str | list[str]) -> list[str]:
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if isinstance(target_modules, str):
        return [n for n in names if re.fullmatch(target_modules, n)]
    return [n for n in names if any(n == t or n.endswith("." + t) for t in target_modules)]


def resolve_targets(model: nn.Module, arch: ArchSpec, cfg: LoraConfig,
                    layers: list[int] | None = None) -> str | list[str]:
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
    regex = arch.part_regex(list(cfg.targets), layers)
    n_layers = len(arch.blocks(model)) if layers is None else len(set(layers))
    found = _matching_modules(model, regex)
    if len(found) != n_layers * len(cfg.targets):
        raise ConfigError(f"lora.targets {cfg.targets} matched {len(found)} modules, expected "
                          f"{n_layers * len(cfg.targets)} ({len(cfg.targets)} per layer x {n_layers})")
    return regex


def apply_lora(model: nn.Module, arch: ArchSpec, cfg: LoraConfig,
               layers: list[int] | None = None) -> nn.Module:
    """Wrap ``model`` with LoRA adapters (in every layer, or only in ``layers``); the classifier
    stays trainable if configured.

    The classifier is made trainable in place (not via peft's ``modules_to_save`` copies), so its
    parameter names stay those of the HF checkpoint.
    """
    targets = resolve_targets(model, arch, cfg, layers)
    peft_cfg = PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                              target_modules=targets, bias="none")
    model = get_peft_model(model, peft_cfg)
    if cfg.train_classifier:
        base = model.get_base_model()
        for name in arch.classifier:
            for p in getattr(base, name).parameters():
                p.requires_grad_(True)
    return model


def lora_module_names(model: nn.Module) -> list[str]:
    """Names of modules that carry LoRA adapters (for tests and reports)."""
    return [n for n, m in model.named_modules() if hasattr(m, "lora_A") and isinstance(m, nn.Module)
            and len(getattr(m, "lora_A", {})) > 0]
