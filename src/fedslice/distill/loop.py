"""The distillation loop: a student matches a frozen teacher on corpus chunks, training only the
given parameters (optionally only some of their rows/columns, through gradient masks).

Both models run in eval mode (no dropout), the teacher under ``no_grad``; every other parameter
of the student is frozen for the duration (flags restored afterwards), so parameters the student
shares with the teacher (FedPFT's attention and LoRA, FedOT's adapter) never change. AdamW without
weight decay, linear warm-up then linear decay (the public FedPFT schedule). With zero weight
decay, an element whose gradient is always masked to 0 keeps its value exactly (Adam's update of a
zero-gradient element is 0).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn as nn

from fedslice.compute import model_device, to_device
from fedslice.data.batching import TokenizedSplit, iter_batches
from fedslice.measure import count_flops
from fedslice.models.arch import ArchSpec
from fedslice import progress

#: loss_fn(student_layers, teacher_layers, batch) -> (loss, parts); *_layers[i] = output of block i
#: (global index over the stacks, :func:`block_units`).
LossFn = Callable[[list[torch.Tensor], list[torch.Tensor], dict[str, torch.Tensor]],
                  tuple[torch.Tensor, dict[str, float]]]


def block_units(model: nn.Module, arch: ArchSpec) -> list[tuple[int, int]]:
    """(stack, layer) of every block of ``model``, stacks in table order: the position in this
    list is a block's *global* index (an encoder-decoder's decoder blocks follow its encoder's)."""
    return [(k, l) for k in range(len(arch.stacks)) for l in range(len(arch.blocks(model, k)))]


