"""What a payload tells its client, as one typed record: :class:`Orders`.

A payload's ``config`` is its wire form (JSON scalars and lists: what a Flower ``ConfigRecord``
carries); strategies write it through :func:`order_fields` and every reader takes the record,
:meth:`Orders.of`, never the dict by key. It holds the round's training settings (the
strategy's, :meth:`fedslice.fl.strategy.Strategy.train_config`) and the client's plan
(:mod:`fedslice.methods.planner`: sub-model, sparsity, rank, local work, adapter depth as the
tensors it freezes, base precision, FLOPs and memory budgets). A plan's knob that is None means
"the method's": :meth:`Orders.resolved` is the one place that rule is applied, with the
defaults the method's options give (:meth:`fedslice.config.MethodOptions.knob_defaults`).
Keys a method's own strategy adds for its own clients (FedPFT's proxy version, its APoZ request)
are in ``extra``, read by that method only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


def _opt(cast):
    return lambda v: None if v is None else cast(v)


@dataclass(frozen=True)
class Orders:
    """A client's orders for one round (None: not given, or the method's setting)."""

    # -- who and when
    round: int | None = None
    client: int | None = None
    # -- the round's training settings (a plan may lower local_steps and batch_size)
    lr: float | None = None
    weight_decay: float = 0.0
    local_steps: int = 0  # 0: local_epochs over the client's data
    local_epochs: int = 1
    batch_size: int | None = None
    group_by_length: bool = False
    max_grad_norm: float = 0.0  # 0: no clipping
    fedprox_mu: float = 0.0
    pack: bool = False
    # -- the client's plan
    tier: int | None = None
    budget: str | None = None  # the budget it was planned under, described
    spec: Mapping[str, Any] | None = None  # its sub-model (slicing.spec_from_dict); None: the whole
    sit_out: str | None = None  # why it trains nothing this round
    sparsity: float | None = None  # the head stage's
    importance_source: str | None = None  # where the head stage's scores come from
    lora_rank: int | None = None
    base_precision: str | None = None  # its frozen base's ("int8", "nf4"; None: the run's)
    base_order: str | None = None  # the digest of the neuron order its quantized base is in
    upload_dtype: str | None = None  # the dtype its reply travels in (None: federation.upload_dtype)
    micro_batches: int = 1
    checkpointing: bool = False
    frozen_tensors: tuple[str, ...] = ()  # trainable tensors it leaves frozen (adapter depth)
    flops_budget: float | None = None  # FLOPs its round may take, enforced as it trains
    memory_budget: float | None = None  # MiB its steps may hold, held as it trains
    memory_reference: Mapping[str, Any] | None = None  # the planner's measured step
    weight_factor: float = 1.0  # its reply's weight factor (RaFFM's f^p)
    #: keys a method's own strategy adds for its own clients
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, config: Orders | Mapping[str, Any]) -> Orders:
        """The record of a payload's config (an :class:`Orders` is returned as it is)."""
        if isinstance(config, Orders):
            return config
        known = {k: _CAST[k](v) for k, v in config.items() if k in _CAST}
        extra = {k: v for k, v in config.items() if k not in _CAST}
        return cls(**known, extra=extra)

    def resolved(self, defaults: Mapping[str, Any]) -> Orders:
        """The plan's knob, else the method's: every field None here takes ``defaults``' value."""
        unknown = set(defaults) - set(_CAST)
        if unknown:
            raise ValueError(f"not fields of Orders: {sorted(unknown)}")
        fill = {k: v for k, v in defaults.items() if getattr(self, k) is None}
        return dataclasses.replace(self, **fill) if fill else self

    def train_key(self) -> tuple:
        """What clients must agree on to train in one batched pass (which reads one record)."""
        return tuple(getattr(self, k) for k in TRAIN_FIELDS)

    def trains_alone(self) -> bool:
        """The plan splits its batches, checkpoints, trains the top blocks' adapters only or
        holds a memory budget step by step (none of which a batched pass does)."""
        return self.micro_batches > 1 or self.checkpointing or bool(self.frozen_tensors) \
            or self.memory_budget is not None


_CAST: dict[str, Any] = {
    "round": _opt(int), "client": _opt(int), "lr": _opt(float),
    "weight_decay": lambda v: float(v or 0.0), "local_steps": lambda v: int(v or 0),
    "local_epochs": lambda v: int(v or 1), "batch_size": _opt(int),
    "group_by_length": bool, "max_grad_norm": lambda v: float(v or 0.0),
    "fedprox_mu": lambda v: float(v or 0.0), "pack": bool,
    "tier": _opt(int), "budget": _opt(str), "spec": _opt(dict), "sit_out": lambda v: v or None,
    "sparsity": _opt(float), "importance_source": _opt(str), "lora_rank": _opt(int),
    "base_precision": _opt(str), "base_order": _opt(str), "upload_dtype": _opt(str),
    "micro_batches": lambda v: int(v or 1), "checkpointing": bool,
    "frozen_tensors": lambda v: tuple(v or ()), "flops_budget": _opt(float),
    "memory_budget": _opt(float), "memory_reference": _opt(dict),
    "weight_factor": lambda v: 1.0 if v is None else float(v),
}
assert set(_CAST) == {f.name for f in dataclasses.fields(Orders)} - {"extra"}

#: the fields :func:`fedslice.fl.client.train_local` and
#: :func:`fedslice.fl.batched.train_batched` train by (a plan may set some per client)
TRAIN_FIELDS = ("lr", "weight_decay", "local_steps", "local_epochs", "batch_size",
                "group_by_length", "max_grad_norm", "fedprox_mu", "flops_budget", "memory_budget")


def order_fields(**fields: Any) -> dict[str, Any]:
    """``fields`` as a payload config's entries, each checked to be a field of :class:`Orders`
    (a strategy writes a client's orders through this, so no key is misspelled)."""
    unknown = set(fields) - set(_CAST)
    if unknown:
        raise ValueError(f"not fields of Orders: {sorted(unknown)}")
    return fields


#: what a function taking a client's orders accepts: the record, or a payload config to read it from
OrdersLike = Orders | Mapping[str, Any]
