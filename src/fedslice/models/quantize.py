"""A quantized frozen base (``model.quantize``): the ``nn.Linear`` layers of a model's transformer
blocks stored in int8 (torchao) or NF4 (bitsandbytes, CUDA only), quantized **in place** on an
already-built model, so a sliced sub-model can be quantized as well as a full one, and adapters
(LoRA, DoRA, IA3 through HF peft) train over it.

What stays in fp32: everything outside the blocks (embeddings, the classifier / pooler, the LM
head, norms), every bias, and everything that trains (adapters, the classifier). Only adapter and
classifier tensors train, travel and aggregate (in fp32); the quantized weights never leave the
process.

Backends (measured on this project's 2-core CPU machine, torch 2.13, transformers 5.23, peft
0.21.2; BENCHMARKS.md, "Quantized base"):

* ``int8``: torchao's ``Int8WeightOnlyConfig`` (symmetric, one scale per output row): a weight
  becomes a ``torchao.quantization.Int8Tensor`` (int8 data + an fp32 scale per row) that
  ``F.linear`` runs by converting it to the activation's dtype on the fly, so gradients flow to
  the input (LoRA below it trains) and peft recognises it (``TorchaoLoraLinear``). Runs on the
  CPU and on CUDA. Chosen over bitsandbytes' CPU backend (0.50.2: loads, but a LoRA step fails:
  ``'Parameter' object has no attribute 'CB'``) and torchao's int4 (does not convert on the CPU).
* ``nf4``: bitsandbytes ``Linear4bit`` (NF4, fp32 compute), CUDA only: the weights are quantized
  when the model moves to the GPU. Refused at config load on a machine without CUDA or without
  the bitsandbytes package (:func:`fedslice.config.check_quantize_available`).

Slicing a quantized weight (RaFFM's width slices, heads' forward pruning) needs no
re-quantization: the rows or columns of the int8 data are taken with their per-row scales
(:func:`index_select`), exactly the values of the slice of the de-quantized weight.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn

from fedslice.config import QUANTIZE_MODES
from fedslice.models.arch import ArchSpec, unwrap_model

log = logging.getLogger(__name__)

#: mode -> (library, where it runs)
BACKENDS = {"int8": ("torchao", "CPU or CUDA"), "nf4": ("bitsandbytes", "CUDA")}


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """torchao logs a warning per optional C++/CUDA extension it cannot load on a CPU-only
    machine, and peft warns that a torchao LoRA layer cannot merge in place (fedslice merges by
    de-quantizing: :func:`dequantize_base`): neither concerns the user."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*get_apply_tensor_subclass.*")
            warnings.filterwarnings("ignore", module="torchao")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def check_architecture(mode: str, arch: ArchSpec) -> None:
    """A ValueError when ``arch`` has no ``nn.Linear`` layers to quantize (GPT-2's ``Conv1D``)."""
    if mode != "none" and arch.layout.transposed:
        raise ValueError(f"model.quantize = {mode!r}: {arch.model_type}'s blocks use HF's Conv1D "
                         "layers, not nn.Linear, which torchao and bitsandbytes do not quantize; "
                         "use model.quantize = 'none' for this model")


# -- which tensors ---------------------------------------------------------------------------

def is_quantized(t: torch.Tensor | None) -> bool:
    """True for a torchao quantized tensor or a bitsandbytes 4-bit parameter."""
    if t is None:
        return False
    mod = type(t).__module__
    return mod.startswith("torchao.") or (mod.startswith("bitsandbytes") and
                                          getattr(t, "quant_state", None) is not None) \
        or type(t).__name__ == "Params4bit"


def base_linears(model: nn.Module, arch: ArchSpec) -> dict[str, nn.Linear]:
    """Name (in ``model``) -> every ``nn.Linear`` inside the transformer blocks of every stack
    that does not train: the frozen base :func:`quantize_base` quantizes. Adapter layers (peft's
    ``lora_A``/``lora_B``, ...) and anything with a trainable weight are left out; so is
    everything outside the blocks (embeddings, classifier, pooler, LM head)."""
    base = unwrap_model(model)
    block_ids = {id(b) for k in range(len(arch.stacks)) for b in arch.blocks(base, k)}
    names = {id(m): n for n, m in model.named_modules()}
    out: dict[str, nn.Linear] = {}
    for block in (m for m in base.modules() if id(m) in block_ids):
        for sub in block.modules():
            name = names.get(id(sub), "")
            if not isinstance(sub, nn.Linear) or _in_adapter(name):
                continue
            if sub.weight.requires_grad and not is_quantized(sub.weight) and _adapter_present(model):
                continue  # a weight that trains (an adapter layer of another kind) stays fp32
            out[name] = sub
    return out


