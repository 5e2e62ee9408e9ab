"""Extract and scatter, pure functions over state dicts: a sub-model's tensors from the full
model's (:func:`extract_state`) and back in full shape with the mask of what the sub-model holds
(:func:`scatter`). See :mod:`fedslice.slicing.spec` for the slicing model."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedslice.models.arch import ArchSpec
from fedslice.slicing.keys import KeyInfo, key_info
from fedslice.slicing.spec import QKV_PARTS, SliceSpec, Spec, State, kept_rows, stack_specs

# --------------------------------------------------------------------------------------------
# Extract / scatter (pure, over state dicts)
# --------------------------------------------------------------------------------------------

def _locate(specs, info: KeyInfo) -> tuple[SliceSpec | None, int | None]:
    """(the stack's spec, the sub-layer of the key) -- (None, None): the stack is kept whole."""
    s = specs[info.stack]
    return (None, None) if s is None else (s, s.sub_layer(info.layer))


def extract_state(state: Mapping[str, torch.Tensor], spec: Spec, arch: ArchSpec,
                  within: Spec | None = None) -> State:
    """The sub-model's tensors: sliced copies for sliced tensors, the same tensor objects otherwise
    (never a copy of a whole tensor). Keys of dropped layers are left out, kept layers renumbered;
    so are the q/k/v tensors of an attention family that keeps no head in a layer. ``within``:
    ``state`` is the sub-model of that slice (its layers renumbered), ``spec`` a part of it
    keeping its layers, both in full-model indices (:meth:`SliceSpec.index_within`)."""
    specs = stack_specs(spec, arch)
    outers = (None,) * len(specs) if within is None else stack_specs(within, arch)
    out: State = {}
    for key, t in state.items():
        info = key_info(arch, key)
        if info is None:
            out[key] = t
            continue
        w = outers[info.stack]
        s, j = _locate(specs, info) if w is None else (specs[info.stack], info.layer)
        if s is None:
            out[key] = t
            continue
        if j is None or (info.part in QKV_PARTS and s.no_heads(j, info.family)):
            continue
        if info.axis is not None and (idx := kept_rows(s, w, j, info.kind, info.family)) is not None:
            t = t.index_select(info.axis, idx)
        out[info.renamed(j)] = t
    return out


def scatter(sub_state: Mapping[str, torch.Tensor], spec: Spec, arch: ArchSpec,
            full_shapes: Mapping[str, torch.Size]) -> tuple[State, dict[str, torch.Tensor]]:
    """Sub-model tensors -> full-shape tensors (zeros where not held) and per-key masks.

    A mask is 1 where the client holds the element, 0 elsewhere, shaped to broadcast against the
    full tensor (e.g. ``(out, 1)`` for a row slice), so ``num_examples * mask`` is the client's
    weight for :func:`fedslice.slicing.aggregate.aggregate_deltas`.
    """
    specs = stack_specs(spec, arch)
    full: State = {}
    masks: dict[str, torch.Tensor] = {}
    for key, t in sub_state.items():
        info = key_info(arch, key)
        s = None if info is None else specs[info.stack]
        if s is None:
            full[key], masks[key] = t, torch.ones(())
            continue
        j = info.layer
        full_key = info.renamed(s.layers[j])
        shape = full_shapes[full_key]
        if info.axis is None or s.is_identity(j, info.kind, info.family):
            full[full_key], masks[full_key] = t, torch.ones(())
            continue
        idx = s.index(j, info.kind, info.family)
        full[full_key] = torch.zeros(shape, dtype=t.dtype).index_copy_(info.axis, idx, t)
        mshape = [1] * len(shape)
        mshape[info.axis] = shape[info.axis]
        mask = torch.zeros(shape[info.axis])
        mask[idx] = 1.0
        masks[full_key] = mask.reshape(mshape)
    return full, masks
