"""Parameter pruning: a model whose forward pass is the full model's, of which only some slices train.

The heads paper (§3.1) prunes *parameters*: "the trainable parameters of a pruned head are neither
trained nor sent" -- the frozen head still runs in the forward pass. :func:`partial_model` builds
that model from a :class:`~fedslice.slicing.spec.SliceSpec` that keeps every layer:

* a head-tied trainable tensor (q/k/v LoRA ``B`` rows -- per key/value head under grouped-query
  attention, per section of a fused q|k|v --, o LoRA ``A`` columns: the axis a
  :class:`~fedslice.slicing.keys.KeyInfo` reports) of any stack and attention family becomes a
  :class:`PartialLinear` (rows; ``A`` columns use :func:`partial_parameters`, since DoRA reads
  ``lora_A.weight``'s width): its kept
  slice is a trainable parameter (same name and shape as :func:`extract_state` gives), the pruned
  slice a frozen buffer, both in the forward pass;
* in a layer that keeps no head of an attention family, every trainable tensor of that family
  (q/k/v/o, also the ones that mix heads) is frozen: it trains nothing and sends nothing;
* any other head-tied trainable tensor (an IA3 vector's entries, DoRA's magnitudes of q/k/v rows,
  a prefix's key/value columns) trains its kept entries only (:func:`partial_parameters`);
* every other module is the same object as in ``model``.

The saved work is the pruned slices' weight gradients and optimizer state (and, in a headless
layer, the attention LoRA's): forward FLOPs are those of the full model. Compare
:func:`fedslice.slicing.surgery.extract_model` (the pruned heads leave the forward pass).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

import torch
import torch.nn as nn
import torch.nn.functional as F

from fedslice.models.arch import ArchSpec
from fedslice.slicing.keys import key_info
from fedslice.slicing.spec import HEAD_PARTS, Spec, kept_rows, stack_specs
from fedslice.slicing.surgery import rebuild_tree, shallow_clone


class PartialLinear(nn.Linear):
    """A bias-free linear map (a LoRA ``A`` or ``B``) of which only the rows (``axis=0``, outputs)
    or columns (``axis=1``, inputs) ``idx`` train; the others are a frozen buffer.

    ``weight`` is the kept slice, in the order of ``idx``; the output equals that of the original
    ``(out, in)`` matrix. Only the kept slice gets a weight gradient.
    """

    def __init__(self, lin: nn.Linear, idx: torch.Tensor, axis: int):
        nn.Module.__init__(self)
        if lin.bias is not None:
            raise NotImplementedError("PartialLinear handles bias-free linears (LoRA A/B) only")
        w = lin.weight.detach()                                           # (out, in)
        rest = torch.ones(w.shape[axis], dtype=torch.bool)
        rest[idx] = False
        rest = torch.nonzero(rest).flatten()
        self.in_features, self.out_features, self.axis = lin.in_features, lin.out_features, axis
        self.weight = nn.Parameter(w.index_select(axis, idx).clone(), requires_grad=lin.weight.requires_grad)
        self.bias = None
        self.register_buffer("frozen", w.index_select(axis, rest).clone(), persistent=False)
        self.register_buffer("idx", idx.clone(), persistent=False)
        self.register_buffer("rest", rest, persistent=False)
        # [kept | rest] order -> original order (output rows)
        self.register_buffer("inverse", torch.argsort(torch.cat([idx, rest])), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.axis == 0:
            y = torch.cat([F.linear(x, self.weight), F.linear(x, self.frozen)], -1)  # (..., out) permuted
            return y.index_select(-1, self.inverse)                                # (..., out)
        return (F.linear(x.index_select(-1, self.idx), self.weight)              # (..., out)
                + F.linear(x.index_select(-1, self.rest), self.frozen))


def _frozen(module: nn.Module) -> nn.Module:
    """A copy of a (bias-free or not) linear sharing its tensors, with no trainable parameter."""
    new = shallow_clone(module)
    for name, p in module._parameters.items():
        if p is not None:
            new._parameters[name] = nn.Parameter(p.detach(), requires_grad=False)
    return new


def _assembled(leaf: str) -> property:
    """The full tensor of a partly trained parameter: its kept slice (the parameter) and its
    frozen rest, in the original order along the sliced axis."""
    def get(self):
        frozen, inverse, axis = self._partial[leaf]
        kept = self._parameters[leaf]
        return torch.cat([kept, frozen], axis).index_select(axis, inverse)
    return property(get)


@lru_cache(maxsize=None)
def _partial_class(cls: type, leaves: tuple[str, ...]) -> type:
    """``cls`` whose attributes ``leaves`` read the assembled tensor (:func:`_assembled`), while
    the module's parameter of that name is the kept slice only (its name and what trains)."""
    return type(f"Partial{cls.__name__}", (cls,), {leaf: _assembled(leaf) for leaf in leaves})


