"""What slicing measures: sub-model grids, a training step's measured cost, and the elastic sizes.

:func:`width_candidates` is the grid of leading-slice specs ordered by size (``round(w*H)`` heads
and ``round(w*F)`` neurons per layer, optionally fewer layers); :func:`measure_training_step`
measures one training step of a real model on a batch (FLOPs with ``FlopCounterMode``; memory =
parameters + gradients and AdamW state of the trainable ones + the peak of tensors saved for
backward), which the budget planner (:mod:`fedslice.methods.planner`, the one planner of client
budgets) builds on. :class:`WidthsByFlops` picks the largest sub-model within a fraction of the
full model's training FLOPs: RaFFM's serve-at-any-size sizes (``method.elastic_sizes``), measured
on a profile batch, never over the fraction.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from fedslice.compute import model_device, to_device
from fedslice.data.packing import first_rows
from fedslice.measure import PeakMemory, count_flops
from fedslice.measure.sizes import storage_nbytes, storage_ptr
from fedslice.models.quantize import held_bytes
from fedslice.slicing.spec import ModelSlice, SliceSpec, Spec, stack_list

_MIB = float(1 << 20)


@dataclass(frozen=True)
class SpecCost:
    params: int  # parameters of the sub-model (embeddings and head included)
    trainable: int
    flops: float  # FLOPs of one training step (forward + backward) on the profile batch
    flops_ratio: float  # flops / the full model's
    memory_mb: float  # parameters + grads + AdamW state of the trainable ones + saved activations

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SizedSpec:
    """The largest sub-model within a FLOPs fraction, its measured cost, or why there is none."""

    spec: Spec | None
    cost: SpecCost | None
    reason: str | None = None


def depth_layers(num_layers: int, keep: int) -> list[int]:
    """``keep`` layers spread evenly, first and last always kept (Offsite-Tuning's emulator rule)."""
    if keep >= num_layers:
        return list(range(num_layers))
    if keep == 1:
        return [num_layers - 1]
    return sorted({round(i * (num_layers - 1) / (keep - 1)) for i in range(keep)})


def _linear_params(dims: Mapping[str, int], spec: SliceSpec) -> int:
    d = dims["hidden"]
    return sum(4 * d * len(h) * spec.head_dim + 2 * d * len(f) for h, f in zip(spec.heads, spec.neurons))


def _size(dims: Sequence[Mapping[str, int]], spec: Spec) -> int:
    return sum(_linear_params(d, s) for d, s in zip(dims, stack_list(spec)) if s is not None)


def spec_params(spec: Spec, dims: Mapping[str, int] | Sequence[Mapping[str, int]]) -> int:
    """Linear parameters (attention and FFN) of the blocks ``spec`` keeps."""
    return _size([dims] if isinstance(dims, Mapping) else list(dims), spec)


def width_candidates(dims: Mapping[str, int] | Sequence[Mapping[str, int]], steps: int,
                     depth: bool = False) -> list[Spec]:
    """Leading-slice specs, smallest first (by linear parameters); the last is the full model.

    One stack's ``dims``: :class:`SliceSpec` s (``depth``: also fewer layers); every stack's
    (an encoder-decoder): :class:`ModelSlice` s of the same width in every stack."""
    if not isinstance(dims, Mapping) and len(dims) == 1:
        dims = dims[0]
    if not isinstance(dims, Mapping):
        if depth:
            raise ValueError("depth candidates are for one-stack models")
        specs = {ModelSlice.leading(dims, j / steps): None for j in range(1, steps + 1)}
        return sorted(specs, key=lambda s: _size(dims, s))
    H, F, L = dims["num_heads"], dims["ffn"], dims["num_layers"]
    out: dict[SliceSpec, None] = {}
    for keep in (range(1, L + 1) if depth else [L]):
        layers = depth_layers(L, keep)
        for j in range(1, steps + 1):
            w = j / steps
            out[SliceSpec.leading(dims, max(1, round(w * H)), max(1, round(w * F)), layers)] = None
    return sorted(out, key=lambda s: (_linear_params(dims, s), len(s.layers)))


def profile_batch(vocab_size: int, batch_size: int, seq_len: int, seed: int = 0,
                  head: str = "sequence_classification") -> dict[str, torch.Tensor]:
    """A synthetic training batch of the given shape (costs depend on shapes, not on tokens):
    class labels (``sequence_classification``), the second half of every row as the target
    (``causal_lm``), or a decoder half as long as the input (``seq2seq_lm``)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long)}
    if head == "sequence_classification":
        batch["labels"] = torch.zeros(batch_size, dtype=torch.long)
    elif head == "causal_lm":
        labels = ids.clone()
        labels[:, : seq_len // 2] = -100
        batch["labels"] = labels
    else:
        dec = torch.randint(0, vocab_size, (batch_size, max(1, seq_len // 2)), generator=g)
        batch.update(decoder_input_ids=dec, labels=dec.clone())
    return batch


def training_state_bytes(model: nn.Module) -> int:
    """Bytes a training step holds besides its activations: every parameter (a quantized base's
    int8 data and scales, not fp32) and buffer (position ids, ...), and a gradient and two
    AdamW moments per trainable parameter: what a run's ``memory_mb`` counts besides them."""
    params = {id(p): p for p in model.parameters()}.values()
    buffers = {storage_ptr(b): storage_nbytes(b) for b in model.buffers() if not b.is_meta}
    return sum(held_bytes(p) for p in params) + sum(buffers.values()) + 3 * sum(
        p.numel() * p.element_size() for p in params if p.requires_grad)


@dataclass(frozen=True)
class StepMeasure:
    """One training step measured on a batch as given (not scaled): what
    :func:`measure_training_step` scales to a whole batch, and what a caller that measures the
    same model on the same rows again may keep (:func:`batch_key`)."""

    flops: float  # FLOPs of the step (0 where not counted)
    saved_mb: float  # peak MiB of tensors saved for backward
    attention: float  # of ``flops``, attention's
    head: float  # of ``flops``, the head modules'
    static_bytes: int  # :func:`training_state_bytes`
    params: int
    trainable: int


def batch_key(batch: Mapping[str, torch.Tensor]) -> tuple:
    """What a step's measured costs depend on in ``batch``: each tensor's name, shape, dtype
    and values (a digest), so that equal keys are the same step."""
    import hashlib

    return tuple((k, tuple(v.shape), str(v.dtype),
                  hashlib.blake2b(v.detach().cpu().contiguous().numpy().tobytes(), digest_size=16).hexdigest())
                 for k, v in sorted(batch.items()))


def measure_step(model: nn.Module, batch: Mapping[str, torch.Tensor],
                 loss_fn: Callable[[nn.Module, dict], torch.Tensor] | None = None,
                 flops: bool = True, head: Sequence[str] = ()) -> StepMeasure:
    """One training step of ``model`` on ``batch`` as given, measured (:class:`StepMeasure`);
    :func:`measure_training_step` documents what is counted."""
    params = {id(p): p for p in model.parameters()}.values()
    n_params = sum(p.numel() for p in params)
    n_train = sum(p.numel() for p in params if p.requires_grad)
    static = training_state_bytes(model)
    was_training = model.training
    model.train()
    try:
        with torch.random.fork_rng(), torch.enable_grad():
            with PeakMemory(model, interval_s=1.0, rss=False) as mem, count_flops(enabled=flops, head=head) as fc:
                batch = to_device(batch, model_device(model))
                loss = loss_fn(model, dict(batch)) if loss_fn else model(**batch).loss
                loss.backward()
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return StepMeasure(float(fc.total), mem.saved_activation_mb, float(fc.attention), float(fc.head),
                       static, n_params, n_train)


def measure_training_step(model: nn.Module, batch: Mapping[str, torch.Tensor],
                          measure_rows: int | None = 2,
                          loss_fn: Callable[[nn.Module, dict], torch.Tensor] | None = None,
                          flops: bool = True, head: Sequence[str] = (),
                          parts: dict[str, float] | None = None,
                          measured: Callable[[Mapping[str, torch.Tensor]], StepMeasure] | None = None,
                          rows: int | None = None) -> tuple[float, float, int, int]:
    """(FLOPs, memory MiB, params, trainable params) of one training step of ``model`` on ``batch``.

    Memory = every parameter + gradient and two AdamW moments per trainable parameter + the peak
    of tensors saved for backward (deterministic, unlike RSS). The step is run on the first
    ``measure_rows`` rows of the batch and its FLOPs and saved-activation bytes are scaled to the
    whole batch: every matmul and every saved activation of an encoder is linear in the batch
    dimension, and the measurement is then ~16x cheaper (``None``: run the whole batch). The
    RNG state and train/eval mode are restored and the gradients left as None. ``loss_fn``
    (a task's loss: e.g. logits at target positions only) replaces ``model(**batch).loss``.
    ``flops=False``: memory only (no FLOP counter, which slows every op down); FLOPs are 0.
    ``parts``: filled with the FLOPs' ``attention`` and ``head`` shares (``head``: the head
    modules' name parts, :func:`fedslice.measure.flops.head_segments`), scaled as the total.
    ``measured(rows)``: the step on the measured rows (default :func:`measure_step`; a caller
    that measures the same model often passes one that keeps its answers, :func:`batch_key`).
    ``rows``: the rows to scale to where fewer than the batch's (a step of one row predicted
    from the first two, as two rows predict four).
    """
    held = len(batch["input_ids"] if "input_ids" in batch else batch["pixel_values"])
    rows = held if rows is None else rows
    if measure_rows is not None and measure_rows < held:
        scale = rows / measure_rows
        batch = first_rows(batch, measure_rows)
    else:
        scale = rows / held
    if measured is None:
        m = measure_step(model, batch, loss_fn, flops, head)
    else:
        m = measured(batch)
    memory = m.static_bytes / _MIB + scale * m.saved_mb
    if parts is not None:
        parts.update(attention=scale * m.attention, head=scale * m.head)
    return scale * m.flops, memory, m.params, m.trainable


class WidthsByFlops:
    """Largest candidate whose measured training FLOPs are within a fraction of the full model's;
    measurements are cached per spec."""

    def __init__(self, candidates: Sequence[Spec],
                 measure: Callable[[Spec], tuple[float, float, int, int]]):
        if not candidates:
            raise ValueError("the elastic sizes need at least one candidate")
        self.candidates = list(candidates)
        self._measure = measure
        self._costs: dict[Spec, SpecCost] = {}
        self._full_flops: float | None = None

    @property
    def full_flops(self) -> float:
        if self._full_flops is None:
            self._full_flops = self._measure(self.candidates[-1])[0]
        return self._full_flops

    def cost(self, spec: Spec) -> SpecCost:
        if spec not in self._costs:
            flops, mem, params, train = self._measure(spec)
            self._costs[spec] = SpecCost(params, train, flops, flops / self.full_flops, mem)
        return self._costs[spec]

    def fits(self, fraction: float, spec: Spec) -> bool:
        return self.cost(spec).flops_ratio <= fraction * (1 + 1e-9)

    def at(self, fraction: float) -> SizedSpec:
        """The largest fitting candidate (binary search over the size-ordered grid, every answer
        verified by measurement), or no spec with the reason."""
        if not self.fits(fraction, self.candidates[0]):
            smallest = self.cost(self.candidates[0]).flops_ratio
            return SizedSpec(None, None, f"size {fraction:g} is below the smallest sub-model "
                               f"({smallest:.4g}x the full model's training FLOPs)")
        lo, hi = 0, len(self.candidates) - 1  # candidates[lo] fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.fits(fraction, self.candidates[mid]) else (lo, mid - 1)
        spec = self.candidates[lo]
        return SizedSpec(spec, self.cost(spec))