def _in_adapter(name: str) -> bool:
    """A module of an adapter's own (peft's ``lora_A.default``, ``lora_B``, ...)."""
    from fedslice.registry import ADAPTERS
    for entry in ADAPTERS.entries():
        if entry.adapter_cls.prefix and entry.adapter_cls.owns(name):
            return True
    return False


def _adapter_present(model: nn.Module) -> bool:
    """The model is wrapped (an adapter applied): what trains is decided already."""
    return hasattr(model, "peft_config") or any(hasattr(m, "base_layer") for m in model.modules())


# -- quantizing ------------------------------------------------------------------------------

@dataclass(frozen=True)
class QuantReport:
    """What :func:`quantize_base` did: the mode, the layers quantized, and their weights' bytes
    before (fp32) and after."""

    mode: str
    layers: int
    fp32_bytes: int
    quantized_bytes: int

    @property
    def ratio(self) -> float:
        return self.fp32_bytes / self.quantized_bytes if self.quantized_bytes else 1.0


@torch.no_grad()
def quantize_base(model: nn.Module, mode: str, arch: ArchSpec) -> QuantReport:
    """Quantize the frozen ``nn.Linear`` weights of ``model``'s blocks (:func:`base_linears`) in
    place, to ``mode`` ('int8': torchao; 'nf4': bitsandbytes, quantized when the model moves to
    CUDA). Already-quantized layers are kept as they are (calling it twice quantizes once).
    Works on a sliced sub-model as on a full one; a meta-device model is left alone. Call it
    before the adapter is applied (peft then wraps the quantized layers with its torchao LoRA
    layer) or after (only the frozen base layers are touched)."""
    if mode == "none":
        return QuantReport(mode, 0, 0, 0)
    targets = base_linears(model, arch)
    todo = {n: m for n, m in targets.items()
            if not is_quantized(m.weight) and not m.weight.is_meta}
    before = sum(held_bytes(m.weight) if is_quantized(m.weight) else m.weight.numel() * 4
                 for m in targets.values())
    if mode == "int8":
        _int8(model, todo)
    elif mode == "nf4":
        _nf4(model, todo)
    else:
        raise ValueError(f"model.quantize = {mode!r}: unknown (one of {', '.join(QUANTIZE_MODES)})")
    if todo:
        _own_memory(model)
        from fedslice.heap import trim_heap
        trim_heap()  # the quantization's fp32 temporaries back to the system (glibc)
    after = sum(held_bytes(getattr(_module(model, n), "weight")) for n in targets)
    report = QuantReport(mode, len(targets), before, after)
    if todo:
        log.info("model.quantize = %r: %d linear layers of the blocks quantized (%.1f MiB -> "
                 "%.1f MiB of weights)", mode, len(todo), before / 2**20, after / 2**20)
    return report


def quantized_copy(model: nn.Module, mode: str, arch: ArchSpec) -> nn.Module:
    """A copy of ``model`` (an fp32 base, adapter applied or not) whose frozen block linears are
    quantized to ``mode`` (:func:`quantize_base`), for clients planned at a lower precision than
    the run's base (``budgets.precisions``). The copy shares every frozen tensor that stays fp32
    with ``model`` (embeddings, norms, biases, the head: one copy in memory) and reads the fp32
    linear weights it quantizes without copying them; trainable tensors are its own. ``model``
    is left unchanged."""
    import copy

    if mode not in ("int8", "nf4"):
        raise ValueError(f"budgets.precisions: {mode!r} is not a quantization (int8 or nf4)")
    # frozen tensors and buffers are shared, not copied (the linears' fp32 weights too: the
    # copy's modules get quantized weights of their own, the shared ones stay the model's)
    memo = {id(p): p for p in model.parameters() if not p.requires_grad}
    memo.update({id(b): b for b in model.buffers()})
    twin = copy.deepcopy(model, memo)
    todo = {n: m for n, m in base_linears(twin, arch).items() if not is_quantized(m.weight)}
    (_int8 if mode == "int8" else _nf4)(twin, todo)
    return twin


