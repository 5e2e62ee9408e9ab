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

import csv
import io
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from fedslice import measure
from fedslice.config import BUDGET_LIMITS, DEVICE_FIELDS, BudgetsConfig, read_utf8
from fedslice.data.packing import packed_training
from fedslice.errors import ConfigError
from fedslice.fl.client import (ActivationReference, activation_units, extrapolates_by_parts,
                               gradient_checkpointing)
from fedslice.fl.strategy import Payload, State, Strategy
from fedslice.fl.tiers import tier_of_clients
from fedslice.fl.wire import wire_bytes
from fedslice.measure.flops import head_segments
from fedslice.tasks.base import batch_head_positions
from fedslice.slicing.planner import measure_training_step, training_state_bytes
from fedslice.slicing.spec import Spec, spec_sizes

log = logging.getLogger(__name__)

_MB = 1e6
_MIB = float(1 << 20)
BUDGET_FIELDS = BUDGET_LIMITS
UNITS = {"memory_mb": "MiB", "gflops_per_round": "GFLOPs/round", "upload_mb_per_round": "MB up/round",
         "flops_share": "x dense's FLOPs", "memory_share": "x dense's memory",
         "seconds_per_round": "s/round"}


@dataclass(frozen=True)
class ClientBudget:
    """One client's limits (None: no limit) and where they come from (for messages)."""

    memory_mb: float | None = None
    gflops_per_round: float | None = None
    upload_mb_per_round: float | None = None
    flops_share: float | None = None  # of a dense client's FLOPs per round (the whole model)
    memory_share: float | None = None  # of a dense client's peak memory
    seconds_per_round: float | None = None  # simulated seconds of a client-round on its device
    name: str = ""  # the tier's name, or 'csv'
    field: str = "budgets"  # 'budgets.tiers[1]' / 'budgets.csv row 4'
    #: the client's device on the simulated clock (:class:`fedslice.fl.devices.Device`; None:
    #: no devices), what a plan's seconds are predicted on
    device: Any = None

    def describe(self) -> str:
        return ", ".join(f"{v:g} {UNITS[k]}" for k, v in self.limits().items())

    def relative(self) -> bool:
        """Some limit is a share of a dense client's cost (the planner predicts dense's too)."""
        return self.flops_share is not None or self.memory_share is not None

    def limits(self) -> dict[str, float]:
        return {k: v for k in BUDGET_FIELDS if (v := getattr(self, k)) is not None}

    def key(self) -> tuple:
        """What a plan depends on: the limits and the device."""
        return tuple(sorted(self.limits().items())), self.device


def read_budget_csv(path: Path, num_clients: int) -> dict[int, ClientBudget]:
    """Client -> budget from a CSV with a ``client`` column and any of :data:`BUDGET_FIELDS`
    (an empty cell: no limit); every client of the federation once. UTF-8, with or without a
    byte-order mark. Errors name the file, the row (its line in the file: the header's is 1)
    and the field."""
    where = f"budgets.csv {path}"
    if path.is_dir():
        raise ConfigError(f"budgets.csv = {str(path)!r} is a folder: give a CSV file")
    try:
        text = read_utf8(path, "budgets.csv").removeprefix("\ufeff")
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    lines = _csv_rows(text, where)
    if not lines:
        raise ConfigError(f"{where}: the file is empty (give a header: client,memory_mb,...)")
    head_line, header = lines[0]
    columns = [c.strip() for c in header]
    for k, c in enumerate(columns):
        if not c:
            raise ConfigError(f"{where} row {head_line}: column {k + 1} has no name (columns: "
                              f"{','.join(columns)})")
        if c in columns[:k]:
            raise ConfigError(f"{where} row {head_line}: column {c!r} appears twice (columns "
                              f"{columns.index(c) + 1} and {k + 1})")
    if "client" not in columns:
        raise ConfigError(f"{where}: no `client` column (columns: {columns})")
    limits = [c for c in columns if c in BUDGET_FIELDS]
    if not limits:
        raise ConfigError(f"{where}: no budget column: give at least one of {', '.join(BUDGET_FIELDS)}")
    # a client's device may sit in the same file (fedslice.fl.devices reads those columns)
    known = (*BUDGET_FIELDS, *DEVICE_FIELDS)
    if unknown := [c for c in columns if c not in known and c != "client"]:
        raise ConfigError(f"{where}: unknown column(s) {unknown} (known: client, {', '.join(known)})")
    if len(lines) == 1:
        raise ConfigError(f"{where}: no rows after the header (give one row per client, ids "
                          f"0..{num_clients - 1})")
    out: dict[int, ClientBudget] = {}
    for i, cells in lines[1:]:
        if len(cells) != len(columns):
            raise ConfigError(f"{where} row {i}: {len(cells)} cells, the header has {len(columns)} "
                              f"({','.join(columns)}; an empty cell is no limit)")
        row = dict(zip(columns, (c.strip() for c in cells)))
        out[_client_id(row["client"], f"{where} row {i}", num_clients, out)] = ClientBudget(
            **_row_limits(row, limits, f"{where} row {i}"), name="csv", field=f"budgets.csv row {i}")
    if missing := sorted(set(range(num_clients)) - set(out)):
        raise ConfigError(f"{where}: no row for client(s) {missing[:10]}{' ...' if len(missing) > 10 else ''}")
    return out


