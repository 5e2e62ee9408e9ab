"""A real smaller model by module surgery (:func:`extract_model`): it shares every unsliced
module with the full model and holds copies of the sliced tensors only; a layer that keeps no
head gets :class:`NoHeadsAttention`, layers reading their own heads of a stack-wide T5 bias
:class:`SharedBiasColumns`. See :mod:`fedslice.slicing.spec` for the slicing model."""

from __future__ import annotations

from collections import OrderedDict
from functools import lru_cache

import torch
import torch.nn as nn

from fedslice.models.quantize import index_select as quantized_index_select, is_quantized
from fedslice.models.arch import LINEAR, ArchSpec, Attention, Layout, module_at as _get
from fedslice.registry import adapter_of_module
from fedslice.slicing.keys import attention_parts
from fedslice.slicing.spec import SLOTS, SliceSpec, Spec, check_forward, expand_heads, stack_specs

# --------------------------------------------------------------------------------------------
# A real smaller model (module surgery, no copy of the full model)
# --------------------------------------------------------------------------------------------

def shallow_clone(module: nn.Module) -> nn.Module:
    """A new module object sharing every parameter, buffer and child of ``module``, with its own
    copies of the hook tables (a hook registered on the clone must not fire on the original)."""
    new = object.__new__(type(module))
    new.__dict__ = dict(module.__dict__)
    new._modules = dict(module._modules)
    new._parameters = dict(module._parameters)
    new._buffers = dict(module._buffers)
    for k, v in module.__dict__.items():
        if "hooks" in k and isinstance(v, dict):
            new.__dict__[k] = type(v)(v)
    return new


def install_output_hooks(model: nn.Module) -> None:
    """transformers 5 records attention weights and hidden states with forward hooks that a
    model installs on its modules at its first call asking for them. Installed on the full model
    before a sub-model is cut from it, they are copied into the sub-model's cloned modules and
    shared with its other ones; installed later by the sub-model, they would be added a second
    time to the modules it shares with the full model, which would then record every layer
    twice. A quirk handled once, here."""
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # an older transformers: outputs are returned, not hooked
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # a task model (BertForSequenceClassification) and its inner model (BertModel) declare the
    # same recordings, and transformers installs at the first call of whichever forward asks,
    # marking only that module: the outermost's hooks cover the inner one's modules, so both are
    # marked. Owners with recordings of their own (BART's encoder and decoder) install their own.
    owners = [(n, m) for n, m in base.named_modules() if getattr(type(m), "_can_record_outputs", None)]
    groups: dict[str, list[nn.Module]] = {}
    for name, m in owners:
        spec = type(m)._can_record_outputs
        top = next((n for n, o in owners if type(o)._can_record_outputs is spec
                    and (n == "" or name == n or name.startswith(n + "."))), name)
        groups.setdefault(top, []).append(m)
    for members in groups.values():
        if not any(getattr(m, "_output_capturing_hooks_installed", False) for m in members):
            maybe_install_capturing_hooks(members[0])
        for m in members:
            m._output_capturing_hooks_installed = True


def _slice_param(p: nn.Parameter | None, axis: int | None, idx: torch.Tensor) -> nn.Parameter | None:
    if p is None:
        return None
    if axis is None:
        return p
    if is_quantized(p):  # a quantized frozen base weight: its int8 rows/columns, no re-quantizing
        return nn.Parameter(quantized_index_select(p, axis, idx), requires_grad=False)
    return nn.Parameter(p.detach().index_select(axis, idx), requires_grad=p.requires_grad)


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
    install_output_hooks(model)
    names = {id(m): n for n, m in model.named_modules()}
    replace: dict[str, nn.Module] = {}
    hooks: dict[str, dict] = {}
    lists: dict[str, list[int]] = {}
    layout = arch.layout
    for k, s in enumerate(specs):
        if s is None:
            continue
        check_forward(arch, s)
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
                for part, path in attention_parts(att)[:-1]:
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
