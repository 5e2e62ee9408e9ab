"""Sub-models as explicit index maps: the slice spec (:class:`SliceSpec`, :class:`ModelSlice`).

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
  the stack's bias (:class:`~fedslice.slicing.surgery.SharedBiasColumns`), so layers may keep different heads, or none;
* a depth spec keeps some layers (``layers``), renumbered 0.. in the sub-model;
* a kept layer may keep no head (head pruning ranked over all layers): its q/k/v are dropped, o
  keeps zero input columns, and the attention outputs o's bias only (:class:`~fedslice.slicing.surgery.NoHeadsAttention`);
* every other tensor (embeddings, LayerNorms, the o/ffn_out biases, the classifier) is whole.

Weights are ``(out, in)`` (``nn.Linear``) or ``(in, out)`` (GPT-2's ``Conv1D``): the table's
:attr:`~fedslice.models.arch.ArchSpec.layout` says which axis is which. An adapter's tensors
(LoRA ``A`` (r, in) and ``B`` (out, r)) are found by the adapter's ``prefix`` and sliced along
the axes the adapter declares (:meth:`fedslice.peft.Adapter.tensor_axes`), asked through
:mod:`fedslice.registry`: nothing here knows an adapter's tensor names.

The spec is used by three modules: :mod:`.keys` (where a state-dict key sits: stack, layer, part,
sliced axis), :mod:`.state` and :mod:`.surgery`. Server side, pure functions over state dicts
(:mod:`.state`)::

    sub = extract_state(state, spec, arch)                       # the client's tensors
    full, masks = scatter(sub, spec, arch, shapes)               # back in full shape + held-mask
    aggregate_deltas(state, [full...], [{k: n_c * masks[k]}...]) # slice aggregation

Client side, :func:`~fedslice.slicing.surgery.extract_model` builds a real smaller HF (or peft)
model that shares every unsliced module with the full model and holds copies of the sliced
tensors only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from fedslice.models.arch import ArchSpec

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

    def index_within(self, outer: SliceSpec, sub_layer: int, kind: str, family: int = 0) -> torch.Tensor:
        """:meth:`index` read inside the sub-model of ``outer``: the positions of this slice's
        rows along the sliced axis among ``outer``'s (both in full-model indices; this slice keeps
        ``outer``'s layers and a part of its units). A slice of a sub-model is decided once, in
        full-model indices: under grouped-query attention a sub-model's key/value heads need not
        come in equal blocks of its query heads (RaFFM keeps 3 + 1 query heads of two groups of
        SmolLM2's 3), so its own head positions do not say which key/value heads they read."""
        if self.layers != outer.layers:
            raise ValueError(f"a slice of layers {self.layers} inside one of layers {outer.layers}")
        where = {int(r): p for p, r in enumerate(outer.index(sub_layer, kind, family))}
        rows = self.index(sub_layer, kind, family)
        if missing := [int(r) for r in rows if int(r) not in where]:
            raise ValueError(f"layer {self.layers[sub_layer]}: {kind} rows {missing[:4]} are "
                             "outside the sub-model's slice")
        return torch.tensor([where[int(r)] for r in rows], dtype=torch.long)

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


def kept_rows(s: SliceSpec, outer: SliceSpec | None, sub_layer: int, kind: str,
              family: int = 0) -> torch.Tensor | None:
    """The rows of ``s`` along a sliced axis of ``sub_layer`` of the model that holds them: the
    full model (``outer`` None: :meth:`SliceSpec.index`) or the sub-model of ``outer``
    (:meth:`SliceSpec.index_within`); None when it keeps them all."""
    if outer is None:
        return None if s.is_identity(sub_layer, kind, family) else s.index(sub_layer, kind, family)
    idx = s.index_within(outer, sub_layer, kind, family)
    whole = torch.arange(len(outer.index(sub_layer, kind, family)))
    return None if torch.equal(idx, whole) else idx


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


def check_forward(arch: ArchSpec, s: SliceSpec) -> None:
    """What a sub-model's forward pass needs beyond a valid slice of the state."""
    if arch.head_bias is not None and s.layers[0] != 0:
        # one relative-bias table in the first block, read by every layer of the stack
        raise ValueError(f"{arch.model_type} keeps its relative-position bias in the first block "
                         f"of a stack: a sub-model keeps layer 0 (layers {s.layers})")


def expand_heads(heads: Sequence[int], head_dim: int) -> torch.Tensor:
    """Head indices -> row indices: head h is rows h*head_dim:(h+1)*head_dim (boundaries kept)."""
    h = torch.as_tensor(list(heads), dtype=torch.long)
    return (h[:, None] * head_dim + torch.arange(head_dim)).reshape(-1)  # (len(heads) * head_dim,)
