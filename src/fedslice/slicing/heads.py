"""Attention-head importance (confidence) and head keep-masks.

Importance follows Voita et al. (2019), as used by Eq. 6 of the heads paper: for each layer and
head, the max attention probability over keys for each query token, averaged over the real
(non-padding) query tokens of an example, then over the examples. Special tokens ([SEP]/EOS, and
padding) are excluded as keys: attention parked on [SEP] is a "no-op" and would make every head
look confident. transformers 5 has no ``head_mask``; attention weights need eager attention.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import numpy as np
import torch
import torch.nn as nn

from fedslice.data.batching import TokenizedSplit, iter_batches
from fedslice.errors import ConfigError, ModelError

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
