"""HF ``peft`` LoRA wiring, with a check that the targets matched what was intended.

Logical targets (``q``, ``v``, ``ffn_in``, ..., or ``all-linear``) are resolved through the
architecture table to the exact module names of every block of every stack (encoder, decoder,
cross-attention); raw ``target_modules`` entries must each match at least one module (peft
silently accepts a list of which only some names match).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model

from fedslice.config import LoraConfig
from fedslice.errors import ConfigError
from fedslice.models.arch import PART_NAMES, ArchSpec


def _is_linear(module: nn.Module) -> bool:
    """nn.Linear, or HF's Conv1D (GPT-2: a linear layer with its weight stored (in, out))."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _matching_modules(model: nn.Module, target_modules: list[str]) -> list[str]:
    names = [n for n, m in model.named_modules() if _is_linear(m)]
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
    missing = [n for n in names if n not in modules or not _is_linear(modules[n])]
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
                              fan_in_fan_out=arch.weight_layout == "conv1d")
    model = get_peft_model(model, peft_cfg)
    if cfg.train_classifier:
        base = model.get_base_model()
        for name in arch.classifier:
            head = getattr(base, name, None)  # absent on a language-model head
            for p in head.parameters() if head is not None else ():
                p.requires_grad_(True)
    return model


def lora_module_names(model: nn.Module) -> list[str]:
    """Names of modules that carry LoRA adapters (for tests and reports)."""
    return [n for n, m in model.named_modules() if hasattr(m, "lora_A") and isinstance(m, nn.Module)
            and len(getattr(m, "lora_A", {})) > 0]


# -- several clients' LoRA in one pass (fl/batched.py) -------------------------------------------

ADAPTER = "default"  # the peft adapter name fedslice trains


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """``{module name: peft LoRA layer}`` of every module carrying fedslice's adapter."""
    return {n: m for n, m in model.named_modules()
            if isinstance(getattr(m, "lora_A", None), nn.ModuleDict) and ADAPTER in m.lora_A
            and hasattr(m, "base_layer")}


def lora_tensor_names(name: str) -> tuple[str, str]:
    """The ``(A, B)`` parameter names of the LoRA layer ``name`` (as ``named_parameters`` gives)."""
    return f"{name}.lora_A.{ADAPTER}.weight", f"{name}.lora_B.{ADAPTER}.weight"


def stacked_lora_forward(layer: nn.Module, names: tuple[str, str], stack) -> callable:
    """A forward for ``layer`` in which the rows of each client of ``stack`` (its ``rows`` and
    ``params``, set per step) get that client's own A and B: ``base(x) + B_k A_k dropout(x_k) *
    scaling`` for the rows of client k, as peft's vanilla LoRA computes it for one client.
    The frozen base runs once on the whole batch; equal-sized clients use one batched matmul
    (``bmm``), others one matmul per client."""
    a_name, b_name = names
    dropout, scaling = layer.lora_dropout[ADAPTER], layer.scaling[ADAPTER]

    def forward(x, *args, **kwargs):
        result = layer.base_layer(x, *args, **kwargs)  # (N, ..., out)
        dtype = result.dtype
        h = dropout(x)
        sizes = {hi - lo for lo, hi in stack.rows}
        if len(sizes) == 1 and len(stack.rows) > 1:
            k = len(stack.rows)
            A = torch.stack([p[a_name] for p in stack.params])  # (K, r, in)
            B = torch.stack([p[b_name] for p in stack.params])  # (K, out, r)
            hk = h.reshape(k, -1, h.shape[-1])                   # (K, n*T, in)
            delta = torch.bmm(torch.bmm(hk, A.transpose(1, 2).to(hk.dtype)),
                              B.transpose(1, 2).to(hk.dtype))    # (K, n*T, out)
            delta = delta.reshape(*result.shape)
        else:
            delta = torch.cat([nn.functional.linear(nn.functional.linear(h[lo:hi], p[a_name]), p[b_name])
                               for (lo, hi), p in zip(stack.rows, stack.params)])
        return (result + delta * scaling).to(dtype)

    return forward
