"""Measured and analytic costs of a client's local training.

Four kinds of cost are tracked for every client and round:

* **communication** — :func:`tensor_bytes` / :func:`num_params` of what the server sends down and
  the client sends back up;
* **compute** — :func:`measure_step_flops` counts the FLOPs of one real training step with
  :class:`torch.utils.flop_counter.FlopCounterMode`, and :func:`analytic_train_flops` gives the
  textbook estimate (6·N·tokens plus the attention term) to check it against;
* **memory** — :class:`PeakMemory` measures the peak resident memory (RSS) of the process during
  local training, and, deterministically, the peak bytes of tensors saved for backward
  (activations), to which the caller adds gradients and optimizer state
  (:func:`trainable_state_bytes`);
* **time** — wall-clock seconds, recorded by the caller.

:class:`ClientCost` bundles one client's numbers for one round.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from fedslice.models.arch import is_linear

__all__ = [
    "ClientCost",
    "FlopCount",
    "PeakMemory",
    "analytic_train_flops",
    "embeddings_train",
    "count_flops",
    "linear_param_counts",
    "measure_step_flops",
    "num_params",
    "tensor_bytes",
    "trainable_state_bytes",
]

_MIB = float(1 << 20)

# Head modules of sequence-classification models run once per example (on the pooled / first
# token), not once per token. Matched against the module's qualified name.
_HEAD_NAME_PARTS = ("pooler", "classifier", "score")


# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------


def tensor_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Total payload bytes of ``tensors``: the sum of ``numel * element_size`` over all values."""
    return int(sum(t.numel() * t.element_size() for t in tensors.values()))


def num_params(tensors: Mapping[str, torch.Tensor]) -> int:
    """Total number of elements in ``tensors``."""
    return int(sum(t.numel() for t in tensors.values()))


def module_bytes(model: nn.Module) -> int:
    """Bytes of a module's parameters and buffers (each storage once: tied and shared tensors
    count once)."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if not t.is_meta:
            seen.setdefault(_storage_ptr(t), _storage_nbytes(t))
    return int(sum(seen.values()))


def trainable_state_bytes(params: Iterable[torch.Tensor] | nn.Module, optimizer_slots: int = 2) -> int:
    """Bytes of the gradients plus optimizer state of the trainable parameters.

    ``params`` is a module (its parameters with ``requires_grad``) or an iterable of tensors.
    ``optimizer_slots`` is the number of parameter-sized state tensors the optimizer keeps:
    2 for Adam/AdamW (``exp_avg``, ``exp_avg_sq``), 1 for SGD with momentum, 0 for plain SGD.
    Use the result as ``PeakMemory(extra_bytes=...)``.
    """
    if isinstance(params, nn.Module):
        params = params.parameters()
    total = 0
    for p in params:
        if p.requires_grad:
            total += p.numel() * p.element_size() * (1 + optimizer_slots)
    return int(total)


def _output_embeddings(model: nn.Module) -> nn.Module | None:
    """The LM head of ``model`` (HF or peft-wrapped), or None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    get_out = getattr(base, "get_output_embeddings", None)
    return get_out() if callable(get_out) else None


