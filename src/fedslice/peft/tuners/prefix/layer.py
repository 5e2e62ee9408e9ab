"""What prefix tuning holds, under ``prompt_encoder.<adapter>``: ``embedding.weight``
(P, L·2·KV·hd), the keys and values of every layer (or, with ``projection``, ``embedding``
(P, d) and ``transform.{0,2}``, an MLP whose last linear has L·2·KV·hd outputs).

peft reads that axis as (layer, key/value, key/value head, head_dim), layer-major: position
``c = ((l·2 + s)·KV + g)·hd + i`` is dimension i of key/value head g of layer l (s = 0 keys,
1 values). So each key/value head of each layer owns 2·hd columns: the per-head parameters of
head pruning (:func:`prefix_positions`)."""

from __future__ import annotations

import torch


def prefix_positions(num_layers: int, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer (N,), key/value head (N,)) of every position of the prefix axis."""
    p = torch.arange(num_layers * 2 * kv_heads * head_dim)
    return p // (2 * kv_heads * head_dim), (p // head_dim) % kv_heads