def _csv_rows(text: str, where: str) -> list[tuple[int, list[str]]]:
    """(line where the row starts, cells) of every row that is not blank."""
    reader = csv.reader(io.StringIO(text, newline=""))
    out, end = [], 0
    try:
        for cells in reader:
            start, end = end + 1, reader.line_num
            if any(c.strip() for c in cells):
                out.append((start, cells))
    except csv.Error as e:
        raise ConfigError(f"{where} row {reader.line_num}: {e}") from None
    return out


def _client_id(text: str, where: str, num_clients: int, seen: Mapping[int, Any]) -> int:
    try:
        client = int(text)
    except ValueError:
        raise ConfigError(f"{where}, client: {text!r} is not a client id") from None
    if not 0 <= client < num_clients:
        raise ConfigError(f"{where}, client: {client} is not a client of this federation "
                          f"(ids 0..{num_clients - 1})")
    if client in seen:
        raise ConfigError(f"{where}, client: client {client} has a second row")
    return client


def _row_limits(row: Mapping[str, str], limits: list[str], where: str) -> dict[str, float]:
    values = {}
    for k in limits:
        if not row[k]:
            continue
        try:
            values[k] = float(row[k])
        except ValueError:
            raise ConfigError(f"{where}, {k}: {row[k]!r} is not a number") from None
        if math.isinf(values[k]):
            raise ConfigError(f"{where}, {k}: {row[k]} is not a budget (leave the cell empty for "
                              "no limit)")
        if not values[k] > 0:  # nan too
            raise ConfigError(f"{where}, {k}: {row[k]} is not a positive number")
        if k.endswith("_share") and values[k] > 1:
            raise ConfigError(f"{where}, {k}: {row[k]} is not a share in (0, 1]")
    if not values:
        raise ConfigError(f"{where}: no budget (every one of {', '.join(limits)} is empty)")
    return values


def client_budgets(cfg: BudgetsConfig, num_clients: int, seed: int
                   ) -> dict[int, tuple[int | None, ClientBudget]]:
    """Client -> (tier index or None for a CSV row or a drawn share, budget), reproducible from
    ``seed``: tiers placed at random (:func:`tier_of_clients`), or every client's
    ``flops_share`` drawn uniformly from ``budgets.flops_share_range``."""
    if cfg.csv is not None:
        return {c: (None, b) for c, b in read_budget_csv(Path(cfg.csv), num_clients).items()}
    if cfg.flops_share_range is not None:
        rng = np.random.default_rng([seed, 0x7A11])
        draws = rng.uniform(*cfg.flops_share_range, size=num_clients)
        field = cfg.field_of("flops_share_range")
        return {c: (None, ClientBudget(flops_share=float(x), name="drawn", field=field))
                for c, x in enumerate(draws)}
    out = {}
    for c, i in enumerate(tier_of_clients([t.share for t in cfg.tiers], num_clients, seed)):
        t = cfg.tiers[i]
        out[c] = (i, ClientBudget(**{k: getattr(t, k) for k in BUDGET_FIELDS},
                                  name=t.name or f"tier{i}", field=cfg.field_of(f"tiers[{i}]")))
    return out


@dataclass(frozen=True)
class Knobs:
    """One plan: what a client trains (None: the stage is absent or at the run's setting)."""

    spec: Spec | None = None  # the sub-model (None: the whole model)
    sparsity: float | None = None  # the head stage's sparsity
    rank: int | None = None  # the LoRA rank
    checkpointing: bool = False
    micro_batches: int = 1
    width: float = 1.0  # the sub-model's share of the full model's linear parameters
    importance: str | None = None  # where the head stage's scores come from ("pass", "first_step")
    precision: str | None = None  # the base's ("none": the run's fp32; "int8", "nf4": a quantized copy)
    steps: int | None = None  # local steps per round (None: federation.local_steps, every one)
    batch: int | None = None  # examples per local step (None: federation.batch_size)
    depth: float | None = None  # share of the top blocks whose adapters train (None: every block)

    def payload_config(self) -> dict[str, Any]:
        """What the client reads from its payload's config (the sub-model and rank travel as the
        stages below put them: ``spec``, ``lora_rank``)."""
        out: dict[str, Any] = {"micro_batches": self.micro_batches, "checkpointing": self.checkpointing}
        if self.sparsity is not None:
            out["sparsity"] = self.sparsity
        if self.importance is not None:
            out["importance_source"] = self.importance
        if self.precision not in (None, "none"):
            out["base_precision"] = self.precision
        if self.steps is not None:
            out["local_steps"] = self.steps
        if self.batch is not None:
            out["batch_size"] = self.batch
        return out  # the adapter depth travels as the tensors it freezes (ClientPlan.frozen)

    def describe(self, overhead: bool = True) -> str:
        parts = []
        if self.spec is not None:
            parts.append(f"width {self.width:.2f}")
        if self.steps is not None:
            parts.append(f"{self.steps} local step{'s' if self.steps > 1 else ''}")
        if self.batch is not None:
            parts.append(f"{self.batch} example{'s' if self.batch > 1 else ''} per step")
        if self.depth is not None and self.depth < 1:
            parts.append(f"adapters in the top {self.depth:.0%} of blocks")
        if self.sparsity is not None:
            parts.append(f"sparsity {self.sparsity:g}")
        if self.rank is not None:
            parts.append(f"rank {self.rank}")
        if self.importance == "first_step":
            parts.append("importance from the first step")
        elif self.importance == "pass":
            parts.append("the importance pass")
        if self.precision not in (None, "none"):
            parts.append(f"{self.precision} base")
        if overhead:
            parts.append("checkpointing" if self.checkpointing else "no checkpointing")
            parts.append(f"{self.micro_batches} micro-batch{'es' if self.micro_batches > 1 else ''}")
        return ", ".join(parts) or "the whole model"

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "spec"}
        if self.spec is not None:
            d.update(spec_sizes(self.spec))
        return d