def linear_param_counts(model: nn.Module) -> dict[str, int]:
    """Weight counts of the model's ``nn.Linear`` layers, for :func:`analytic_train_flops`.

    Returns ``{"total", "trainable", "head_total", "head_trainable"}``: ``total``/``trainable``
    are the per-token linear layers (the transformer body, including LoRA ``lora_A``/``lora_B``
    linears of a peft model); ``head_*`` are the linears of the classification head (module
    names containing ``pooler``, ``classifier`` or ``score``), which run once per example, and
    the LM head (the output embedding), which runs at the positions where a loss is taken.
    GPT-2's ``Conv1D`` counts as a linear layer.
    Biases are not counted (they cost no multiply-adds). The unused ``original_module`` copy that
    peft keeps for ``modules_to_save`` is skipped, and so is a prompt-learning ``prompt_encoder``
    (it runs on the virtual tokens once per step or per sequence: ``Adapter.cost`` counts it).
    """
    counts = {"total": 0, "trainable": 0, "head_total": 0, "head_trainable": 0}
    lm_head = _output_embeddings(model)
    for name, module in model.named_modules():
        if not is_linear(module):
            continue
        w = module._parameters.get("weight")  # a partly trained weight: its kept slice
        w = module.weight if w is None else w
        segments = name.split(".")
        if "original_module" in segments:
            continue  # peft modules_to_save keeps an unused copy of the original head
        if "prompt_encoder" in segments:
            continue  # P-tuning's MLP, prefix tuning's projection: not per token (the adapter's cost)
        is_head = module is lm_head or any(part in seg for seg in segments for part in _HEAD_NAME_PARTS)
        prefix = "head_" if is_head else ""
        frozen = getattr(module, "frozen", None)  # PartialLinear: the frozen slice runs forward too
        frozen = getattr(module, "_partial", {}).get("weight", (frozen,))[0]  # partial_parameters
        counts[prefix + "total"] += w.numel() + (frozen.numel() if isinstance(frozen, torch.Tensor) else 0)
        if w.requires_grad:
            counts[prefix + "trainable"] += w.numel()
    return counts


# --------------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------------


def _cpu_attention_flop_mapping() -> dict[Any, Any]:
    """FLOP formulas for the fused CPU attention kernels that torch's counter does not know.

    On CPU, ``scaled_dot_product_attention`` dispatches to
    ``aten._scaled_dot_product_flash_attention_for_cpu``, which :class:`FlopCounterMode` does not
    count (it counts the CUDA kernels). We count it the same way torch counts the CUDA flash
    kernel: 2 matmuls forward, 5 backward (the scores are recomputed).
    """
    from torch.utils import flop_counter as fc

    mapping: dict[Any, Any] = {}
    aten = torch.ops.aten
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is not None and fwd not in fc.flop_registry:

        def _fwd(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
            return fc.sdpa_flop_count(query_shape, key_shape, value_shape)

        mapping[fwd] = _fwd
    if bwd is not None and bwd not in fc.flop_registry:

        def _bwd(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
            return fc.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)

        mapping[bwd] = _bwd
    return mapping


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


class FlopCount:
    """Result holder of :func:`count_flops`: ``total`` FLOPs (0 when counting was disabled)."""

    __slots__ = ("total", "enabled")

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.total = 0

    def __repr__(self) -> str:
        return f"FlopCount(total={self.total}, enabled={self.enabled})"


@contextlib.contextmanager
def count_flops(enabled: bool = True) -> Iterator[FlopCount]:
    """Count the FLOPs of the code in the block::

        with count_flops(enabled=step == 0) as fc:
            model(**batch).loss.backward()
        fc.total

    Same counter as :func:`measure_step_flops` (including the CPU attention kernels) but around
    the caller's own code, so the real training step is measured without running it twice.
    ``fc.total`` is set when the block ends; with ``enabled=False`` nothing is counted (no
    overhead) and ``fc.total`` stays 0.
    """
    result = FlopCount(enabled)
    if not enabled:
        yield result
        return
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False, custom_mapping=_cpu_attention_flop_mapping())
    try:
        with counter:
            yield result
    finally:
        result.total = int(counter.get_total_flops())


