"""The client side: local training of the trainable tensors of a (shared) model."""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from fedslice import progress
from fedslice.compute import CPU, Compute, model_device, to_device
from fedslice.data.batching import TokenizedSplit, batch_indices, num_batches
from fedslice.data.packing import packed_training
from fedslice.measure import LargestBatches, PeakMemory, count_flops
from fedslice.measure.flops import head_segments
from fedslice.tasks.base import batch_examples, batch_head_positions, batch_real_tokens, batch_rows, batch_tokens
from fedslice.fl.orders import Orders, OrdersLike
from fedslice.fl.memory_hold import (ActivationBound, ActivationReference, MemoryBudgetExceeded,
                                     activation_units, cheapest_step_mb, memory_allowance,
                                     memory_split)


_MIB = float(1 << 20)


#: ``loss_fn(model, batch) -> scalar`` (the task's training loss)
LossFn = Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]


@dataclass
class LocalResult:
    loss: float  # mean training loss over the local steps (not finite if a step diverged)
    steps: int
    examples: int  # examples trained on, repeats included (FedAvg weights use the partition size)
    head_positions: int  # where the output head ran: examples, or target tokens of an LM task
    tokens: int  # padded tokens processed (what the FLOPs scale with)
    flops_measured: float  # FlopCounterMode on the first step, extrapolated (train_local)
    peak_rss_mb: float
    activation_mb: float
    time_s: float
    nonfinite: bool
    gpu_peak_mb: float | None = None  # torch.cuda.max_memory_allocated during training (CUDA)
    tokens_real: int | None = None  # non-padding tokens of the batches trained on
    rows: int | None = None  # rows the model ran on (packed batches: fewer than examples)
    # packed batches: the row length attention's FLOPs go with, sum(rows x length²) / tokens
    # (rows differ in length from step to step; tokens / rows, their mean, is off by the spread)
    attention_length: float | None = None
    # a FLOPs budget (Orders.flops_budget): the local steps it cut (None: no budget)
    steps_cut: int | None = None
    # a memory budget (Orders.memory_budget): the local steps run as micro-batches to hold it
    # (None: no budget)
    plan_downgrades: int | None = None


def local_batches(data: TokenizedSplit, cfg: OrdersLike, gen: torch.Generator, pack: bool = False):
    """Local epochs, or exactly ``local_steps`` batches cycling through reshuffled epochs;
    ``pack``: each batch packed into rows (the same examples, no padded work)."""
    collate = data.collate_packed if pack else data.collate
    for rows in local_batch_rows(data, cfg, gen):
        yield collate(rows)


def local_batch_rows(data: TokenizedSplit, cfg: OrdersLike, gen: torch.Generator
                     ) -> Iterator[torch.Tensor]:
    """The rows of ``data`` in each of :func:`local_batches`' batches (the same draws from
    ``gen``), not collated."""
    idx = range(len(data))
    o = Orders.of(cfg)
    steps, epochs, bs, group = o.local_steps, o.local_epochs, o.batch_size, o.group_by_length
    if not steps:
        for _ in range(epochs):
            yield from batch_indices(data, idx, bs, shuffle=True, generator=gen, group_by_length=group)
        return
    done = 0
    while done < steps:
        for rows in batch_indices(data, idx, bs, shuffle=True, generator=gen, group_by_length=group):
            yield rows
            done += 1
            if done == steps:
                return


def planned_tokens(data: TokenizedSplit, cfg: OrdersLike, seed: int) -> int:
    """The tokens of the examples :func:`train_local` will train on with ``seed`` (its batches,
    drawn the same way, not collated): what a client's training time grows with."""
    gen = torch.Generator().manual_seed(seed)
    return sum(int(data.lengths[rows].sum()) for rows in local_batch_rows(data, cfg, gen))


def batch_units(batch: dict[str, torch.Tensor], virtual_tokens: int = 0) -> tuple[int, int, int]:
    """``(positions, attention pairs, head positions)`` of a batch: what a training step's FLOPs
    grow with (:class:`_FlopExtrapolation`; pairs 0 for a batch without ``input_ids``)."""
    pairs = _attention_units(batch) if "input_ids" in batch else 0
    return _positions(batch, virtual_tokens), pairs, batch_head_positions(batch)


