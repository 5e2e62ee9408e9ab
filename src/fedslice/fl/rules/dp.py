"""``dp.enabled``: central DP-FedAvg (:class:`fedslice.fl.privacy.Privacy`: each update clipped,
the fixed-denominator mean, Gaussian noise, an RDP accountant) in place of the method's mean.
Needs same-shaped updates; it is itself the clipped mean, so it takes no other rule."""

from __future__ import annotations

from typing import Any

from fedslice.config import ExperimentConfig
from fedslice.fl.privacy import Privacy
from fedslice.fl.rules.base import Rule
from fedslice.fl.strategy import Reply, State, Strategy
from fedslice.registry import register_rule


class DPFedAvg(Rule):
    name = "dp"
    selected_by = "dp.enabled"
    order = 30
    needs_same_shaped = True

    def __init__(self, inner: Strategy, privacy: Privacy):
        super().__init__(inner)
        self.privacy = privacy

    @classmethod
    def selected(cls, cfg: ExperimentConfig) -> bool:
        return cfg.dp.enabled

    @classmethod
    def setting(cls, cfg: ExperimentConfig) -> str:
        return "dp.enabled: DP-FedAvg"

    @classmethod
    def check_config(cls, cfg: ExperimentConfig, method_cls: type) -> None:
        super().check_config(cfg, method_cls)
        agg = cfg.aggregation
        if agg.rule != "mean" or agg.clip_norm is not None:
            raise ValueError("dp.enabled: DP-FedAvg is the clipped mean (dp.clip_norm); "
                             "aggregation.rule must be 'mean' without aggregation.clip_norm")

    @classmethod
    def from_config(cls, inner: Strategy, cfg: ExperimentConfig, role: str) -> Strategy:
        if role == "client":  # a client never aggregates: no accountant there
            return inner
        fed = cfg.federation
        return cls(inner, Privacy(cfg.dp, fed.clients_per_round, fed.num_clients, fed.rounds, cfg.seed))

    def combine(self, server_round: int, state: State, deltas: list[State], weights: list,
                replies: dict[int, Reply]) -> tuple[State, dict[str, Any]]:
        return self.privacy.aggregate(server_round, state, deltas, self.fed.server_lr)

    def state_dict(self) -> dict[str, Any]:
        return {**self.inner.state_dict(), "privacy": self.privacy.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)
        if "privacy" in state:
            self.privacy.load_state_dict(state["privacy"])


register_rule(name=DPFedAvg.name, rule_cls=DPFedAvg)