@dataclass(frozen=True)
class PlannedModel:
    """What a client with some knobs trains (from :meth:`Method.planned_model`): the model, the
    tensors it sends back, and the model its importance pass runs on (the head stage; None)."""

    model: nn.Module
    upload: Mapping[str, torch.Tensor]
    importance_model: nn.Module | None = None


@dataclass(frozen=True)
class KnobCost:
    """Measured costs of one plan on the profile batch."""

    memory_mb: float  # peak training memory of a step (its micro-batch's activations)
    step_flops: float  # FLOPs of one step over a whole batch (every micro-batch)
    upload_bytes: int
    importance_flops_per_example: float = 0.0
    download_bytes: int = 0  # the tensors the client receives to train (as held)
    #: the measured step's saved tensors and batch shape, which a client holding its memory
    #: budget predicts its own steps from until it has measured one (fl.client.memory_split)
    reference: ActivationReference | None = None
    #: of ``step_flops``, attention's and the head's (None: not split; extrapolated per
    #: position), the attention pairs of the batch counted, and whether the head runs once per
    #: example (classification) or per target token
    step_attention: float | None = None
    step_head: float = 0.0
    pairs: float = 0.0
    heads: float = 0.0


@dataclass
class ClientPlan:
    """A client's plan, its predicted costs and why it was chosen."""

    client: int
    tier: int | None
    budget: ClientBudget
    knobs: Knobs
    memory_mb: float
    gflops_per_round: float
    upload_mb: float
    reason: str = ""
    #: the trainable tensors the plan leaves frozen (below its adapter depth), by name
    frozen: tuple[str, ...] = ()
    #: FLOPs the client's round may take, enforced as it trains (``budgets.enforce_flops``;
    #: None: not enforced): :func:`fedslice.fl.client.train_local`
    flops_budget: float | None = None
    #: MiB the client's steps may hold, held as it trains (``budgets.enforce_memory``; None:
    #: not held), and the planner's measured step it predicts its first from
    memory_budget: float | None = None
    memory_reference: ActivationReference | None = None
    #: the plan's predicted FLOPs per round over a dense client's (the whole model at the run's
    #: settings, the same examples)
    flops_share: float | None = None
    #: why the client trains nothing (``budgets.on_infeasible = "sit_out"``: no plan fits)
    sits_out: str | None = None
    #: a client-round's simulated seconds on the client's device (None: no device)
    seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"client": self.client, "tier": self.tier, "budget_name": self.budget.name,
                "budget": self.budget.limits(), **self.knobs.to_dict(),
                "predicted": {"memory_mb": self.memory_mb, "gflops_per_round": self.gflops_per_round,
                              "upload_mb": self.upload_mb}, "reason": self.reason,
                "flops_budget": self.flops_budget, "memory_budget": self.memory_budget,
                "flops_share": self.flops_share, "sits_out": self.sits_out, "seconds": self.seconds}


def examples_per_round(fed, n: int) -> int:
    """Examples a client of ``n`` examples trains on per round (local steps x batch, or epochs x n)."""
    return fed.local_steps * fed.batch_size if fed.local_steps else fed.local_epochs * n