def measure_step_flops(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> int:
    """FLOPs of one training step (forward, loss, backward) of ``model`` on ``batch``.

    ``model(**batch)`` must return an object with ``.loss`` (HF models do when ``labels`` is in the
    batch; a peft model works too). Counted with :class:`torch.utils.flop_counter.FlopCounterMode`:
    matrix multiplications, convolutions and attention kernels (a multiply-add is 2 FLOPs);
    element-wise ops, softmax, layer norms and the optimizer step are not counted. Only the
    gradients autograd actually computes are counted, so frozen weights cost no weight-gradient.

    The measurement does not alter training: existing ``.grad`` values are restored (parameters
    without a gradient before have ``grad is None`` after), the CPU/CUDA random state is restored
    (dropout draws), and the train/eval mode is left as it was. Tensors in ``batch`` are moved to
    the model's device.
    """
    device = _model_device(model)
    inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    params = list(model.parameters())
    saved_grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    cuda_devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda_devices), torch.enable_grad():
            with count_flops() as fc:
                out = model(**inputs)
                loss = out.loss if hasattr(out, "loss") else out["loss"]
                if loss is None:
                    raise ValueError("measure_step_flops: model(**batch) returned no loss; put 'labels' in the batch")
                loss.backward()
            flops = fc.total
    finally:
        model.zero_grad(set_to_none=True)
        for p, g in zip(params, saved_grads):
            p.grad = g
    return flops


def embeddings_train(model: nn.Module) -> bool:
    """Whether ``model``'s input embeddings train (full fine-tuning): autograd then computes the
    gradient of the first layer's input (``analytic_train_flops(embedding_backward=...)``)."""
    try:
        return any(p.requires_grad for p in model.get_input_embeddings().parameters())
    except (AttributeError, NotImplementedError):
        return False


def frozen_bottom(model: nn.Module, blocks: Sequence[nn.Module]) -> tuple[int, int]:
    """``(L_f, N_f)``: the number of lowest ``blocks`` (one stack, bottom first) that hold no
    trainable tensor, and their linear weights (:func:`linear_param_counts`), when nothing below
    or beside them trains either (frozen embeddings; outside the blocks only the output head:
    the LM head or a ``pooler``/``classifier``/``score`` module). Autograd's backward then stops
    above them (:func:`analytic_train_flops` ``frozen_layers``); otherwise ``(0, 0)``."""
    if embeddings_train(model):
        return 0, 0
    inside = {id(p) for b in blocks for p in b.parameters()}
    lm_head = _output_embeddings(model)
    head = {id(p) for p in lm_head.parameters()} if lm_head is not None else set()
    for name, p in model.named_parameters():
        if not p.requires_grad or not p.numel() or id(p) in inside or id(p) in head:
            continue
        if not any(part in seg for seg in name.split(".") for part in _HEAD_NAME_PARTS):
            return 0, 0  # a prompt, a prefix, a trained norm below the head: no early stop
    frozen = 0
    for block in blocks:
        if any(p.requires_grad and p.numel() for p in block.parameters()):
            break
        frozen += 1
    return frozen, sum(linear_param_counts(b)["total"] for b in blocks[:frozen])