def planned_steps(data: TokenizedSplit, cfg: OrdersLike, seed: int, pack: bool = False,
                  virtual_tokens: int = 0) -> list[list[tuple[int, int, int]]]:
    """Each step :func:`train_local` will train with ``seed``: its parts' :func:`batch_units`
    (the batch, or the plan's micro-batches), drawn and collated as it draws them, before any
    FLOPs budget cuts a step. What a client can tell of its coming round from its own data (its
    examples' lengths) and its orders; a step a memory budget splits further is counted as the
    plan's parts."""
    o = Orders.of(cfg)
    gen = torch.Generator().manual_seed(seed)
    collate = data.collate_packed if pack else data.collate
    out = []
    for rows in local_batch_rows(data, o, gen):
        parts, _ = memory_split(rows, collate, None, None, o.micro_batches)
        out.append([batch_units(p, virtual_tokens) for p in parts])
    return out


def round_flops(steps: list[list[tuple[int, int, int]]], rates: tuple[float, float, float],
                budget: float | None = None) -> tuple[float, int]:
    """``(FLOPs, steps run)`` of a round of ``steps`` (:func:`planned_steps`) at ``rates``
    (FLOPs per position, attention pair and head position: :class:`_FlopExtrapolation`'s) under
    a FLOPs ``budget`` (what is left of it after an importance pass): the steps stop before the
    first that would pass it (:func:`over_budget`), as :func:`train_local` stops."""
    per_position, per_pair, per_head = rates
    total = 0.0
    for i, parts in enumerate(steps):
        cost = sum(per_position * p + per_pair * q + per_head * h for p, q, h in parts)
        if over_budget(total, cost, budget, i):
            return total, i
        total += cost
    return total, len(steps)


def local_step_count(data: TokenizedSplit, cfg: OrdersLike) -> int:
    o = Orders.of(cfg)
    return o.local_steps or o.local_epochs * num_batches(len(data), o.batch_size)


def flops_budget(cfg: OrdersLike, spent: float = 0.0) -> float | None:
    """The FLOPs local training may take this round: a plan's ``flops_budget`` (its client's
    whole round) less ``spent`` before training (an importance pass); None: no budget."""
    budget = Orders.of(cfg).flops_budget
    return None if budget is None else budget - spent


def over_budget(spent: float, step_cost: float, budget: float | None, step: int) -> bool:
    """Whether a budgeted client stops before a step of ``step_cost`` FLOPs, ``spent`` already
    counted: the step would pass ``budget``. The first step always runs (a plan whose one step
    passes its budget is the planner's to refuse; a round that trains nothing learns nothing)."""
    return budget is not None and step > 0 and spent + step_cost > budget


def _proximal(params: dict[str, nn.Parameter], ref: dict[str, torch.Tensor], mu: float) -> torch.Tensor:
    """FedProx term mu/2 * ||w - w_global||^2 over the trained tensors."""
    return 0.5 * mu * sum(((p - ref[n]) ** 2).sum() for n, p in params.items())


def _positions(batch: dict[str, torch.Tensor], virtual_tokens: int) -> int:
    """Where the model runs for a batch: its tokens and an adapter's virtual tokens per row."""
    return batch_tokens(batch) + (virtual_tokens * batch_rows(batch) if virtual_tokens else 0)


def _attention_units(batch: dict[str, torch.Tensor]) -> int:
    """Query-key pairs of a batch's self-attention: rows x row length squared (each row attends
    over its whole length: padding and a packed batch's block-diagonal mask hide pairs, they do
    not skip them)."""
    rows, length = batch["input_ids"].shape
    return int(rows) * int(length) ** 2


def extrapolates_by_parts(batch: dict[str, torch.Tensor], virtual_tokens: int) -> bool:
    """Whether a step's counted FLOPs give per-unit rates (per position, attention pair and head
    position) that hold for any batch of the same model: packed or padded rows of one token
    sequence without virtual tokens; not an encoder-decoder's two sequences or images, whose
    count extrapolates per position."""
    return not virtual_tokens and "input_ids" in batch and "decoder_input_ids" not in batch


