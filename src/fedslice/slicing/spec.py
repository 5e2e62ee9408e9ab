"""Sub-models as explicit index maps: ``SliceSpec``, ``extract_state``, ``scatter``, ``extract_model``.

A :class:`SliceSpec` says, for every kept layer of one stack of blocks, which attention heads
(per attention family: ``heads`` for self-attention, ``cross`` for a decoder's cross-attention)
and which FFN neurons the sub-model keeps (indices into the full model, in sub-model order). A
model with two stacks (an encoder-decoder) is sliced by a :class:`ModelSlice` (one spec per
stack; ``None`` keeps a stack whole). Everything else follows from the architecture table:

* query head h is the block of ``head_dim`` rows ``h*head_dim:(h+1)*head_dim`` of q (weight,
  bias, LoRA ``B``) and the same block of columns of o (weight, LoRA ``A``), so head boundaries
  never shift (the RaFFM public code slices single query rows);
* key/value heads: without groups they follow the query heads; with grouped-query attention
  (``num_kv_heads`` < ``num_heads``) a key/value head is kept while any query head of its group
  is (:meth:`SliceSpec.kv_heads`), and the sub-model maps each kept query head to its group;
* a fused q|k|v projection (GPT-2's ``c_attn``) is sliced inside each of its three sections;
* FFN neuron j is row j of ``ffn_in`` (and of the ``gate`` of a gated FFN: SwiGLU, gated-GELU)
  and column j of ``ffn_out``;
* T5's relative-position bias table (one per stack, in its first block, read by every layer)
  has one column per head. When every layer of the stack keeps the same heads, the table is sliced
  with them; otherwise it is kept whole and each layer's attention reads its own heads' columns of
  the stack's bias (:class:`SharedBiasColumns`), so layers may keep different heads, or none;
* a depth spec keeps some layers (``layers``), renumbered 0.. in the sub-model;
* a kept layer may keep no head (head pruning ranked over all layers): its q/k/v are dropped, o
  keeps zero input columns, and the attention outputs o's bias only (:class:`NoHeadsAttention`);
* every other tensor (embeddings, LayerNorms, the o/ffn_out biases, the classifier) is whole.

Weights are ``(out, in)`` (``nn.Linear``) or ``(in, out)`` (GPT-2's ``Conv1D``): the table's
:attr:`~fedslice.models.arch.ArchSpec.layout` says which axis is which. An adapter's tensors
(LoRA ``A`` (r, in) and ``B`` (out, r)) are found by the adapter's ``prefix`` and sliced along
the axes the adapter declares (:meth:`fedslice.peft.Adapter.tensor_axes`), asked through
:mod:`fedslice.registry`: nothing here knows an adapter's tensor names.

Server side, pure functions over state dicts::

    sub = extract_state(state, spec, arch)                       # the client's tensors
    full, masks = scatter(sub, spec, arch, shapes)               # back in full shape + held-mask
    aggregate_deltas(state, [full...], [{k: n_c * masks[k]}...]) # slice aggregation

Client side, :func:`extract_model` builds a real smaller HF (or peft) model that shares every
unsliced module with the full model and holds copies of the sliced tensors only.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn as nn

from fedslice.models.arch import LINEAR, ArchSpec, Attention, Layout, module_at as _get
from fedslice.registry import adapter_of_module, adapter_owning

State = dict[str, torch.Tensor]
Index = tuple[tuple[int, ...], ...]

#: Parts whose *outputs* are heads / neurons (rows are sliced) and parts whose *inputs* are.
OUT_PARTS = ("q", "k", "v", "qkv", "ffn_in", "gate")
IN_PARTS = ("o", "ffn_out")
#: Parts indexed by attention heads (``qkv``: a fused q|k|v; ``bias``: T5's relative-bias table).
HEAD_PARTS = ("q", "k", "v", "qkv", "o", "bias")
QKV_PARTS = ("q", "k", "v", "qkv")
#: What indexes a part's sliced axis (see :meth:`SliceSpec.index`).
SLOTS = {"q": "heads", "o": "heads", "k": "kv", "v": "kv", "qkv": "qkv", "bias": "bias",
         "ffn_in": "ffn", "gate": "ffn", "ffn_out": "ffn"}


# --------------------------------------------------------------------------------------------
# The spec
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SliceSpec:
    """One stack's kept layers, and per kept layer the kept heads (self-attention; ``cross``:
    cross-attention) and FFN neurons (indices into the full model).

    ``heads[j]``/``cross[j]``/``neurons[j]`` belong to the full layer ``layers[j]``; the order of
    the indices is the order in the sub-model. ``num_kv_heads`` > 0 marks grouped-query
    attention (query head h reads key/value head ``h // (num_heads // num_kv_heads)``); 0 means
    one key/value head per query head. Full-model sizes are kept for validation and expansion.
    """

    layers: tuple[int, ...]
    heads: Index
    neurons: Index
    num_layers: int
    num_heads: int
    head_dim: int
    ffn: int
    num_kv_heads: int = 0
    cross: Index | None = None

    def __post_init__(self):
        if not self.layers:
            raise ValueError("a SliceSpec keeps at least one layer")
        if len(self.heads) != len(self.layers) or len(self.neurons) != len(self.layers):
            raise ValueError("heads and neurons need one entry per kept layer")
        if self.cross is not None and len(self.cross) != len(self.layers):
            raise ValueError("cross needs one entry per kept layer")
        if len(set(self.layers)) != len(self.layers) or not all(0 <= i < self.num_layers for i in self.layers):
            raise ValueError(f"layers {self.layers} must be distinct indices < {self.num_layers}")
        if self.num_kv_heads and (self.num_kv_heads >= self.num_heads or self.num_heads % self.num_kv_heads):
            raise ValueError(f"num_kv_heads {self.num_kv_heads} must divide num_heads {self.num_heads}"
                             f" (0: no groups)")
        for j, i in enumerate(self.layers):
            # HF infers the head count from the projection width (view(..., -1, head_dim)), so a
            # layer without heads gets a different attention module (NoHeadsAttention), not a slice.
            for what, h in (("heads", self.heads[j]), ("cross", self.cross[j] if self.cross else ())):
                if len(set(h)) != len(h) or not all(0 <= x < self.num_heads for x in h):
                    raise ValueError(f"layer {i}: {what} {h} must be distinct indices < {self.num_heads}")
            f = self.neurons[j]
            if not f or len(set(f)) != len(f) or not all(0 <= x < self.ffn for x in f):
                raise ValueError(f"layer {i}: neurons must be 1+ distinct indices < {self.ffn}")

    # -- constructors ----------------------------------------------------------------------
    @classmethod
    def full(cls, dims: Mapping[str, int]) -> SliceSpec:
        return cls.leading(dims, dims["num_heads"], dims["ffn"])

    @classmethod
    def leading(cls, dims: Mapping[str, int], heads: int | Sequence[int], ffn: int | Sequence[int],
                layers: Sequence[int] | None = None) -> SliceSpec:
        """The leading ``heads`` heads (of every attention family) and ``ffn`` neurons of each kept
        layer (salience order)."""
        layers = tuple(range(dims["num_layers"])) if layers is None else tuple(layers)
        hs = [heads] * len(layers) if isinstance(heads, int) else list(heads)
        fs = [ffn] * len(layers) if isinstance(ffn, int) else list(ffn)
        kept = tuple(tuple(range(h)) for h in hs)
        return cls(layers, kept, tuple(tuple(range(f)) for f in fs), dims["num_layers"],
                   dims["num_heads"], dims["head_dim"], dims["ffn"], kv_groups(dims),
                   kept if dims.get("families", 1) > 1 else None)

    def _replace_heads(self, heads: Sequence[int]) -> SliceSpec:
        """The same spec keeping ``heads`` (self-attention) in every kept layer."""
        return SliceSpec(self.layers, (tuple(heads),) * len(self.layers), self.neurons,
                         self.num_layers, self.num_heads, self.head_dim, self.ffn,
                         self.num_kv_heads, self.cross)

    # -- JSON (payload config) ---------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {"layers": list(self.layers), "heads": [list(h) for h in self.heads],
             "neurons": [list(f) for f in self.neurons], "num_layers": self.num_layers,
             "num_heads": self.num_heads, "head_dim": self.head_dim, "ffn": self.ffn}
        if self.num_kv_heads:
            d["num_kv_heads"] = self.num_kv_heads
        if self.cross is not None:
            d["cross"] = [list(h) for h in self.cross]
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> SliceSpec:
        cross = d.get("cross")
        return cls(tuple(d["layers"]), tuple(tuple(h) for h in d["heads"]),
                   tuple(tuple(f) for f in d["neurons"]), d["num_layers"], d["num_heads"],
                   d["head_dim"], d["ffn"], d.get("num_kv_heads", 0),
                   None if cross is None else tuple(tuple(h) for h in cross))

    # -- queries ---------------------------------------------------------------------------
    @property
    def is_full(self) -> bool:
        return (self.layers == tuple(range(self.num_layers))
                and all(self.is_identity(j, k, f) for j in range(len(self.layers))
                        for k, f in (("heads", 0), ("heads", 1), ("ffn", 0))))

    def describe(self) -> dict:
        """Sizes per kept layer (for logs and summaries)."""
        d = {"layers": list(self.layers), "heads": [len(h) for h in self.heads],
             "ffn": [len(f) for f in self.neurons]}
        if self.cross is not None:
            d["cross"] = [len(h) for h in self.cross]
        return d

    def sub_layer(self, full_layer: int) -> int | None:
        return self.layers.index(full_layer) if full_layer in self.layers else None

    def heads_of(self, sub_layer: int, family: int = 0) -> tuple[int, ...]:
        """Kept query heads of an attention family (0: self, 1: cross) of a kept layer."""
        if family == 0:
            return self.heads[sub_layer]
        return self.cross[sub_layer] if self.cross is not None else tuple(range(self.num_heads))

    @property
    def queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads if self.num_kv_heads else 1

    def kv_heads(self, sub_layer: int, family: int = 0) -> tuple[int, ...]:
        """Kept key/value heads: with groups, every group with a kept query head, in the order of
        its first kept query head; without, the query heads."""
        heads = self.heads_of(sub_layer, family)
        if family or not self.num_kv_heads:
            return heads
        return tuple(dict.fromkeys(h // self.queries_per_kv for h in heads))

    def index(self, sub_layer: int, kind: str, family: int = 0) -> torch.Tensor:
        """Full-model indices along a sliced axis of sub-layer ``sub_layer`` for ``kind``:
        'heads' (query heads -> their ``head_dim`` rows), 'kv' (key/value heads -> rows), 'qkv'
        (a fused q|k|v: the query-head rows in each of the three sections), 'bias' (head indices
        themselves: a table with one column per head) or 'ffn' (neurons)."""
        if kind == "ffn":
            return torch.tensor(self.neurons[sub_layer], dtype=torch.long)
        heads = self.heads_of(sub_layer, family)
        if kind == "bias":  # a per-stack table: sliced only when every layer keeps the same heads
            return torch.tensor(heads if self.same_heads else range(self.num_heads), dtype=torch.long)
        if kind == "kv":
            return expand_heads(self.kv_heads(sub_layer, family), self.head_dim)
        rows = expand_heads(heads, self.head_dim)
        if kind == "qkv":
            width = self.num_heads * self.head_dim
            return torch.cat([rows, rows + width, rows + 2 * width])
        return rows

    @property
    def same_heads(self) -> bool:
        """Every layer keeps the same (1+) self-attention heads and the same number of
        cross-attention heads: a stack-wide per-head table (T5's bias) can be sliced with them."""
        return (all(h == self.heads[0] for h in self.heads) and bool(self.heads[0])
                and (self.cross is None or len({len(h) for h in self.cross}) == 1))

    def no_heads(self, sub_layer: int, family: int = 0) -> bool:
        """True if the layer keeps no head of that family (its attention is skipped)."""
        return not self.heads_of(sub_layer, family)

    def is_identity(self, sub_layer: int, kind: str, family: int = 0) -> bool:
        if kind == "ffn":
            return self.neurons[sub_layer] == tuple(range(self.ffn))
        if kind == "kv":
            n = self.num_kv_heads if self.num_kv_heads and not family else self.num_heads
            return self.kv_heads(sub_layer, family) == tuple(range(n))
        return self.heads_of(sub_layer, family) == tuple(range(self.num_heads))


def kv_groups(dims: Mapping[str, int]) -> int:
    """``num_kv_heads`` of a SliceSpec for a stack's dims (0 when every query head has its own)."""
    kv = dims.get("num_kv_heads", dims["num_heads"])
    return 0 if kv == dims["num_heads"] else kv


@dataclass(frozen=True)
class ModelSlice:
    """One :class:`SliceSpec` per stack of a model (``None``: that stack is kept whole)."""

    stacks: tuple[SliceSpec | None, ...]

    @classmethod
    def full(cls, dims: Sequence[Mapping[str, int]]) -> ModelSlice:
        return cls(tuple(SliceSpec.full(d) for d in dims))

    @classmethod
    def leading(cls, dims: Sequence[Mapping[str, int]], width: float,
                layers: Sequence[Sequence[int] | None] | None = None) -> ModelSlice:
        """The leading ``round(width * H)`` heads and ``round(width * F)`` neurons of every layer
        of every stack (at least one of each)."""
        layers = layers or [None] * len(dims)
        return cls(tuple(SliceSpec.leading(d, max(1, round(width * d["num_heads"])),
                                           max(1, round(width * d["ffn"])), l)
                         for d, l in zip(dims, layers)))

    @property
    def is_full(self) -> bool:
        return all(s is None or s.is_full for s in self.stacks)

    def describe(self) -> dict:
        return {"stacks": [None if s is None else s.describe() for s in self.stacks]}

    def to_dict(self) -> dict:
        return {"stacks": [None if s is None else s.to_dict() for s in self.stacks]}


Spec = SliceSpec | ModelSlice


def spec_from_dict(d: Mapping) -> Spec:
    """A :class:`SliceSpec` or :class:`ModelSlice` from its ``to_dict``."""
    if "stacks" in d:
        return ModelSlice(tuple(None if s is None else SliceSpec.from_dict(s) for s in d["stacks"]))
    return SliceSpec.from_dict(d)


def stack_list(spec: Spec) -> tuple[SliceSpec | None, ...]:
    """The per-stack specs of ``spec`` (a bare SliceSpec is the first stack's)."""
    return spec.stacks if isinstance(spec, ModelSlice) else (spec,)


def spec_sizes(spec: Spec) -> dict[str, float]:
    """Mean kept heads and neurons per kept layer, and kept layers, over every sliced stack."""
    specs = [s for s in stack_list(spec) if s is not None]
    heads = [len(h) for s in specs for h in s.heads]
    ffn = [len(f) for s in specs for f in s.neurons]
    return {"heads_mean": sum(heads) / len(heads), "ffn_mean": sum(ffn) / len(ffn),
            "layers": len(heads)}


def stack_specs(spec: Spec, arch: ArchSpec) -> tuple[SliceSpec | None, ...]:
    """One entry per stack of ``arch`` (a bare SliceSpec slices the first stack only), checked
    against what the architecture allows."""
    specs = stack_list(spec)
    if len(specs) > len(arch.stacks):
        raise ValueError(f"{len(specs)} stack specs for a {arch.model_type} with {len(arch.stacks)} stack(s)")
    specs = tuple(specs) + (None,) * (len(arch.stacks) - len(specs))
    for k, s in enumerate(specs):
        if s is not None:
            _check_stack(arch, k, s)
    return specs


def _check_stack(arch: ArchSpec, k: int, s: SliceSpec) -> None:
    if len(arch.stacks[k].attention) < 2 and s.cross is not None:
        raise ValueError(f"stack {arch.stacks[k].name} of {arch.model_type} has no cross-attention")


def _check_forward(arch: ArchSpec, s: SliceSpec) -> None:
    """What a sub-model's forward pass needs beyond a valid slice of the state."""
    if arch.head_bias is not None and s.layers[0] != 0:
        # one relative-bias table in the first block, read by every layer of the stack
        raise ValueError(f"{arch.model_type} keeps its relative-position bias in the first block "
                         f"of a stack: a sub-model keeps layer 0 (layers {s.layers})")


def expand_heads(heads: Sequence[int], head_dim: int) -> torch.Tensor:
    """Head indices -> row indices: head h is rows h*head_dim:(h+1)*head_dim (boundaries kept)."""
    h = torch.as_tensor(list(heads), dtype=torch.long)
    return (h[:, None] * head_dim + torch.arange(head_dim)).reshape(-1)  # (len(heads) * head_dim,)


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


def _attention_parts(att: Attention) -> list[tuple[str, str]]:
    """(part, path) of an attention family: a fused q|k|v is one part 'qkv'."""
    qkv = [("qkv", att.q)] if att.fused_qkv else [("q", att.q), ("k", att.k), ("v", att.v)]
    return [*qkv, ("o", att.o)]


def block_parts(arch: ArchSpec, stack: int) -> list[tuple[str, int, str]]:
    """(part, family, path inside a block) of every sliceable part of a stack's blocks."""
    s = arch.stacks[stack]
    out = [(part, f, path) for f, att in enumerate(s.attention) for part, path in _attention_parts(att)]
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


# --------------------------------------------------------------------------------------------
# Extract / scatter (pure, over state dicts)
# --------------------------------------------------------------------------------------------

def _locate(specs, info: KeyInfo) -> tuple[SliceSpec | None, int | None]:
    """(the stack's spec, the sub-layer of the key) -- (None, None): the stack is kept whole."""
    s = specs[info.stack]
    return (None, None) if s is None else (s, s.sub_layer(info.layer))


def extract_state(state: Mapping[str, torch.Tensor], spec: Spec, arch: ArchSpec) -> State:
    """The sub-model's tensors: sliced copies for sliced tensors, the same tensor objects otherwise
    (never a copy of a whole tensor). Keys of dropped layers are left out, kept layers renumbered;
    so are the q/k/v tensors of an attention family that keeps no head in a layer."""
    specs = stack_specs(spec, arch)
    out: State = {}
    for key, t in state.items():
        info = key_info(arch, key)
        if info is None:
            out[key] = t
            continue
        s, j = _locate(specs, info)
        if s is None:
            out[key] = t
            continue
        if j is None or (info.part in QKV_PARTS and s.no_heads(j, info.family)):
            continue
        if info.axis is not None and not s.is_identity(j, info.kind, info.family):
            t = t.index_select(info.axis, s.index(j, info.kind, info.family))
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


# --------------------------------------------------------------------------------------------
# A real smaller model (module surgery, no copy of the full model)
# --------------------------------------------------------------------------------------------

def shallow_clone(module: nn.Module) -> nn.Module:
    """A new module object sharing every parameter, buffer and child of ``module``."""
    new = object.__new__(type(module))
    new.__dict__ = dict(module.__dict__)
    new._modules = dict(module._modules)
    new._parameters = dict(module._parameters)
    new._buffers = dict(module._buffers)
    return new


def _slice_param(p: nn.Parameter | None, axis: int | None, idx: torch.Tensor) -> nn.Parameter | None:
    if p is None:
        return None
    t = p.detach() if axis is None else p.detach().index_select(axis, idx)
    return nn.Parameter(t, requires_grad=p.requires_grad) if axis is not None else p


def _slice_linear(lin: nn.Module, idx: torch.Tensor, side: str, layout: Layout = LINEAR) -> nn.Module:
    """An ``nn.Linear`` (or a ``Conv1D``, ``layout=CONV1D``: weight (in, out)) keeping output
    rows (``side='out'``) or input columns (``side='in'``)."""
    new = shallow_clone(lin)
    new.weight = _slice_param(lin.weight, layout.out_axis if side == "out" else layout.in_axis, idx)
    if side == "out" and lin.bias is not None:
        new.bias = _slice_param(lin.bias, 0, idx)  # (out',)
    size = layout.out_attr if side == "out" else layout.in_attr
    if hasattr(lin, size):
        setattr(new, size, len(idx))
    return new


def _slice_part(module: nn.Module, idx: torch.Tensor, side: str, layout: Layout = LINEAR) -> nn.Module:
    """Slice a part: a plain linear map or an adapter's layer (peft: ``base_layer`` + the
    adapter's containers, e.g. LoRA's ``lora_A``/``lora_B``, DoRA's ``lora_magnitude_vector``,
    IA3's ``ia3_l``).

    Every tensor of the adapter with an axis along the sliced side
    (:meth:`fedslice.peft.Adapter.tensor_axes`: LoRA ``B`` rows and DoRA magnitudes for an output
    slice, LoRA ``A`` columns for an input slice, an IA3 vector on the side it scales) loses
    those entries; the others are shared.
    """
    if not hasattr(module, "base_layer"):
        if not hasattr(module, "weight"):
            raise TypeError(f"cannot slice {type(module).__name__}: expected a linear map or an "
                            "adapter's layer")
        return _slice_linear(module, idx, side, layout)
    adapter = adapter_of_module(module)
    if adapter is None:
        raise TypeError(f"cannot slice {type(module).__name__}: no registered adapter wraps it")
    new = shallow_clone(module)
    new.base_layer = _slice_part(module.base_layer, idx, side, layout)
    for attr in adapter.module_tensors:
        container = getattr(module, attr)
        sliced = _slice_container(container, attr, adapter, idx, side)
        if sliced is not container:
            setattr(new, attr, sliced)
    setattr(new, "out_features" if side == "out" else "in_features", len(idx))  # peft's sizes
    return new


def _side_axis(adapter, leaf: str, side: str) -> int | None:
    """The axis of the adapter's tensor ``leaf`` that follows the module's ``side``."""
    out_axis, in_axis = adapter.tensor_axes(leaf)
    return out_axis if side == "out" else in_axis


def _slice_container(container: nn.Module, attr: str, adapter, idx: torch.Tensor,
                     side: str) -> nn.Module:
    """An adapter container (a ModuleDict of sub-modules, or a ParameterDict) with the tensors
    that follow ``side`` sliced to ``idx``; the container itself when none does."""
    new = shallow_clone(container)
    changed = False
    for key, p in container._parameters.items():                  # ParameterDict (IA3)
        axis = _side_axis(adapter, f"{attr}.{key}", side)
        if p is not None and axis is not None:
            new._parameters[key] = _slice_param(p, axis, idx)
            changed = True
    for key, child in container._modules.items():                 # ModuleDict (LoRA, DoRA)
        new_child = shallow_clone(child)
        hit = False
        for pname, p in child._parameters.items():
            axis = _side_axis(adapter, f"{attr}.{key}.{pname}", side)
            if p is not None and axis is not None:
                new_child._parameters[pname] = _slice_param(p, axis, idx)
                hit = True
                size = "out_features" if side == "out" else "in_features"
                if hasattr(child, size):
                    setattr(new_child, size, len(idx))
        if hit:
            new._modules[key] = new_child
            changed = True
    return new if changed else container


def _slice_table(emb: nn.Embedding, idx: torch.Tensor) -> nn.Embedding:
    """A per-head table (T5's relative-position bias, (buckets, H)) keeping the columns ``idx``."""
    new = shallow_clone(emb)
    new.weight = _slice_param(emb.weight, 1, idx)
    new.embedding_dim = len(idx)
    return new


class _TakeRows:
    """A forward hook: the module's output keeps the features ``rows`` of its last axis."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def __call__(self, module, args, output):
        return output.index_select(-1, self.rows)


def _gather_out(module: nn.Module, rows: torch.Tensor) -> nn.Module:
    """A copy of ``module`` (sharing its tensors) whose output keeps ``rows`` of its last axis."""
    new = shallow_clone(module)
    for hooks in ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
        setattr(new, hooks, OrderedDict(getattr(module, hooks)))
    new.register_forward_hook(_TakeRows(rows))
    return new


def _kv_repeat(s: SliceSpec, j: int) -> int | None:
    """Grouped-query attention in a sub-model: the queries per key/value head when the kept query
    heads come in equal blocks, one per kept key/value head in its order (HF's ``repeat_kv``
    then maps them); None when they do not (each key/value head is then gathered per query)."""
    heads, kv = s.heads[j], s.kv_heads(j)
    if len(heads) % len(kv):
        return None
    m = len(heads) // len(kv)
    ok = all(kv.index(h // s.queries_per_kv) == p // m for p, h in enumerate(heads))
    return m if ok else None


def rebuild_tree(module: nn.Module, path: str, replace: dict[str, nn.Module], lists: dict[str, list[int]],
             hooks: dict[str, dict]) -> nn.Module:
    """A copy of the module tree in which only ancestors of replaced modules are new objects."""
    if path in replace:
        return replace[path]
    if not any(p == path or p.startswith(path + ".") or not path for p in (*replace, *lists, *hooks)):
        return module  # untouched subtree: the same object
    new = shallow_clone(module)
    keep = lists.get(path)
    children = list(module._modules.items())
    if keep is not None:  # the layer list of a depth spec: kept blocks, renumbered
        children = [(str(i), module._modules[str(i)]) for i in keep]
        new._modules = {}
        for j, (i, child) in enumerate(children):
            new._modules[str(j)] = rebuild_tree(child, _join(path, i), replace, lists, hooks)
    else:
        for name, child in children:
            if child is not None:
                new._modules[name] = rebuild_tree(child, _join(path, name), replace, lists, hooks)
    for attr, value in hooks.get(path, {}).items():
        setattr(new, attr, value)
    return new


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


class NoHeadsAttention(nn.Module):
    """The attention module of a layer that keeps no head: no q/k/v, an empty context.

    Returns ``(context, None)`` like HF attention modules: the context is ``(B, T, 0)``, or, when
    the output projection lives inside the attention module (DistilBERT's ``out_lin``, LLaMA's
    ``o_proj``), that projection applied to it (with zero input columns it outputs its bias, or
    zeros). Outside (BERT's ``attention.output.dense``) the sliced o does the same. The
    projection keeps its name. A ``Conv1D`` o (GPT-2's ``c_proj``, a transposed layout) cannot
    read a zero-width input: its bias (or zeros) is taken directly.
    """

    def __init__(self, out_name: str | None = None, out: nn.Module | None = None,
                 layout: Layout = LINEAR):
        super().__init__()
        self._out_name, self._layout = out_name, layout
        if out_name is not None:
            self.add_module(out_name, out)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        ctx = hidden_states.new_zeros(*hidden_states.shape[:-1], 0)  # (B, T, 0)
        if self._out_name is None:
            return ctx, None
        o = getattr(self, self._out_name)
        if not self._layout.transposed:
            return o(ctx), None  # (B, T, d): o's bias
        base = getattr(o, "base_layer", o)                            # Conv1D, weight (0, d)
        out = ctx.new_zeros(*ctx.shape[:-1], self._layout.out_features(base.weight))  # (B, T, d)
        return (out if base.bias is None else out + base.bias), None


class SharedBiasColumns:
    """Mixed into the attention class of a stack whose per-head position bias ``(1, H, T, K)`` is
    computed by the first layer (from the stack's table) and passed on to every layer (T5's
    relative-position bias; T5's cross-attention passes on a zero bias). In a sub-model whose
    layers keep different heads, the table stays whole: each layer adds its own heads' columns
    (``bias_columns``) to its scores and hands the whole bias on; a layer keeping no head outputs
    ``o`` of an empty context (zeros) and still hands the bias on.
    """

    stack_heads: int
    bias_columns: list[int]

    def forward(self, hidden_states, mask=None, key_value_states=None, position_bias=None,
                past_key_values=None, **kwargs):
        if position_bias is None:
            position_bias = self._stack_bias(hidden_states, key_value_states, past_key_values)
        if not self.bias_columns:
            ctx = hidden_states.new_zeros(*hidden_states.shape[:-1], 0)  # (B, T, 0)
            return self.o(ctx), position_bias, None
        out, _, weights = super().forward(hidden_states, mask, key_value_states,
                                          position_bias[:, self.bias_columns], past_key_values, **kwargs)
        return out, position_bias, weights                                # bias: (1, H, T, K)

    def _stack_bias(self, hidden_states, key_value_states, past_key_values) -> torch.Tensor:
        """The whole stack's bias, as the first layer computes it (before its cache update)."""
        T = hidden_states.shape[1]
        past = 0 if past_key_values is None or key_value_states is not None else \
            int(past_key_values.get_seq_length(self.layer_idx))
        K = key_value_states.shape[1] if key_value_states is not None else past + T
        if self.has_relative_attention_bias:
            return self.compute_bias(T, K, device=hidden_states.device, past_seen_tokens=past)
        return hidden_states.new_zeros(1, self.stack_heads, T, K)         # (1, H, T, K)


@lru_cache(maxsize=None)
def _shared_bias_class(cls: type) -> type:
    return type(f"SharedBias{cls.__name__}", (SharedBiasColumns, cls), {})


def _no_heads(att: Attention, o: nn.Module, layout: Layout = LINEAR) -> NoHeadsAttention:
    """The stub for a headless attention, hosting o when o lives inside the attention module."""
    parent = att.module
    if parent and not att.o.startswith(parent + "."):
        return NoHeadsAttention()
    rel = att.o[len(parent) + 1:] if parent else att.o
    if "." in rel:
        raise NotImplementedError(f"o at {att.o!r} is nested in the attention module")
    return NoHeadsAttention(rel, o, layout)


def extract_model(model: nn.Module, spec: Spec, arch: ArchSpec) -> nn.Module:
    """A sub-model of ``model`` (HF or peft-wrapped) for ``spec``.

    Sliced parts get new, smaller tensors copied from ``model``; every other module (embeddings,
    LayerNorms, classifier, parts kept whole) is the same object as in ``model``. Parameter names
    equal those of :func:`extract_state` on ``model``'s state dict. The attention modules'
    head-count attributes are set per layer (HF infers heads from the weights' width); the
    attention of a layer without heads becomes a :class:`NoHeadsAttention` (in a stack with a
    per-head bias table whose layers keep different heads, every attention becomes a
    :class:`SharedBiasColumns` instead, without q/k/v where it keeps no head); renumbered layers
    get their new ``layer_idx`` (key/value caches are indexed by it).
    """
    specs = stack_specs(spec, arch)
    names = {id(m): n for n, m in model.named_modules()}
    replace: dict[str, nn.Module] = {}
    hooks: dict[str, dict] = {}
    lists: dict[str, list[int]] = {}
    layout = arch.layout
    for k, s in enumerate(specs):
        if s is None:
            continue
        _check_forward(arch, s)
        stack, blocks = arch.stacks[k], arch.blocks(model, k)
        depth = s.layers != tuple(range(len(blocks)))
        # layers keep different heads under a stack-wide bias: each reads its own columns
        columns = arch.head_bias is not None and not s.same_heads
        for j, i in enumerate(s.layers):
            block = blocks[i]

            def cut(path: str, kind: str, side: str, family: int = 0) -> nn.Module:
                mod = _get(block, path)
                new = replace[names[id(mod)]] = _slice_part(mod, s.index(j, kind, family), side, layout)
                return new

            for f, att in enumerate(stack.attention):
                attn = _get(block, att.module) if att.module else block
                attn_name = names[id(attn)]
                o = _get(block, att.o)
                if not s.is_identity(j, "heads", f):
                    o = cut(att.o, "heads", "in", f)
                if s.no_heads(j, f) and not columns:
                    replace[attn_name] = _no_heads(att, o, layout)
                    continue
                for part, path in _attention_parts(att)[:-1]:
                    if s.no_heads(j, f):  # a headless SharedBiasColumns reads no q/k/v
                        replace[names[id(_get(block, path))]] = None
                    elif not s.is_identity(j, SLOTS[part], f):
                        cut(path, SLOTS[part], "out", f)
                attrs: dict = {}
                if not s.is_identity(j, "heads", f):
                    n = len(s.heads_of(j, f))
                    if arch.heads_attr:
                        attrs[arch.heads_attr] = n
                    if arch.heads_width_attr:
                        attrs[arch.heads_width_attr] = n * s.head_dim
                    if f == 0 and s.num_kv_heads:
                        attrs.update(_group_queries(s, j, block, att, names, replace))
                if columns:
                    attrs.update(__class__=_shared_bias_class(type(attn)), stack_heads=s.num_heads,
                                 bias_columns=list(s.heads_of(j, f)))
                if depth and hasattr(attn, "layer_idx"):
                    attrs["layer_idx"] = j
                if attrs:
                    hooks[attn_name] = attrs
            if arch.head_bias and s.layers[j] == 0 and not s.is_identity(j, "heads") and not columns:
                table = _get(block, arch.head_bias)
                replace[names[id(table)]] = _slice_table(table, s.index(j, "bias"))
            if not s.is_identity(j, "ffn"):
                for path, side in ((stack.ffn.gate, "out"), (stack.ffn.ffn_in, "out"),
                                   (stack.ffn.ffn_out, "in")):
                    if path:
                        cut(path, "ffn", side)
        if depth:
            lists[names[id(blocks)]] = list(s.layers)
    return rebuild_tree(model, "", replace, lists, hooks)


def _group_queries(s: SliceSpec, j: int, block: nn.Module, att: Attention, names: dict,
                   replace: dict[str, nn.Module]) -> dict:
    """The attention attributes (and k/v output gathers) mapping a sub-model's kept query heads
    to their key/value heads under grouped-query attention."""
    m = _kv_repeat(s, j)
    if m is not None:
        return {"num_key_value_groups": m}
    kv = s.kv_heads(j)
    rows = expand_heads([kv.index(h // s.queries_per_kv) for h in s.heads[j]], s.head_dim)
    for path in (att.k, att.v):
        name = names[id(_get(block, path))]
        replace[name] = _gather_out(replace.get(name, _get(block, path)), rows)
    return {"num_key_value_groups": 1}
