"""Peak memory of local training (:class:`PeakMemory`): the process's resident memory and,
deterministically, the peak bytes of tensors saved for backward (activations)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from fedslice.heap import trim_heap
from fedslice.measure.sizes import model_device, storage_nbytes, storage_ptr


_MIB = float(1 << 20)


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


class BlockPeak:
    """What :meth:`PeakMemory.track_block` yields: the block's saved-tensor peak, in bytes."""

    __slots__ = ("peak_bytes",)

    def __init__(self) -> None:
        self.peak_bytes = 0


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

    ``rss=False`` measures no RSS (``rss_peak_mb`` stays None): no heap trim, no sampler, what
    a caller that reads only the saved tensors saves on every block (the planner's measured
    steps).

    ``saved_tensors=False`` installs no hooks for the whole block: only the blocks under
    :meth:`track` are counted (a training loop tracks the steps whose batch no earlier tracked
    batch dominates, :class:`LargestBatches`; each hook call is Python work per saved tensor,
    which on a GPU, where a step is launch-bound, costs a third of a small decoder's step).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        extra_bytes: int = 0,
        interval_s: float = 0.002,
        device: torch.device | str | None = None,
        saved_tensors: bool = True,
        rss: bool = True,
    ) -> None:
        self.extra_bytes = int(extra_bytes)
        self._every_block = bool(saved_tensors)
        self._rss = bool(rss)
        self.interval_s = float(interval_s)
        self._param_ptrs: set[int] = set()
        if model is not None:
            for p in model.parameters():
                self._param_ptrs.add(storage_ptr(p))
            if device is None:
                device = model_device(model)
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
        ptr = storage_ptr(tensor)
        if ptr == 0 or ptr in self._param_ptrs:
            return tensor
        nbytes = storage_nbytes(tensor)
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
        if psutil is not None and self._rss:
            proc = psutil.Process(os.getpid())
            # heap pages freed by earlier work would be reused silently (an RSS delta of 0 MB):
            # give them back first, then restart the kernel's exact high-water mark
            trim_heap()
            self._hwm = _reset_rss_high_water_mark()
            self._rss_base = self._rss_peak = proc.memory_info().rss
            if not self._hwm:  # the kernel's mark misses nothing: no sampler to take the GIL
                self._stop.clear()
                self._thread = threading.Thread(target=self._sample, args=(proc,), name="fedslice-peak-rss",
                                                daemon=True)
                self._thread.start()
        if self._use_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_base = torch.cuda.memory_allocated(self.device)
        self._active = True
        if self._every_block:
            self._hooks = self.track()
            self._hooks.__enter__()
        return self

    def track(self) -> torch.autograd.graph.saved_tensors_hooks:
        """A context counting the tensors saved for backward inside it (the whole block does
        unless ``saved_tensors=False``)."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    @contextlib.contextmanager
    def track_block(self) -> Iterator[BlockPeak]:
        """:meth:`track`, and the block's own peak of saved bytes in the ``peak_bytes`` of what
        it yields (the running peak stays the maximum over every block)."""
        block = BlockPeak()
        with self._lock:
            before, self._peak = self._peak, self._current
        try:
            with self.track():
                yield block
        finally:
            with self._lock:
                block.peak_bytes = self._peak
                self._peak = max(before, self._peak)

    def add_saved_peak(self, nbytes: int) -> None:
        """A block's saved-tensor peak measured elsewhere (the same computation on an earlier
        call: :meth:`track_block`), counted as if this block had been tracked."""
        with self._lock:
            self._peak = max(self._peak, self._current + int(nbytes))

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._hooks is not None:
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
        if self._rss_base:
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


class LargestBatches:
    """Which batches of a loop to measure the saved tensors of: a batch is measured unless an
    earlier measured batch has the same tensors, each at least as large in every dimension
    (activations grow with every dimension of the input: rows, length, examples packed), so the
    peak over the measured batches is the peak over all of them."""

    def __init__(self) -> None:
        self._measured: list[dict[str, tuple[int, ...]]] = []

    def __call__(self, batch) -> bool:
        shapes = {k: tuple(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        if any(_dominates(m, shapes) for m in self._measured):
            return False
        self._measured.append(shapes)
        return True


def _dominates(a: dict[str, tuple[int, ...]], b: dict[str, tuple[int, ...]]) -> bool:
    return a.keys() == b.keys() and all(
        len(a[k]) == len(b[k]) and all(x >= y for x, y in zip(a[k], b[k])) for k in a)