def analytic_train_flops(
    *,
    num_layers: int,
    hidden: int,
    ffn: int,
    num_heads: int,
    tokens: int,
    seq_len: float,
    trainable_linear_params: int,
    total_linear_params: int,
    embedding_backward: bool = False,
    examples: int = 0,
    head_positions: int | None = None,
    head_linear_params: int = 0,
    head_trainable_linear_params: int = 0,
    virtual_tokens: int = 0,
    prefix_keys: int = 0,
    adapter_flops: float = 0.0,
    frozen_layers: int = 0,
    frozen_linear_params: int = 0,
) -> dict[str, float]:
    """Analytic FLOPs of training on ``tokens`` tokens (forward + backward; optimizer excluded).

    A multiply-add is 2 FLOPs. With ``N`` = ``total_linear_params`` (weights of the per-token
    linear layers), ``N_t`` = ``trainable_linear_params``, ``L`` = ``num_layers``,
    ``d`` = ``hidden``, ``s`` = ``seq_len`` (mean sequence length) and ``T`` = ``tokens``:

    * forward  = 2·N·T  +  4·L·s·d·T  — the matmuls, plus the attention scores QKᵀ and the
      weighted sum AV (2·s·d multiply-adds per token and layer; PaLM, Chowdhery et al. 2022,
      appendix B: 6·N + 12·L·d·s FLOPs per token for training, of which 4·L·d·s forward);
    * backward = input-gradients + weight-gradients, where input-gradients ≈ forward
      (2·N·T for the linears, and 8·L·s·d·T for attention, since both operands of QKᵀ and AV are
      activations) and weight-gradients = 2·N_t·T (frozen weights need none).

    Full fine-tuning (``N_t = N``) gives the familiar ≈ 6·N·tokens (Kaplan et al. 2020) plus
    12·L·s·d·T; LoRA with a frozen backbone (``N_t`` ≈ 0) gives ≈ 4·N·tokens plus the attention
    term. If ``embedding_backward`` is false (the embeddings are frozen), autograd does not
    compute the gradient w.r.t. the embedding output, so the input-gradients of the first
    layer's Q/K/V projections (3·d² weights) are subtracted.

    ``ffn`` and ``num_heads`` describe the model but do not change the count (``N`` already
    includes the FFN, and attention FLOPs do not depend on the number of heads). The
    output head (``head_linear_params``, ``head_trainable_linear_params``) runs at
    ``head_positions`` positions: once per example for a classifier (the default,
    ``examples``), at every target token for a language-model head (generation computes the
    logits only there).

    An adapter adds (:class:`fedslice.peft.AdapterCost`): ``virtual_tokens`` positions per
    example that the whole model runs on (prompt tuning, P-tuning: ``T + P·examples`` tokens of
    length ``s + P``; the gradient reaches the input, so the first layer's input-gradients are
    computed), ``prefix_keys`` keys every self-attention reads at each query (prefix tuning:
    the attention term at ``s + P`` keys), and ``adapter_flops`` of its own operations (IA3's
    scaling, P-tuning's encoder, DoRA's norms), counted in the backward half as a whole.

    ``frozen_layers`` lowest blocks with nothing trainable in or below them (their
    ``frozen_linear_params`` linear weights, part of ``N``): autograd's backward stops above
    them, so their input-gradients (linears and attention) are not computed, and the skipped
    q/k/v input-gradient is the lowest trained block's. Only with frozen embeddings and no
    virtual tokens or prefix keys (those need the gradient at the bottom).

    Returns ``{"forward", "backward", "total"}`` in FLOPs (floats).
    """
    del ffn, num_heads  # documented: they do not enter the count
    T = float(tokens) + float(virtual_tokens) * examples
    seq_len = float(seq_len) + virtual_tokens + prefix_keys
    embedding_backward = embedding_backward or virtual_tokens > 0
    if frozen_layers and (embedding_backward or prefix_keys or not 0 < frozen_layers <= num_layers):
        raise ValueError(f"frozen_layers={frozen_layers} of {num_layers}: the backward reaches the "
                         "bottom (trained embeddings, virtual tokens or prefix keys), or out of range")
    heads = float(examples if head_positions is None else head_positions)
    attn_fwd = 4.0 * num_layers * float(seq_len) * hidden * T
    forward = 2.0 * total_linear_params * T + attn_fwd + 2.0 * head_linear_params * heads
    input_grads = 2.0 * total_linear_params * T + 2.0 * attn_fwd + 2.0 * head_linear_params * heads
    if frozen_layers:  # (L_f of L blocks, their weights): no backward below the lowest trained block
        input_grads -= 2.0 * frozen_linear_params * T + 2.0 * attn_fwd * frozen_layers / num_layers
    if not embedding_backward and frozen_layers < num_layers:
        input_grads -= 2.0 * (3 * hidden * hidden) * T
    weight_grads = 2.0 * trainable_linear_params * T + 2.0 * head_trainable_linear_params * heads
    backward = input_grads + weight_grads + adapter_flops
    return {"forward": forward, "backward": backward, "total": forward + backward}


# --------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------


class _SavedRef:
    """What the pack hook stores in the autograd graph: the tensor itself, plus accounting.

    Unpacking returns the very same tensor, so results are unchanged. When autograd frees the
    saved tensor (after backward, or when the graph is dropped) this object is deleted and the
    bytes are released from the running total.
    """

    __slots__ = ("tensor", "_release", "__weakref__")

    def __init__(self, tensor: torch.Tensor, release) -> None:
        self.tensor = tensor
        self._release = release

    def __del__(self) -> None:  # pragma: no cover - exercised through the autograd engine
        release, self._release = self._release, None
        if release is not None:
            release()


