"""Where and how tensors are computed: the device, autocast precision, and the CPU cores a run
may use (``[compute]`` of the config).

Everything that trains or evaluates asks this module instead of hard-coding ``cpu``: a
:class:`Compute` is resolved once per process from the config (``auto`` becomes ``cuda`` when
torch sees a GPU) and passed to the code that runs models. Master weights, optimizer state and
the server's aggregation stay fp32; only the forward/backward runs under autocast.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from fedslice import onednn
from fedslice.config import ComputeConfig
from fedslice.errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask; ``os.cpu_count()`` elsewhere)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def cpu_has_bf16() -> bool:
    """Whether the CPU computes bf16 natively (AVX512-BF16 or AMX-BF16 on x86; ARM's BF16)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # pragma: no cover - not Linux
        return False
    flags = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def resolve_device(spec: str) -> torch.device:
    """``compute.device`` as a torch device; a ConfigError naming the field when it cannot be had."""
    if spec == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ConfigError(f"compute.device = {spec!r}: no CUDA GPU is visible (torch "
                              f"{torch.__version__}, {build}; torch.cuda.is_available() is False)")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise ConfigError(f"compute.device = {spec!r}: only {torch.cuda.device_count()} CUDA "
                              f"device(s) visible")
    return device


def check_precision(precision: str, device: torch.device) -> None:
    """A ConfigError when ``compute.precision`` cannot run on ``device``, saying why."""
    if device.type == "cpu" and precision == "fp16":
        raise ConfigError("compute.precision = 'fp16' needs a GPU: CPU autocast has no fp16 "
                          "matmul kernels worth using and fp16 training needs loss scaling; use "
                          "'bf16' (on a CPU with native bf16) or 'fp32'")
    if device.type == "cpu" and precision == "bf16" and not cpu_has_bf16():
        raise ConfigError("compute.precision = 'bf16': this CPU has no native bf16 instructions "
                          "(no avx512_bf16 / amx_bf16 in /proc/cpuinfo), so bf16 would be emulated "
                          "and slower than fp32; use 'fp32'")
    if device.type == "cuda" and precision == "bf16" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"compute.precision = 'bf16': GPU {torch.cuda.get_device_name(device)} "
                          "does not support bf16; use 'fp16' or 'fp32'")


@dataclass(frozen=True)
class Compute:
    """A resolved ``[compute]`` section: the device, the autocast dtype, the concurrency."""

    device: torch.device = torch.device("cpu")
    precision: str = "fp32"
    workers: int = 1
    batched: bool = False
    max_batched: int | None = None
    gradient_checkpointing: bool = False
    compile: bool = False
    linear_kernels: str = "auto"

    @classmethod
    def from_config(cls, cfg: ComputeConfig, clients_per_round: int = 1) -> Compute:
        device = resolve_device(cfg.device)
        check_precision(cfg.precision, device)
        if cfg.linear_kernels == "onednn" and not onednn.available():
            raise ConfigError("compute.linear_kernels = 'onednn': this torch build has no oneDNN "
                              "linear kernel (torch.backends.mkldnn); use 'auto' or 'torch'")
        if device.type == "cuda":
            workers = 1  # one GPU: a round's clients share it through the batched pass
        elif cfg.workers == "auto":
            workers = max(1, min(usable_cores(), clients_per_round))
        else:
            workers = int(cfg.workers)
        batched = device.type == "cuda" if cfg.batched_clients == "auto" else bool(cfg.batched_clients)
        return cls(device=device, precision=cfg.precision, workers=workers, batched=batched,
                   max_batched=cfg.max_batched_clients,
                   gradient_checkpointing=cfg.gradient_checkpointing, compile=cfg.compile,
                   linear_kernels=cfg.linear_kernels)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.precision]

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def autocast(self) -> contextlib.AbstractContextManager:
        """Autocast to ``precision`` on the device (a no-op in fp32)."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def training_linears(self) -> contextlib.AbstractContextManager:
        """Around a client's training: its frozen linear layers on oneDNN's kernels where
        ``linear_kernels`` picks them, on the CPU in fp32 (:mod:`fedslice.onednn`)."""
        cpu_fp32 = self.device.type == "cpu" and self.precision == "fp32"
        return onednn.frozen_linears_on_onednn(cpu_fp32 and onednn.uses_onednn(self.linear_kernels))

    def grad_scaler(self):
        """A loss scaler for fp16 (None otherwise: bf16 and fp32 need none)."""
        if self.precision != "fp16":
            return None
        return torch.amp.GradScaler(self.device.type)

    def to_device(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return to_device(batch, self.device)

    def apply_to(self, model: torch.nn.Module) -> None:
        """``gradient_checkpointing`` and ``compile`` on the model clients train (in place:
        parameter names are unchanged; a compiled model compiles at first use)."""
        if self.gradient_checkpointing:
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            if not getattr(base, "supports_gradient_checkpointing", False):
                raise ConfigError(f"compute.gradient_checkpointing: {type(base).__name__} does not "
                                  "support gradient checkpointing")
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.compile:
            model.compile()


CPU = Compute()


def to_device(batch: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A batch's tensors on ``device`` (unchanged when they are there already; from pinned host
    memory without blocking on a GPU)."""
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.device != device:
            v = v.to(device, non_blocking=device.type == "cuda")
        out[k] = v
    return out


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's first parameter (the CPU for a model without parameters)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run the block at one intra-op thread (restored after)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