def block_outputs(model: nn.Module, arch: ArchSpec, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The output hidden states (B, T_k, d) of every block of every stack of ``model`` on
    ``batch``, in :func:`block_units` order.

    Captured with temporary forward hooks, not HF's ``output_hidden_states``: transformers 5
    records hidden states through hooks installed once per module, which double-count modules
    that a proxy shares with its full model.
    """
    units = block_units(model, arch)
    outs: list[torch.Tensor | None] = [None] * len(units)

    def hook_for(i: int):
        def hook(_module, _inputs, output):
            outs[i] = output[0] if isinstance(output, tuple) else output
        return hook

    handles = [arch.blocks(model, k)[l].register_forward_hook(hook_for(i))
               for i, (k, l) in enumerate(units)]
    try:
        model(**to_device(batch, model_device(model)))
    finally:
        for h in handles:
            h.remove()
    return outs  # type: ignore[return-value]


def stack_mask(arch: ArchSpec, stack: int, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, T_k) 0/1 mask of the real tokens a stack reads: the decoder of an encoder-decoder reads
    the decoder inputs (``decoder_attention_mask``, when the batch has one), any other stack the
    inputs (``attention_mask``)."""
    if arch.kind == "encoder-decoder" and arch.stacks[stack].name == "decoder":
        return batch.get("decoder_attention_mask", batch["attention_mask"])
    return batch["attention_mask"]


def block_masks(model: nn.Module, arch: ArchSpec, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """:func:`stack_mask` of every block, in :func:`block_units` order."""
    return [stack_mask(arch, k, batch) for k, _ in block_units(model, arch)]


def teacher_forced(batch: dict[str, torch.Tensor], arch: ArchSpec, start_id: int | None) -> dict[str, torch.Tensor]:
    """A corpus batch for ``arch``: an encoder-decoder's decoder reads the chunk itself shifted
    right behind ``start_id`` (teacher forcing: the decoder reproduces what the encoder read), so
    its real positions are the chunk's (``decoder_attention_mask`` = ``attention_mask``); other
    architectures read the chunk as it is (a decoder with its causal attention)."""
    if arch.kind != "encoder-decoder" or "decoder_input_ids" in batch or start_id is None:
        return batch
    ids, mask = batch["input_ids"], batch["attention_mask"]  # (B, T)
    start = torch.full_like(ids[:, :1], start_id)
    return {**batch, "decoder_input_ids": torch.cat([start, ids[:, :-1]], 1),  # (B, T)
            "decoder_attention_mask": mask}


def decoder_start(model: nn.Module) -> int | None:
    """The HF config's ``decoder_start_token_id`` (None for models without a decoder start)."""
    return getattr(getattr(model, "config", None), "decoder_start_token_id", None)


def input_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens of the inputs (token ids; an image batch: patches + prefix tokens, its mask)."""
    return int((batch["input_ids"] if "input_ids" in batch else batch["attention_mask"]).numel())


@dataclass
class DistillLog:
    """Per-step loss parts and the measured cost of one distillation."""

    losses: list[dict[str, float]] = field(default_factory=list)
    steps: int = 0
    tokens: int = 0
    flops: float = 0.0  # FlopCounterMode on the first step, scaled by tokens
    time_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DistillLog:
        return cls(**{k: d[k] for k in ("losses", "steps", "tokens", "flops", "time_s")})

    def summary(self, prefix: str) -> dict[str, float]:
        first = self.losses[0]["loss"] if self.losses else math.nan
        last = self.losses[-1]["loss"] if self.losses else math.nan
        return {f"{prefix}_steps": self.steps, f"{prefix}_loss_start": first,
                f"{prefix}_loss_end": last, f"{prefix}_flops": self.flops,
                f"{prefix}_tokens": self.tokens, f"{prefix}_time_s": self.time_s}


@contextlib.contextmanager
def train_only(models: list[nn.Module], params: dict[str, nn.Parameter]) -> Iterator[None]:
    """Freeze every parameter of ``models`` except ``params``, in eval mode; restore afterwards."""
    keep = {id(p) for p in params.values()}
    every = {id(p): p for m in models for p in m.parameters()}
    every.update({id(p): p for p in params.values()})
    flags = {i: p.requires_grad for i, p in every.items()}
    modes = [m.training for m in models]
    try:
        for i, p in every.items():
            p.requires_grad_(i in keep)
        for m in models:
            m.eval()
        yield
    finally:
        for i, p in every.items():
            p.requires_grad_(flags[i])
        for m, mode in zip(models, modes):
            m.train(mode)


def _cycle(corpus: TokenizedSplit, batch_size: int, gen: torch.Generator) -> Iterator[dict]:
    while True:
        for batch in iter_batches(corpus, range(len(corpus)), batch_size, shuffle=True, generator=gen):
            batch.pop("labels", None)
            yield batch


def _schedule(steps: int, warmup: float) -> Callable[[int], float]:
    w = max(1, int(round(warmup * steps)))
    return lambda s: (s + 1) / w if s < w else max(0.0, (steps - s) / max(1, steps - w))


def distill(student: nn.Module, teacher: nn.Module, arch: ArchSpec, params: dict[str, nn.Parameter],
            corpus: TokenizedSplit, loss_fn: LossFn, *, steps: int, lr: float, warmup: float,
            batch_size: int, seed: int, grad_masks: dict[str, torch.Tensor] | None = None,
            max_grad_norm: float = 1.0) -> DistillLog:
    """Train ``params`` of ``student`` for ``steps`` steps so that ``loss_fn(student_layers,
    teacher_layers, batch)`` falls (the block outputs of :func:`block_outputs` over every stack;
    an encoder-decoder reads each corpus chunk in both stacks, :func:`teacher_forced`).

    ``grad_masks[name]`` (broadcastable to the parameter) zeroes the gradient of frozen elements.
    """
    log = DistillLog()
    if steps <= 0 or not params:
        return log
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(params.values(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(steps, warmup))
    batches = _cycle(corpus, batch_size, gen)
    start_id = decoder_start(teacher)
    t0 = time.perf_counter()
    flops_per_token = 0.0
    with train_only([student, teacher], params), progress.task("distillation", steps) as advance:
        for step in range(steps):
            advance()
            batch = teacher_forced(next(batches), arch, start_id)
            with count_flops(enabled=step == 0) as fc:
                with torch.no_grad():
                    t_out = block_outputs(teacher, arch, batch)
                s_out = block_outputs(student, arch, batch)
                loss, parts = loss_fn(s_out, t_out, batch)
                loss.backward()
            if step == 0:
                flops_per_token = fc.total / input_tokens(batch)
            _mask_grads(params, grad_masks)
            if max_grad_norm:
                torch.nn.utils.clip_grad_norm_(params.values(), max_grad_norm)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            log.losses.append(parts)
            log.tokens += input_tokens(batch)
    log.steps = steps
    log.flops = flops_per_token * log.tokens
    log.time_s = time.perf_counter() - t0
    return log


def _mask_grads(params: dict[str, nn.Parameter], masks: dict[str, torch.Tensor] | None) -> None:
    if not masks:
        return
    for name, m in masks.items():
        g = params[name].grad
        if g is not None:
            g.mul_(m.to(g.dtype))
