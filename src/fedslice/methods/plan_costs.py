"""What one training step of a planned client costs, measured: the budget planner's figures
(:class:`~fedslice.methods.planner.BudgetPlanner` searches over them).

A plan's step (:class:`~fedslice.methods.plan_records.Knobs`) is measured on the profile batch:
its FLOPs with PyTorch's FLOP counter (attention's and the head's apart where a client
extrapolates its steps by parts), its memory as the model's tensors + gradients and AdamW state
of the trainable ones + the peak of tensors saved for backward, its upload and download as the
bytes of the tensors it sends and receives. Each step is measured once per (planned model,
measured rows), on the model cut to a few of its blocks and extrapolated per block where
:attr:`StepCosts.by_blocks` (:mod:`fedslice.slicing.block_steps`), and kept across runs in a
``budgets.step_cache`` folder where one is given.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import replace

import torch
import torch.nn as nn

from fedslice import measure
from fedslice.data.packing import packed_training
from fedslice.fl.client import batch_units, extrapolates_by_parts, gradient_checkpointing
from fedslice.fl.memory_hold import ActivationReference, activation_units
from fedslice.fl.wire import WIRE_DTYPES, wire_bytes
from fedslice.measure.flops import head_segments
from fedslice.methods.plan_records import KnobCost, Knobs
from fedslice.slicing.block_steps import extrapolated_step, plan_for
from fedslice.slicing.planner import StepMeasure, batch_key, measure_step, measure_training_step, training_state_bytes
from fedslice.slicing.step_cache import StepCache
from fedslice.tasks.base import batch_head_positions

_MIB = float(1 << 20)


class StepCosts:
    """The measured costs of ``method``'s plans, one step each, cached."""

    def __init__(self, method, batch: dict[str, torch.Tensor], flops_scale: float = 1.0,
                 packed_of: Callable[[int], tuple] | None = None, by_blocks: bool = True,
                 store: StepCache | None = None):
        """``batch``: ``federation.batch_size`` examples padded to the longest; ``flops_scale``:
        the tokens a real batch of that size holds over the profile's; ``packed_of(n)``: the
        first ``n`` examples packed into rows (a plan of one micro-batch trains on them where
        batches pack) and its ``flops_scale``; ``by_blocks``: steps measured on the model cut to
        a few blocks of each kind and extrapolated; ``store``: measured steps kept across runs."""
        self.method, self.batch, self.flops_scale, self.packed_of = method, batch, flops_scale, packed_of
        self.by_blocks = by_blocks and getattr(method, "arch", None) is not None
        self.store = store
        self.rows = len(batch["input_ids"] if "input_ids" in batch else batch["pixel_values"])
        #: some step was extrapolated from a cut model (then the plans chosen are verified)
        self.extrapolated = False
        self._costs: dict[Knobs, KnobCost] = {}
        #: costs measured in part (:meth:`cost`'s ``need``), by (knobs, "memory" or "flops")
        self._parts: dict[tuple[Knobs, str], KnobCost] = {}
        self._packed: dict[int, tuple[dict, float]] = {}
        #: measured steps by (the planned model, packed, the measured rows), then by the head
        #: modules whose FLOPs were counted apart (None: no FLOPs counted): plans that differ
        #: only in their rows per step or micro-batches often measure the same rows (the first
        #: two of the profile batch, scaled), measured once
        self._steps: dict[tuple, dict] = {}

    def whole(self) -> StepCosts:
        """The same costs measured on whole models (nothing extrapolated, nothing measured yet)."""
        return StepCosts(self.method, self.batch, self.flops_scale, self.packed_of and self._packed_rows,
                         False, self.store)

    def memory(self, knobs: Knobs) -> float:
        """``knobs``' memory alone (no FLOP counter), kept."""
        knobs = self.same_step(knobs)
        if (knobs, "memory") not in self._parts:
            self._parts[knobs, "memory"] = self._measure(knobs, "memory")
        return self._parts[knobs, "memory"].memory_mb

    @staticmethod
    def same_step(knobs: Knobs) -> Knobs:
        """``knobs`` as the step they train, one spelling per step: a plan's local steps change
        how many steps, not what one costs; the run's base is the precision None or "none", and
        every block's adapters the depth None or 1 (the dense client, spelled with None, is the
        plan at the top of the search, spelled with "none" and 1, measured once); the dtype its
        reply travels in changes the upload's bytes only (:meth:`KnobCost.sent_in`)."""
        return replace(knobs, steps=None, precision=None if knobs.precision == "none" else knobs.precision,
                       depth=None if knobs.depth is not None and knobs.depth >= 1 else knobs.depth,
                       upload=None)

    def cost(self, knobs: Knobs, need: str = "all") -> KnobCost:
        """One step's costs (a plan's local steps change how many, not what a step costs).
        ``need``: "memory" or "flops" where the caller reads only those (the memory of a plan
        weighed at its least, the FLOPs of the plans beside it): a packed plan, whose memory
        and FLOPs are two steps (:meth:`two_steps`), runs only the one asked; the part
        measured is kept (its other figures NaN) and its step serves the whole cost later.
        The upload's bytes are those of ``knobs.upload`` (the run's where None)."""
        wire, knobs = knobs.upload, self.same_step(knobs)
        if knobs in self._costs:
            return self._costs[knobs].sent_in(wire)
        if not self.two_steps(knobs):
            need = "all"  # one step gives both (a memory step without the counter, measured
            # again with it when the plan is weighed whole, would cost more than the counter)
        if need == "all":
            self._costs[knobs] = self._measure(knobs)
            return self._costs[knobs].sent_in(wire)
        if (knobs, need) not in self._parts:
            self._parts[knobs, need] = self._measure(knobs, need)
        return self._parts[knobs, need].sent_in(wire)

    def rows_of(self, knobs: Knobs) -> int:
        return self.rows if knobs.batch is None else knobs.batch

    def two_steps(self, knobs: Knobs) -> bool:
        """``knobs``' memory and FLOPs are two measured steps: a packed plan's memory is
        measured on the layout every batch fits in, its FLOPs on the packed profile."""
        packed = self.packed_batch(knobs)
        return packed is not None and len(packed) > 2

    def packed_batch(self, knobs: Knobs) -> tuple | None:
        """The packed profile batch of ``knobs``' rows, its FLOPs scale and (optionally) the
        packed batch its peak memory is measured on (None: it trains unpacked)."""
        if self.packed_of is None or knobs.micro_batches != 1:
            return None
        return self._packed_rows(self.rows_of(knobs))

    def _packed_rows(self, rows: int) -> tuple:
        if rows not in self._packed:
            self._packed[rows] = self.packed_of(rows)
        return self._packed[rows]

    def _measure(self, knobs: Knobs, need: str = "all") -> KnobCost:
        packed = self.packed_batch(knobs)
        if packed is not None:
            part = packed[0]
        else:
            part = {k: v[:self.rows_of(knobs) // knobs.micro_batches] for k, v in self.batch.items()}
        # a padded batch's FLOPs, upload and importance do not depend on its split: counted once
        known = None if packed is not None else next(
            (c for k, c in self._costs.items() if self.packed_batch(k) is None
             and replace(k, micro_batches=1) == replace(knobs, micro_batches=1)), None)
        depth_frozen = set(self.method.depth_frozen(knobs.depth))  # (asked before freezing them)
        with self.method.planned_model(knobs) as planned, \
                gradient_checkpointing(planned.model, knobs.checkpointing), \
                (packed_training(planned.model) if packed is not None else nullcontext()):
            split = self.method.adapter.in_modules and extrapolates_by_parts(
                part, self.method.adapter.virtual_tokens)
            counted: dict[str, float] = {}
            head = head_segments(planned.model) if split else ()
            # a padded part of fewer rows than the measurement's two: the profile batch's first
            # two, scaled down (as two rows are scaled up to a whole batch): one step serves
            # every split and every share of local work of a planned model
            rows = len(part["input_ids"] if "input_ids" in part else part["pixel_values"])
            whole = self.batch if packed is None and rows < 2 <= self.rows else part
            # a packed plan's peak memory is measured on the layout every batch fits in (below):
            # its step on the packed profile counts FLOPs only
            peak = packed is not None and len(packed) > 2
            count = known is None and need != "memory"
            flops, memory = math.nan, math.nan
            if not (peak and need == "memory"):
                flops, memory, _, _ = measure_training_step(
                    planned.model, whole, loss_fn=self.method.task.loss, flops=count,
                    head=head if count else (), parts=counted, rows=rows,
                    measured=self._step_of(knobs, planned.model, packed is not None, count,
                                           head if count else (), memory=not peak))
                flops = flops if count else math.nan
            steps = 1 if packed is not None else knobs.micro_batches
            positions = float(batch_units(part, self.method.adapter.virtual_tokens)[0] * steps)
            shares = {} if known is not None or not split or not count else dict(
                step_attention=counted["attention"] * steps, step_head=counted["head"] * steps,
                pairs=float(activation_units(part)[1] * steps), heads=float(batch_head_positions(part) * steps))
            if peak and need == "flops":
                upload, imp, download = self._sent_and_importance(planned, depth_frozen)
                return KnobCost(math.nan, flops, upload, imp, download, **shares, positions=positions,
                                uploads=self._uploads(planned))
            if peak:  # the packed layout every batch fits in
                part = packed[2]
                memory = measure_training_step(planned.model, part, loss_fn=self.method.task.loss,
                                               flops=False, measured=self._step_of(
                                                   knobs, planned.model, True, False, ()))[1]
            saved = memory * _MIB - training_state_bytes(planned.model)
            reference = ActivationReference(saved, *activation_units(part))
            if known is not None:
                return replace(known, memory_mb=memory, reference=reference)
            if need == "memory":
                return KnobCost(memory, math.nan, 0, reference=reference, positions=positions)
            upload, imp, download = self._sent_and_importance(planned, depth_frozen)
            uploads = self._uploads(planned)
        return KnobCost(memory, flops * (1 if packed is not None else knobs.micro_batches), upload, imp,
                        download, reference, **shares, positions=positions, uploads=uploads)

    def _sent_and_importance(self, planned, depth_frozen: set[str]) -> tuple[int, float, int]:
        """A planned model's upload (as it travels), importance FLOPs per example, and download:
        the tensors it trains and those its adapter depth leaves frozen (``depth_frozen``: their
        forward still runs), at its rank."""
        upload = wire_bytes(planned.upload, self.method.cfg.federation.upload_dtype)
        imp = 0.0
        if planned.importance_model is not None:
            imp = self._forward_flops(planned.importance_model) / self.rows
        below = depth_frozen - set(planned.upload)
        download = measure.tensor_bytes(dict(planned.upload)) + measure.tensor_bytes(
            {n: p for n, p in planned.model.named_parameters() if n in below})
        return upload, imp, download

    @staticmethod
    def _uploads(planned) -> tuple[tuple[str, int], ...]:
        """The planned model's upload at every upload dtype (a plan's ``Knobs.upload`` picks one)."""
        return tuple((name, wire_bytes(planned.upload, name)) for name in WIRE_DTYPES)

    def _step_of(self, knobs: Knobs, model: nn.Module, packed: bool, flops: bool,
                 head, memory: bool = True) -> Callable[[Mapping[str, torch.Tensor]], StepMeasure]:
        """Measures a step of ``knobs``' planned ``model`` on the rows it is given, once per
        (model, rows): the model is what every knob but the rows per step and the micro-batches
        makes it. A step whose FLOPs are not asked reuses one measured with them (the counter
        does not change what is saved for backward), and a step whose FLOPs were counted over
        another precision of the base lends them (a quantized base changes bytes, not
        operations): its own step is measured without the counter, which costs most of a
        measured step (tests/test_budgets.py checks both). ``memory=False``: only the FLOPs are
        read (a packed plan's memory is measured on another batch): FLOPs lent need no step
        at all (what is returned then holds no memory figure, and is not kept)."""
        model_knobs = replace(self.same_step(knobs), batch=None, micro_batches=1)
        ops = replace(model_knobs, precision=None)

        def measured(rows: Mapping[str, torch.Tensor]) -> StepMeasure:
            key = batch_key(rows)
            done = self._steps.setdefault((model_knobs, packed, key), {})
            got = done.get(tuple(head)) if flops else next(iter(done.values()), None)
            if got is not None:
                return got
            lent = None if not flops else next(
                (d[tuple(head)] for (k, p, b), d in self._steps.items()
                 if p == packed and b == key and tuple(head) in d and replace(k, precision=None) == ops), None)
            if lent is not None and not memory:
                return replace(lent, saved_mb=math.nan, static_bytes=training_state_bytes(model))
            got = self._run_step(model, rows, flops and lent is None, head if lent is None else (), packed)
            if lent is not None:
                got = replace(got, flops=lent.flops, attention=lent.attention, head=lent.head)
            done[tuple(head) if flops else None] = got
            return got
        return measured

    def _run_step(self, model: nn.Module, rows: Mapping[str, torch.Tensor], flops: bool, head,
                  packed: bool) -> StepMeasure:
        """A training step of ``model`` on ``rows`` measured (:func:`measure_step`), on the
        model cut to a few blocks and extrapolated where :attr:`by_blocks`; kept in
        :attr:`store` where there is one (and taken from it where it holds the step)."""
        def step(m: nn.Module) -> StepMeasure:
            return measure_step(m, rows, self.method.task.loss, flops, head)
        how = plan_for(model, self.method.arch) if self.by_blocks else None
        self.extrapolated |= how is not None
        key = None if self.store is None else self.store.key(
            model, batch_key(rows), flops, head, packed, "whole" if how is None else "by blocks")
        got = None if key is None else self.store.get(key)
        if got is None:
            got = step(model) if how is None else extrapolated_step(model, self.method.arch, step, how)
            if key is not None:
                self.store.put(key, got)
        return got

    def _forward_flops(self, model: nn.Module) -> float:
        """FLOPs of a forward pass over the profile batch (two rows, scaled: linear in rows)."""
        part = {k: v[:2] for k, v in self.batch.items() if k != "labels"}
        was = model.training
        model.eval()
        try:
            with torch.no_grad(), measure.count_flops() as fc:
                model(**part)
        finally:
            model.train(was)
        return float(fc.total) * self.rows / 2