class _FlopExtrapolation:
    """The first step's counted FLOPs, extrapolated to every step. Batches of one token sequence
    per row (padded or packed), whose rows differ in length from step to step: each part by what
    it grows with, so the total is the count of every step (to rounding): the attention ops by
    rows x row length², the head's ops by head positions (examples, or target tokens), the rest
    (the linear layers) by positions. Other batches (virtual tokens, an encoder-decoder's two
    sequences, images): per position (tokens + virtual tokens)."""

    def __init__(self, by_parts: bool = True) -> None:
        self.by_parts = by_parts
        self.per_position = self.per_pair = self.per_head = 0.0
        self.positions = self.pairs = self.heads = 0

    def first(self, fc, batches: list[dict[str, torch.Tensor]], virtual_tokens: int) -> None:
        """The rates of the counted first step ``fc``, which ran on ``batches`` (its batch, or
        the micro-batches a memory budget split it into)."""
        positions = sum(_positions(b, virtual_tokens) for b in batches)
        if self.counts_rates(batches[0], virtual_tokens):
            heads = sum(batch_head_positions(b) for b in batches)
            self.per_pair = fc.attention / sum(_attention_units(b) for b in batches)
            self.per_head = fc.head / heads if heads else 0.0
            rest = fc.total - fc.attention - (fc.head if heads else 0)
            self.per_position = rest / positions
        else:
            self.per_position = fc.total / positions

    def counts_rates(self, batch: dict[str, torch.Tensor], virtual_tokens: int) -> bool:
        return self.by_parts and extrapolates_by_parts(batch, virtual_tokens)

    @property
    def rates(self) -> tuple[float, float, float]:
        return self.per_position, self.per_pair, self.per_head

    @rates.setter
    def rates(self, value: tuple[float, float, float]) -> None:
        self.per_position, self.per_pair, self.per_head = value

    def add(self, batches: list[dict[str, torch.Tensor]], virtual_tokens: int) -> None:
        """A step on ``batches`` (its batch, or its micro-batches) done."""
        for batch in batches:
            self.positions += _positions(batch, virtual_tokens)
            if self.per_pair or self.per_head:
                self.pairs += _attention_units(batch)
                self.heads += batch_head_positions(batch)

    def cost(self, batches: list[dict[str, torch.Tensor]], virtual_tokens: int) -> float:
        """The FLOPs one more step on ``batches`` adds to :attr:`total` (after :meth:`first`)."""
        cost = 0.0
        for batch in batches:
            cost += self.per_position * _positions(batch, virtual_tokens)
            if self.per_pair or self.per_head:
                cost += self.per_pair * _attention_units(batch) + self.per_head * batch_head_positions(batch)
        return cost

    def attention_length(self) -> float | None:
        """Packed batches: sum(rows x length²) / sum(rows x length) over the steps."""
        return self.pairs / self.positions if self.pairs and self.positions else None

    @property
    def total(self) -> float:
        return self.per_position * self.positions + self.per_pair * self.pairs + self.per_head * self.heads


class _ModelCache:
    """Figures measured on a shared model that depend only on what it computes, kept per model
    so a round's later clients of the same model skip measuring them again: the packed steps'
    FLOP rates (the counter's per-op Python costs about a second per client of a launch-bound GPU
    step) and a batch shape's saved-tensor peak (hooks on every saved tensor: a quarter of a
    small decoder's GPU step). Keys hold what the figure depends on (:func:`structure`, and the
    caller's additions); a model that changes in any of it is measured again, one that is
    garbage-collected drops its entries. At most ``per_model`` entries per model (oldest out)."""

    def __init__(self, per_model: int) -> None:
        self._models: weakref.WeakKeyDictionary[nn.Module, dict[tuple, Any]] = weakref.WeakKeyDictionary()
        self.per_model = per_model

    def get(self, model: nn.Module, key: tuple) -> Any:
        return self._models.get(model, {}).get(key)

    def put(self, model: nn.Module, key: tuple, value: Any) -> None:
        entries = self._models.setdefault(model, {})
        if key not in entries and len(entries) >= self.per_model:
            entries.pop(next(iter(entries)))
        entries[key] = value