class PeakMemory:
    """Peak memory of a block of training code.

    Usage::

        extra = trainable_state_bytes(model, optimizer_slots=2)   # grads + AdamW state
        with PeakMemory(model=model, extra_bytes=extra) as pm:
            ...local training...
        pm.rss_peak_mb           # peak RSS of the process minus RSS at entry (MiB; noisy)
        pm.saved_activation_mb   # peak bytes of tensors saved for backward (MiB; deterministic)
        pm.activation_mb         # the same (alias)
        pm.tensor_peak_mb        # saved_activation_mb + extra_bytes (MiB)
        pm.cuda_peak_mb          # torch.cuda.max_memory_allocated() minus allocated at entry,
                                 # when the model is on CUDA; otherwise None
        pm.peak_mb               # cuda_peak_mb if on CUDA, else rss_peak_mb

    Two measurements are made:

    * **RSS** — at entry, heap pages freed by earlier work are given back to the kernel
      (glibc ``malloc_trim``; otherwise a second client in the same process reuses them and its
      delta reads 0 MB) and the kernel's peak-RSS mark is reset; at exit the peak is the kernel's
      ``VmHWM`` (exact), with a background thread sampling ``psutil`` RSS every ``interval_s``
      (2 ms) where /proc is not available. It sees everything (allocator caching, Python
      objects, the optimizer). It is ``None`` if psutil is missing.
    * **saved tensors** — :func:`torch.autograd.graph.saved_tensors_hooks` sees every tensor
      autograd keeps for backward. Each storage is counted once (by data pointer) while it is
      held, released when autograd frees it, and the running peak is reported. Parameters and
      views of parameters are excluded (weights are not activations), and so are all storages
      of ``model``'s parameters if ``model`` is given. The hooks return the
      saved tensor unchanged, so training results are identical. Code that installs its own
      saved-tensor hooks inside the block (activation checkpointing, offloading) takes
      precedence, and what it saves is then not counted — correctly so for checkpointing.

    ``extra_bytes`` may also be set on the object before the block ends.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        extra_bytes: int = 0,
        interval_s: float = 0.002,
        device: torch.device | str | None = None,
    ) -> None:
        self.extra_bytes = int(extra_bytes)
        self.interval_s = float(interval_s)
        self._param_ptrs: set[int] = set()
        if model is not None:
            for p in model.parameters():
                self._param_ptrs.add(_storage_ptr(p))
            if device is None:
                device = _model_device(model)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._use_cuda = self.device.type == "cuda" and torch.cuda.is_available()

        self.rss_peak_mb: float | None = None
        self.saved_activation_mb: float = 0.0
        self.cuda_peak_mb: float | None = None
        self.elapsed_s: float = 0.0

        self._lock = threading.Lock()
        self._held: dict[int, list[int]] = {}  # storage ptr -> [refcount, nbytes]
        self._current = 0
        self._peak = 0
        self._active = False
        self._hooks = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._rss_base = 0
        self._rss_peak = 0
        self._hwm = False
        self._cuda_base = 0
        self._t0 = 0.0

    # -- results ---------------------------------------------------------------------------

    @property
    def tensor_peak_mb(self) -> float:
        """Peak saved-for-backward bytes plus ``extra_bytes``, in MiB."""
        return self.saved_activation_mb + self.extra_bytes / _MIB

    @property
    def activation_mb(self) -> float:
        """Alias of :attr:`saved_activation_mb` (activations only, without ``extra_bytes``)."""
        return self.saved_activation_mb

    @property
    def peak_mb(self) -> float | None:
        """The main number to report: the CUDA peak on CUDA, else the RSS peak (MiB)."""
        return self.cuda_peak_mb if self._use_cuda else self.rss_peak_mb

    # -- saved-tensor accounting ---------------------------------------------------------------

    def _pack(self, tensor: torch.Tensor):
        if _is_parameter(tensor):
            return tensor
        ptr = _storage_ptr(tensor)
        if ptr == 0 or ptr in self._param_ptrs:
            return tensor
        nbytes = _storage_nbytes(tensor)
        with self._lock:
            entry = self._held.get(ptr)
            if entry is None:
                self._held[ptr] = [1, nbytes]
                self._current += nbytes
                if self._current > self._peak:
                    self._peak = self._current
            else:
                entry[0] += 1
        ref = weakref.ref(self)
        return _SavedRef(tensor, lambda: _release(ref, ptr))

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _SavedRef) else packed

    def _release_ptr(self, ptr: int) -> None:
        with self._lock:
            entry = self._held.get(ptr)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] <= 0:
                del self._held[ptr]
                self._current -= entry[1]

    # -- RSS sampling ----------------------------------------------------------------------

    def _sample(self, proc) -> None:
        while not self._stop.is_set():
            try:
                rss = proc.memory_info().rss
            except Exception:  # pragma: no cover - process info unavailable
                return
            if rss > self._rss_peak:
                self._rss_peak = rss
            self._stop.wait(self.interval_s)

    # -- context manager ---------------------------------------------------------------------

    def __enter__(self) -> PeakMemory:
        self._t0 = time.perf_counter()
        try:
            import psutil
        except ImportError:  # pragma: no cover - psutil is a dependency
            psutil = None
        if psutil is not None:
            proc = psutil.Process(os.getpid())
            # heap pages freed by earlier work would be reused silently (an RSS delta of 0 MB):
            # give them back first, then restart the kernel's exact high-water mark
            trim_heap()
            self._hwm = _reset_rss_high_water_mark()
            self._rss_base = self._rss_peak = proc.memory_info().rss
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, args=(proc,), name="fedslice-peak-rss", daemon=True)
            self._thread.start()
        if self._use_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_base = torch.cuda.memory_allocated(self.device)
        self._active = True
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._hooks.__exit__(exc_type, exc, tb)
        self._hooks = None
        self._active = False
        if self._use_cuda:
            torch.cuda.synchronize(self.device)
            self.cuda_peak_mb = max(0, torch.cuda.max_memory_allocated(self.device) - self._cuda_base) / _MIB
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            try:
                import psutil

                self._rss_peak = max(self._rss_peak, psutil.Process(os.getpid()).memory_info().rss)
            except Exception:  # pragma: no cover
                pass
            if self._hwm:  # the kernel's peak misses no short spike, unlike the sampler
                self._rss_peak = max(self._rss_peak, _rss_high_water_mark() or 0)
            self.rss_peak_mb = max(0, self._rss_peak - self._rss_base) / _MIB
        with self._lock:
            self.saved_activation_mb = self._peak / _MIB
        self.elapsed_s = time.perf_counter() - self._t0


def trim_heap() -> None:
    """glibc's ``malloc_trim(0)``: return freed heap pages to the kernel (no-op elsewhere)."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC = None

