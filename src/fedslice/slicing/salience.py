"""L1 / L2 salience of attention heads and FFN neurons, per stack and layer, from a state dict.

Query head h of an attention family is the group of rows ``h*head_dim:(h+1)*head_dim`` of W_q
and the same columns of W_o, plus its key/value rows: its own rows of W_k and W_v, or under
grouped-query attention a ``1/g`` share of its group's (g query heads per key/value head), so a
group's salience is the sum of its query heads'. A fused q|k|v (GPT-2) is split into its three
sections first. Salience is the norm of that whole group (L1: sum of |w|; L2: sqrt of the sum of
w^2). FFN neuron j is row j of W_in (and of the gate of a gated FFN) and column j of W_out.
Biases are not counted. A block that scales its attention / FFN output per channel (DINOv2's
LayerScale) is scored with the effective ``diag(scale) W_o`` / ``diag(scale) W_out`` (when the
scales are in the state). With an adapter's tensors in the state, the effective weight is scored
(:meth:`~fedslice.peft.Adapter.effective_weight`: LoRA's ``W + scale * B @ A`` with
``adapter_scale`` = alpha / r, DoRA's normalised and magnitude-scaled weight, IA3's scaled rows
or columns); without a scale, LoRA's base weight.

:func:`salience_order` turns salience into a function-preserving :class:`Permutation`: under
grouped-query attention groups are ordered by salience and query heads within their group; T5
stacks (one relative-bias table for every layer) get one head order per stack, by salience
summed over the layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from fedslice.models.arch import ArchSpec
from fedslice.registry import adapter_owning
from fedslice.slicing.permute import Permutation
from fedslice.slicing.keys import key_info
from fedslice.slicing.spec import SliceSpec, kv_groups


@dataclass
class LayerSalience:
    heads: torch.Tensor  # (H,) self-attention query heads
    neurons: torch.Tensor  # (F,)
    cross: torch.Tensor | None = None  # (H,) cross-attention heads of a decoder block


def layer_scales(state: Mapping[str, torch.Tensor], arch: ArchSpec
                 ) -> dict[tuple[int, int, str], torch.Tensor]:
    """(stack, layer, 'o' or 'ffn_out') -> the per-channel scale a block multiplies that output
    by (DINOv2's LayerScale: ``Stack.layer_scale``), for the scales present in ``state``."""
    out = {}
    for key, t in state.items():
        info = key_info(arch, key)
        scale = arch.stacks[info.stack].layer_scale if info is not None and info.part is None else None
        if scale and info.rest in scale:
            out[(info.stack, info.layer, ("o", "ffn_out")[scale.index(info.rest)])] = t.float()
    return out


def scale_tensors(model, arch: ArchSpec) -> dict[str, torch.Tensor]:
    """The layer-scale parameters of ``model`` by name (empty without ``Stack.layer_scale``)."""
    if not any(s.layer_scale for s in arch.stacks):
        return {}
    state = dict(model.named_parameters())
    keep = {k for k in state if (info := key_info(arch, k)) is not None and info.part is None
            and arch.stacks[info.stack].layer_scale and info.rest in arch.stacks[info.stack].layer_scale}
    return {k: state[k].detach() for k in keep}


def part_weights(state: Mapping[str, torch.Tensor], arch: ArchSpec,
                 adapter_scale: float | None = None) -> dict[tuple[int, int, str, int], torch.Tensor]:
    """(stack, layer, part, family) -> the effective (out, in) weight of that part, float32;
    an output projection followed by a layer scale: ``diag(scale) W``."""
    found: dict[tuple, dict[str, torch.Tensor]] = {}
    adapters: dict[tuple, tuple[type, dict[str, torch.Tensor]]] = {}
    scales = layer_scales(state, arch)
    for key, t in state.items():
        info = key_info(arch, key)
        if info is None or info.part is None or info.part == "bias":
            continue
        where = (info.stack, info.layer, info.part, info.family)
        if info.adapter is not None:  # the adapter's tensors, by their name inside the part
            owner = adapter_owning(info.leaf)
            adapters.setdefault(where, (owner, {}))[1][_adapter_leaf(info.leaf, owner)] = t
        elif info.leaf.rsplit(".", 1)[-1] == "weight":
            found.setdefault(where, {})["W"] = t.float()
    out = {}
    for where, w in found.items():
        W = arch.layout.as_linear(w["W"])  # (out, in)
        if where in adapters:  # LoRA: W + scale B A; DoRA, IA3: their own effective weight
            owner, tensors = adapters[where]
            W = owner.effective_weight(W, tensors, adapter_scale)
        scale = scales.get(where[:3]) if where[3] == 0 else None
        out[where] = W if scale is None else scale[:, None] * W  # (out, in)
    missing = set(adapters) - set(found)
    if missing:
        where = min(missing)
        raise KeyError(f"no weight for stack {where[0]} layer {where[1]} part {where[2]} in the state")
    return out


def _adapter_leaf(leaf: str, owner) -> str:
    """The adapter's tensor name from its first own segment on: 'lora_A.default.weight'."""
    parts = leaf.split(".")
    start = next(i for i, s in enumerate(parts) if owner.owns(s))
    return ".".join(parts[start:])


def _head_scores(W, k: int, l: int, f: int, dims: Mapping[str, int], elem) -> torch.Tensor:
    """(H,) summed element norms of every query head of one attention family (see module doc)."""
    H, hd = dims["num_heads"], dims["head_dim"]
    if (k, l, "qkv", f) in W:
        q, kk, v = W[k, l, "qkv", f].split(H * hd)  # (H*hd, in) each
    else:
        q, kk, v = (W[k, l, p, f] for p in ("q", "k", "v"))
    g = H // (kv_groups(dims) or H) if f == 0 else 1
    own = elem(q).sum(1) + elem(W[k, l, "o", f]).sum(0)  # (H*hd,)
    kv = (elem(kk).sum(1) + elem(v).sum(1)).view(-1, hd).sum(1)  # (KV,)
    return own.view(H, hd).sum(1) + kv.repeat_interleave(g) / g  # (H,)


def salience(state: Mapping[str, torch.Tensor], arch: ArchSpec, dims: Mapping[str, int],
             norm: str = "l1", adapter_scale: float | None = None, stack: int = 0) -> list[LayerSalience]:
    """Salience of every head and FFN neuron of every layer of one stack (see module doc)."""
    if norm not in ("l1", "l2"):
        raise ValueError(f"norm must be 'l1' or 'l2', got {norm!r}")
    W = part_weights(state, arch, adapter_scale)
    elem = torch.abs if norm == "l1" else torch.square
    finish = (lambda x: x) if norm == "l1" else torch.sqrt
    families = len(arch.stacks[stack].attention)
    out = []
    for l in range(dims["num_layers"]):
        heads = [finish(_head_scores(W, stack, l, f, dims, elem)) for f in range(families)]
        neurons = elem(W[stack, l, "ffn_in", 0]).sum(1) + elem(W[stack, l, "ffn_out", 0]).sum(0)
        if (stack, l, "gate", 0) in W:
            neurons = neurons + elem(W[stack, l, "gate", 0]).sum(1)
        out.append(LayerSalience(heads[0], finish(neurons), heads[1] if families > 1 else None))
    return out


def model_salience(state: Mapping[str, torch.Tensor], arch: ArchSpec,
                   dims: Sequence[Mapping[str, int]], norm: str = "l1",
                   adapter_scale: float | None = None) -> list[list[LayerSalience]]:
    """:func:`salience` of every stack."""
    return [salience(state, arch, d, norm, adapter_scale, k) for k, d in enumerate(dims)]


def _desc(x: torch.Tensor) -> list[int]:
    return torch.argsort(x, descending=True, stable=True).tolist()


def _grouped_desc(x: torch.Tensor, g: int) -> list[int]:
    """Most salient first, moving query heads only within their group of ``g`` and groups whole."""
    if g == 1:
        return _desc(x)
    groups = x.view(-1, g)  # (KV, g)
    return [grp * g + i for grp in _desc(groups.sum(1)) for i in _desc(groups[grp])]


def stack_order(sal: list[LayerSalience], dims: Mapping[str, int], shared_heads: bool = False
                ) -> SliceSpec:
    """The full-size spec (a permutation) that puts one stack's most salient units first (stable
    on ties); ``shared_heads``: one self-attention head order for every layer (T5)."""
    g = dims["num_heads"] // (kv_groups(dims) or dims["num_heads"])
    if shared_heads:
        order = _grouped_desc(sum(s.heads for s in sal), g)
        heads = [order] * len(sal)
    else:
        heads = [_grouped_desc(s.heads, g) for s in sal]
    cross = [_desc(s.cross) for s in sal] if sal[0].cross is not None else None
    n = len(sal)
    tup = lambda orders: tuple(tuple(o) for o in orders)  # noqa: E731
    return SliceSpec(tuple(range(n)), tup(heads), tup(_desc(s.neurons) for s in sal), n,
                     dims["num_heads"], dims["head_dim"], dims["ffn"], kv_groups(dims),
                     None if cross is None else tup(cross))


def salience_order(sal: list[LayerSalience] | list[list[LayerSalience]],
                   dims: Mapping[str, int] | Sequence[Mapping[str, int]] | int,
                   arch: ArchSpec | None = None) -> Permutation:
    """The permutation that puts the most salient heads and neurons first, per stack.

    ``sal`` is :func:`salience` of one stack (with its ``dims``) or :func:`model_salience`
    (with every stack's dims). A bare ``head_dim`` int is accepted for a one-stack model without
    key/value groups."""
    if sal and isinstance(sal[0], LayerSalience):
        sal = [sal]
    if isinstance(dims, int):
        first = sal[0][0]
        dims = [{"num_heads": len(first.heads), "head_dim": dims, "ffn": len(first.neurons),
                 "num_layers": len(sal[0])}]
    elif isinstance(dims, Mapping):
        dims = [dims]
    shared = arch is not None and arch.head_bias is not None
    return Permutation(tuple(stack_order(s, d, shared) for s, d in zip(sal, dims)))
