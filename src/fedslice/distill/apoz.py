"""APoZ (Average Percentage of Zeros, Hu et al. 2016) of FFN neurons, GELU-aware (FedPFT Eq. 14).

Eq. 14 counts activations that are exactly 0. That is meaningful for ReLU, but GELU is 0 only at
x = 0 exactly: for BERT-style models the paper's count is (almost) always 0 for every neuron, so
ranking neurons by it degenerates to the tie-break order. Here an activation counts as "zero" when
``|gelu(x)| < tau`` (``method.apoz_tau``); ``tau = 0`` reproduces the exact-zero count. Ties (equal
APoZ) are broken by a seeded random permutation, never by index order.

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

from fedslice.data.batching import TokenizedSplit, iter_batches
from fedslice.measure import count_flops
from fedslice.models.arch import ArchSpec

#: Reply keys of APoZ reports: ``apoz.<layer>`` -> (F'_l,) fractions.
APOZ_PREFIX = "apoz."


def near_zero_counts(act: torch.Tensor, mask: torch.Tensor, tau: float) -> torch.Tensor:
    """Per-neuron count of real tokens with |activation| < tau (tau = 0: exactly 0).

    act (B, T, F), mask (B, T) of 0/1 -> (F,) float counts."""
    zero = act == 0 if tau <= 0 else act.abs() < tau  # (B, T, F)
    return (zero & mask.bool().unsqueeze(-1)).sum(dim=(0, 1)).float()


@dataclass
class ApozCount:
    counts: dict[int, torch.Tensor]  # layer -> (F_l,) near-zero token counts
    tokens: int  # real tokens counted
    flops: float  # forward FLOPs: FlopCounterMode on the first batch, scaled by padded tokens


@torch.no_grad()
def count_near_zero(model: nn.Module, arch: ArchSpec, layers: Sequence[int], data: TokenizedSplit,
                    batch_size: int, tau: float, max_examples: int | None = None,
                    seed: int = 0) -> ApozCount:
    """Near-zero counts of the FFN activations (the input of ``ffn_out``) in ``layers`` of
    ``model`` over ``data`` (or a seeded sample of ``max_examples`` of it)."""
    rows = torch.arange(len(data))
    if max_examples is not None and max_examples < len(data):
        rows = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))[:max_examples]
    counts: dict[int, torch.Tensor] = {}
    current: dict[str, torch.Tensor] = {}

    def hook_for(layer: int):
        def hook(_module, inputs):
            c = near_zero_counts(inputs[0], current["mask"], tau)
            counts[layer] = counts[layer] + c if layer in counts else c
        return hook

    handles = [arch.part(model, l, "ffn_out").register_forward_pre_hook(hook_for(l)) for l in layers]
    was_training = model.training
    model.eval()
    tokens = padded = 0
    per_token = 0.0
    try:
        for i, batch in enumerate(iter_batches(data, rows, batch_size, shuffle=False, generator=None)):
            batch.pop("labels", None)
            current["mask"] = batch["attention_mask"]
            with count_flops(enabled=i == 0) as fc:
                model(**batch)
            if i == 0:
                per_token = fc.total / batch["input_ids"].numel()
            tokens += int(batch["attention_mask"].sum())
            padded += batch["input_ids"].numel()
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return ApozCount(counts, tokens, per_token * padded)


def apoz_report(counts: Mapping[int, torch.Tensor], tokens: int) -> dict[str, torch.Tensor]:
    """Reply arrays of a client: ``apoz.<layer>`` -> fraction of near-zero tokens per neuron."""
    return {f"{APOZ_PREFIX}{l}": c / max(tokens, 1) for l, c in counts.items()}


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
