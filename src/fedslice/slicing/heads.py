"""Attention-head importance (confidence) and head keep-masks.

Importance follows Voita et al. (2019), as used by Eq. 6 of the heads paper: for each layer and
head, the max attention probability over keys for each query token, averaged over the real
(non-padding) query tokens of an example, then over the examples. Special tokens ([SEP]/EOS, and
padding) are excluded as keys: attention parked on [SEP] is a "no-op" and would make every head
look confident. transformers 5 has no ``head_mask``; attention weights need eager attention.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn as nn

from fedslice.data.batching import TokenizedSplit, iter_batches
from fedslice.errors import ConfigError, ModelError
from fedslice.slicing.aggregate import aggregate_deltas
from fedslice.slicing.spec import SliceSpec, extract_state, scatter

#: Attention families an output may carry (encoder-decoder models have all three).
FAMILIES = {"encoder": "attentions", "decoder": "decoder_attentions", "cross": "cross_attentions"}


def confidence(attentions: Iterable[torch.Tensor], query_mask: torch.Tensor,
               key_mask: torch.Tensor) -> torch.Tensor:
    """Per-example head confidence.

    attentions: one (B, H, Tq, Tk) tensor of probabilities per layer.
    query_mask: (B, Tq), 1 on query tokens to average over.
    key_mask:   (B, Tk), 1 on keys that may be attended (not padding, not special).
    Returns (B, L, H): mean over real queries of the max over allowed keys.
    """
    q = query_mask.float()
    out = []
    for att in attentions:
        allowed = att * key_mask[:, None, None, :].to(att.dtype)        # (B, H, Tq, Tk)
        peak = allowed.amax(dim=-1)                                      # (B, H, Tq)
        out.append((peak * q[:, None, :]).sum(-1) / q.sum(-1).clamp_min(1)[:, None])  # (B, H)
    return torch.stack(out, dim=1)                                       # (B, L, H)


def _ensure_eager(model: nn.Module) -> str:
    """Switch a HF model to eager attention (SDPA returns no weights); return the previous one."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    previous = getattr(base.config, "_attn_implementation", None) or "eager"
    if previous != "eager":
        try:
            base.set_attn_implementation("eager")
        except (ValueError, AttributeError, NotImplementedError) as e:
            raise ModelError(f"head importance needs eager attention weights, which "
                             f"{type(base).__name__} cannot provide: {e}") from None
    return previous


@torch.no_grad()
def head_importance(model: nn.Module, data: TokenizedSplit, special_token_ids: Iterable[int],
                    batch_size: int = 64) -> dict[str, torch.Tensor]:
    """Mean head confidence over ``data``: {family: (L, H)} for each attention family present.

    Runs in inference mode with eager attention (restored afterwards).
    """
    if len(data) == 0:
        raise ValueError("head importance of an empty dataset")
    special = torch.tensor(sorted(set(special_token_ids)), dtype=torch.int64)
    previous = _ensure_eager(model)
    was_training = model.training
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    try:
        order = torch.argsort(data.lengths, stable=True)
        for batch in iter_batches(data, order, batch_size, shuffle=False, generator=None):
            batch.pop("labels")
            out = model(**batch, output_attentions=True)
            real = batch["attention_mask"].bool()                        # (B, T)
            keys = real & ~torch.isin(batch["input_ids"], special)
            for family, attr in FAMILIES.items():
                atts = getattr(out, attr, None)
                if atts:
                    conf = confidence(atts, real, keys).sum(0)            # (L, H)
                    sums[family] = sums.get(family, 0) + conf
    finally:
        model.train(was_training)
        if previous != "eager":
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            base.set_attn_implementation(previous)
    if not sums:
        raise ModelError("the model returned no attention weights (output_attentions=True)")
    return {f: s / len(data) for f, s in sums.items()}


