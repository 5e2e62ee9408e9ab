"""The budget planner's records: a plan's knobs (:class:`Knobs`), what a client with them
trains (:class:`PlannedModel`), their measured costs (:class:`KnobCost`) and a client's plan
(:class:`ClientPlan`). The planner itself: :mod:`fedslice.methods.planner`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn as nn

from fedslice.fl.client import round_flops
from fedslice.fl.memory_hold import ActivationReference
from fedslice.methods.budgets import ClientBudget
from fedslice.slicing.spec import Spec, spec_sizes


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
    upload: str | None = None  # the dtype its reply travels in (None: federation.upload_dtype)

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
        if self.upload is not None:
            out["upload_dtype"] = self.upload
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
        if self.upload not in (None, "fp32"):
            parts.append(f"{self.upload} upload")
        if overhead:
            parts.append("checkpointing" if self.checkpointing else "no checkpointing")
            parts.append(f"{self.micro_batches} micro-batch{'es' if self.micro_batches > 1 else ''}")
        return ", ".join(parts) or "the whole model"

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "spec" and not (k == "upload" and v is None)}
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
    #: budget predicts its own steps from until it has measured one (fl.memory_hold.memory_split)
    reference: ActivationReference | None = None
    #: of ``step_flops``, attention's and the head's (None: not split; extrapolated per
    #: position), the attention pairs of the batch counted, and whether the head runs once per
    #: example (classification) or per target token
    step_attention: float | None = None
    step_head: float = 0.0
    pairs: float = 0.0
    heads: float = 0.0
    #: the positions of the batch counted (rows x length, + virtual tokens x rows): what the
    #: rest of ``step_flops`` (or all of it, not split) grows with
    positions: float = 0.0
    #: ``upload_bytes`` at each upload dtype, (name, bytes) pairs (empty: measured at the run's only)
    uploads: tuple[tuple[str, int], ...] = ()

    def sent_in(self, name: str | None) -> KnobCost:
        """These costs with the reply sent in upload dtype ``name`` (None: as measured)."""
        if name is None or not self.uploads:
            return self
        return replace(self, upload_bytes=dict(self.uploads)[name])

    def rates(self) -> tuple[float, float, float]:
        """FLOPs per position, attention pair and head position of a step of this plan, as a
        client extrapolates its first step's count (:func:`fedslice.fl.client.round_flops`)."""
        if not self.positions:
            return 0.0, 0.0, 0.0
        if self.step_attention is None or not self.pairs or not self.heads:
            return self.step_flops / self.positions, 0.0, 0.0
        rest = self.step_flops - self.step_attention - self.step_head
        return rest / self.positions, self.step_attention / self.pairs, self.step_head / self.heads


@dataclass(frozen=True)
class RoundCost:
    """What a client-round of a plan costs, by what it trains: the measured step's FLOP rates
    (per position, attention pair and head position), the importance pass's FLOPs and the
    bytes received and sent. With the round's own batches (:func:`fedslice.fl.client.planned_steps`)
    it predicts that round, not a mean one (:meth:`seconds`)."""

    rates: tuple[float, float, float]
    importance_flops: float = 0.0
    download_bytes: int = 0
    upload_bytes: int = 0

    def flops(self, steps: list[list[tuple[int, int, int]]], budget: float | None = None
              ) -> tuple[float, int]:
        """``(FLOPs, steps run)`` of a round of ``steps`` under the plan's FLOPs ``budget``
        (the client stops before a step that would pass it; the first always runs)."""
        left = None if budget is None else budget - self.importance_flops
        trained, run = round_flops(steps, self.rates, left)
        return self.importance_flops + trained, run

    def seconds(self, device, steps: list[list[tuple[int, int, int]]], budget: float | None = None,
                host_gflops_per_s: float | None = None) -> tuple[float, float]:
        """``(the round's seconds, the seconds of a reply after its first step alone)`` on
        ``device`` (:class:`fedslice.fl.devices.Device`), as the simulated clock counts a reply."""
        flops, _ = self.flops(steps, budget)
        first, _ = self.flops(steps[:1], budget)
        down, up = self.download_bytes, self.upload_bytes
        return (device.seconds(flops, down, up, host_gflops_per_s),
                device.seconds(first, down, up, host_gflops_per_s))


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
    #: a client-round's simulated seconds on the client's device (None: no device): a mean
    #: round's; :attr:`round_cost` predicts each round from its own batches
    seconds: float | None = None
    round_cost: RoundCost | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"client": self.client, "tier": self.tier, "budget_name": self.budget.name,
                "budget": self.budget.limits(), **self.knobs.to_dict(),
                "predicted": {"memory_mb": self.memory_mb, "gflops_per_round": self.gflops_per_round,
                              "upload_mb": self.upload_mb}, "reason": self.reason,
                "flops_budget": self.flops_budget, "memory_budget": self.memory_budget,
                "flops_share": self.flops_share, "sits_out": self.sits_out, "seconds": self.seconds}


def sitting_out(plans: Mapping[int, ClientPlan]) -> dict[int, str]:
    """The clients whose plan sits out every round (``budgets.on_infeasible = "sit_out"``: no
    plan the config allows fits their budget), and why. They are never selected: like an
    offline device, a client that would train nothing does not take one of a round's places."""
    return {c: p.sits_out for c, p in sorted(plans.items()) if p.sits_out is not None}


def eligible(candidates: Sequence[int], plans: Mapping[int, ClientPlan]) -> list[int]:
    """``candidates`` less the clients that sit out every round (:func:`sitting_out`)."""
    out = sitting_out(plans)
    return [c for c in candidates if c not in out]


def too_few_eligible(plans: Mapping[int, ClientPlan], per_round: int) -> str | None:
    """A warning when so many clients sit out every round that fewer than ``per_round``
    (``federation.clients_per_round``) remain: every round then trains all of those left, as
    when fewer clients are online than a round asks for (None: enough remain)."""
    out = sitting_out(plans)
    left = len(plans) - len(out)
    if not out or left >= per_round:
        return None
    return (f"budgets.on_infeasible = 'sit_out': {len(out)} of {len(plans)} clients sit out every "
            f"round, leaving {left}, fewer than federation.clients_per_round = {per_round}: every "
            f"round trains those {left} (lower clients_per_round, or widen the budgets)")


def sit_out_summary(plans: Mapping[int, ClientPlan], client_sizes: Mapping[int, int]) -> str | None:
    """One line: how many clients, and what share of the training examples, sit out every
    round and are never selected, and which (None: none does)."""
    out = sitting_out(plans)
    if not out:
        return None
    total = sum(client_sizes.values())
    held = sum(client_sizes.get(c, 0) for c in out)
    share = f" ({100 * held / total:.1f}% of the training examples)" if total else ""
    shown = ", ".join(map(str, list(out)[:20])) + (", ..." if len(out) > 20 else "")
    return (f"{len(out)} of {len(plans)} clients{share} sit out every round and are never "
            f"selected (budgets.on_infeasible = 'sit_out': no plan fits their budget): {shown}")


def examples_per_round(fed, n: int) -> int:
    """Examples a client of ``n`` examples trains on per round (local steps x batch, or epochs x n)."""
    return fed.local_steps * fed.batch_size if fed.local_steps else fed.local_epochs * n
