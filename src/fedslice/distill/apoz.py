"""APoZ (Average Percentage of Zeros, Hu et al. 2016) of FFN neurons, GELU-aware (FedPFT Eq. 14).

Eq. 14 counts activations that are exactly 0. That is meaningful for ReLU (T5 v1.0), but GELU and
SiLU are 0 only at x = 0 exactly: for BERT- or LLaMA-style models the paper's count is (almost)
always 0 for every neuron, so ranking neurons by it degenerates to the tie-break order. Here an
activation counts as "zero" when ``|a| <= tau`` (``method.apoz_tau``); ``tau = 0`` reproduces the
exact-zero count. Ties (equal APoZ) are broken by a seeded random permutation, never by index
order.

The activation of neuron j is what the FFN's output projection reads: the input of ``ffn_out``,
i.e. ``act(in(x))_j`` for a plain FFN and the *gated* activation ``act(gate(x))_j * in(x)_j``
for a gated one (SwiGLU, T5's gated-GELU), for every FFN of the architecture table. Layers are
numbered globally over the stacks (:func:`fedslice.distill.loop.block_units`); the decoder
layers of an encoder-decoder count the decoder's real tokens.

Client side: :func:`count_near_zero` runs the model over the local data and counts, per neuron,
the real (non-padding) tokens whose activation is near zero. Server side (pure):
:func:`aggregate_apoz` pools the clients' fractions weighted by their token counts, and
:func:`select_neurons` picks the proportion ``p`` with the highest APoZ (the least active on the
downstream data) for re-distillation; the most active neurons stay fixed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from fedslice.compute import model_device, to_device
from fedslice.data.batching import TokenizedSplit, iter_batches
from fedslice.distill.loop import block_units, stack_mask
from fedslice.measure import count_flops
from fedslice.tasks.base import batch_tokens
from fedslice.models.arch import ArchSpec

#: Reply keys of APoZ reports: ``apoz.<layer>`` -> (F'_l,) fractions.
APOZ_PREFIX = "apoz."


def near_zero_counts(act: torch.Tensor, mask: torch.Tensor, tau: float) -> torch.Tensor:
    """Per-neuron count of real tokens with |activation| <= tau (tau = 0: exactly 0).

    act (B, T, F), mask (B, T) of 0/1 -> (F,) float counts."""
    zero = act.abs() <= max(tau, 0.0)  # (B, T, F)
    return (zero & mask.bool().unsqueeze(-1)).sum(dim=(0, 1)).float()


@dataclass
class ApozCount:
    counts: dict[int, torch.Tensor]  # global layer -> (F_l,) near-zero token counts
    tokens: int  # real tokens counted (of the first stack: the inputs)
    flops: float  # forward FLOPs: FlopCounterMode on the first batch, scaled by padded tokens
    layer_tokens: dict[int, int] | None = None  # global layer -> real tokens its stack read


@torch.no_grad()
def count_near_zero(model: nn.Module, arch: ArchSpec, layers: Sequence[int], data: TokenizedSplit,
                    batch_size: int, tau: float, max_examples: int | None = None,
                    seed: int = 0) -> ApozCount:
    """Near-zero counts of the FFN activations (the input of ``ffn_out``) in ``layers`` (global
    indices, :func:`~fedslice.distill.loop.block_units`) of ``model`` over ``data`` (or a seeded
    sample of ``max_examples`` of it)."""
    rows = torch.arange(len(data))
    if max_examples is not None and max_examples < len(data):
        rows = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))[:max_examples]
    units = block_units(model, arch)
    counts: dict[int, torch.Tensor] = {}
    seen = {g: 0 for g in layers}
    current: dict[str, dict] = {}

    def hook_for(g: int):
        def hook(_module, inputs):
            mask = stack_mask(arch, units[g][0], current["batch"])  # (B, T_k)
            c = near_zero_counts(inputs[0], mask, tau)  # input of ffn_out: (B, T_k, F)
            counts[g] = counts[g] + c if g in counts else c
            seen[g] += int(mask.sum())
        return hook

    handles = [arch.ffn_part(model, *units[g], "ffn_out").register_forward_pre_hook(hook_for(g))
               for g in layers]
    was_training = model.training
    model.eval()
    tokens = padded = 0
    per_token = 0.0
    try:
        for i, batch in enumerate(iter_batches(data, rows, batch_size, shuffle=False, generator=None)):
            batch.pop("labels", None)
            batch = to_device(batch, model_device(model))
            current["batch"] = batch
            with count_flops(enabled=i == 0) as fc:
                model(**batch)
            if i == 0:
                per_token = fc.total / batch_tokens(batch)
            tokens += int(batch["attention_mask"].sum())
            padded += batch_tokens(batch)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return ApozCount(counts, tokens, per_token * padded, seen)


def apoz_report(counts: Mapping[int, torch.Tensor], tokens: int | Mapping[int, int]) -> dict[str, torch.Tensor]:
    """Reply arrays of a client: ``apoz.<layer>`` -> fraction of near-zero tokens per neuron
    (``tokens``: real tokens, one number or per layer)."""
    def n(l: int) -> int:
        return max(tokens if isinstance(tokens, int) else tokens[l], 1)
    return {f"{APOZ_PREFIX}{l}": c / n(l) for l, c in counts.items()}


def split_report(arrays: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[int, torch.Tensor]]:
    """(model tensors, layer -> APoZ) of a reply's arrays."""
    model = {k: v for k, v in arrays.items() if not k.startswith(APOZ_PREFIX)}
    apoz = {int(k[len(APOZ_PREFIX):]): v for k, v in arrays.items() if k.startswith(APOZ_PREFIX)}
    return model, apoz


def aggregate_apoz(reports: Sequence[Mapping[int, torch.Tensor]],
                   tokens: Sequence[float]) -> dict[int, torch.Tensor]:
    """Token-weighted mean of the clients' per-layer APoZ (Eq. 14 over the union of their data)."""
    out: dict[int, torch.Tensor] = {}
    weight: dict[int, float] = {}
    for rep, n in zip(reports, tokens):
        for l, a in rep.items():
            out[l] = out.get(l, 0) + float(n) * a.float()
            weight[l] = weight.get(l, 0.0) + float(n)
    return {l: out[l] / weight[l] for l in out if weight[l] > 0}


def select_neurons(apoz: torch.Tensor, proportion: float, generator: torch.Generator) -> torch.Tensor:
    """Bool mask (F,) of the ``round(proportion * F)`` (at least 1) neurons with the highest APoZ;
    ties broken by a random permutation drawn from ``generator``."""
    F = apoz.numel()
    k = min(F, max(1, round(proportion * F)))
    perm = torch.randperm(F, generator=generator)  # random tie order
    order = perm[torch.argsort(apoz[perm], descending=True, stable=True)]
    mask = torch.zeros(F, dtype=torch.bool)
    mask[order[:k]] = True
    return mask