@torch.no_grad()
def _own_memory(model: nn.Module) -> None:
    """Give every tensor that stays fp32 its own memory. transformers reads a safetensors file by
    memory-mapping it: the weights are the file's pages, one mapping for the whole file, resident
    once read. Quantizing reads every linear weight and drops it, but the mapping (and those
    pages) stays as long as any tensor of the file lives (the embeddings): the process would hold
    the fp32 file *and* the int8 copies (measured on MiniLM: RSS +48 MiB instead of -30).
    Copied out, the file's tensors are all dropped and the mapping with them. A parameter keeps
    its identity (its ``.data`` is replaced), so tied and shared parameters stay tied."""
    seen: set[int] = set()
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None and not is_quantized(p) and not p.is_meta and id(p) not in seen:
                seen.add(id(p))
                p.data = p.data.clone()
        for name, b in list(m._buffers.items()):
            if b is not None and not b.is_meta and id(b) not in seen:
                seen.add(id(b))
                m._buffers[name] = b.clone()


def _module(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name) if name else model


def _int8(model: nn.Module, todo: dict[str, nn.Linear]) -> None:
    # a layer of one input column (a sub-model's W_out keeping one FFN unit) stays fp32: torchao
    # 0.18 cannot quantize it per row (its scale reshape fails), and it holds a column of weights
    todo = {n: m for n, m in todo.items() if m.in_features > 1}
    if not todo:
        return
    with quiet():
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
        ids = {id(m) for m in todo.values()}
        # set_inductor_config=False: fedslice does not torch.compile by default, and torchao's
        # inductor settings are process-wide
        quantize_(model, Int8WeightOnlyConfig(set_inductor_config=False),
                  filter_fn=lambda m, _fqn: id(m) in ids)
    for m in todo.values():
        if type(m) is nn.Linear:
            m.__class__ = FrozenInt8Linear


class _Int8Linear(torch.autograd.Function):
    """``x W^T + b`` for a frozen int8 weight ``W = qdata * scale`` (one scale per output row)
    that keeps only the int8 data for the backward. torchao's own ``F.linear`` converts the int8
    weight to an fp32 copy for the matmul, and autograd keeps that copy until the backward: a
    training step then holds every quantized layer's fp32 weight again (measured: +11.8 MiB saved
    tensors on a 2-layer MiniLM-sized model, as much as the fp32 weights). Here the copy lives for
    one matmul in the forward and one in the backward."""

    @staticmethod
    def forward(ctx, x, qdata, scale, bias):
        ctx.save_for_backward(qdata, scale)
        ctx.bias_shape = None if bias is None else bias.shape
        y = torch.matmul(x, qdata.t().to(x.dtype)) * scale.reshape(-1).to(x.dtype)
        return y if bias is None else y + bias.to(y.dtype)

    @staticmethod
    def backward(ctx, gy):
        qdata, scale = ctx.saved_tensors
        gx = gbias = None
        if ctx.needs_input_grad[0]:
            gx = torch.matmul(gy * scale.reshape(-1).to(gy.dtype), qdata.to(gy.dtype))
        if ctx.needs_input_grad[3]:
            gbias = gy.reshape(-1, gy.shape[-1]).sum(0)
        return gx, None, None, gbias


def _fast_int8(w: torch.Tensor) -> bool:
    """A torchao int8 weight of the weight-only per-row (or per-tensor) symmetric kind."""
    return (type(w).__name__ == "Int8Tensor" and w.qdata.ndim == 2
            and getattr(w, "act_quant_kwargs", None) is None
            and getattr(w, "act_pre_scale", None) is None
            and w.block_size[-1] == w.qdata.shape[-1]
            and (w.zero_point is None or not bool(w.zero_point.any())))


class FrozenInt8Linear(nn.Linear):
    """An ``nn.Linear`` whose weight is a torchao int8 tensor (``model.quantize = "int8"``):
    the forward of :class:`_Int8Linear` (the same values as torchao's, without keeping an fp32
    copy of the weight for the backward). Still an ``nn.Linear``: peft wraps it (its
    ``TorchaoLoraLinear``, IA3's layer), the architecture table and slicing see a linear map."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if _fast_int8(w):
            return _Int8Linear.apply(x, w.qdata, w.scale, self.bias)
        return super().forward(x)


def _nf4(model: nn.Module, todo: dict[str, nn.Linear]) -> None:
    """Each layer becomes a bitsandbytes ``Linear4bit`` (NF4, fp32 compute) holding the fp32
    weight; bitsandbytes quantizes it when the model moves to CUDA (``Method`` moves it)."""
    if not todo:
        return
    import bitsandbytes as bnb

    for name, lin in todo.items():
        new = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                compute_dtype=torch.float32, quant_type="nf4",
                                device=lin.weight.device)
        new.weight = bnb.nn.Params4bit(lin.weight.data.clone(), requires_grad=False,
                                       quant_type="nf4")
        if lin.bias is not None:
            new.bias = nn.Parameter(lin.bias.data.clone(), requires_grad=lin.bias.requires_grad)
        parent, _, leaf = name.rpartition(".")
        setattr(_module(model, parent), leaf, new)
        if lin.weight.device.type == "cuda":
            new.cuda(lin.weight.device)


# -- sizes, slicing, de-quantizing -----------------------------------------------------------

def held_bytes(t: torch.Tensor) -> int:
    """Bytes that hold ``t``: a quantized weight's int data and scales (a torchao tensor
    subclass, whose dtype is the high-precision one; a bitsandbytes 4-bit parameter and its
    quantization state), a plain tensor's ``numel * element_size``."""
    inner = quantized_parts(t)
    if inner is not None:
        return int(sum(held_bytes(x) for x in inner))
    if type(t).__name__ == "Params4bit" and getattr(t, "quant_state", None) is not None:
        qs = t.quant_state
        extra = sum(x.numel() * x.element_size() for x in (qs.absmax, getattr(qs, "code", None))
                    if isinstance(x, torch.Tensor))
        return int(t.data.numel() * t.data.element_size() + extra)
    return int(t.numel() * t.element_size())


