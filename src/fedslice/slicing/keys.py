"""Where a state-dict key sits in a sliceable model: its stack, layer, part (q/k/v/o/FFN...),
attention family and sliced axis (:func:`key_info`), read from the architecture table; and where
an adapter's tensors outside the blocks sit per head (:class:`HeadPositions`). See
:mod:`fedslice.slicing.spec` for the slicing model."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

import torch

from fedslice.models.arch import ArchSpec, Attention, Layout
from fedslice.registry import adapter_owning
from fedslice.slicing.spec import OUT_PARTS, SLOTS

@dataclass(frozen=True)
class HeadPositions:
    """Along ``axis`` of an adapter tensor outside the blocks (a prefix), the keep-mask row
    (:func:`fedslice.slicing.heads.mask_rows`: one per attention family and layer) and the
    key/value head of every position (``row[p]``, ``kv[p]``; both (N,) long). Under grouped-query
    attention a key/value head is kept while any query head of its group is. An adapter reports
    them (:meth:`fedslice.peft.Adapter.head_positions`)."""

    axis: int
    row: torch.Tensor
    kv: torch.Tensor


# --------------------------------------------------------------------------------------------
# State-dict keys -> (stack, layer, part, family, sliced axis)
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KeyInfo:
    """Where a state-dict key sits: its stack and layer, and for a sliceable tensor the part, the
    attention family (0 self, 1 cross), the sliced axis and what indexes it (``slot``)."""

    prefix: str  # up to and including the layer list, e.g. 'base_model.model.bert.encoder.layer'
    layer: int
    rest: str  # inside the block, e.g. 'attention.self.query.lora_B.default.weight'
    part: str | None  # q/k/v/qkv/o/bias/ffn_in/gate/ffn_out, or None (a LayerNorm in a block, ...)
    axis: int | None  # axis indexed by heads/neurons, or None (tensor kept whole)
    stack: int = 0
    family: int = 0
    leaf: str = ""  # after the part's path: 'weight', 'base_layer.weight', 'lora_A.default.weight'
    adapter: str | None = None  # the adapter that owns the tensor (None: the model's own)

    @property
    def kind(self) -> str | None:
        """'heads', 'kv', 'qkv', 'bias' or 'ffn' (see :meth:`SliceSpec.index`); None if whole."""
        return None if self.axis is None else SLOTS[self.part]

    def renamed(self, layer: int) -> str:
        return f"{self.prefix}.{layer}.{self.rest}"


def attention_parts(att: Attention) -> list[tuple[str, str]]:
    """(part, path) of an attention family: a fused q|k|v is one part 'qkv'."""
    qkv = [("qkv", att.q)] if att.fused_qkv else [("q", att.q), ("k", att.k), ("v", att.v)]
    return [*qkv, ("o", att.o)]


def block_parts(arch: ArchSpec, stack: int) -> list[tuple[str, int, str]]:
    """(part, family, path inside a block) of every sliceable part of a stack's blocks."""
    s = arch.stacks[stack]
    out = [(part, f, path) for f, att in enumerate(s.attention) for part, path in attention_parts(att)]
    out += [(part, 0, path) for part, path in (("gate", s.ffn.gate), ("ffn_in", s.ffn.ffn_in),
                                               ("ffn_out", s.ffn.ffn_out)) if path]
    if arch.head_bias:
        out.append(("bias", 0, arch.head_bias))
    return out


@lru_cache(maxsize=64)
def _stack_regexes(arch: ArchSpec) -> tuple[tuple[re.Pattern, list[tuple[str, int]]], ...]:
    out = []
    for k, s in enumerate(arch.stacks):
        parts = sorted(block_parts(arch, k), key=lambda x: -len(x[2]))
        alts = "|".join(f"(?P<p{i}>{re.escape(path)})" for i, (_, _, path) in enumerate(parts))
        rx = re.compile(rf"^(?P<prefix>(?:.*\.)?{re.escape(s.layers)})\.(?P<layer>\d+)\."
                        rf"(?P<rest>(?:(?:{alts})\.)?(?P<leaf>.+))$")
        out.append((rx, [(part, f) for part, f, _ in parts]))
    return tuple(out)


def _axis(part: str, leaf: str, layout: Layout, adapter) -> int | None:
    """The sliced axis of a tensor of ``part`` named ``leaf`` ('weight', 'bias',
    'base_layer.weight', an adapter's 'lora_A.default.weight', ...); None if it is kept whole."""
    last = leaf.rsplit(".", 1)[-1]
    if part == "bias":
        return 1 if last == "weight" else None  # embedding (buckets, H)
    if adapter is not None:
        out_axis, in_axis = adapter.tensor_axes(leaf)  # e.g. LoRA A (r, in), B (out, r)
    elif last == "weight":
        out_axis, in_axis = layout.out_axis, layout.in_axis  # Linear (out, in); Conv1D (in, out)
    elif last == "bias":
        out_axis, in_axis = 0, None
    else:
        raise ValueError(f"cannot slice tensor {leaf!r} of part {part!r} (unknown kind)")
    return out_axis if part in OUT_PARTS else in_axis


def key_info(arch: ArchSpec, key: str) -> KeyInfo | None:
    """Parse a state-dict key of an HF model (or a peft-wrapped one); None outside the blocks."""
    for k, (rx, parts) in enumerate(_stack_regexes(arch)):
        m = rx.match(key)
        if m is None:
            continue
        hit = next((i for i in range(len(parts)) if m.group(f"p{i}") is not None), None)
        if hit is None:
            return KeyInfo(m.group("prefix"), int(m.group("layer")), m.group("rest"), None, None, k)
        part, family = parts[hit]
        leaf = m.group("leaf")
        adapter = adapter_owning(leaf)
        return KeyInfo(m.group("prefix"), int(m.group("layer")), m.group("rest"), part,
                       _axis(part, leaf, arch.layout, adapter), k, family, leaf,
                       None if adapter is None else adapter.name)
    return None


def sliceable_keys(arch: ArchSpec, keys: Iterable[str]) -> list[str]:
    """The keys of tensors of sliceable parts (the ones a permutation or slice touches)."""
    out = []
    for k in keys:
        info = key_info(arch, k)
        if info is not None and info.part is not None:
            out.append(k)
    return out