def partial_parameters(module: nn.Module, cuts: Mapping[str, tuple[torch.Tensor, int]]) -> nn.Module:
    """A copy of ``module`` (sharing its other tensors) in which each parameter ``leaf`` of
    ``cuts`` trains only the entries ``idx`` along ``axis``: the parameter named ``leaf`` is that
    slice (the name and shape :func:`extract_state` gives), the rest a frozen copy, and the
    module reads the whole tensor, so its outputs are unchanged. For any module: an IA3
    ``ParameterDict``, DoRA's magnitude, a prefix's embedding (LoRA's bias-free linears use
    :class:`PartialLinear`, which skips assembling the weight)."""
    new = shallow_clone(module)
    state = {}
    for leaf, (idx, axis) in cuts.items():
        p = module._parameters[leaf]
        w = p.detach()
        rest = torch.ones(w.shape[axis], dtype=torch.bool)
        rest[idx] = False
        rest = torch.nonzero(rest).flatten()
        new._parameters[leaf] = nn.Parameter(w.index_select(axis, idx).clone(), requires_grad=p.requires_grad)
        state[leaf] = (w.index_select(axis, rest).clone(), torch.argsort(torch.cat([idx, rest])), axis)
    new.__dict__["_partial"] = state
    new.__class__ = _partial_class(type(module), tuple(sorted(cuts)))
    return new


def partial_model(model: nn.Module, spec: Spec, arch: ArchSpec,
                  extra: Mapping[str, tuple[torch.Tensor, int]] | None = None,
                  within: Spec | None = None) -> nn.Module:
    """``model`` (HF or peft-wrapped) with the trainable tensors of the heads ``spec`` prunes frozen.

    ``spec`` keeps every layer of each sliced stack in order (a keep-mask,
    :func:`fedslice.slicing.heads.mask_spec`). A head-tied tensor keeps the rows of its kept heads
    along its slot (:meth:`SliceSpec.index`): query heads for q and o, key/value heads (every
    group with a kept query head) for k and v, the three sections of a fused q|k|v. ``extra``:
    trainable tensors outside the blocks that map to heads (a prefix: name -> (kept entries,
    axis), :func:`fedslice.slicing.heads.position_cuts`). The trainable parameters of the result
    have the names and shapes of :func:`~fedslice.slicing.state.extract_state` on ``model``'s
    trainable state, less the attention tensors of headless (layer, family) pairs; its outputs
    equal ``model``'s. ``within``: ``model`` is the sub-model of that slice
    (:func:`~fedslice.slicing.surgery.extract_model`), ``spec`` a part of it keeping its layers,
    both in full-model indices; each tensor keeps the positions of ``spec``'s rows among
    ``within``'s (:meth:`SliceSpec.index_within`), the names and shapes of
    :func:`~fedslice.slicing.state.extract_state` of ``spec`` on the full model.
    """
    specs = stack_specs(spec, arch)
    outers = (None,) * len(specs) if within is None else stack_specs(within, arch)
    if any(s is not None and s.layers != (tuple(range(s.num_layers)) if w is None else w.layers)
           for s, w in zip(specs, outers)):
        raise ValueError("parameter pruning keeps every layer (a head keep-mask)")
    modules = dict(model.named_modules())
    replace: dict[str, nn.Module] = {}
    cuts: dict[str, dict[str, tuple[torch.Tensor, int]]] = {}
    for name, p in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        if p.requires_grad and extra and name in extra:
            cuts.setdefault(owner, {})[leaf] = extra[name]
            continue
        info = key_info(arch, name)
        if not p.requires_grad or info is None or info.part not in HEAD_PARTS:
            continue
        s, w, j = specs[info.stack], outers[info.stack], info.layer
        if s is None:
            continue
        if s.no_heads(j, info.family):
            replace[owner] = _frozen(modules[owner])
        elif info.axis is not None and (idx := kept_rows(s, w, j, info.kind, info.family)) is not None:
            cuts.setdefault(owner, {})[leaf] = (idx, info.axis)
    for owner, leaves in cuts.items():
        if owner in replace:
            continue
        module = modules[owner]
        if isinstance(module, nn.Linear) and module.bias is None and list(leaves) == ["weight"] \
                and leaves["weight"][1] == 0:
            replace[owner] = PartialLinear(module, *leaves["weight"])  # LoRA B rows
        else:  # LoRA A columns too: DoRA reads lora_A.weight.shape[1] as the input width
            replace[owner] = partial_parameters(module, leaves)
    return rebuild_tree(model, "", replace, {}, {})


def freeze_parameters(model: nn.Module, names: set[str]) -> nn.Module:
    """``model`` with the modules that own the parameters ``names`` replaced by copies sharing
    their tensors with nothing trainable (``model`` itself is unchanged: only ancestors of the
    replaced modules are new objects). Autograd then neither computes those gradients nor, when
    nothing below them trains, runs the backward down to them."""
    modules = dict(model.named_modules())
    owners = {n.rpartition(".")[0] for n in names}
    return rebuild_tree(model, "", {o: _frozen(modules[o]) for o in owners}, {}, {})