def quantized_parts(t: torch.Tensor) -> list[torch.Tensor] | None:
    """The plain tensors that hold a tensor subclass of torchao's (a quantized weight: int8 data
    and scales), None for any other tensor."""
    names = getattr(type(t), "tensor_data_names", None)
    if names is None:
        return None
    names = [*names, *(getattr(type(t), "optional_tensor_data_names", None) or [])]
    return [x for x in (getattr(t, n, None) for n in names) if isinstance(x, torch.Tensor)]


def quantized_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Name -> every quantized parameter of ``model``."""
    return {n: p for n, p in model.named_parameters() if is_quantized(p)}


def dequantize(t: torch.Tensor) -> torch.Tensor:
    """A plain fp32 tensor of the values ``t`` stands for."""
    if type(t).__name__ == "Params4bit":
        import bitsandbytes as bnb
        return bnb.functional.dequantize_4bit(t.data, t.quant_state).float()
    if is_quantized(t):
        return t.dequantize().float()
    return t


@torch.no_grad()
def dequantize_base(model: nn.Module) -> nn.Module:
    """Every quantized weight of ``model`` back to a plain fp32 ``nn.Parameter`` (frozen) in
    place, ``Linear4bit`` layers back to ``nn.Linear``: a model that plain transformers saves
    and peft merges into (``fedslice export --format merged``)."""
    for name, module in list(model.named_modules()):
        w = getattr(module, "weight", None)
        if not is_quantized(w):
            continue
        plain = nn.Parameter(dequantize(w), requires_grad=False)
        if type(w).__name__ == "Params4bit":
            lin = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                            device=plain.device)
            lin.weight = plain
            if module.bias is not None:
                lin.bias = module.bias
            parent, _, leaf = name.rpartition(".")
            setattr(_module(model, parent), leaf, lin)
        else:
            module.weight = plain
            if type(module) is FrozenInt8Linear:
                module.__class__ = nn.Linear
            if hasattr(module, "extra_repr") and "extra_repr" in vars(module):
                del module.extra_repr  # torchao's per-instance repr
    return model


def index_select(t: torch.Tensor, axis: int, idx: torch.Tensor) -> torch.Tensor:
    """``t.index_select(axis, idx)`` for a 2-D int8 weight (torchao ``Int8Tensor``, one scale per
    row) without re-quantizing: the int8 rows (``axis=0``, with their scales) or columns
    (``axis=1``, scales unchanged) are taken, so the result stands for exactly the slice of the
    de-quantized weight. Plain tensors: ``index_select``."""
    if not is_quantized(t):
        return t.index_select(axis, idx)
    if type(t).__name__ != "Int8Tensor" or t.qdata.ndim != 2:
        raise TypeError(f"cannot slice a {type(t).__name__} weight (model.quantize): only "
                        "torchao's int8 weights can be sliced (slice before quantizing)")
    from torchao.quantization import Int8Tensor

    qdata = t.qdata.index_select(axis, idx)
    per_row = t.scale.numel() > 1
    scale, zero = t.scale, t.zero_point
    if axis == 0 and per_row:
        scale = scale.index_select(0, idx)
        zero = zero.index_select(0, idx) if zero is not None and zero.numel() > 1 else zero
    block = [min(b, s) for b, s in zip(t.block_size, qdata.shape)]
    if axis == 1 and t.block_size[1] < t.qdata.shape[1]:
        raise TypeError("cannot slice the columns of a per-group int8 weight")
    return Int8Tensor(qdata, scale, block, t.dtype, zero_point=zero,
                      act_quant_kwargs=t.act_quant_kwargs, reduce_range=t.reduce_range)
