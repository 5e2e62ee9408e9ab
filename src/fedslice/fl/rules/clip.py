"""``aggregation.clip_norm``: every client's update clipped to an L2 norm before the wrapped
combination (Flower's FlatClip), whatever it is (the method's mean or a robust rule)."""

from __future__ import annotations

from typing import Any

from fedslice.config import ExperimentConfig
from fedslice.fl.rules.base import Rule
from fedslice.fl.strategy import Reply, State, Strategy
from fedslice.registry import register_rule
from fedslice.slicing.robust import clip_update


class Clip(Rule):
    name = "clip"
    secagg_hint = " (to clip: federation.max_grad_norm clips each client's gradients locally)"
    selected_by = "aggregation.clip_norm"
    order = 20

    def __init__(self, inner: Strategy, clip_norm: float):
        super().__init__(inner)
        self.clip_norm = clip_norm

    @classmethod
    def selected(cls, cfg: ExperimentConfig) -> bool:
        return cfg.aggregation.clip_norm is not None

    @classmethod
    def setting(cls, cfg: ExperimentConfig) -> str:
        return f"aggregation.clip_norm={cfg.aggregation.clip_norm}"

    @classmethod
    def from_config(cls, inner: Strategy, cfg: ExperimentConfig, role: str) -> Strategy:
        return cls(inner, cfg.aggregation.clip_norm)

    def combine(self, server_round: int, state: State, deltas: list[State], weights: list,
                replies: dict[int, Reply]) -> tuple[State, dict[str, Any]]:
        clipped = [clip_update(d, self.clip_norm) for d in deltas]
        new, metrics = self.inner.combine(server_round, state, [d for d, _ in clipped], weights,
                                          replies)
        return new, {"clipped": sum(n > self.clip_norm for _, n in clipped), **metrics}


register_rule(name=Clip.name, rule_cls=Clip)