#: ``mallopt`` parameter numbers (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: :func:`release_freed_memory`'s size for ``compute.release_memory`` (glibc's initial mmap threshold)
RELEASE_THRESHOLD = 128 * 1024


def release_freed_memory(threshold: int | None) -> bool:
    """glibc: serve allocations of at least ``threshold`` bytes (tensors) from their own memory
    maps, so that freeing one returns it to the kernel at once, and give the heap's free top back
    beyond the same size. Without it glibc raises its mmap threshold to the largest block freed so
    far (up to 32 MB), the activations of a training step then come from the heap, and the heap
    stays at its fragmented peak: a process holds far more than it uses (BENCHMARKS.md,
    "Memory"). ``None`` leaves glibc's policy alone. Returns whether the policy was set (False off
    glibc). Process-wide, like ``torch.set_num_threads``; forked workers inherit it."""
    if threshold is None:
        return False
    if _LIBC is None:
        trim_heap()  # loads libc
    if not _LIBC:
        return False
    mallopt = _LIBC.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, int(threshold))) and bool(mallopt(_M_TRIM_THRESHOLD, int(threshold)))


def _reset_rss_high_water_mark() -> bool:
    """Reset the process's peak RSS (``VmHWM``; Linux >= 4.0: ``5`` > /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _rss_high_water_mark() is not None
    except OSError:
        return False


def _rss_high_water_mark() -> int | None:
    """The kernel's peak RSS of this process since start or the last reset, in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _release(ref: weakref.ref, ptr: int) -> None:
    pm = ref()
    if pm is not None:
        pm._release_ptr(ptr)


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (``F.linear`` saves ``weight.t()`` for the input-gradient)."""
    if isinstance(t, nn.Parameter):
        return True
    base = getattr(t, "_base", None)
    return base is not None and isinstance(base, nn.Parameter)


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except Exception:  # sparse / nested / tensor subclasses without a plain storage
        return int(t.data_ptr()) if t.layout == torch.strided else 0


def _storage_nbytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:
        return int(t.numel() * t.element_size())


# --------------------------------------------------------------------------------------------
# Per-client record
# --------------------------------------------------------------------------------------------


@dataclass
class ClientCost:
    """One client's costs for one round: the typed record behind the cost keys of a round's
    ``client_metrics`` (metrics.jsonl) and of summary.json.

    ``bytes_down``/``params_down``: what the server sent; ``bytes_up``/``params_up``: what the client
    sent back; ``trainable_params``: parameters updated locally; ``flops_measured``: FLOPs of the
    local training (measured on one step and scaled to all steps, or summed); ``flops_analytic``:
    :func:`analytic_train_flops` total for the same tokens; ``examples``/``tokens``: training
    examples and (non-padding or padded, as the caller documents) tokens processed;
    ``peak_rss_mb``: :attr:`PeakMemory.peak_mb`; ``activation_mb``:
    :attr:`PeakMemory.tensor_peak_mb` (or ``saved_activation_mb``); ``train_time_s``: wall time.
    A field is None when it was not measured (a client that sat out).
    """

    bytes_down: int | None = 0
    bytes_up: int | None = 0
    params_down: int | None = 0
    params_up: int | None = 0
    trainable_params: int | None = 0
    flops_measured: float | None = None
    flops_analytic: float | None = None
    examples: int = 0
    tokens: int = 0
    peak_rss_mb: float | None = None
    activation_mb: float | None = None
    train_time_s: float | None = 0.0
    #: what the client's device holds at its peak: the model it trains + ``activation_mb``
    #: (deterministic, unlike RSS deltas); ``gpu_peak_mb``: torch.cuda.max_memory_allocated
    model_mb: float | None = None
    memory_mb: float | None = None
    tokens_real: int | None = None  # non-padding tokens (``tokens`` counts padding too)
    gpu_peak_mb: float | None = None

    #: metrics keys averaged over a round's used replies (``<key>_mean`` in the round record)
    ROUND_MEANS: ClassVar[tuple[str, ...]] = ("bytes_down", "bytes_up", "flops_measured",
                                               "flops_analytic", "trainable_params", "params_up")
    #: ... and over the whole run (``<key>_mean`` in summary.json)
    SUMMARY_MEANS: ClassVar[tuple[str, ...]] = ROUND_MEANS + ("train_time_s",)
    #: metrics keys whose maximum is reported (``<key>_max``)
    PEAKS: ClassVar[tuple[str, ...]] = ("peak_rss_mb", "activation_mb", "memory_mb", "gpu_peak_mb")
    #: field -> its key in a client's metrics where they differ
    METRIC_KEYS: ClassVar[dict[str, str]] = {"examples": "examples_trained"}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_metrics(self) -> dict[str, Any]:
        """The record as a client's metrics (the keys of metrics.jsonl)."""
        return {self.METRIC_KEYS.get(k, k): v for k, v in asdict(self).items()}