def structure(model: nn.Module, loss_fn: LossFn, checkpointing: bool, head: tuple[str, ...]) -> tuple:
    """What a training step of ``model`` computes, for :class:`_ModelCache` keys: every tensor's
    name, shape and whether it trains, the active peft adapter, the loss (held, so its id is not
    reused; a loss built per client that computes the same step names it by its ``step_key``),
    checkpointing and the head modules."""
    params = tuple((n, tuple(p.shape), p.requires_grad) for n, p in model.named_parameters())
    loss = getattr(loss_fn, "step_key", loss_fn)
    return (loss, checkpointing, head, repr(getattr(model, "active_adapters", None)), params)


def _shapes(batch: dict[str, torch.Tensor]) -> tuple:
    return tuple((k, tuple(v.shape)) for k, v in batch.items() if isinstance(v, torch.Tensor))


_RATES = _ModelCache(per_model=8)  # structure -> FLOP rates (per position, pair and head position)


_SAVED = _ModelCache(per_model=8)  # (structure, precision, ...) -> {batch shapes: saved-tensor peak bytes}


_SHAPES_KEPT = 4096  # batch shapes remembered per key


@contextmanager
def gradient_checkpointing(model: nn.Module, on: bool = True) -> Iterator[None]:
    """Gradient checkpointing of ``model``'s transformer blocks (transformers' own, non-reentrant)
    turned on inside the block and back off after if it was off: a client's plan may checkpoint
    the shared model for that client only. A model that cannot checkpoint raises ValueError."""
    if not on:
        yield
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ValueError(f"gradient checkpointing: {type(base).__name__} does not support it")
    was = is_checkpointing(base)
    if not was:
        hooked = bool(getattr(base, "_require_grads_hooks", None))
        _checkpointing_call(base, "enable")
        if not hooked and hasattr(base, "disable_input_require_grads"):
            # transformers also makes the embeddings' output require grad (for reentrant
            # checkpointing and peft): non-reentrant checkpointing does not need it, and kept it
            # would run the backward down through the frozen bottom blocks, for this client and
            # every later one of the shared model
            base.disable_input_require_grads()
    try:
        yield
    finally:
        if not was:
            _checkpointing_call(base, "disable")


