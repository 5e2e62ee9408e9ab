"""L1 / L2 / activation-aware salience of attention heads and FFN neurons, per stack and layer.

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

``norm = "activation"`` (data-aware, for decoders with a few massive-activation FFN units that
weight norms miss): FFN neuron j scores ``mean|a_j| * ||W_out[:, j]||_1`` with ``a_j`` its input
to the output projection, averaged over the real tokens of a calibration batch; a self-attention
query head scores the same over its ``head_dim`` input channels of W_o (summed), i.e. the L1 size
of what the unit writes into the residual stream. The activations come from
:func:`output_activations` (forward hooks on the W_o / W_out modules of the model holding the
state). Cross-attention heads keep their L1 score.

:func:`salience_order` turns salience into a function-preserving :class:`Permutation`: under
grouped-query attention groups are ordered by salience and query heads within their group; T5
stacks (one relative-bias table for every layer) get one head order per stack, by salience
summed over the layers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

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


#: (stack, layer, 'o' or 'ffn_out') -> (in,) mean |input| of that output projection per channel
Activations = Mapping[tuple[int, int, str], torch.Tensor]


def output_modules(model: nn.Module, arch: ArchSpec) -> dict[tuple[int, int, str], nn.Module]:
    """(stack, layer, 'o' / 'ffn_out') -> the self-attention / FFN output projection module."""
    out = {}
    for name, module in model.named_modules():
        info = key_info(arch, name + ".weight") if name else None
        if info is None or info.leaf != "weight" or info.family != 0 or info.part not in ("o", "ffn_out"):
            continue
        out[(info.stack, info.layer, info.part)] = module
    return out


@torch.no_grad()
def output_activations(model: nn.Module, arch: ArchSpec,
                       batches: Iterable[Mapping[str, torch.Tensor]]) -> dict[tuple[int, int, str], torch.Tensor]:
    """Mean |input| per channel of every self-attention (W_o) and FFN (W_out) output projection of
    ``model`` over ``batches`` (model inputs; ``labels`` is dropped). A batch's
    ``attention_mask`` excludes padding where the projection's input has the batch's (B, T) shape
    (an encoder-decoder's other stack: every position counts)."""
    from fedslice.compute import model_device, to_device
    sums: dict = {}
    counts: dict = {}
    mask: list[torch.Tensor | None] = [None]

    def hook(where):
        def fn(module, args):
            a = args[0].detach().float().abs()  # (..., in)
            m = mask[0]
            if m is not None and a.dim() == 3 and tuple(a.shape[:2]) == tuple(m.shape):
                w = m.to(a.device, a.dtype)[..., None]
                s, n = (a * w).sum((0, 1)), w.sum()
            else:
                s, n = a.reshape(-1, a.shape[-1]).sum(0), a.numel() // a.shape[-1]
            sums[where] = sums.get(where, 0) + s.cpu()
            counts[where] = counts.get(where, 0) + float(n)
        return fn

    handles = [m.register_forward_pre_hook(hook(w)) for w, m in output_modules(model, arch).items()]
    was = model.training
    model.eval()
    try:
        device = model_device(model)
        for batch in batches:
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            mask[0] = inputs.get("attention_mask")
            model(**to_device(inputs, device))
    finally:
        for h in handles:
            h.remove()
        model.train(was)
    return {w: sums[w] / max(counts[w], 1.0) for w in sums}


def salience(state: Mapping[str, torch.Tensor], arch: ArchSpec, dims: Mapping[str, int],
             norm: str = "l1", adapter_scale: float | None = None, stack: int = 0,
             activations: Activations | None = None) -> list[LayerSalience]:
    """Salience of every head and FFN neuron of every layer of one stack (see module doc)."""
    if norm == "activation":
        return _activation_salience(state, arch, dims, adapter_scale, stack, activations)
    if norm not in ("l1", "l2"):
        raise ValueError(f"norm must be 'l1', 'l2' or 'activation', got {norm!r}")
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


def _activation_salience(state, arch: ArchSpec, dims: Mapping[str, int], adapter_scale, stack: int,
                         activations: Activations | None) -> list[LayerSalience]:
    """``norm = "activation"`` (module doc): mean |input| x L1 column norm of the output projection."""
    if activations is None:
        raise ValueError("norm='activation' needs the activations (output_activations of the model "
                         "holding the state over a calibration batch)")
    W = part_weights(state, arch, adapter_scale)
    l1 = salience(state, arch, dims, "l1", adapter_scale, stack)
    H, hd = dims["num_heads"], dims["head_dim"]
    out = []
    for l, base in enumerate(l1):
        def score(part):
            a = activations.get((stack, l, part))
            if a is None:
                raise KeyError(f"no activations for stack {stack} layer {l} part {part}")
            return a.to(W[stack, l, part, 0].device) * W[stack, l, part, 0].abs().sum(0)  # (in,)
        heads = score("o").view(H, hd).sum(1)
        out.append(LayerSalience(heads, score("ffn_out"), base.cross))
    return out


def model_salience(state: Mapping[str, torch.Tensor], arch: ArchSpec,
                   dims: Sequence[Mapping[str, int]], norm: str = "l1",
                   adapter_scale: float | None = None,
                   activations: Activations | None = None) -> list[list[LayerSalience]]:
    """:func:`salience` of every stack."""
    return [salience(state, arch, d, norm, adapter_scale, k, activations) for k, d in enumerate(dims)]


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
