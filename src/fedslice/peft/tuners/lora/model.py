"""LoRA through HF ``peft``, with a check that the targets matched what was intended.

Logical targets (``q``, ``v``, ``ffn_in``, ..., or ``all-linear``) are resolved through the
architecture table to the exact module names of every block of every stack (encoder, decoder,
cross-attention); raw ``target_modules`` entries must each match at least one module (peft
silently accepts a list of which only some names match).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn

from fedslice.errors import FedsliceError
from fedslice.models.quantize import quiet
from fedslice.models.arch import ArchSpec
import fedslice.peft.targets as targets
from fedslice.peft.base import Adapter, Layers, freeze, train_classifier
from fedslice.peft.tuners.lora.aggregate import fresh_a
from fedslice.peft.tuners.lora.config import LoraConfig
from fedslice.peft.tuners.lora.layer import LORA_TENSORS, dora_weight, lora_delta


def logical_targets(cfg: LoraConfig) -> list[str]:
    """``lora.targets`` with ``all-linear`` expanded to every part of the table."""
    return targets.logical(cfg.targets)


def resolve_targets(model: nn.Module, arch: ArchSpec, cfg: LoraConfig,
                    layers: list[int] | list[list[int]] | None = None, section: str = "lora") -> list[str]:
    """peft ``target_modules`` for this config, validated against the model's modules
    (:func:`fedslice.peft.targets.resolve`; errors name ``<section>.targets``).

    ``layers`` restricts the logical targets to those layers (raw ``target_modules`` cannot be
    restricted and are refused then)."""
    return targets.resolve(model, arch, section, cfg.targets, cfg.target_modules, layers)


def apply_lora(model: nn.Module, arch: ArchSpec, cfg: LoraConfig,
               layers: list[int] | list[list[int]] | None = None, *, use_dora: bool = False,
               section: str = "lora") -> nn.Module:
    """Wrap ``model`` with LoRA adapters (in every layer, or only in ``layers``; DoRA's
    magnitude vectors too with ``use_dora``); the sequence-classification head stays trainable if
    configured. A rank above a target's smaller dimension is a ConfigError naming the module.

    The classifier is made trainable in place (not via peft's ``modules_to_save`` copies), so its
    parameter names stay those of the HF checkpoint.
    """
    from peft import LoraConfig as PeftLoraConfig, get_peft_model  # peft loads transformers' auto classes: only when used

    names = resolve_targets(model, arch, cfg, layers, section)
    targets.check_rank(model, arch, section, cfg.r, names)
    peft_cfg = PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                              target_modules=names, bias="none", use_dora=use_dora,
                              fan_in_fan_out=arch.layout.transposed)
    with quiet():  # over a quantized base: peft's warning that its torchao layer cannot merge
        model = get_peft_model(model, peft_cfg)  # in place (fedslice de-quantizes to merge)
    if cfg.train_classifier:
        train_classifier(model, arch)
    return model


def lora_module_names(model: nn.Module) -> list[str]:
    """Names of modules that carry LoRA adapters (for tests and reports)."""
    return list(LoraAdapter.adapted_modules_of(model))


class LoraAdapter(Adapter):
    """LoRA through HF peft: ``W + (alpha / r) B A`` on the targets of ``[lora]``; everything
    else frozen, the classifier trainable if ``lora.train_classifier``. With
    ``lora.aggregation = "ffa"`` every ``A`` is drawn from the experiment's seed and its name
    (:func:`~fedslice.peft.tuners.lora.aggregate.fresh_a`: the same on the server and on every
    client, never sent) and frozen: only ``B`` trains. A client of a smaller rank
    (``lora.ranks``) holds the leading components of each factor (:meth:`resize`)."""

    name = "lora"
    prefix = "lora_"
    module_tensors = LORA_TENSORS
    batched_clients = True
    table6 = "lora"
    options: LoraConfig

    def __init__(self, options, arch, seed: int = 0):
        super().__init__(options, arch, seed)
        #: FFA's frozen A of every module at the global rank (kept when a client's is smaller)
        self._full_a: dict[nn.Module, torch.Tensor] = {}

    @property
    def frozen_a(self) -> bool:
        """FFA-LoRA: A is frozen at its seeded initialisation."""
        return self.options.aggregation == "ffa"

    def apply(self, model: nn.Module, layers: Layers = None) -> nn.Module:
        freeze(model)
        model = apply_lora(model, self.arch, self.options, layers=layers)
        if self.frozen_a:
            with torch.no_grad():
                for mname, module in self.adapted_modules(model).items():
                    for adapter, lin in module.lora_A.items():
                        lin.weight.copy_(fresh_a(lin.weight.shape, self.seed,
                                                 f"{mname}.lora_A.{adapter}.weight"))
                        lin.weight.requires_grad_(False)
        return model

    @property
    def scale(self) -> float:
        return self.options.scale

    #: DoRA's magnitude vectors too (peft's ``use_dora``)
    use_dora = False

    def export_config(self, state, modules_to_save):
        """peft's ``LoraConfig`` for the modules carrying ``lora_A``/``lora_B`` in ``state``, at
        the rank of their tensors (one rank: a peft adapter has one) and this config's alpha."""
        from peft import LoraConfig as PeftLoraConfig  # peft only when used (start-up)

        ranks = {int(t.shape[0]) for k, t in state.items() if ".lora_A." in k}
        if len(ranks) != 1:
            raise FedsliceError(f"LoRA tensors of several ranks {sorted(ranks)}: not one peft adapter")
        return PeftLoraConfig(r=ranks.pop(), lora_alpha=self.options.alpha, lora_dropout=0.0,
                              target_modules=self.modules_carrying(list(state)), bias="none",
                              use_dora=self.use_dora, fan_in_fan_out=self.arch.layout.transposed,
                              modules_to_save=modules_to_save or None)

    def resize(self, model: nn.Module, rank: int | None) -> None:
        """Every LoRA factor of ``model`` at rank ``rank`` (None: ``lora.r``): new zero tensors of
        that size (the client's payload is loaded into them next), FFA's frozen A its leading rows
        of the global A. peft's ``scaling`` (alpha / lora.r) is kept: a client at rank r uses
        the global adapter's effective scale, so its zero-padded factors add into the global
        ones unchanged."""
        r = self.options.r if rank is None else int(rank)
        if not 0 < r <= self.options.r:
            raise ValueError(f"LoRA rank {r} is outside 1..lora.r={self.options.r}")
        for module in self.adapted_modules(model).values():
            for adapter in list(module.lora_A):
                lin_a, lin_b = module.lora_A[adapter], module.lora_B[adapter]
                if lin_a.weight.shape[0] == r:
                    continue
                a, b = lin_a.weight, lin_b.weight
                if not a.requires_grad:  # frozen (FFA): the leading rows of the global A
                    full = self._full_a.setdefault(lin_a, a.detach().clone())
                    new_a = full[:r].clone()
                else:
                    new_a = a.new_zeros(r, a.shape[1])
                lin_a.weight = nn.Parameter(new_a, requires_grad=a.requires_grad)
                lin_b.weight = nn.Parameter(b.new_zeros(b.shape[0], r), requires_grad=b.requires_grad)
                lin_a.out_features = lin_b.in_features = r
                module.r[adapter] = r

    @contextlib.contextmanager
    def at_rank(self, model: nn.Module, rank: int) -> Iterator[nn.Module]:
        """``model`` with every LoRA factor at rank ``rank`` (zero tensors: for measuring a
        client's training step); its own tensors are put back afterwards."""
        saved = [(m, a, m.lora_A[a].weight, m.lora_B[a].weight, m.r[a])
                 for m in self.adapted_modules(model).values() for a in m.lora_A]
        try:
            self.resize(model, rank)
            yield model
        finally:
            for m, a, wa, wb, r in saved:
                m.lora_A[a].weight, m.lora_B[a].weight, m.r[a] = wa, wb, r
                m.lora_A[a].out_features = m.lora_B[a].in_features = wa.shape[0]

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
        """``lora_A.<adapter>.weight`` and ``lora_B.<adapter>.weight`` of each active adapter
        (and DoRA's magnitude, where the layer has one), those that train (FFA's frozen A is
        shared by every client: not among them)."""
        active = getattr(module, "active_adapters", None) or list(module.lora_A)
        return [f"{attr}.{a}.weight" for a in active for attr in self.module_tensors
                if a in getattr(module, attr) and getattr(module, attr)[a].weight.requires_grad]

    @classmethod
    def delta_weight(cls, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        return lora_delta(tensors)

    @classmethod
    def effective_weight(cls, weight: torch.Tensor, tensors: Mapping[str, torch.Tensor],
                         scale: float | None) -> torch.Tensor:
        """``W + scale B A``; DoRA's normalised, magnitude-scaled weight when the layer holds a
        magnitude vector (a LoRA layer with ``use_dora``)."""
        dora = dora_weight(weight, tensors, scale) if scale else None
        return dora if dora is not None else super().effective_weight(weight, tensors, scale)

    def stacked_forward(self, module: nn.Module, names: list[str], stack):
        """``base(x) + scaling * B_k A_k dropout(x_k)`` on the rows of each client k, as peft's
        vanilla LoRA computes it for one client: the frozen base runs once on the whole batch;
        equal-sized clients share one batched matmul over their stacked A and B (``bmm``),
        others get one matmul each."""
        (adapter,) = module.active_adapters
        a_name = next((n for n in names if f"lora_A.{adapter}." in n), None)
        b_name = next(n for n in names if f"lora_B.{adapter}." in n)
        dropout, scaling = module.lora_dropout[adapter], module.scaling[adapter]
        shared_a = module.lora_A[adapter].weight  # FFA: one frozen A for every client

        def a_of(p):
            return shared_a if a_name is None else p[a_name]

        def forward(x, *args, **kwargs):
            result = module.base_layer(x, *args, **kwargs)  # (N, ..., out)
            if module.disable_adapters:  # the frozen base (peft.base.adapters_off: a reference)
                return result
            dtype = result.dtype
            h = dropout(x)
            if len({hi - lo for lo, hi in stack.rows}) == 1 and len(stack.rows) > 1:
                k = len(stack.rows)
                A = torch.stack([a_of(p) for p in stack.params])    # (K, r, in)
                B = torch.stack([p[b_name] for p in stack.params])  # (K, out, r)
                hk = h.reshape(k, -1, h.shape[-1])                   # (K, n*T, in)
                delta = torch.bmm(torch.bmm(hk, A.transpose(1, 2).to(hk.dtype)),
                                  B.transpose(1, 2).to(hk.dtype)).reshape(*result.shape)
            else:
                delta = torch.cat([nn.functional.linear(nn.functional.linear(h[lo:hi], a_of(p)), p[b_name])
                                   for (lo, hi), p in zip(stack.rows, stack.params)])
            return (result + delta * scaling).to(dtype)

        return forward

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "rank": self.options.r, "alpha": self.options.alpha}
