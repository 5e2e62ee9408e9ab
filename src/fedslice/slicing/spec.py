"""Sub-models as explicit index maps: ``SliceSpec``, ``extract_state``, ``scatter``, ``extract_model``.

A :class:`SliceSpec` says, for every kept layer of the full model, which attention heads and which
FFN neurons the sub-model keeps (indices into the full model, in sub-model order). Everything else
follows from the architecture table:

* heads are whole blocks of ``head_dim`` rows of q/k/v (weights, biases, LoRA ``B``) and the same
  block of columns of o (weight, LoRA ``A``): head h is rows ``h*head_dim:(h+1)*head_dim``, so head
  boundaries never shift (the RaFFM public code slices single query rows);
* FFN neuron j is row j of ``ffn_in`` (weight, bias, LoRA ``B``) and column j of ``ffn_out``
  (weight, LoRA ``A``);
* a depth spec keeps some layers (``layers``), renumbered 0.. in the sub-model;
* a kept layer may keep no head (head pruning ranked over all layers): its q/k/v are dropped, o
  keeps zero input columns, and the attention outputs o's bias only (:class:`NoHeadsAttention`);
* every other tensor (embeddings, LayerNorms, the o/ffn_out biases, the classifier) is whole.

Server side, pure functions over state dicts::

    sub = extract_state(state, spec, arch)                       # the client's tensors
    full, masks = scatter(sub, spec, arch, shapes)               # back in full shape + held-mask
    aggregate_deltas(state, [full...], [{k: n_c * masks[k]}...]) # slice aggregation

Client side, :func:`extract_model` builds a real smaller HF (or peft) model that shares every
unsliced module with the full model and holds copies of the sliced tensors only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from fedslice.models.arch import ArchSpec

State = dict[str, torch.Tensor]

#: Parts whose *outputs* are heads / neurons (rows are sliced) and parts whose *inputs* are.
OUT_PARTS = ("q", "k", "v", "ffn_in")
IN_PARTS = ("o", "ffn_out")
HEAD_PARTS = ("q", "k", "v", "o")
QKV_PARTS = ("q", "k", "v")


# --------------------------------------------------------------------------------------------
# The spec
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SliceSpec:
    """Kept layers, and per kept layer the kept heads and FFN neurons (indices into the full model).

    ``heads[j]``/``neurons[j]`` belong to the full layer ``layers[j]``; the order of the indices is
    the order in the sub-model. Full-model sizes are kept for validation and index expansion.
    """

    layers: tuple[int, ...]
    heads: tuple[tuple[int, ...], ...]
    neurons: tuple[tuple[int, ...], ...]
    num_layers: int
    num_heads: int
    head_dim: int
    ffn: int

    def __post_init__(self):
        if not self.layers:
            raise ValueError("a SliceSpec keeps at least one layer")
        if len(self.heads) != len(self.layers) or len(self.neurons) != len(self.layers):
            raise ValueError("heads and neurons need one entry per kept layer")
        if len(set(self.layers)) != len(self.layers) or not all(0 <= i < self.num_layers for i in self.layers):
            raise ValueError(f"layers {self.layers} must be distinct indices < {self.num_layers}")
        for i, h, f in zip(self.layers, self.heads, self.neurons):
            # HF infers the head count from the projection width (view(..., -1, head_dim)), so a
            # layer without heads gets a different attention module (NoHeadsAttention), not a slice.
            if len(set(h)) != len(h) or not all(0 <= x < self.num_heads for x in h):
                raise ValueError(f"layer {i}: heads {h} must be distinct indices < {self.num_heads}")
            if not f or len(set(f)) != len(f) or not all(0 <= x < self.ffn for x in f):
                raise ValueError(f"layer {i}: neurons must be 1+ distinct indices < {self.ffn}")

    # -- constructors ----------------------------------------------------------------------
    @classmethod
    def full(cls, dims: Mapping[str, int]) -> SliceSpec:
        return cls.leading(dims, dims["num_heads"], dims["ffn"])

    @classmethod
    def leading(cls, dims: Mapping[str, int], heads: int | Sequence[int], ffn: int | Sequence[int],
                layers: Sequence[int] | None = None) -> SliceSpec:
        """The leading ``heads`` heads and ``ffn`` neurons of each kept layer (salience order)."""
        layers = tuple(range(dims["num_layers"])) if layers is None else tuple(layers)
        hs = [heads] * len(layers) if isinstance(heads, int) else list(heads)
        fs = [ffn] * len(layers) if isinstance(ffn, int) else list(ffn)
        return cls(layers, tuple(tuple(range(h)) for h in hs), tuple(tuple(range(f)) for f in fs),
                   dims["num_layers"], dims["num_heads"], dims["head_dim"], dims["ffn"])

    # -- JSON (payload config) ---------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"layers": list(self.layers), "heads": [list(h) for h in self.heads],
                "neurons": [list(f) for f in self.neurons], "num_layers": self.num_layers,
                "num_heads": self.num_heads, "head_dim": self.head_dim, "ffn": self.ffn}

    @classmethod
    def from_dict(cls, d: Mapping) -> SliceSpec:
        return cls(tuple(d["layers"]), tuple(tuple(h) for h in d["heads"]),
                   tuple(tuple(f) for f in d["neurons"]), d["num_layers"], d["num_heads"],
                   d["head_dim"], d["ffn"])

    # -- queries ---------------------------------------------------------------------------
    @property
    def is_full(self) -> bool:
        return (self.layers == tuple(range(self.num_layers))
                and all(h == tuple(range(self.num_heads)) for h in self.heads)
                and all(f == tuple(range(self.ffn)) for f in self.neurons))

    def describe(self) -> dict:
        """Sizes per kept layer (for logs and summaries)."""
        return {"layers": list(self.layers), "heads": [len(h) for h in self.heads],
                "ffn": [len(f) for f in self.neurons]}

    def sub_layer(self, full_layer: int) -> int | None:
        return self.layers.index(full_layer) if full_layer in self.layers else None

    def index(self, sub_layer: int, kind: str) -> torch.Tensor:
        """Full-model indices along a sliced axis of sub-layer ``sub_layer``: head indices expanded
        to their ``head_dim`` rows (``kind='heads'``) or neuron indices (``kind='ffn'``)."""
        if kind == "heads":
            return expand_heads(self.heads[sub_layer], self.head_dim)
        return torch.tensor(self.neurons[sub_layer], dtype=torch.long)

    def no_heads(self, sub_layer: int) -> bool:
        """True if the layer keeps no attention head (its attention is skipped)."""
        return not self.heads[sub_layer]

    def is_identity(self, sub_layer: int, kind: str) -> bool:
        if kind == "heads":
            return self.heads[sub_layer] == tuple(range(self.num_heads))
        return self.neurons[sub_layer] == tuple(range(self.ffn))


def expand_heads(heads: Sequence[int], head_dim: int) -> torch.Tensor:
    """Head indices -> row indices: head h is rows h*head_dim:(h+1)*head_dim (boundaries kept)."""
    h = torch.as_tensor(list(heads), dtype=torch.long)
    return (h[:, None] * head_dim + torch.arange(head_dim)).reshape(-1)  # (len(heads) * head_dim,)


# --------------------------------------------------------------------------------------------
# State-dict keys -> (layer, part, sliced axis)
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KeyInfo:
    """Where a state-dict key sits: its layer, and for a sliceable tensor the axis and kind."""

    prefix: str  # up to and including the layer list, e.g. 'base_model.model.bert.encoder.layer'
    layer: int
    rest: str  # inside the block, e.g. 'attention.self.query.lora_B.default.weight'
    part: str | None  # q/k/v/o/ffn_in/ffn_out, or None (LayerNorm inside a block, ...)
    axis: int | None  # axis indexed by heads/neurons, or None (tensor kept whole)

    @property
    def kind(self) -> str | None:
        if self.axis is None:
            return None
        return "heads" if self.part in HEAD_PARTS else "ffn"

    def renamed(self, layer: int) -> str:
        return f"{self.prefix}.{layer}.{self.rest}"


_REGEX: dict[tuple, re.Pattern] = {}


def _key_regex(arch: ArchSpec) -> re.Pattern:
    cache_key = (arch.layers, tuple(sorted(arch.parts.items())))
    if cache_key not in _REGEX:
        _REGEX[cache_key] = _build_regex(arch)
    return _REGEX[cache_key]


def _build_regex(arch: ArchSpec) -> re.Pattern:
    parts = sorted(arch.parts.items(), key=lambda kv: -len(kv[1]))
    alts = "|".join(f"(?P<{p}>{re.escape(path)})" for p, path in parts)
    return re.compile(rf"^(?P<prefix>(?:.*\.)?{re.escape(arch.layers)})\.(?P<layer>\d+)\."
                      rf"(?P<rest>(?:(?:{alts})\.)?(?P<leaf>.+))$")


def _axis(part: str, leaf: str) -> int | None:
    """The sliced axis of a tensor of ``part`` named ``leaf`` ('weight', 'bias',
    'base_layer.weight', 'lora_A.default.weight', ...); None if it is kept whole."""
    last = leaf.rsplit(".", 1)[-1]
    if "lora_A" in leaf:
        out_axis, in_axis = None, 1  # (r, in)
    elif "lora_B" in leaf:
        out_axis, in_axis = 0, None  # (out, r)
    elif last == "weight":
        out_axis, in_axis = 0, 1  # nn.Linear (out, in)
    elif last == "bias":
        out_axis, in_axis = 0, None
    else:
        raise ValueError(f"cannot slice tensor {leaf!r} of part {part!r} (unknown kind)")
    return out_axis if part in OUT_PARTS else in_axis


def key_info(arch: ArchSpec, key: str) -> KeyInfo | None:
    """Parse a state-dict key of an HF model (or a peft-wrapped one); None outside the blocks."""
    m = _key_regex(arch).match(key)
    if m is None:
        return None
    part = next((p for p in arch.parts if m.group(p) is not None), None)
    axis = _axis(part, m.group("leaf")) if part is not None else None
    return KeyInfo(m.group("prefix"), int(m.group("layer")), m.group("rest"), part, axis)


def sliceable_keys(arch: ArchSpec, keys: Iterable[str]) -> list[str]:
    """The keys of tensors of q/k/v/o/ffn_in/ffn_out (the ones a permutation or slice touches)."""
    out = []
    for k in keys:
        info = key_info(arch, k)
        if info is not None and info.part is not None:
            out.append(k)
    return out


# --------------------------------------------------------------------------------------------
# Extract / scatter (pure, over state dicts)
# --------------------------------------------------------------------------------------------

def extract_state(state: Mapping[str, torch.Tensor], spec: SliceSpec, arch: ArchSpec) -> State:
    """The sub-model's tensors: sliced copies for sliced tensors, the same tensor objects otherwise
    (never a copy of a whole tensor). Keys of dropped layers are left out, kept layers renumbered;
    so are the q/k/v tensors of a layer that keeps no head."""
    out: State = {}
    for key, t in state.items():
        info = key_info(arch, key)
        if info is None:
            out[key] = t
            continue
        j = spec.sub_layer(info.layer)
        if j is None or (info.part in QKV_PARTS and spec.no_heads(j)):
            continue
        if info.axis is not None and not spec.is_identity(j, info.kind):
            t = t.index_select(info.axis, spec.index(j, info.kind))
        out[info.renamed(j)] = t
    return out


def scatter(sub_state: Mapping[str, torch.Tensor], spec: SliceSpec, arch: ArchSpec,
            full_shapes: Mapping[str, torch.Size]) -> tuple[State, dict[str, torch.Tensor]]:
    """Sub-model tensors -> full-shape tensors (zeros where not held) and per-key masks.

    A mask is 1 where the client holds the element, 0 elsewhere, shaped to broadcast against the
    full tensor (e.g. ``(out, 1)`` for a row slice), so ``num_examples * mask`` is the client's
    weight for :func:`fedslice.slicing.aggregate.aggregate_deltas`.
    """
    full: State = {}
    masks: dict[str, torch.Tensor] = {}
    for key, t in sub_state.items():
        info = key_info(arch, key)
        if info is None:
            full[key], masks[key] = t, torch.ones(())
            continue
        j = info.layer
        full_key = info.renamed(spec.layers[j])
        shape = full_shapes[full_key]
        if info.axis is None or spec.is_identity(j, info.kind):
            full[full_key], masks[full_key] = t, torch.ones(())
            continue
        idx = spec.index(j, info.kind)
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

def _clone(module: nn.Module) -> nn.Module:
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


def _slice_linear(lin: nn.Linear, idx: torch.Tensor, side: str) -> nn.Linear:
    """An ``nn.Linear`` keeping output rows (``side='out'``) or input columns (``side='in'``)."""
    new = _clone(lin)
    if side == "out":
        new.weight = _slice_param(lin.weight, 0, idx)  # (out', in)
        if lin.bias is not None:
            new.bias = _slice_param(lin.bias, 0, idx)  # (out',)
        new.out_features = len(idx)
    else:
        new.weight = _slice_param(lin.weight, 1, idx)  # (out, in')
        new.in_features = len(idx)
    return new


def _slice_part(module: nn.Module, idx: torch.Tensor, side: str) -> nn.Module:
    """Slice a part: a plain ``nn.Linear`` or a peft LoRA layer (``base_layer`` + ``lora_A``/``lora_B``).

    For an output slice LoRA ``B`` loses rows and ``A`` is shared; for an input slice ``A`` loses
    columns and ``B`` is shared.
    """
    if isinstance(module, nn.Linear) and not hasattr(module, "base_layer"):
        return _slice_linear(module, idx, side)
    if not hasattr(module, "base_layer"):
        raise TypeError(f"cannot slice {type(module).__name__}: expected nn.Linear or a peft LoRA layer")
    new = _clone(module)
    new.base_layer = _slice_part(module.base_layer, idx, side)
    sliced = "lora_B" if side == "out" else "lora_A"
    adapters = getattr(module, sliced)
    new_adapters = _clone(adapters)
    for name, lin in adapters.items():
        new_adapters._modules[name] = _slice_linear(lin, idx, side)
    setattr(new, sliced, new_adapters)
    setattr(new, "out_features" if side == "out" else "in_features", len(idx))
    return new


def _rebuild(module: nn.Module, path: str, replace: dict[str, nn.Module], lists: dict[str, list[int]],
             hooks: dict[str, dict]) -> nn.Module:
    """A copy of the module tree in which only ancestors of replaced modules are new objects."""
    if path in replace:
        return replace[path]
    if not any(p == path or p.startswith(path + ".") or not path for p in (*replace, *lists, *hooks)):
        return module  # untouched subtree: the same object
    new = _clone(module)
    keep = lists.get(path)
    children = list(module._modules.items())
    if keep is not None:  # the layer list of a depth spec: kept blocks, renumbered
        children = [(str(i), module._modules[str(i)]) for i in keep]
        new._modules = {}
        for j, (i, child) in enumerate(children):
            new._modules[str(j)] = _rebuild(child, _join(path, i), replace, lists, hooks)
    else:
        for name, child in children:
            if child is not None:
                new._modules[name] = _rebuild(child, _join(path, name), replace, lists, hooks)
    for attr, value in hooks.get(path, {}).items():
        setattr(new, attr, value)
    return new


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


class NoHeadsAttention(nn.Module):
    """The attention module of a layer that keeps no head: no q/k/v, an empty context.

    Returns ``(context, None)`` like HF attention modules: the context is ``(B, T, 0)``, or, when
    the output projection lives inside the attention module (DistilBERT's ``out_lin``), that
    projection applied to it (with zero input columns it outputs its bias). Outside (BERT's
    ``attention.output.dense``) the sliced o does the same. The projection keeps its name.
    """

    def __init__(self, out_name: str | None = None, out: nn.Module | None = None):
        super().__init__()
        self._out_name = out_name
        if out_name is not None:
            self.add_module(out_name, out)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        ctx = hidden_states.new_zeros(*hidden_states.shape[:-1], 0)  # (B, T, 0)
        if self._out_name is not None:
            ctx = getattr(self, self._out_name)(ctx)  # (B, T, d): o's bias
        return ctx, None


def _attention_path(arch: ArchSpec) -> str:
    return arch.parts["q"].rpartition(".")[0]


def extract_model(model: nn.Module, spec: SliceSpec, arch: ArchSpec) -> nn.Module:
    """A sub-model of ``model`` (HF or peft-wrapped) for ``spec``.

    Sliced q/k/v/o/ffn parts get new, smaller tensors copied from ``model``; every other module
    (embeddings, LayerNorms, classifier, parts kept whole) is the same object as in ``model``.
    Parameter names equal those of :func:`extract_state` on ``model``'s state dict. The attention
    modules' head-count attributes are set per layer (HF infers heads from the weights' width);
    the attention of a layer without heads becomes a :class:`NoHeadsAttention`.
    """
    names = {id(m): n for n, m in model.named_modules()}
    blocks = arch.blocks(model)
    replace: dict[str, nn.Module] = {}
    hooks: dict[str, dict] = {}
    for j, i in enumerate(spec.layers):
        sliced = {}
        for part in arch.parts:
            kind = "heads" if part in HEAD_PARTS else "ffn"
            if spec.is_identity(j, kind) or (part in QKV_PARTS and spec.no_heads(j)):
                continue
            module = arch.part(model, i, part)
            side = "out" if part in OUT_PARTS else "in"
            sliced[part] = replace[names[id(module)]] = _slice_part(module, spec.index(j, kind), side)
        attn_name = names[id(arch.attention(model, i))]
        if spec.no_heads(j):
            replace[attn_name] = _no_heads(arch, sliced["o"])
            continue
        n_heads = len(spec.heads[j])
        attrs = {arch.heads_attr: n_heads}
        if arch.heads_width_attr:
            attrs[arch.heads_width_attr] = n_heads * spec.head_dim
        hooks[attn_name] = attrs
    lists = {}
    if spec.layers != tuple(range(len(blocks))):
        lists[names[id(blocks)]] = list(spec.layers)
    return _rebuild(model, "", replace, lists, hooks)


def _no_heads(arch: ArchSpec, o: nn.Module) -> NoHeadsAttention:
    """The stub for a headless layer, hosting o when o lives inside the attention module."""
    attn = _attention_path(arch)
    inside = arch.parts["o"].startswith(attn + ".") if attn else True
    if not inside:
        return NoHeadsAttention()
    rel = arch.parts["o"][len(attn) + 1:] if attn else arch.parts["o"]
    if "." in rel:
        raise NotImplementedError(f"o at {arch.parts['o']!r} is nested in the attention module")
    return NoHeadsAttention(rel, o)