class BudgetPlanner:
    """Plans clients of ``method`` (built up to its strategy) under their budgets; costs are
    measured once per plan and cached."""

    def __init__(self, method, cfg: BudgetsConfig, batch: dict[str, torch.Tensor],
                 flops_scale: float = 1.0, packed_of: Callable[[int], tuple] | None = None,
                 scale_of: Callable[[int], float] | None = None,
                 pairs_of: Callable[[int, bool], float] | None = None,
                 heads_of: Callable[[int], float] | None = None):
        """``batch``: ``federation.batch_size`` examples padded to the longest; ``flops_scale``:
        the tokens a real batch of that size holds over the profile's (``scale_of(n)``: the
        same for batches of ``n`` examples, a plan's smaller batch); ``packed_of(n)``: the
        first ``n`` examples packed into rows, what a client trains on when its batches pack (a
        plan of one micro-batch: a split trains unpacked), and its ``flops_scale``."""
        self.method, self.cfg, self.batch, self.flops_scale = method, cfg, batch, flops_scale
        self.packed_of, self.scale_of, self.pairs_of = packed_of, scale_of, pairs_of
        self.heads_of = heads_of or float
        self.rows = len(batch["input_ids"] if "input_ids" in batch else batch["pixel_values"])
        axes = method.plan_axes(cfg)
        self.specs: list[tuple[Spec | None, float]] = axes.get("specs") or [(None, 1.0)]  # largest first
        self.sparsities: list[float | None] = axes.get("sparsities") or [None]  # fewest pruned first
        self.ranks: list[int | None] = axes.get("ranks") or [None]  # largest first
        self.importances: list[str | None] = axes.get("importances") or [None]  # best first
        self.precisions: list[str | None] = axes.get("precisions") or [None]  # most precise first
        self.depths: list[float | None] = axes.get("depths") or [None]  # deepest first
        self.local_steps = method.cfg.federation.local_steps or 0
        #: a round's local work, most first: {} (all of it), then {"batch": rows per step} or
        #: {"steps": local steps} at each share of ``budgets.local_work``
        self.works: list[dict[str, int]] = [{}]
        whole = self.rows if cfg.local_work_by == "batch" else self.local_steps
        cut = {max(1, math.floor(w * whole + 0.5)) for w in cfg.local_work if w < 1} - {whole}
        self.works += [{cfg.local_work_by: n} for n in sorted(cut, reverse=True)]
        self.checkpoints = [False, True] if cfg.checkpointing and method.can_checkpoint() else [False]
        #: a dense client, what ``flops_share`` and ``memory_share`` are shares of: the whole
        #: model at the run's settings (lora.r, the method's sparsity and importance source, the
        #: whole round in one batch, the run's base)
        devices = method.cfg.devices
        #: this host's GFLOP/s that devices' speed factors multiply (None: not given)
        self.host_gflops = devices.host_gflops_per_s if devices is not None else None
        self.dense = Knobs(self.specs[0][0], width=self.specs[0][1],
                           rank=method.cfg.lora.r if "ranks" in axes else None)
        self._costs: dict[Knobs, KnobCost] = {}
        self._packed: dict[int, tuple[dict, float]] = {}

    def overheads(self, knobs: Knobs | None = None) -> list[tuple[bool, int]]:
        """(checkpointing, micro-batches), least overhead first: the splits of ``knobs``' batch."""
        rows = self.rows if knobs is None or knobs.batch is None else knobs.batch
        splits = [m for m in self.cfg.micro_batches if rows % m == 0] or [1]
        return [(c, m) for c in self.checkpoints for m in splits]

    # -- costs -------------------------------------------------------------------------------
    def cost(self, knobs: Knobs) -> KnobCost:
        """One step's costs (a plan's local steps change how many, not what a step costs)."""
        knobs = replace(knobs, steps=None)
        if knobs not in self._costs:
            self._costs[knobs] = self._measure(knobs)
        return self._costs[knobs]

    def _rows(self, knobs: Knobs) -> int:
        return self.rows if knobs.batch is None else knobs.batch

    def _packed_batch(self, knobs: Knobs) -> tuple | None:
        """The packed profile batch of ``knobs``' rows, its FLOPs scale and (optionally) the
        packed batch its peak memory is measured on (None: it trains unpacked)."""
        if self.packed_of is None or knobs.micro_batches != 1:
            return None
        rows = self._rows(knobs)
        if rows not in self._packed:
            self._packed[rows] = self.packed_of(rows)
        return self._packed[rows]

    def _measure(self, knobs: Knobs) -> KnobCost:
        packed = self._packed_batch(knobs)
        if packed is not None:
            part = packed[0]
        else:
            part = {k: v[:self._rows(knobs) // knobs.micro_batches] for k, v in self.batch.items()}
        # a padded batch's FLOPs, upload and importance do not depend on its split: counted once
        known = None if packed is not None else next(
            (c for k, c in self._costs.items() if self._packed_batch(k) is None
             and replace(k, micro_batches=1) == replace(knobs, micro_batches=1)), None)
        with self.method.planned_model(knobs) as planned, \
                gradient_checkpointing(planned.model, knobs.checkpointing), \
                (packed_training(planned.model) if packed is not None else nullcontext()):
            split = self.method.adapter.in_modules and extrapolates_by_parts(
                part, self.method.adapter.virtual_tokens)
            counted: dict[str, float] = {}
            flops, memory, _, _ = measure_training_step(
                planned.model, part, loss_fn=self.method.task.loss, flops=known is None,
                head=head_segments(planned.model) if split else (), parts=counted)
            steps = 1 if packed is not None else knobs.micro_batches
            shares = {} if known is not None or not split else dict(
                step_attention=counted["attention"] * steps, step_head=counted["head"] * steps,
                pairs=float(activation_units(part)[1] * steps), heads=float(batch_head_positions(part) * steps))
            if packed is not None and len(packed) > 2:  # the packed layout every batch fits in
                part = packed[2]
                memory = measure_training_step(planned.model, part, loss_fn=self.method.task.loss,
                                               flops=False)[1]
            saved = memory * _MIB - training_state_bytes(planned.model)
            reference = ActivationReference(saved, *activation_units(part))
            if known is not None:
                return replace(known, memory_mb=memory, reference=reference)
            upload = wire_bytes(planned.upload, self.method.cfg.federation.upload_dtype)  # as it travels
            download = measure.tensor_bytes(dict(planned.upload))
            imp = 0.0
            if planned.importance_model is not None:
                imp = self._forward_flops(planned.importance_model) / self.rows
        return KnobCost(memory, flops * (1 if packed is not None else knobs.micro_batches), upload, imp,
                        download, reference, **shares)

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

    def predicted(self, knobs: Knobs, examples: int, importance_examples: int,
                  device=None) -> dict[str, float]:
        """A plan's costs for a client of ``examples`` per round at full work, their shares of a
        dense client's (:attr:`dense`), and on a ``device`` (:class:`fedslice.fl.devices.Device`)
        a client-round's simulated seconds: the download, its FLOPs at the device's speed, the
        upload (as the simulated clock counts a reply)."""
        out = self._predicted(knobs, examples, importance_examples)
        dense = out if knobs == self.dense else self._predicted(self.dense, examples, importance_examples)
        out = {**out, "flops_share": out["gflops_per_round"] / dense["gflops_per_round"],
               "memory_share": out["memory_mb"] / dense["memory_mb"]}
        if device is not None:
            c = self.cost(knobs)
            out["seconds_per_round"] = device.seconds(out["gflops_per_round"] * 1e9, c.download_bytes,
                                                      c.upload_bytes, self.host_gflops)
        return out

    def _predicted(self, knobs: Knobs, examples: int, importance_examples: int) -> dict[str, float]:
        c = self.cost(knobs)
        # training batches hold about flops_scale x the profile's tokens; an importance pass
        # runs a client's examples in few large batches, each padded to its longest: counted at
        # the profile's length (the data's longest), an upper bound
        packed = self._packed_batch(knobs)
        rows = self._rows(knobs)
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

    # -- choice ------------------------------------------------------------------------------
    def _violations(self, budget: ClientBudget, pred: Mapping[str, float]) -> list[str]:
        out = []
        for k, limit in budget.limits().items():
            if pred[k] > limit * (1 + 1e-9):
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
                      depth=self.depths[-1] if depth is None else depth)
        ckpt = any(c for c, _ in self.overheads(knobs))
        return replace(knobs, checkpointing=ckpt, micro_batches=max(m for _, m in self.overheads(knobs)))

    def _out_of_reach(self, budget: ClientBudget, examples: int, importance_examples: int,
                      least: Knobs) -> list[str]:
        """What no overhead of a (sub-model, local work, sparsity, rank) brings within
        ``budget``: its memory at the least-memory point ``least`` (every saving on), its FLOPs
        and upload at the least-FLOPs points (no checkpointing: it recomputes; one micro-batch,
        packed where batches pack, and the most); empty when some overhead may fit."""
        # (the base's precision changes its bytes, not its operations: the least-memory one)
        no_ckpt = [replace(least, checkpointing=False, micro_batches=m)
                   for m in {min(m for _, m in self.overheads(least)), least.micro_batches}]
        mem = self.predicted(least, examples, importance_examples, budget.device)
        rest = [self.predicted(k, examples, importance_examples, budget.device) for k in no_ckpt]
        best = {"memory_mb": mem["memory_mb"], "memory_share": mem["memory_share"],
                "gflops_per_round": min(r["gflops_per_round"] for r in rest),
                "flops_share": min(r["flops_share"] for r in rest),
                "upload_mb_per_round": min(r["upload_mb_per_round"] for r in rest)}
        if budget.device is not None:
            best["seconds_per_round"] = min(r["seconds_per_round"] for r in rest)
        return self._violations(budget, best)

    def plan(self, client: int, tier: int | None, budget: ClientBudget, examples: int,
             importance_examples: int = 0) -> ClientPlan | None:
        """The most-training plan whose predicted costs fit ``budget``; None when none does.
        Pruned search, most-training first, one knob at a time: sub-model, local work, sparsity,
        rank, importance source, precision, then the overheads. A sub-model whose
        cheapest point (least local work, largest sparsity, smallest rank, every memory saving)
        does not fit is skipped whole, then the same per local work, per sparsity and per rank.
        The plan says why: what the nearest larger plan it passed over needs."""
        passed = None  # (the nearest larger plan passed over, what it needs)

        def fits(least: Knobs, shown: Knobs) -> bool:
            """Some overhead of ``least``'s point may fit; else ``shown`` (its fixed knobs) passed."""
            nonlocal passed
            over = self._out_of_reach(budget, examples, importance_examples, least)
            if over:
                passed = (f"{shown.describe(overhead=False)}, at its least", over)
            return not over

        s_min, r_min = self.sparsities[-1], self.ranks[-1]
        for spec, width in self.specs:
            if not fits(self._cheapest(spec, width, s_min, r_min), Knobs(spec, width=width)):
                continue  # not even the sub-model's smallest point fits
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
                            for prec in self.precisions:
                                point = Knobs(spec, s, r, False, 1, width, imp, prec, **work, depth=d)
                                for ckpt, mb in self.overheads(point):
                                    knobs = replace(point, checkpointing=ckpt, micro_batches=mb)
                                    pred = self.predicted(knobs, examples, importance_examples, budget.device)
                                    over = self._violations(budget, pred)
                                    if not over:
                                        return self._plan(client, tier, budget, knobs, pred, passed)
                                    passed = (knobs.describe(), over)
        return None

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
        key = self.cfg.local_work_by
        whole = self.rows if key == "batch" else self.local_steps

        def in_reach(work: dict[str, int], d) -> bool:
            return fits(self._cheapest(spec, width, s_min, r_min, work=work, depth=d),
                        Knobs(spec, width=width, depth=d, **work))

        missed: dict[float | None, int] = {}  # depth -> the least work out of reach so far
        for work in self.works:
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
                        lo, hi = (mid, hi) if in_reach({key: mid}, d) else (lo, mid)
                    if lo > n:
                        fills.append((lo, d, hi))
            for lo, d, hi in sorted(fills, key=lambda f: -f[0]):  # most work first, then depth
                in_reach({key: hi}, d)  # the plan passed over is the next larger one
                yield {key: lo}, d
            yield from ((work, d) for d in self.depths if reach[d])

    def _plan(self, client, tier, budget, knobs, pred, passed) -> ClientPlan:
        why = ("the most-training plan (largest sub-model, every local step, every block's "
               "adapters, most heads, highest rank, the importance pass, the most precise base, "
               "least overhead)")
        if passed is not None:
            why = f"the next larger plan ({passed[0]}) needs {'; '.join(passed[1])}"
        return ClientPlan(client, tier, budget, knobs, pred["memory_mb"], pred["gflops_per_round"],
                          pred["upload_mb_per_round"], why, self.method.depth_frozen(knobs.depth),
                          memory_reference=self.cost(knobs).reference, flops_share=pred["flops_share"],
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


def planning_lengths(cfg, lengths: torch.Tensor | None, packed: bool = False,
                     batch_size: int | None = None, client_examples: int | None = None
                     ) -> tuple[int, float]:
    """(the profile batch's sequence length, the tokens a training example costs on average).

    The length is the longest training example's as encoded (a generation task's prompt and
    target together; data.max_length without the data): peak memory is the longest batch's.
    Per example: :func:`step_units`' positions over the batch's examples."""
    if lengths is None or len(lengths) == 0:
        return cfg.data.max_length, float(cfg.data.max_length)
    b = batch_size or cfg.federation.batch_size
    return int(torch.as_tensor(lengths).max()), step_units(cfg, lengths, packed, b, client_examples)[0] / b


def step_units(cfg, lengths: torch.Tensor | None, packed: bool, batch_size: int,
               client_examples: int | None = None) -> tuple[float, float]:
    """``(positions, attention pairs)`` a training step of ``batch_size`` examples of the
    training ``lengths`` holds in the mean: rows x row length and rows x row length², what its
    FLOPs grow with (fl.client's extrapolation). Packed batches: their rows, simulated as
    :func:`packed_layouts` lays them out; length-grouped padded batches: each as long as its
    longest, simulated as ``iter_batches`` groups (windows of 16 random batches sorted by
    length, or a client's whole data where it holds fewer: ``client_examples``); random padded
    batches: the expected longest of the batch (order statistics, drawn with replacement). No
    lengths: every example at ``data.max_length``."""
    b = batch_size
    if lengths is None or len(lengths) == 0:
        t = cfg.data.max_length
        return float(b * t), float(b * t * t)
    lens = torch.as_tensor(lengths).flatten().double()
    if packed:
        layouts = packed_layouts(cfg, lens, b, client_examples).astype(np.float64)  # (rows, length)
        return float((layouts[:, 0] * layouts[:, 1]).mean()), float((layouts[:, 0] * layouts[:, 1] ** 2).mean())
    if cfg.federation.group_by_length:
        as_float = lens.numpy()
        batches = [as_float[idx] for idx in drawn_batches(cfg, lens, b, client_examples)]
        rows = np.asarray([len(x) for x in batches])
        t = np.asarray([x.max() for x in batches])
        return float((rows * t).mean()), float((rows * t ** 2).mean())
    ordered, _ = torch.sort(lens)
    n = len(ordered)
    cdf = (torch.arange(1, n + 1, dtype=torch.float64) / n) ** b  # P(max <= i-th smallest)
    pmf = cdf - torch.cat([cdf.new_zeros(1), cdf[:-1]])
    return float(b * (ordered * pmf).sum()), float(b * (ordered ** 2 * pmf).sum())


def drawn_batches(cfg, lengths, batch_size: int, client_examples: int | None = None,
                  draws: int = 48) -> list[np.ndarray]:
    """The examples (indices into the training ``lengths``) of simulated training batches of
    ``batch_size`` examples, drawn as a client's data loader draws them
    (``federation.group_by_length``: a pass over a client's ``client_examples`` examples in
    windows of 16 batches, each sorted by length and cut, the last window and the last batch of
    a window short; else random examples). Seeded: the same lengths give the same batches."""
    lens = torch.as_tensor(lengths).flatten().long().numpy()
    rng = np.random.default_rng(0)
    if not cfg.federation.group_by_length:
        return [rng.integers(0, len(lens), size=batch_size) for _ in range(draws * 4)]
    window = 16 * batch_size
    epoch = window if client_examples is None else max(1, client_examples)  # a client's pass
    out: list[np.ndarray] = []
    while len(out) < draws * 16:
        drawn = rng.integers(0, len(lens), size=epoch)
        for lo in range(0, epoch, window):  # iter_batches: each window of the pass sorted, cut
            idx = drawn[lo:lo + window]
            idx = idx[np.argsort(-lens[idx], kind="stable")]
            out += [idx[i:i + batch_size] for i in range(0, len(idx), batch_size)]
    return out


def packed_layouts(cfg, lengths, batch_size: int, client_examples: int | None = None,
                   head_lengths=None) -> np.ndarray:
    """``(K, 3)``: the rows, row length and head positions (target tokens; the examples where
    ``head_lengths`` is None) of the simulated packed training batches of
    :func:`drawn_batches`, laid out as :func:`fedslice.data.packing.row_capacity` lays a batch
    out."""
    from fedslice.data.packing import ROW_TOKENS, row_capacity

    lens = torch.as_tensor(lengths).flatten().long().numpy()
    heads = None if head_lengths is None else torch.as_tensor(head_lengths).flatten().long().numpy()
    out = []
    for idx in drawn_batches(cfg, lengths, batch_size, client_examples):
        capacity, place = row_capacity(lens[idx].tolist(), ROW_TOKENS)
        out.append((1 + max(r for r, _ in place), capacity, len(idx) if heads is None else heads[idx].sum()))
    return np.asarray(out, dtype=np.int64)


def packed_peak_shape(cfg, lengths, batch_size: int, client_examples: int | None = None,
                      head_lengths=None) -> tuple[int, int, int]:
    """``(rows, row length, head positions)`` that every simulated packed batch of
    ``batch_size`` examples fits in (:func:`packed_layouts`; each at most ``batch_size`` rows of
    the longest example or :data:`fedslice.data.packing.ROW_TOKENS`): the batch a packed plan's
    peak memory is measured on, as activations grow with each (a language model's logits with
    its target tokens)."""
    layouts = packed_layouts(cfg, lengths, batch_size, client_examples, head_lengths)
    return int(layouts[:, 0].max()), int(layouts[:, 1].max()), int(layouts[:, 2].max())


def client_time_budgets(cfg, budgets: dict[int, tuple[int | None, ClientBudget]]
                        ) -> dict[int, tuple[int | None, ClientBudget]]:
    """Each client's budget with its device on the simulated clock (``[devices]`` or the
    tier's device fields; :func:`fedslice.fl.devices.population`) and its time limit: the
    tier's ``seconds_per_round``, and under ``round_policy = "deadline"`` the round's deadline
    (the smaller). A time limit without a device, or on a device whose speed is a factor of the
    host's without ``devices.host_gflops_per_s`` (the planner plans before the run measures
    the host), is a ConfigError naming the fields."""
    from fedslice.fl.devices import population

    fed = cfg.federation
    deadline = fed.round_deadline_s if fed.round_policy == "deadline" else None
    pop = population(cfg)
    host = cfg.devices.host_gflops_per_s if cfg.devices is not None else None
    out = {}
    for c, (tier, budget) in budgets.items():
        device = pop.devices.get(c) if pop is not None else None
        limit = min((x for x in (budget.seconds_per_round, deadline) if x is not None), default=None)
        if device is not None and device.speed is not None and host is None:
            if limit is not None:
                raise ConfigError(f"{budget.field}: a time limit ({'seconds_per_round' if budget.seconds_per_round else 'federation.round_deadline_s'}) "
                                  f"on a device whose speed is a factor of the host's ({device.where}, "
                                  "speed): the planner needs the host's rate before the run measures it: "
                                  "set devices.host_gflops_per_s (or give the device's gflops_per_s)")
            device = None  # its seconds are the clock's, not predicted
        if budget.seconds_per_round is not None and device is None:
            raise ConfigError(f"{budget.field}: seconds_per_round needs the client's device on the "
                              "simulated clock ([devices], or the tier's gflops_per_s and links)")
        out[c] = (tier, replace(budget, device=device, seconds_per_round=limit if device is not None else None))
    return out


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
            cost = planner.cost(p.knobs)
            in_time = budget.device.flops_within(budget.seconds_per_round, cost.download_bytes,
                                                 cost.upload_bytes, planner.host_gflops)
            enforced = in_time if enforced is None else min(enforced, in_time)
        held = budget.memory_mb if budgets.enforce_memory else None
        plans[c] = replace(p, client=c, tier=tier, budget=budget, flops_budget=enforced,
                           memory_budget=held)
    if failed:
        shown = failed[:10] + ([f"... and {len(failed) - 10} more"] if len(failed) > 10 else [])
        if budgets.on_infeasible == "error" or len(failed) == num_clients:
            raise ConfigError("no plan fits the budget of some clients:\n  " + "\n  ".join(shown)
                              + ("\n  (every client would sit out)" if budgets.on_infeasible == "sit_out" else ""))
        for line in shown:
            log.warning("these clients sit out every round (budgets.on_infeasible): %s", line)
    return plans


def plan_groups(plans: Mapping[int, ClientPlan]) -> list[tuple[list[int], ClientPlan]]:
    """Clients that share a budget and a plan, as (clients, one plan), in order of first client."""
    groups: dict[tuple, list[int]] = {}
    for c, p in sorted(plans.items()):
        key = (p.budget.name, p.budget.field if p.tier is not None else "", p.knobs,
               round(p.gflops_per_round, 6), round(p.memory_mb, 6), None if p.seconds is None else round(p.seconds, 6))
        groups.setdefault(key, []).append(c)
    return [(cs, plans[cs[0]]) for cs in groups.values()]


def render_plans(plans: Mapping[int, ClientPlan]) -> list[str]:
    """Lines of ``fedslice plan``: one per group of clients with the same budget and plan."""
    lines = []
    for clients, p in plan_groups(plans):
        shown = ", ".join(map(str, clients[:8])) + (", ..." if len(clients) > 8 else "")
        lines.append(f"  {p.budget.name} ({p.budget.describe()}): {len(clients)} client(s) [{shown}]")
        lines.append(f"    plan: {p.knobs.describe()}")
        lines.append(f"    predicted: {p.memory_mb:.1f} MiB peak, {p.gflops_per_round:.4g} GFLOPs/round, "
                     f"{p.upload_mb:.4g} MB up/round"
                     + (f", {p.seconds:.4g} s/round on its device" if p.seconds is not None else ""))
        lines.append(f"    why: {p.reason}")
        if p.flops_budget is not None:
            lines.append(f"    enforced: at most {p.flops_budget / 1e9:.4g} GFLOPs/round as it trains "
                         "(local steps past it are cut: budgets.enforce_flops)")
        if p.memory_budget is not None:
            lines.append(f"    enforced: at most {p.memory_budget:g} MiB as it trains (a step that would "
                         "pass it runs as micro-batches: budgets.enforce_memory)")
    return lines


class PlannedStrategy(Strategy):
    """FedAvg whose clients train their plans: each payload's config carries the client's knobs
    (:meth:`Knobs.payload_config`), its tier and budget; its LoRA rank is the plan's
    (``client_rank``: the ``lora_ranks`` rule truncates payloads and pads replies)."""

    def __init__(self, fed, plans: Mapping[int, ClientPlan], client_sizes: Mapping[int, int] | None = None):
        super().__init__(fed, client_sizes)
        self.plans = dict(plans)

    def client_rank(self, client: int) -> int | None:
        p = self.plans.get(client)
        return None if p is None else p.knobs.rank

    def payload_for(self, server_round: int, state: State, client: int, config: dict) -> Payload:
        p = super().payload_for(server_round, state, client, config)
        p.config.update(plan_config(self.plans.get(client)))
        return p


def plan_config(plan: ClientPlan | None) -> dict[str, Any]:
    """What a payload's config carries of a client's plan (nothing without one)."""
    if plan is None:
        return {}
    return {**plan.knobs.payload_config(), "tier": plan.tier, "budget": plan.budget.describe(),
            **({"frozen_tensors": list(plan.frozen)} if plan.frozen else {}),
            **({"flops_budget": plan.flops_budget} if plan.flops_budget is not None else {}),
            **({"memory_budget": plan.memory_budget} if plan.memory_budget is not None else {}),
            **({"memory_reference": plan.memory_reference.to_config()}
               if plan.memory_budget is not None and plan.memory_reference is not None else {})}


def plan_report(plans: Mapping[int, ClientPlan], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per group of clients with one budget and plan: the plan, its predicted costs and the
    measured ones over its client-rounds (peak memory: the largest; FLOPs and upload: the mean)."""
    every = [m for r in records for m in r.get("client_metrics", [])]
    per_client = [m for m in every if m.get("used", True)]
    out = []
    for clients, p in plan_groups(plans):
        ran = [m for m in per_client if m.get("client") in set(clients)]

        def values(key):
            return [float(m[key]) for m in ran if m.get(key) is not None]

        mem, up, cut, sim = values("memory_mb"), values("bytes_up"), values("steps_cut"), values("sim_s")
        down = values("plan_downgrades")
        skipped = [1 for m in every if m.get("client") in set(clients) and m.get("memory_skipped")]
        # training and the head stage's importance pass, per client-round
        flops = [float(m["flops_measured"]) + float(m.get("flops_importance") or 0.0)
                 for m in ran if m.get("flops_measured") is not None]
        out.append({"clients": clients, "budget_name": p.budget.name, "budget": p.budget.limits(),
                    "plan": p.knobs.to_dict(), "why": p.reason,
                    "predicted": {"memory_mb": p.memory_mb, "gflops_per_round": p.gflops_per_round,
                                  "upload_mb": p.upload_mb, "seconds": p.seconds},
                    "measured": {"client_rounds": len(ran),
                                 "memory_mb_max": max(mem) if mem else None,
                                 "gflops_per_round_mean": sum(flops) / len(flops) / 1e9 if flops else None,
                                 "upload_mb_mean": sum(up) / len(up) / _MB if up else None,
                                 # a client-round's simulated seconds (runs with devices)
                                 "seconds_mean": sum(sim) / len(sim) if sim else None,
                                 "seconds_max": max(sim) if sim else None,
                                 # client-rounds the FLOPs budget stopped early, steps cut in all
                                 "rounds_cut": sum(x > 0 for x in cut) if cut else None,
                                 "steps_cut": int(sum(cut)) if cut else None,
                                 # steps a memory budget ran as micro-batches, and client-rounds
                                 # it skipped (not one example at a time fitted)
                                 "plan_downgrades": int(sum(down)) if down else None,
                                 "memory_skipped": int(sum(skipped)) if skipped else None}})
    return out


def plans_view(groups: list[dict[str, Any]]):
    """The HTML report's view of a planned run (``summary["plans"]``): per group of clients, its
    budget, plan and why, predicted against measured peak memory, GFLOPs and upload per round."""
    from fedslice.viz import View, figure, svg

    names = [f"{g['budget_name']} ({len(g['clients'])})" for g in groups]
    fig, axes = figure(width=9.0, height=3.0, ncols=3)
    for ax, (key, mkey, label) in zip(axes, (("memory_mb", "memory_mb_max", "peak MiB"),
                                             ("gflops_per_round", "gflops_per_round_mean", "GFLOPs / round"),
                                             ("upload_mb", "upload_mb_mean", "MB up / round"))):
        xs = range(len(groups))
        ax.bar([x - 0.2 for x in xs], [g["predicted"][key] for g in groups], 0.4, label="predicted")
        ax.bar([x + 0.2 for x in xs], [g["measured"][mkey] or 0 for g in groups], 0.4, label="measured")
        ax.set_xticks(list(xs), names, fontsize=7, rotation=20)
        ax.set_title(label, fontsize=9)
    axes[0].legend(fontsize=7)
    rows = [{"group": n, "budget": ", ".join(f"{k} {v:g}" for k, v in g["budget"].items()),
             "plan": ", ".join(f"{k} {v}" for k, v in g["plan"].items() if v is not None),
             **{f"predicted {k}": v for k, v in g["predicted"].items()},
             **{f"measured {k}": v for k, v in g["measured"].items()}, "why": g["why"]}
            for n, g in zip(names, groups)]
    return View("Client plans ([budgets])", svg(fig), rows,
                "Each group of clients with one budget and plan (fedslice plan): predicted costs "
                "against those measured over its client-rounds (peak memory: the largest).")
