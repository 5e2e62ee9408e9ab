"""Head-weighted aggregation (the heads paper's Eq. 8): each client's per-head update weighed by
its kept heads' confidence, combined over the clients that kept each head.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from fedslice.slicing.aggregate import aggregate_deltas
from fedslice.slicing.keys import HeadPositions, KeyInfo
from fedslice.slicing.spec import Spec
from fedslice.slicing.state import extract_state, scatter
from fedslice.slicing.heads import Dims, dims_stacks, head_axes, head_weight, mask_rows, mask_spec


@dataclass
class HeadUpdate:
    """One client's upload: its sub-state (full-model names, kept heads only), its (R, H) keep
    mask, its importance α_c (Eq. 7: 0 on pruned heads; None under FedAvg) and |D_c|."""

    arrays: Mapping[str, torch.Tensor]
    kept: torch.Tensor
    alpha: torch.Tensor | None
    num_examples: int
    #: the slice the client trained, in full-model indices (None: :func:`mask_spec` of ``kept``,
    #: the full model's kept heads); a sub-model's, restricted to its kept heads (:func:`restrict`)
    spec: Spec | None = None
    #: a factor on every weight of the client (RaFFM's f^p)
    factor: float = 1.0


def head_client_weights(update: HeadUpdate, keys: Iterable[str], masks: Mapping[str, torch.Tensor],
                        axes: Mapping[str, KeyInfo], dims: Dims,
                        mode: Literal["head_weighted", "fedavg"]) -> dict[str, torch.Tensor | float]:
    """Per-key weights of one client: α_hc on the rows/columns of head h of a head-tied tensor
    (``head_weighted``, Eq. 8; a key/value head: the sum of α over its kept query heads) or |D_c|
    on the kept heads (``fedavg``; a key/value head: while any query head of its group is kept);
    |D_c| times the held-mask on every other tensor (Eq. 5)."""
    n = float(update.num_examples)
    kept, stacks, rows = update.kept.bool(), dims_stacks(dims), mask_rows(dims)
    out: dict[str, torch.Tensor | float] = {}
    for k in keys:
        info = axes.get(k)
        if info is None:
            out[k] = n * masks[k]
            continue
        r = rows[(info.stack, info.family)] + info.layer
        if mode == "head_weighted":
            per_head, reduce = update.alpha[r].float() * kept[r], "sum"     # (H,)
        else:
            per_head, reduce = n * kept[r].float(), "max"
        w = head_weight(per_head, info, stacks[info.stack], reduce)
        if isinstance(keys, Mapping) and keys[k].dim() == 1:
            w = w.flatten()  # a vector along the head axis (DoRA's magnitudes): (rows,)
        out[k] = w * masks[k]
    return out


def aggregate_heads(global_state: Mapping[str, torch.Tensor], updates: Sequence[HeadUpdate],
                    arch, dims: Dims, *,
                    mode: Literal["head_weighted", "fedavg"] = "head_weighted",
                    eta: float = 1.0, eps: float = 1e-8,
                    positions: Positions | None = None) -> dict[str, torch.Tensor]:
    """Server update of the global trainable state from head-pruned clients (pure function).

    Head-tied LoRA tensors (q/k/v ``lora_B`` rows, o ``lora_A`` columns; :func:`head_axes`):
    ``p_h += eta * sum_c α_hc Δp_hc / (sum_c α_hc + eps)`` (Eq. 8), or the example-weighted mean
    over the clients that kept head h (``fedavg``). A head that no client kept is unchanged.
    A tensor outside the blocks that maps to heads (``positions``: a prefix's key/value columns)
    is weighted per key/value head the same way. Every other tensor: Eq. 5 over the clients that
    sent it (eps = 0).
    """
    deltas, weights = head_deltas(global_state, updates, arch, dims, mode, positions)
    return combine_heads(global_state, deltas, weights, arch, dims, eta=eta, eps=eps,
                         positions=positions)


Positions = Mapping[str, HeadPositions]


def kept_positions(pos: HeadPositions, kept: torch.Tensor, dims: Dims) -> torch.Tensor:
    """The entries along ``pos.axis`` that a client with the (R, H) keep-mask ``kept`` holds:
    those of a key/value head with a kept query head in its row (all of them under plain
    multi-head attention, where a key/value head is its query head)."""
    return torch.nonzero(_kv_kept(kept, dims)[pos.row, pos.kv]).flatten()


def _kv_kept(kept: torch.Tensor, dims: Dims) -> torch.Tensor:
    """(R, KV): a key/value head is kept while any query head of its group is."""
    kv = dims_stacks(dims)[0].get("num_kv_heads", kept.shape[1])
    return kept.bool().view(kept.shape[0], kv, -1).any(-1)


def position_cuts(positions: Positions, kept: torch.Tensor, dims: Dims
                  ) -> dict[str, tuple[torch.Tensor, int]]:
    """name -> (kept entries, axis) of each tensor outside the blocks that maps to heads (for
    :func:`fedslice.slicing.partial.partial_model`'s ``extra``)."""
    return {n: (kept_positions(p, kept, dims), p.axis) for n, p in positions.items()}


def heads_state(state: Mapping[str, torch.Tensor], kept: torch.Tensor, arch, dims: Dims,
                positions: Positions | None = None) -> dict[str, torch.Tensor]:
    """What a client with keep-mask ``kept`` holds of ``state``: the block tensors of its kept
    heads (:func:`extract_state` of :func:`mask_spec`), and of a tensor outside the blocks that
    maps to heads (a prefix: ``positions``) the entries of its kept key/value heads."""
    out = extract_state(state, mask_spec(kept, dims), arch)
    for name, pos in (positions or {}).items():
        if name in out:
            out[name] = out[name].index_select(pos.axis, kept_positions(pos, kept, dims))
    return out


def _position_weight(per_head: torch.Tensor, pos: HeadPositions, dims: Dims, shape,
                     reduce: Literal["sum", "max"]) -> torch.Tensor:
    """A per-(row, query head) weight (R, H) summed (or maxed) over each key/value head's group
    and laid out along ``pos.axis`` of a tensor of ``shape``, broadcastable against it."""
    kv = dims_stacks(dims)[0].get("num_kv_heads", per_head.shape[1])
    groups = per_head.float().view(per_head.shape[0], kv, -1)           # (R, KV, H / KV)
    w = (groups.sum(-1) if reduce == "sum" else groups.amax(-1))[pos.row, pos.kv]  # (N,)
    view = [1] * len(shape)
    view[pos.axis] = shape[pos.axis]
    return w.view(view)


def head_deltas(global_state: Mapping[str, torch.Tensor], updates: Sequence[HeadUpdate], arch,
                dims: Dims, mode: Literal["head_weighted", "fedavg"],
                positions: Positions | None = None
                ) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor | float]]]:
    """Each client's update scattered to full shape (zeros where not held) and its per-element
    weights (α on head-tied rows/columns, or |D_c| x held-mask). ``positions``: tensors outside
    the blocks that map to heads (a prefix), weighted per key/value head alike."""
    if mode == "head_weighted" and any(u.alpha is None for u in updates):
        raise ValueError("head_weighted aggregation needs every client's importance alpha")
    positions = positions or {}
    shapes = {k: t.shape for k, t in global_state.items()}
    axes = head_axes(global_state, arch)
    deltas, weights = [], []
    for u in updates:
        spec = mask_spec(u.kept, dims) if u.spec is None else u.spec
        if u.spec is None:
            g_sub = heads_state(global_state, u.kept, arch, dims, positions)
        else:  # a sub-model's slice: no prefix positions (RaFFM refuses such adapters)
            g_sub = extract_state(global_state, spec, arch)
        delta = {k: u.arrays[k].float() - g_sub[k].float() for k in u.arrays}  # sliced shapes
        outside = {k: delta.pop(k) for k in list(delta) if k in positions}
        full, masks = scatter(delta, spec, arch, shapes)
        w = head_client_weights(u, full, masks, axes, dims, mode)
        n, kept = float(u.num_examples), u.kept.bool()
        for k, d in outside.items():
            pos = positions[k]
            idx = kept_positions(pos, kept, dims)
            full[k] = torch.zeros(shapes[k]).index_copy_(pos.axis, idx, d)
            per_head = (u.alpha.float() * kept) if mode == "head_weighted" else n * kept.float()
            held = torch.zeros(shapes[k][pos.axis])
            held[idx] = 1.0
            view = [1] * len(shapes[k])
            view[pos.axis] = shapes[k][pos.axis]
            w[k] = _position_weight(per_head, pos, dims, shapes[k],
                                    "sum" if mode == "head_weighted" else "max") * held.view(view)
        if u.factor != 1.0:
            w = {k: u.factor * x for k, x in w.items()}
        deltas.append(full)
        weights.append(w)
    return deltas, weights


def combine_heads(global_state: Mapping[str, torch.Tensor], deltas, weights, arch,
                  dims: Dims, *, eta: float = 1.0, eps: float = 1e-8,
                  positions: Positions | None = None) -> dict[str, torch.Tensor]:
    """Eq. 8 (eps) on the head-tied tensors (``positions`` too), Eq. 5 (no eps) on the others."""
    axes = {**head_axes(global_state, arch), **(positions or {})}
    tied = {k: t for k, t in global_state.items() if k in axes}
    rest = {k: t for k, t in global_state.items() if k not in axes}
    new = aggregate_deltas(tied, deltas, weights, eta=eta, eps=eps)
    new.update(aggregate_deltas(rest, deltas, weights, eta=eta, eps=0.0))
    return {k: new[k] for k in global_state}
