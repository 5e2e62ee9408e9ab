"""The budget planner: each client's plan from its budget and costs measured on the run's model.

A client declares a budget (``[budgets]``: tiers with shares, or a CSV row per client): peak
training memory, training GFLOPs per round, upload MB per round, any of them. A plan is a point
of the knobs the run's stages expose (:class:`Knobs`): the sub-model (RaFFM's salience-ordered
width slice), the local work per round (``budgets.local_work``), the adapter depth (the top
blocks whose adapters train, ``budgets.adapter_depths``), the head sparsity (the head stage),
the LoRA rank (``lora.ranks``), gradient
checkpointing and the batch split (micro-batches whose gradients add up to the batch's). The
base's precision is the run's (``model.quantize``), measured as it is.

"Trains the most" is lexicographic, largest first: the sub-model's size (what the client's
update reaches, and what it could serve), then its local work (examples per round), then the
adapter depth (more examples over the top blocks before fewer over every block: measured on
SST-2, bench/local_work_sst2.py), then the heads it keeps, then the LoRA rank; among
plans equal on those, the least overhead (no checkpointing, fewest micro-batches). The costs
are measured, not modelled: a training step of the client's model at its knobs on a profile
batch (``federation.batch_size`` x ``data.max_length``, the worst case; FLOPs with PyTorch's
FLOP counter, memory = the model's tensors + gradients and AdamW state of the trainable ones +
the peak of tensors saved for backward), scaled to the client's examples per round; upload =
the bytes of the tensors the client would send. A budget no plan fits is a ConfigError naming
the client, its budget and the cheapest plan's cost.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace

import torch

from fedslice.config import BudgetsConfig
from fedslice.errors import ConfigError
from fedslice.slicing.spec import ModelSlice, Spec
from fedslice.slicing.step_cache import StepCache, config_settings
from fedslice.methods.budgets import ClientBudget, UNITS, client_budgets, client_time_budgets
from fedslice.methods.plan_costs import StepCosts
from fedslice.methods.plan_records import ClientPlan, Knobs, RoundCost, examples_per_round, sit_out_summary

log = logging.getLogger(__name__)

_MB = 1e6
#: the limits a plan's memory alone answers
_MEMORY = frozenset({"memory_mb", "memory_share"})


def contains(big: Spec | None, small: Spec | None) -> bool:
    """Whether sub-model ``small`` is a part of ``big``: each layer, head and FFN neuron it keeps
    is kept by ``big`` (None: the whole model, or stack)."""
    if big is None or small is None:
        return big is None or (small is None and big.is_full)
    if isinstance(big, ModelSlice) or isinstance(small, ModelSlice):
        return isinstance(big, ModelSlice) and isinstance(small, ModelSlice) and \
            len(big.stacks) == len(small.stacks) and all(map(contains, big.stacks, small.stacks))
    at = {layer: j for j, layer in enumerate(big.layers)}
    for j, layer in enumerate(small.layers):
        k = at.get(layer)
        if k is None or not (set(small.heads[j]) <= set(big.heads[k])
                             and set(small.neurons[j]) <= set(big.neurons[k])):
            return False
        if small.cross is not None and (big.cross is None or not set(small.cross[j]) <= set(big.cross[k])):
            return False
    return True


def is_chain(specs: list[Spec | None]) -> bool:
    """Whether each sub-model (largest first) is a part of the one before it: then every cost
    of a point (memory, FLOPs, upload, time) only falls along the list, and so does whether its
    cheapest point fits a budget."""
    return all(map(contains, specs, specs[1:]))


def local_works(shares: list[float], by: str, rows: int, steps: int) -> list[dict[str, int]]:
    """A round's local work at each share of ``shares`` (``budgets.local_work``), most first:
    ``{}`` (the whole round), then by ``by``: ``"batch"``, ``{"batch": n}`` (``n`` of the
    batch's ``rows`` examples in every step); ``"steps"``, ``{"steps": n}`` (``n`` of the
    round's ``steps`` local steps of whole batches), and below the fewest steps the shares give,
    those steps on fewer examples each, ``{"steps": fewest, "batch": n}``: a budget that the fewest whole
    step does not fit still trains (as ``"batch"`` would), with as few cuts to the batch as it
    allows."""
    def cuts(whole: int) -> list[int]:
        return sorted({max(1, math.floor(w * whole + 0.5)) for w in shares if w < 1} - {whole},
                      reverse=True)

    if by == "batch":
        return [{}] + [{"batch": n} for n in cuts(rows)]
    fewest = ([steps] + cuts(steps))[-1]
    at = {"steps": fewest} if fewest < steps else {}
    return [{}] + [{"steps": n} for n in cuts(steps)] + [{**at, "batch": n} for n in cuts(rows)]


def work_key(work: dict[str, int], by: str) -> str:
    """The knob a local work of :func:`local_works` cuts: the batch below the fewest steps."""
    return "batch" if "batch" in work else by


class BudgetPlanner:
    """Plans clients of ``method`` (built up to its strategy) under their budgets; costs are
    measured once per plan and cached."""

    def __init__(self, method, cfg: BudgetsConfig, batch: dict[str, torch.Tensor],
                 flops_scale: float = 1.0, packed_of: Callable[[int], tuple] | None = None,
                 scale_of: Callable[[int], float] | None = None,
                 pairs_of: Callable[[int, bool], float] | None = None,
                 heads_of: Callable[[int], float] | None = None, by_blocks: bool = True):
        """``batch``: ``federation.batch_size`` examples padded to the longest; ``flops_scale``:
        the tokens a real batch of that size holds over the profile's (``scale_of(n)``: the
        same for batches of ``n`` examples, a plan's smaller batch); ``packed_of(n)``: the
        first ``n`` examples packed into rows, what a client trains on when its batches pack (a
        plan of one micro-batch: a split trains unpacked), and its ``flops_scale``.
        ``by_blocks``: a step is measured on the model cut to a few of its blocks of each kind
        and extrapolated per block (:mod:`fedslice.slicing.block_steps`; exact where the blocks
        of a kind cost alike), each plan chosen verified on the whole model (:meth:`plan`)."""
        self.method, self.cfg, self.flops_scale = method, cfg, flops_scale
        #: measured steps kept across runs (``budgets.step_cache``)
        store = None if cfg.step_cache is None else StepCache(cfg.step_cache, (
            type(method.task).__qualname__, method.cfg.task.model_dump(mode="json"),
            method.cfg.model.model_dump(mode="json"), config_settings(getattr(method.model, "config", None))))
        #: one step of each plan, measured (:class:`~fedslice.methods.plan_costs.StepCosts`)
        self.costs = StepCosts(method, batch, flops_scale, packed_of, by_blocks, store)
        #: the same steps measured on whole models, where a plan chosen is verified (:meth:`plan`)
        self._whole: StepCosts | None = None
        self.scale_of, self.pairs_of = scale_of, pairs_of
        self.heads_of = heads_of or float
        self.rows = self.costs.rows
        axes = method.plan_axes(cfg)
        self.specs: list[tuple[Spec | None, float]] = axes.get("specs") or [(None, 1.0)]  # largest first
        self.sparsities: list[float | None] = axes.get("sparsities") or [None]  # fewest pruned first
        self.ranks: list[int | None] = axes.get("ranks") or [None]  # largest first
        self.importances: list[str | None] = axes.get("importances") or [None]  # best first
        self.precisions: list[str | None] = axes.get("precisions") or [None]  # most precise first
        self.depths: list[float | None] = axes.get("depths") or [None]  # deepest first
        self.uploads: list[str | None] = axes.get("uploads") or [None]  # most precise first
        self.local_steps = method.cfg.federation.local_steps or 0
        #: a round's local work, most first: {} (all of it), then {"batch": rows per step} or
        #: {"steps": local steps} at each share of ``budgets.local_work`` (:func:`local_works`)
        self.works = local_works(cfg.local_work, cfg.local_work_by, self.rows, self.local_steps)
        self.checkpoints = [False, True] if cfg.checkpointing and method.can_checkpoint() else [False]
        #: a dense client, what ``flops_share`` and ``memory_share`` are shares of: the whole
        #: model at the run's settings (lora.r, the method's sparsity and importance source, the
        #: whole round in one batch, the run's base)
        devices = method.cfg.devices
        #: this host's GFLOP/s that devices' speed factors multiply (None: not given)
        self.host_gflops = devices.host_gflops_per_s if devices is not None else None
        self.dense = Knobs(self.specs[0][0], width=self.specs[0][1],
                           rank=method.cfg.lora.r if "ranks" in axes else None)
        #: the sub-models nest (RaFFM's leading slices): the first one in reach is found by
        #: bisection (:meth:`_specs_in_reach`)
        self.nested = is_chain([s for s, _ in self.specs])

    def overheads(self, knobs: Knobs | None = None) -> list[tuple[bool, int]]:
        """(checkpointing, micro-batches), least overhead first: the splits of ``knobs``' batch."""
        rows = self.rows if knobs is None or knobs.batch is None else knobs.batch
        splits = [m for m in self.cfg.micro_batches if rows % m == 0] or [1]
        return [(c, m) for c in self.checkpoints for m in splits]

    def predicted(self, knobs: Knobs, examples: int, importance_examples: int,
                  device=None, need: str = "all") -> dict[str, float]:
        """A plan's costs for a client of ``examples`` per round at full work, their shares of a
        dense client's (:attr:`dense`), and on a ``device`` (:class:`fedslice.fl.devices.Device`)
        a client-round's simulated seconds: the download, its FLOPs at the device's speed, the
        upload (as the simulated clock counts a reply). ``need="memory"``: the memory and its
        share only; ``"flops"``: all but those (:meth:`cost`)."""
        if need == "memory":
            memory = self.costs.cost(knobs, need).memory_mb
            return {"memory_mb": memory, "memory_share": memory / self.costs.cost(self.dense).memory_mb}
        out = self._predicted(knobs, examples, importance_examples, need)
        dense = out if knobs == self.dense else self._predicted(self.dense, examples, importance_examples)
        out = {**out, "flops_share": out["gflops_per_round"] / dense["gflops_per_round"],
               "memory_share": out["memory_mb"] / dense["memory_mb"]}
        if need == "flops":
            del out["memory_mb"], out["memory_share"]
        if device is not None:
            c = self.costs.cost(knobs, need)
            out["seconds_per_round"] = device.seconds(out["gflops_per_round"] * 1e9, c.download_bytes,
                                                      c.upload_bytes, self.host_gflops)
        return out

    def _predicted(self, knobs: Knobs, examples: int, importance_examples: int,
                   need: str = "all") -> dict[str, float]:
        c = self.costs.cost(knobs, need)
        # training batches hold about flops_scale x the profile's tokens; an importance pass
        # runs a client's examples in few large batches, each padded to its longest: counted at
        # the profile's length (the data's longest), an upper bound
        packed = self.costs.packed_batch(knobs)
        rows = self.costs.rows_of(knobs)
        scale = packed[1] if packed is not None else \
            self.scale_of(rows) if self.scale_of is not None and rows != self.rows else self.flops_scale
        step = scale * c.step_flops
        if c.step_attention is not None and self.pairs_of is not None and c.pairs and c.heads:
            # each part by what it grows with, as a client extrapolates its first step's count:
            # attention by rows x length², the head by head positions (examples, or target
            # tokens), the rest by positions
            rest = c.step_flops - c.step_attention - c.step_head
            step = scale * rest + self.pairs_of(rows, packed is not None) / c.pairs * c.step_attention \
                + self.heads_of(rows) / c.heads * c.step_head
        examples = examples * rows / self.rows  # partial local work: its share of the examples
        if knobs.steps is not None:
            examples = examples * knobs.steps / self.local_steps
        gflops = (step / rows * examples
                  + c.importance_flops_per_example * importance_examples) / 1e9
        return {"memory_mb": c.memory_mb, "gflops_per_round": gflops, "upload_mb_per_round": c.upload_bytes / _MB}

    def round_cost(self, knobs: Knobs, importance_examples: int) -> RoundCost:
        """What a client-round of ``knobs`` costs by what it trains (:class:`RoundCost`): a
        round predicted from its own batches rather than a mean one."""
        c = self.costs.cost(knobs)
        return RoundCost(c.rates(), c.importance_flops_per_example * importance_examples,
                         c.download_bytes, c.upload_bytes)

    # -- choice ------------------------------------------------------------------------------
    def _violations(self, budget: ClientBudget, pred: Mapping[str, float]) -> list[str]:
        out = []
        for k, limit in budget.limits().items():  # (those ``pred`` holds)
            if k in pred and pred[k] > limit * (1 + 1e-9):
                out.append(f"{pred[k]:.4g} {UNITS[k]} > {limit:g}")
        return out

    def _cheapest(self, spec, width, sparsity, rank, importance=None, work=None, depth=None) -> Knobs:
        """The least-memory point of a (sub-model, local work, adapter depth, sparsity, rank,
        importance source): every memory saving on (the last importance source, the cheapest,
        where none is given; the least local work and the shallowest adapters where ``work``
        and ``depth`` are not given)."""
        imp = self.importances[-1] if importance is None else importance
        knobs = Knobs(spec, sparsity, rank, False, 1, width, imp, self.precisions[-1],
                      **(self.works[-1] if work is None else work),
                      depth=self.depths[-1] if depth is None else depth, upload=self.uploads[-1])
        ckpt = any(c for c, _ in self.overheads(knobs))
        return replace(knobs, checkpointing=ckpt, micro_batches=max(m for _, m in self.overheads(knobs)))

    def _out_of_reach(self, budget: ClientBudget, examples: int, importance_examples: int,
                      least: Knobs) -> list[str]:
        """What no overhead of a (sub-model, local work, sparsity, rank) brings within
        ``budget``: its memory at the least-memory point ``least`` (every saving on), its FLOPs
        and upload at the least-FLOPs points (no checkpointing: it recomputes; one micro-batch,
        packed where batches pack, and the most); empty when some overhead may fit."""
        # (the base's precision changes its bytes, not its operations: the least-memory one)
        mem = self.predicted(least, examples, importance_examples, need="memory")
        if set(budget.limits()) <= _MEMORY:
            return self._violations(budget, mem)  # no limit the FLOPs or upload reach
        no_ckpt = [replace(least, checkpointing=False, micro_batches=m)
                   for m in {min(m for _, m in self.overheads(least)), least.micro_batches}]
        rest = [self.predicted(k, examples, importance_examples, budget.device, need="flops") for k in no_ckpt]
        best = {"memory_mb": mem["memory_mb"], "memory_share": mem["memory_share"],
                "gflops_per_round": min(r["gflops_per_round"] for r in rest),
                "flops_share": min(r["flops_share"] for r in rest),
                "upload_mb_per_round": min(r["upload_mb_per_round"] for r in rest)}
        if budget.device is not None:
            best["seconds_per_round"] = min(r["seconds_per_round"] for r in rest)
        return self._violations(budget, best)

    def _in_reach(self, budget: ClientBudget, examples: int, importance_examples: int,
                  least: Knobs) -> bool:
        """:meth:`_out_of_reach` is empty, its memory at the least asked first: a point whose
        memory is out of reach needs none of its FLOPs measured."""
        if self._violations(budget, self.predicted(least, examples, importance_examples, need="memory")):
            return False
        return not self._out_of_reach(budget, examples, importance_examples, least)

    def plan(self, client: int, tier: int | None, budget: ClientBudget, examples: int,
             importance_examples: int = 0) -> ClientPlan | None:
        """The most-training plan whose predicted costs fit ``budget`` (:meth:`search`); None
        when none does. Where steps are extrapolated from cut models (:attr:`by_blocks`), the
        plan chosen (or, when none fits, the least-memory plan) has its memory measured on the
        whole model, and dense's where a share of it is a limit: a figure that is not the
        extrapolated one turns extrapolation off, and the search runs again on whole models,
        so a plan's memory is always the whole model's."""
        found = self.search(client, tier, budget, examples, importance_examples)
        if not self.costs.extrapolated:
            return found
        knobs = found.knobs if found is not None else self.least(examples, importance_examples)[0]
        checked = [knobs] + ([self.dense] if "memory_share" in budget.limits() else [])
        wrong = [k for k in checked if not self._verified(k)]
        if not wrong:
            return found
        log.warning("the planner's steps extrapolated from a few blocks (%s: %.6g MiB) differ from the "
                    "whole model's (%.6g MiB): measuring whole models from here on", wrong[0].describe(),
                    self.costs.cost(wrong[0]).memory_mb, self._whole_memory(wrong[0]))
        self.costs = self._whole  # every step measured on the whole model from here on
        return self.search(client, tier, budget, examples, importance_examples)

    def _whole_memory(self, knobs: Knobs) -> float:
        """``knobs``' memory measured on the whole model (kept; no FLOP counter)."""
        if self._whole is None:
            self._whole = self.costs.whole()
        return self._whole.memory(knobs)

    def _verified(self, knobs: Knobs) -> bool:
        """``knobs``' memory as extrapolated equals the whole model's."""
        return math.isclose(self.costs.cost(knobs, "memory").memory_mb, self._whole_memory(knobs), rel_tol=1e-9)

    def search(self, client: int, tier: int | None, budget: ClientBudget, examples: int,
               importance_examples: int = 0) -> ClientPlan | None:
        """The most-training plan whose predicted costs fit ``budget``; None when none does.
        Pruned search, most-training first, one knob at a time: sub-model, local work, sparsity,
        rank, importance source, the base's precision, the reply's (upload) precision, then the
        overheads. A sub-model whose
        cheapest point (least local work, largest sparsity, smallest rank, every memory saving)
        does not fit is skipped whole (nested sub-models: the first in reach by bisection), then
        the same per local work, per sparsity and per rank.
        The plan says why: what the nearest larger plan it passed over needs."""
        #: (the nearest larger plan passed over, what it needs): the second a function, called
        #: for the plan passed over last only (a plan out of reach by its memory needs no FLOPs)
        passed = None

        def fits(least: Knobs, shown: Knobs) -> bool:
            """Some overhead of ``least``'s point may fit; else ``shown`` (its fixed knobs) passed."""
            nonlocal passed
            if self._in_reach(budget, examples, importance_examples, least):
                return True
            passed = (f"{shown.describe(overhead=False)}, at its least",
                      lambda: self._out_of_reach(budget, examples, importance_examples, least))
            return False

        s_min, r_min = self.sparsities[-1], self.ranks[-1]

        def spec_fits(i: int) -> bool:  # not even the sub-model's smallest point fits: skipped
            spec, width = self.specs[i]
            return fits(self._cheapest(spec, width, s_min, r_min), Knobs(spec, width=width))

        for i in self._specs_in_reach(spec_fits):
            spec, width = self.specs[i]
            for work, d in self._works_in_reach(spec, width, fits):
                for s in self.sparsities:
                    if not fits(self._cheapest(spec, width, s, r_min, work=work, depth=d),
                                Knobs(spec, s, width=width, depth=d, **work)):
                        continue
                    for r in self.ranks:
                        if not fits(self._cheapest(spec, width, s, r, work=work, depth=d),
                                    Knobs(spec, s, r, width=width, depth=d, **work)):
                            continue
                        for imp in self.importances:
                            if len(self.importances) > 1 and not fits(
                                    self._cheapest(spec, width, s, r, imp, work=work, depth=d),
                                    Knobs(spec, s, r, width=width, importance=imp, depth=d, **work)):
                                continue
                            for prec, up in ((p, u) for p in self.precisions for u in self.uploads):
                                point = Knobs(spec, s, r, False, 1, width, imp, prec, **work, depth=d, upload=up)
                                for ckpt, mb in self.overheads(point):
                                    knobs = replace(point, checkpointing=ckpt, micro_batches=mb)
                                    if self.costs.two_steps(knobs) and self._violations(
                                            budget, self.predicted(knobs, examples, importance_examples,
                                                                   need="memory")):
                                        # its memory and FLOPs are two steps: the FLOPs not needed
                                        passed = (knobs.describe(), self._needs(budget, knobs, examples,
                                                                                importance_examples))
                                        continue
                                    pred = self.predicted(knobs, examples, importance_examples, budget.device)
                                    over = self._violations(budget, pred)
                                    if not over:
                                        if passed is None:  # nothing cut: room for more steps?
                                            knobs, pred = self._more_steps(budget, knobs, pred, examples,
                                                                           importance_examples)
                                        return self._plan(client, tier, budget, knobs, pred, passed)
                                    passed = (knobs.describe(), lambda over=over: over)
        return None

    def _more_steps(self, budget: ClientBudget, knobs: Knobs, pred: dict[str, float], examples: int,
                    importance_examples: int) -> tuple[Knobs, dict[str, float]]:
        """``budgets.max_local_work``: the most-training plan ``knobs`` (nothing cut) with the
        most whole local steps, up to that multiple of the round's, that still fit ``budget``
        (a step costs the same whatever their number: one measured step, scaled)."""
        most = math.floor(self.cfg.max_local_work * self.local_steps + 1e-9)
        if most <= self.local_steps or not {"gflops_per_round", "flops_share", "seconds_per_round"} \
                & set(budget.limits()):
            return knobs, pred
        for n in range(most, self.local_steps, -1):  # most first: the first that fits
            more = replace(knobs, steps=n)
            p = self.predicted(more, examples, importance_examples, budget.device)
            if not self._violations(budget, p):
                return more, p
        return knobs, pred

    def _specs_in_reach(self, spec_fits: Callable[[int], bool]) -> Iterator[int]:
        """The sub-models (indices into :attr:`specs`, largest first) whose cheapest point may fit
        (``spec_fits``), as a scan of every one finds them, with the scan's last effect before
        each (``spec_fits`` of the one before it). Nested sub-models (:attr:`nested`): the
        first in reach by bisection (the fit only turns true along the list), then the rest
        in turn: a 0.25 client on 48 widths asks 6 sub-models, not 37 (tests/test_planner_search.py
        checks plans and reasons against the scan)."""
        n = len(self.specs)
        first = 0
        if self.nested:
            lo, hi = 0, n  # every one before lo is out of reach; hi is in reach (or the end)
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if spec_fits(mid) else (mid + 1, hi)
            if lo == n:
                return
            if lo > 0:
                spec_fits(lo - 1)  # out of reach: the plan passed over, as the scan leaves it
            first = lo
        for i in range(first, n):
            if spec_fits(i):
                yield i

    def _works_in_reach(self, spec, width, fits) -> Iterator[tuple[dict[str, int], float | None]]:
        """(local work, adapter depth) pairs of a sub-model, most training first, whose cheapest
        point may fit (``fits``; every pair when there is one). With ``budgets.local_work_fill``,
        between a share out of reach and the next share in reach (same depth), the largest
        whole number of examples per step (or steps) in between whose cheapest point may fit
        comes first: a bisection, as the costs grow with the work."""
        s_min, r_min = self.sparsities[-1], self.ranks[-1]
        if len(self.works) == 1 and len(self.depths) == 1:
            yield self.works[0], self.depths[0]
            return
        def in_reach(work: dict[str, int], d) -> bool:
            return fits(self._cheapest(spec, width, s_min, r_min, work=work, depth=d),
                        Knobs(spec, width=width, depth=d, **work))

        missed: dict[float | None, int] = {}  # depth -> the least work out of reach so far
        key = None
        for work in self.works:
            # the knob this share cuts: local steps, then (below the fewest steps) the batch
            if work_key(work, self.cfg.local_work_by) != key:
                key = work_key(work, self.cfg.local_work_by)
                # the last work out of reach, in the new knob's units: the whole batch
                missed = {d: self.rows for d in missed} if key == "batch" else missed
            whole = self.rows if key == "batch" else self.local_steps
            fixed = {k: v for k, v in work.items() if k != key}  # the steps of a batch cut
            n = work.get(key, whole)
            reach = {d: in_reach(work, d) for d in self.depths}
            fills = []  # (work in between, depth, the least work out of reach above it)
            for d in self.depths:
                hi = missed.pop(d, None) if reach[d] else None
                if not reach[d]:
                    missed[d] = n
                elif self.cfg.local_work_fill and hi is not None and hi - n > 1:
                    lo = n
                    while hi - lo > 1:  # lo in reach, hi not
                        mid = (lo + hi) // 2
                        lo, hi = (mid, hi) if in_reach({**fixed, key: mid}, d) else (lo, mid)
                    if lo > n:
                        fills.append((lo, d, hi))
            for lo, d, hi in sorted(fills, key=lambda f: -f[0]):  # most work first, then depth
                # the plan passed over is the next larger one (below the fewest steps, the whole
                # batch is those steps alone)
                in_reach(fixed if fixed and hi == whole else {**fixed, key: hi}, d)
                yield {**fixed, key: lo}, d
            yield from ((work, d) for d in self.depths if reach[d])

    def _needs(self, budget: ClientBudget, knobs: Knobs, examples: int,
               importance_examples: int) -> Callable[[], list[str]]:
        """What ``knobs`` needs that ``budget`` lacks, measured when asked (its memory only
        where the budget limits nothing else)."""
        need = "memory" if set(budget.limits()) <= _MEMORY else "all"
        return lambda: self._violations(budget, self.predicted(
            knobs, examples, importance_examples, None if need == "memory" else budget.device, need=need))

    def _plan(self, client, tier, budget, knobs, pred, passed) -> ClientPlan:
        why = ("the most-training plan (largest sub-model, every local step, every block's "
               "adapters, most heads, highest rank, the importance pass, the most precise base "
               "and upload, least overhead)")
        if knobs.steps is not None and knobs.steps > self.local_steps:
            why += (f", with {knobs.steps} local steps of the round's {self.local_steps}: the most "
                    f"within budgets.max_local_work = {self.cfg.max_local_work:g} that fit")
        if passed is not None:
            why = f"the next larger plan ({passed[0]}) needs {'; '.join(passed[1]())}"
        return ClientPlan(client, tier, budget, knobs, pred["memory_mb"], pred["gflops_per_round"],
                          pred["upload_mb_per_round"], why, self.method.depth_frozen(knobs.depth),
                          memory_reference=self.costs.cost(knobs).reference, flops_share=pred["flops_share"],
                          seconds=pred.get("seconds_per_round"))

    def least(self, examples: int, importance_examples: int = 0, device=None
              ) -> tuple[Knobs, Knobs, dict[str, float]]:
        """The smallest plan (the last sub-model, local work, sparsity and rank) at its least
        memory (every saving on) and at its least FLOPs (no checkpointing: it recomputes), and
        what it needs of each limit at the least."""
        spec, width = self.specs[-1]
        small = self._cheapest(spec, width, self.sparsities[-1], self.ranks[-1])
        low_flops = replace(small, checkpointing=False)
        mem = self.predicted(small, examples, importance_examples, device)
        flops = self.predicted(low_flops, examples, importance_examples, device)
        need = {"memory_mb": mem["memory_mb"], "memory_share": mem["memory_share"],
                "gflops_per_round": flops["gflops_per_round"], "flops_share": flops["flops_share"],
                "upload_mb_per_round": mem["upload_mb_per_round"]}
        if device is not None:
            need["seconds_per_round"] = flops["seconds_per_round"]
        return small, low_flops, need

    def cheapest(self, examples: int, importance_examples: int = 0, device=None) -> str:
        """What the smallest plan costs at the least (:meth:`least`)."""
        small, low_flops, need = self.least(examples, importance_examples, device)
        return (f"the cheapest plan ({low_flops.describe().rsplit(', no checkpointing', 1)[0]}) needs "
                f"{need['memory_mb']:.1f} MiB ({'checkpointing, ' if small.checkpointing else ''}"
                f"{small.micro_batches} micro-batches; {need['memory_share']:.4g}x dense's), "
                f"{need['gflops_per_round']:.4g} GFLOPs/round ({need['flops_share']:.4g}x dense's), "
                f"{need['upload_mb_per_round']:.4g} MB up/round"
                + (f", {need['seconds_per_round']:.4g} s/round on its device" if device is not None else ""))

    def smallest_valid(self, budget: ClientBudget, examples: int, importance_examples: int = 0) -> str:
        """Each limit of ``budget`` the cheapest plan passes and the smallest value that fits it,
        rounded up (4 decimals; MiB to 0.1) so that the value printed is valid as written."""
        need = self.least(examples, importance_examples, budget.device)[2]
        out = []
        for k, v in budget.limits().items():
            if need[k] > v * (1 + 1e-9):
                digits = 1 if k in ("memory_mb", "seconds_per_round") else 4
                value = math.ceil(round(need[k] * 10**digits, 6)) / 10**digits
                out.append(f"{k} {v:g} is below it: the smallest valid value is "
                           f"{min(value, 1.0) if k.endswith('_share') else value:g}")
        return "; ".join(out)


def plan_clients(method, budgets: BudgetsConfig, batch: dict[str, torch.Tensor],
                 client_sizes: Mapping[int, int], num_clients: int, seed: int,
                 flops_scale: float = 1.0,
                 packed_of: Callable[[int], tuple] | None = None,
                 scale_of: Callable[[int], float] | None = None,
                 pairs_of: Callable[[int, bool], float] | None = None,
                 heads_of: Callable[[int], float] | None = None) -> dict[int, ClientPlan]:
    """Every client's plan (clients of equal budget and size share one search), or a ConfigError
    naming the clients no plan fits, their budget and the cheapest plan's cost. ``flops_scale``:
    the tokens a real example costs over the profile batch's row length (FLOPs go with tokens);
    ``packed_of(n)``: the first ``n`` examples packed, what a client whose batches pack trains
    on, and its ``flops_scale``; ``scale_of(n)``: ``flops_scale`` for batches of ``n`` examples."""
    planner = BudgetPlanner(method, budgets, batch, flops_scale, packed_of, scale_of, pairs_of, heads_of)
    fed = method.cfg.federation
    plans: dict[int, ClientPlan] = {}
    memo: dict[tuple, ClientPlan | None] = {}
    failed: list[str] = []
    timed = client_time_budgets(method.cfg, client_budgets(budgets, num_clients, seed))
    for c, (tier, budget) in sorted(timed.items()):
        n = int(client_sizes.get(c, fed.batch_size))
        examples = examples_per_round(fed, n)
        imp = method.importance_examples(n)
        key = (budget.key(), examples, imp)
        if key not in memo:
            memo[key] = planner.plan(c, tier, budget, examples, imp)
        p = memo[key]
        if p is None:
            failed.append(f"client {c} ({budget.field}, {budget.name}): budget {budget.describe()}; "
                          + planner.cheapest(examples, imp, budget.device) + "; "
                          + planner.smallest_valid(budget, examples, imp))
            plans[c] = ClientPlan(c, tier, budget, Knobs(), 0.0, 0.0, 0.0,
                                  sits_out=f"budget {budget.describe()} is below the cheapest plan")
            continue
        enforced = budget.gflops_per_round * 1e9 if budgets.enforce_flops \
            and budget.gflops_per_round is not None else None
        if budgets.enforce_flops and budget.seconds_per_round is not None:
            # a time limit holds as a FLOPs budget: what the device computes in the round's
            # seconds less its transfers (a round's batches vary; the client stops before a
            # step that would pass it, so it replies in time)
            cost = planner.costs.cost(p.knobs)
            in_time = budget.device.flops_within(budget.seconds_per_round, cost.download_bytes,
                                                 cost.upload_bytes, planner.host_gflops)
            enforced = in_time if enforced is None else min(enforced, in_time)
        held = budget.memory_mb if budgets.enforce_memory else None
        plans[c] = replace(p, client=c, tier=tier, budget=budget, flops_budget=enforced,
                           memory_budget=held, round_cost=planner.round_cost(p.knobs, imp))
    if failed:
        shown = failed[:10] + ([f"... and {len(failed) - 10} more"] if len(failed) > 10 else [])
        if budgets.on_infeasible == "error" or len(failed) == num_clients:
            raise ConfigError("no plan fits the budget of some clients:\n  " + "\n  ".join(shown)
                              + ("\n  (every client would sit out)" if budgets.on_infeasible == "sit_out" else ""))
        log.warning("%s", sit_out_summary(plans, client_sizes))
        for line in shown:
            log.warning("these clients sit out every round (budgets.on_infeasible): %s", line)
    return plans
