"""The ``[aggregation]``, ``[server_opt]`` and ``[dp]`` sections: how replies combine.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from fedslice.registry import RULES
from fedslice.config.base import Section


class AggregationConfig(Section):
    """How the server combines the valid updates of a round (robust rules against a malicious
    minority; see fedslice/slicing/robust.py)."""

    rule: str = Field(
        "mean", description="A registered rule: mean: the method's own weighted mean (FedAvg, "
        "slice or head-weighted aggregation); median / trimmed_mean: per element, over the clients "
        "holding it; krum / multi_krum: same-shaped updates only (not raffm, heads).")
    trim_fraction: float = Field(0.2, ge=0, lt=0.5, description="trimmed_mean: fraction cut at "
                                 "each end (per element, of the clients holding it).")
    byzantine: int = Field(1, ge=0, description="krum / multi_krum: f, the number of malicious "
                           "clients tolerated; needs clients_per_round >= 2f + 3.")
    multi_krum_keep: int | None = Field(None, gt=0, description="multi_krum: m, the clients "
                                        "averaged (default n - f).")
    clip_norm: float | None = Field(None, gt=0, description="Clip every client's update to this "
                                    "L2 norm before aggregating (FlatClip). None: no clipping.")

    @field_validator("rule")
    @classmethod
    def _registered(cls, v):
        known = [e.name for e in RULES.entries() if e.rule_cls.selected_by == "aggregation.rule"]
        if v != "mean" and v not in known:
            raise ValueError(f"unknown rule {v!r} (known: {', '.join(['mean', *known])})")
        return v


#: each server optimizer's defaults (Flower 1.41's FedAvgM / FedAdagrad / FedAdam / FedYogi,
#: except FedAvgM's momentum, 0 there: FedAvgM would then be FedAvg): lr, momentum (beta_1)
SERVER_OPT_DEFAULTS: dict[str, tuple[float, float]] = {
    "fedavgm": (1.0, 0.9), "fedadagrad": (0.1, 0.0), "fedadam": (0.1, 0.9), "fedyogi": (0.01, 0.9)}


class ServerOptConfig(Section):
    """A server optimizer over the round's aggregate (Reddi et al. 2021, "Adaptive Federated
    Optimization"; Hsu et al. 2019 for FedAvgM): the new global state the method's aggregation
    (and any rule) gives, minus the old one, is the round's pseudo-gradient; the optimizer steps
    the trainable state along it. Wraps every method's weighting (docs/aggregation.md)."""

    name: Literal["none", "fedavgm", "fedadagrad", "fedadam", "fedyogi"] = Field(
        "none", description="none: the aggregate is the new state; fedavgm: server momentum; "
        "fedadagrad / fedadam / fedyogi: per-element adaptive steps.")
    lr: float | None = Field(None, gt=0, description="eta, the server's step size (default: "
                             "fedavgm 1.0, fedadagrad 0.1, fedadam 0.1, fedyogi 0.01).")
    momentum: float | None = Field(None, ge=0, lt=1, description="fedavgm: the momentum; the "
                                   "others: beta_1 (default: fedavgm 0.9, fedadagrad 0, fedadam "
                                   "and fedyogi 0.9).")
    beta2: float = Field(0.99, gt=0, lt=1, description="fedadam / fedyogi: beta_2.")
    tau: float = Field(1e-3, gt=0, description="fedadagrad / fedadam / fedyogi: the adaptivity "
                       "tau added to sqrt(v).")

    @property
    def step_size(self) -> float:
        """eta: the configured one or the optimizer's default."""
        return self.lr if self.lr is not None else SERVER_OPT_DEFAULTS[self.name][0]

    @property
    def beta1(self) -> float:
        """The momentum (beta_1): the configured one or the optimizer's default."""
        return self.momentum if self.momentum is not None else SERVER_OPT_DEFAULTS[self.name][1]


class DPConfig(Section):
    """Central DP-FedAvg (McMahan et al. 2018): each client's update clipped to `clip_norm`, the
    uniform mean over the clients_per_round sampled, Gaussian noise of std
    noise_multiplier * clip_norm / clients_per_round on the aggregate; an RDP accountant (Opacus)
    reports epsilon at `delta` after each round."""

    enabled: bool = False
    clip_norm: float = Field(0.1, gt=0, description="C: L2 bound of each client's update.")
    noise_multiplier: float | None = Field(None, gt=0, description="z; or set target_epsilon.")
    target_epsilon: float | None = Field(None, gt=0, description="Calibrate z so that epsilon "
                                         "after federation.rounds rounds is this (at delta).")
    delta: float = Field(1e-5, gt=0, lt=1)

    @model_validator(mode="after")
    def _one_noise(self) -> "DPConfig":
        if self.enabled and (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("set exactly one of noise_multiplier and target_epsilon")
        return self
