"""The ``[compute]`` section: device, threads, workers, precision.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from fedslice.config.base import Section


class ComputeConfig(Section):
    """Where and how clients train: the device, the precision, and how a round's clients share
    the machine (one process after another, concurrent worker processes, or one batched pass)."""

    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$", description="'auto': "
                        "the first CUDA GPU when torch sees one, else the CPU; 'cpu'; 'cuda' or "
                        "'cuda:N'. Training, evaluation and distillation run there; the server's "
                        "aggregation stays in fp32 on the CPU.")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="Autocast precision of forward/backward (master weights, optimizer "
        "state and aggregation stay fp32). 'fp16' (with loss scaling) needs a GPU; 'bf16' needs "
        "a GPU or a CPU with native bf16 (AVX512-BF16 or AMX).")
    workers: int | Literal["auto"] = Field(
        "auto", description="CPU: worker processes that train a round's clients concurrently, "
        "each at one intra-op thread, forked after the model is loaded (the backbone is shared, "
        "not copied). 'auto': the usable cores, at most the round's clients; 1: one client after "
        "another in this process. Ignored on a GPU (see batched_clients).")
    batched_clients: bool | Literal["auto"] = Field(
        "auto", description="Train a round's clients together in one batched pass over the "
        "shared frozen backbone (each client's adapter applied to its own rows; per-client "
        "losses, optimizers and data order, so the result equals one-after-another training). "
        "For adapters that stack (LoRA) and methods whose clients train the same shapes. 'auto': "
        "on a GPU only.")
    max_batched_clients: int | None = Field(None, gt=0, description="At most this many clients "
                                            "per batched pass (GPU memory); default: all.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in the "
                                         "backward pass (less memory, ~30% more compute).")
    compile: bool = Field(False, description="torch.compile the model (the compile time is "
                          "reported; worth it for long runs on a GPU).")
    linear_kernels: Literal["auto", "onednn", "torch"] = Field(
        "auto", description="CPU training in fp32: the kernels of the linear layers whose weights "
        "are frozen (the backbone under an adapter), forward and backward. 'onednn': oneDNN's "
        "(torch's mkldnn build), 1.5x a MiniLM-L6 + LoRA client step on an AMD EPYC, where "
        "torch's MKL sgemm runs its AVX2 code path (BENCHMARKS.md); 'torch': torch's own (MKL); "
        "'auto': 'onednn' where torch has it. Products under 2^20 multiply-adds keep torch's. "
        "The two agree to float rounding (the same fp32 products summed in another order), not "
        "bit for bit.")
    release_memory: bool = Field(False, description="glibc (Linux): tensors get their own "
                                 "memory maps and go back to the system when freed, instead of "
                                 "the heap growing to a fragmented peak that it keeps. On the "
                                 "SST-2 workload (2 workers): peak memory (PSS) 0.53x, wall time "
                                 "1.28x (BENCHMARKS.md 'Memory'): for clients short of memory. "
                                 "Process-wide, like the thread count.")

    @field_validator("workers")
    @classmethod
    def _workers(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError("workers must be >= 1 (or 'auto')")
        return v
