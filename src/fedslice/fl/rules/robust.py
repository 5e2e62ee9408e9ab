"""Robust combining rules (``aggregation.rule``): median, trimmed mean, Krum, Multi-Krum, over the
method's deltas and held-masks (:mod:`fedslice.slicing.robust`: Flower's functions for same-shaped
updates, per element over the holders for slices)."""

from __future__ import annotations

from typing import Any

from fedslice.config import ExperimentConfig
from fedslice.fl.rules.base import Rule
from fedslice.fl.strategy import Reply, State, Strategy
from fedslice.registry import register_rule
from fedslice.slicing.robust import robust_aggregate


class RobustRule(Rule):
    """Replaces the method's mean by :func:`robust_aggregate` with rule :attr:`name`."""

    def options(self) -> dict[str, Any]:
        return {}

    def combine(self, server_round: int, state: State, deltas: list[State], weights: list,
                replies: dict[int, Reply]) -> tuple[State, dict[str, Any]]:
        n = [replies[c].num_examples for c in sorted(replies)]
        return robust_aggregate(state, deltas, weights, self.name, eta=self.fed.server_lr,
                                num_examples=n, **self.options()), {}


class Median(RobustRule):
    """Coordinate-wise median (over the clients holding each element)."""

    name = "median"


class TrimmedMean(RobustRule):
    """Per element, the mean after cutting ``trim_fraction`` of the holders at each end."""

    name = "trimmed_mean"

    def __init__(self, inner: Strategy, trim_fraction: float):
        super().__init__(inner)
        self.trim_fraction = trim_fraction

    @classmethod
    def from_config(cls, inner: Strategy, cfg: ExperimentConfig, role: str) -> Strategy:
        return cls(inner, cfg.aggregation.trim_fraction)

    def options(self) -> dict[str, Any]:
        return {"trim_fraction": self.trim_fraction}


class Krum(RobustRule):
    """Krum (Blanchard et al. 2017): the update closest to its n - f - 2 neighbours; needs whole
    vectors and 2f + 3 replies."""

    name = "krum"
    same_round = ("it picks among one round's n >= 2f + 3 updates from one model; stale "
                  "updates from older models are not comparable")
    needs_same_shaped = True
    slices_hint = ": use median or trimmed_mean"

    def __init__(self, inner: Strategy, byzantine: int):
        super().__init__(inner)
        self.byzantine = byzantine

    @classmethod
    def from_config(cls, inner: Strategy, cfg: ExperimentConfig, role: str) -> Strategy:
        return cls(inner, cfg.aggregation.byzantine)

    @classmethod
    def check_config(cls, cfg: ExperimentConfig, method_cls: type) -> None:
        super().check_config(cfg, method_cls)
        f, n = cfg.aggregation.byzantine, cfg.federation.clients_per_round
        if n < 2 * f + 3:
            raise ValueError(f"aggregation.byzantine={f}: krum needs federation.clients_per_round "
                             f">= 2f + 3 = {2 * f + 3}, got {n}")

    def options(self) -> dict[str, Any]:
        return {"byzantine": self.byzantine}

    def min_valid(self) -> int:
        return max(self.inner.min_valid(), 2 * self.byzantine + 3)

    def min_valid_reason(self) -> str:
        if 2 * self.byzantine + 3 < self.inner.min_valid():
            return self.inner.min_valid_reason()
        return f"{self.name} needs 2f + 3 = {2 * self.byzantine + 3}"


class MultiKrum(Krum):
    """Multi-Krum: the example-weighted mean of the ``keep`` best-scored updates (n - f)."""

    name = "multi_krum"

    def __init__(self, inner: Strategy, byzantine: int, keep: int | None = None):
        super().__init__(inner, byzantine)
        self.keep = keep

    @classmethod
    def from_config(cls, inner: Strategy, cfg: ExperimentConfig, role: str) -> Strategy:
        return cls(inner, cfg.aggregation.byzantine, cfg.aggregation.multi_krum_keep)

    @classmethod
    def check_config(cls, cfg: ExperimentConfig, method_cls: type) -> None:
        super().check_config(cfg, method_cls)
        agg, n = cfg.aggregation, cfg.federation.clients_per_round
        if agg.multi_krum_keep is not None and agg.multi_krum_keep > n - agg.byzantine:
            raise ValueError(f"aggregation.multi_krum_keep={agg.multi_krum_keep} is more than "
                             f"clients_per_round - byzantine = {n - agg.byzantine}")

    def options(self) -> dict[str, Any]:
        return {"byzantine": self.byzantine, "keep": self.keep}


for _rule in (Median, TrimmedMean, Krum, MultiKrum):
    register_rule(name=_rule.name, rule_cls=_rule)