def _checkpointing_call(model: nn.Module, what: str) -> None:
    """transformers 5's ``activation_checkpointing_enable/disable`` (non-reentrant), or the
    older ``gradient_checkpointing_*`` names where a model has only those."""
    new = getattr(model, f"activation_checkpointing_{what}", None)
    if new is not None:
        new(activation_checkpointing_kwargs={"use_reentrant": False}) if what == "enable" else new()
    elif what == "enable":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def is_checkpointing(model: nn.Module) -> bool:
    """Whether gradient checkpointing is on (transformers 5 renamed the property)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def _hf_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**to_device(batch, model_device(model))).loss


def _optimizer_step(opt: torch.optim.Optimizer, params: dict[str, nn.Parameter], scaler, clip: float) -> None:
    """One optimizer step after the backward: unscale (fp16), clip the gradient norm, step."""
    if scaler:
        scaler.unscale_(opt)
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(params.values(), clip)
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()


def _accumulate(model: nn.Module, params: dict[str, nn.Parameter], parts: list[dict[str, torch.Tensor]],
                loss_fn: LossFn, compute: Compute, scaler, ref, mu: float) -> tuple[torch.Tensor, bool]:
    """One step's gradients from the micro-batches ``parts`` of its batch: each micro-batch's
    loss weighted by its share of the batch's head positions (examples, or target tokens: what
    the task's loss averages over), so the gradients add up to the whole batch's; activations
    are held for one micro-batch at a time. Returns the batch's loss (detached) and whether
    anything trained."""
    total_positions = sum(batch_head_positions(p) for p in parts)
    loss_sum, trains = None, False
    for part in parts:
        share = batch_head_positions(part) / max(total_positions, 1)
        if share == 0:
            continue
        with compute.autocast():
            loss = loss_fn(model, part) * share
        if loss.requires_grad:
            trains = True
            (scaler.scale(loss) if scaler else loss).backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    if ref is not None and trains:
        prox = _proximal(params, ref, mu)
        (scaler.scale(prox) if scaler else prox).backward()
    return (loss_sum if loss_sum is not None else torch.tensor(math.nan)), trains


def train_local(model: nn.Module, params: dict[str, nn.Parameter], data: TokenizedSplit,
                cfg: OrdersLike, seed: int, loss_fn: LossFn = _hf_loss,
                compute: Compute = CPU, virtual_tokens: int = 0, pack: bool = False,
                flops_spent: float = 0.0, by_parts: bool = True) -> LocalResult:
    """AdamW on ``params`` of ``model`` over the client's data; deterministic given ``seed``.

    ``cfg``: the client's orders (:class:`~fedslice.fl.orders.Orders`, or the payload config
    they are read from): lr, weight_decay, local_epochs/local_steps, batch_size, max_grad_norm,
    fedprox_mu. The first step runs under a FLOP counter; the total
    is that count per padded token times the padded tokens of all steps (packed batches: each
    part of the count by what it grows with, :class:`_FlopExtrapolation`, whose rates a later
    client of the same model and structure reuses without counting: :class:`_ModelCache`; so
    are the saved-tensor peaks of the batch shapes measured). ``compute``: the
    device batches go to and the autocast precision of forward and loss (parameters, gradients
    and optimizer state stay fp32; fp16 scales the loss), and on the CPU in fp32 the kernels of
    the frozen linear layers (``compute.linear_kernels``: :mod:`fedslice.onednn`).
    ``virtual_tokens``: positions an adapter prepends to every sequence (prompt tuning,
    P-tuning): the model runs on them too, so the first step's count is scaled by positions
    (tokens + virtual tokens x rows), not tokens alone (which overstates it when the first
    batch is shorter than the others). ``pack``: the
    batches are packed into rows (:mod:`fedslice.data.packing`; the loss must take them), and
    a CPU model with attention dropout trains on eager attention with cheaper dropout masks
    (:func:`fedslice.data.packing.packed_training`). A client's plan may set
    ``cfg.micro_batches`` (each batch as that many micro-batches whose gradients add up:
    :func:`_accumulate`) and ``cfg.checkpointing`` (:func:`gradient_checkpointing`), and
    ``cfg.flops_budget``: the round's FLOPs, of which ``flops_spent`` went before training
    (an importance pass); ``by_parts``: the first step's count may split into parts that
    extrapolate by their own units (False for an adapter outside the model's modules: its
    virtual tokens or prefix keys are positions and pairs the batch does not show); the local
    steps stop before the first whose measured FLOPs (the
    first step's count, extrapolated to the next batch as the total is) would pass it
    (:func:`over_budget`), and the result records the steps cut; and ``cfg.memory_budget``
    (MiB, with the planner's measured step ``cfg.memory_reference``): a step whose saved
    tensors, predicted from the last measured step (the planner's before the first), would
    pass what the model and optimizer state leave of the budget runs as micro-batches
    (:func:`memory_split`: the same update), counted in ``plan_downgrades``; a step that does
    not fit one example at a time raises :class:`MemoryBudgetExceeded`.
    """
    cfg = Orders.of(cfg)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # dropout masks
    opt = torch.optim.AdamW(params.values(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    mu = cfg.fedprox_mu
    ref = {n: p.detach().clone() for n, p in params.items()} if mu > 0 else None
    clip = cfg.max_grad_norm
    was_training = model.training
    model.train()
    losses: list[torch.Tensor] = []
    tokens = examples = head_positions = rows = 0
    real = 0
    flops = _FlopExtrapolation(by_parts)
    head = head_segments(model)
    what = structure(model, loss_fn, cfg.checkpointing, head)
    # padded batches count their own first step, as they always have (a step under the
    # counter may take other kernels than one without it: the stored run digests hold)
    cached = _RATES.get(model, what) if pack else None
    t0 = time.perf_counter()
    optimizer_bytes = 3 * sum(p.numel() * p.element_size() for p in params.values())  # grad + 2 moments
    scaler = compute.grad_scaler()
    micro = cfg.micro_batches
    saved_key = (what, compute.device.type, compute.precision, micro, mu > 0)
    budget = flops_budget(cfg, flops_spent)
    planned, cut = local_step_count(data, cfg), None if budget is None else 0
    saved_peaks = _SAVED.get(model, saved_key)
    if saved_peaks is None:
        saved_peaks = {}
        _SAVED.put(model, saved_key, saved_peaks)
    measured = LargestBatches()  # the steps whose saved tensors are counted (the peak's)
    allowance, reference, downgrades = memory_allowance(model, cfg, optimizer_bytes)
    collate = data.collate_packed if pack else data.collate
    with PeakMemory(model, extra_bytes=optimizer_bytes, interval_s=0.01, saved_tensors=False) as mem, \
            progress.task("local training steps", planned) as advance, \
            (packed_training(model) if pack else nullcontext()), compute.training_linears(), \
            gradient_checkpointing(model, cfg.checkpointing):
        for step, drawn in enumerate(local_batch_rows(data, cfg, gen)):
            parts, split = memory_split(drawn, collate, allowance, reference, micro)
            if parts is None:  # not even one example at a time fits the budget
                raise MemoryBudgetExceeded(cfg.memory_budget, cheapest_step_mb(
                    model, optimizer_bytes, reference, [collate(drawn[i:i + 1])
                                                        for i in range(len(drawn))]))
            if budget is not None and over_budget(flops.total, flops.cost(parts, virtual_tokens),
                                                  budget, step):
                cut = planned - step
                break
            advance()
            downgrades += split
            batch = parts[0]
            counted = step == 0 and not (cached and flops.counts_rates(batch, virtual_tokens))
            # a step split for memory is measured every time (its parts are not one batch shape)
            shape_key = None if split else (_shapes(batch) if measured(batch) else None)
            known = saved_peaks.get(shape_key) if shape_key else None
            if known is not None:
                mem.add_saved_peak(known)  # this shape's peak, measured on an earlier client
            track = split or (shape_key and known is None)
            with count_flops(enabled=counted, head=head) as fc, \
                    (mem.track_block() if track else nullcontext()) as block:
                if len(parts) > 1:
                    loss, trains = _accumulate(model, params, parts, loss_fn, compute, scaler, ref, mu)
                else:
                    with compute.autocast():
                        # a host batch: the loss moves it to the model's device, and a task reads
                        # it there (target positions) without waiting for the device
                        loss = loss_fn(model, batch)
                    total = loss + _proximal(params, ref, mu) if ref is not None else loss
                    # False when nothing trained reaches the loss (a sub-model whose decoder keeps no
                    # cross-attention head reads none of its trained encoder): no step to take
                    trains = total.requires_grad
                    if trains:
                        (scaler.scale(total) if scaler else total).backward()
            if block is not None and shape_key and len(saved_peaks) < _SHAPES_KEPT:
                saved_peaks[shape_key] = block.peak_bytes
            if len(parts) == 1 and (block is not None or known is not None):
                # a measured step of this client's own batches predicts its next ones
                step_ref = ActivationReference(float(known if block is None else block.peak_bytes),
                                               *activation_units(batch))
                reference = ActivationBound((step_ref,)) if reference is None else reference.measured(step_ref)
            if counted:
                flops.first(fc, parts, virtual_tokens)
                if pack and flops.counts_rates(batch, virtual_tokens):
                    _RATES.put(model, what, flops.rates)
            elif step == 0:
                flops.rates = cached
            if trains:
                _optimizer_step(opt, params, scaler, clip)
            opt.zero_grad(set_to_none=True)
            # the losses stay on the device and are read once after the loop (a per-step check
            # for divergence would wait for each step: a GPU sync per step); a non-finite step
            # makes the mean non-finite and the server excludes the reply
            losses.append(loss.detach())
            flops.add(parts, virtual_tokens)
            for part in parts:
                tokens += batch_tokens(part)  # counted on the host batch: no device reads
                real = real + batch_real_tokens(part)
                examples += batch_examples(part)
                rows += batch_rows(part)
                head_positions += batch_head_positions(part)
    model.train(was_training)
    mean_loss = float(torch.stack(losses).mean()) if losses else math.nan
    nonfinite = bool(losses) and not math.isfinite(mean_loss)
    return LocalResult(loss=mean_loss, steps=len(losses),
                       examples=examples, head_positions=head_positions, tokens=tokens, flops_measured=flops.total,
                       peak_rss_mb=mem.rss_peak_mb or 0.0, activation_mb=mem.tensor_peak_mb,
                       time_s=time.perf_counter() - t0, nonfinite=nonfinite,
                       gpu_peak_mb=mem.cuda_peak_mb, tokens_real=int(real), rows=rows,
                       attention_length=flops.attention_length(), steps_cut=cut,
                       plan_downgrades=None if allowance is None else downgrades)