def keep_mask(importance: torch.Tensor, sparsity: float, *,
              mode: Literal["importance", "random", "none"] = "importance",
              scope: Literal["global", "per_layer"] = "global",
              generator: torch.Generator | None = None) -> torch.Tensor:
    """Boolean (L, H) mask of the heads a client keeps (Eq. 7 as a top-k rule).

    ``global`` keeps the round((1-s) * L * H) most important heads over all layers; ``per_layer``
    keeps round((1-s) * H) in every layer. ``random`` draws the kept heads from ``generator``
    instead; ``none`` keeps every head. Ties in importance are broken by the head's index.
    """
    if not 0.0 <= sparsity < 1.0:
        raise ConfigError(f"sparsity must be in [0, 1), got {sparsity}")
    n_layers, n_heads = importance.shape
    if mode == "none" or sparsity == 0.0:
        return torch.ones(n_layers, n_heads, dtype=torch.bool)
    scores = importance.float() if mode == "importance" else \
        torch.rand(n_layers, n_heads, generator=generator)
    if scope == "global":
        k = int(np.round((1 - sparsity) * n_layers * n_heads))
        rows = [scores.flatten()]
    else:
        k = int(np.round((1 - sparsity) * n_heads))
        rows = list(scores)
    if k < 1:
        pool = f"of {n_layers * n_heads}" if scope == "global" else f"per layer of {n_heads}"
        raise ConfigError(f"sparsity {sparsity} keeps no head ({pool}): lower it")
    masks = []
    for row in rows:
        order = torch.argsort(row, descending=True, stable=True)
        m = torch.zeros_like(row, dtype=torch.bool)
        m[order[:k]] = True
        masks.append(m)
    return torch.cat(masks).view(n_layers, n_heads)


def head_axes(names: Iterable[str], arch, num_layers: int) -> dict[str, tuple[int, str, int]]:
    """Which LoRA tensors are split by attention head: name -> (layer, part, axis).

    For q/k/v, ``lora_B`` (out, r) has one block of head_dim rows per head (axis 0); for the
    attention output projection the heads index its input, i.e. the columns of ``lora_A``
    (r, in) (axis 1). ``lora_A`` of q/k/v and ``lora_B`` of o mix all heads: not head-tied.
    """
    names = list(names)
    out = {}
    for layer in range(num_layers):
        for part, side, axis in (("q", "lora_B", 0), ("k", "lora_B", 0), ("v", "lora_B", 0),
                                 ("o", "lora_A", 1)):
            tag = f"{arch.part_name(layer, part)}.{side}."
            for n in names:
                if tag in n:
                    out[n] = (layer, part, axis)
    return out


def head_weight(alpha_layer: torch.Tensor, head_dim: int, axis: int) -> torch.Tensor:
    """A per-head weight vector (H,) expanded to a broadcastable (H*head_dim, 1) or (1, H*head_dim)."""
    w = alpha_layer.float().repeat_interleave(head_dim)                  # (H * head_dim,)
    return w[:, None] if axis == 0 else w[None, :]


# --------------------------------------------------------------------------------------------
# Masks as slice specs, and head-weighted aggregation (Eq. 8)
# --------------------------------------------------------------------------------------------

def mask_spec(mask: torch.Tensor, dims: Mapping[str, int]) -> SliceSpec:
    """The SliceSpec of a (L, H) keep-mask: every layer, its kept heads, every FFN neuron."""
    heads = tuple(tuple(int(h) for h in torch.nonzero(row).flatten()) for row in mask.bool())
    full = tuple(range(dims["ffn"]))
    return SliceSpec(tuple(range(dims["num_layers"])), heads, (full,) * dims["num_layers"],
                     dims["num_layers"], dims["num_heads"], dims["head_dim"], dims["ffn"])


@dataclass
class HeadUpdate:
    """One client's upload: its sub-state (full-model names, kept heads only), its (L, H) keep
    mask, its importance α_c (Eq. 7: 0 on pruned heads; None under FedAvg) and |D_c|."""

    arrays: Mapping[str, torch.Tensor]
    kept: torch.Tensor
    alpha: torch.Tensor | None
    num_examples: int


def head_client_weights(update: HeadUpdate, keys: Iterable[str], masks: Mapping[str, torch.Tensor],
                        axes: Mapping[str, tuple[int, str, int]], head_dim: int,
                        mode: Literal["head_weighted", "fedavg"]) -> dict[str, torch.Tensor | float]:
    """Per-key weights of one client: α_hc on the rows/columns of head h of a head-tied tensor
    (``head_weighted``, Eq. 8) or |D_c| on the kept heads (``fedavg``); |D_c| times the held-mask
    on every other tensor (Eq. 5)."""
    n = float(update.num_examples)
    kept = update.kept.bool()
    out: dict[str, torch.Tensor | float] = {}
    for k in keys:
        if k in axes:
            layer, _, axis = axes[k]
            per_head = (update.alpha[layer].float() * kept[layer] if mode == "head_weighted"
                        else n * kept[layer].float())                    # (H,)
            out[k] = head_weight(per_head, head_dim, axis)
        else:
            out[k] = n * masks[k]
    return out


def aggregate_heads(global_state: Mapping[str, torch.Tensor], updates: Sequence[HeadUpdate],
                    arch, dims: Mapping[str, int], *,
                    mode: Literal["head_weighted", "fedavg"] = "head_weighted",
                    eta: float = 1.0, eps: float = 1e-8) -> dict[str, torch.Tensor]:
    """Server update of the global trainable state from head-pruned clients (pure function).

    Head-tied LoRA tensors (q/k/v ``lora_B`` rows, o ``lora_A`` columns; :func:`head_axes`):
    ``p_h += eta * sum_c α_hc Δp_hc / (sum_c α_hc + eps)`` (Eq. 8), or the example-weighted mean
    over the clients that kept head h (``fedavg``). A head that no client kept is unchanged.
    Every other tensor: Eq. 5 over the clients that sent it (eps = 0).
    """
    deltas, weights = head_deltas(global_state, updates, arch, dims, mode)
    return combine_heads(global_state, deltas, weights, arch, dims, eta=eta, eps=eps)


def head_deltas(global_state: Mapping[str, torch.Tensor], updates: Sequence[HeadUpdate], arch,
                dims: Mapping[str, int], mode: Literal["head_weighted", "fedavg"]
                ) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor | float]]]:
    """Each client's update scattered to full shape (zeros where not held) and its per-element
    weights (α on head-tied rows/columns, or |D_c| x held-mask)."""
    if mode == "head_weighted" and any(u.alpha is None for u in updates):
        raise ValueError("head_weighted aggregation needs every client's importance alpha")
    shapes = {k: t.shape for k, t in global_state.items()}
    axes = head_axes(global_state, arch, dims["num_layers"])
    deltas, weights = [], []
    for u in updates:
        spec = mask_spec(u.kept, dims)
        g_sub = extract_state(global_state, spec, arch)
        delta = {k: u.arrays[k].float() - g_sub[k].float() for k in u.arrays}  # sliced shapes
        full, masks = scatter(delta, spec, arch, shapes)
        deltas.append(full)
        weights.append(head_client_weights(u, full, masks, axes, dims["head_dim"], mode))
    return deltas, weights


def combine_heads(global_state: Mapping[str, torch.Tensor], deltas, weights, arch,
                  dims: Mapping[str, int], *, eta: float = 1.0, eps: float = 1e-8) -> dict[str, torch.Tensor]:
    """Eq. 8 (eps) on the head-tied tensors, Eq. 5 (no eps) on the others."""
    axes = head_axes(global_state, arch, dims["num_layers"])
    tied = {k: t for k, t in global_state.items() if k in axes}
    rest = {k: t for k, t in global_state.items() if k not in axes}
    new = aggregate_deltas(tied, deltas, weights, eta=eta, eps=eps)
    new.update(aggregate_deltas(rest, deltas, weights, eta=eta, eps=0.0))
    return {k: new[k] for k in global_state}
