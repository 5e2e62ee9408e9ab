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
    same_round = ("its accountant counts rounds of clients sampled from the population; a "
                  "buffer of replies is no such sample")
    secagg_hint = " to clip it on the server (distributed DP, noise added by the clients, is not built)"
    selected_by = "dp.enabled"
    order = 30
    needs_same_shaped = True
    server_opt_refusal = ("on Flower its noise is added by Flower's DP wrapper after the server's "
                          "aggregation, so a server optimizer's moments would hold un-noised "
                          "updates, outside the accountant (in-process and on Flower a run must "
                          "be the same run): use one of them")

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
        cls.check_accountable(cfg, method_cls)

    @classmethod
    def check_accountable(cls, cfg: ExperimentConfig, method_cls: type) -> None:
        """What would make the reported epsilon wrong is refused, saying why
        (docs/reliability.md, "Differential privacy")."""
        fed = cfg.federation
        if fed.selection == "loss_gap":
            probe = (" (and cold_start='probe' sends the server every client's loss)"
                     if fed.cold_start == "probe" else "")
            raise ValueError(
                "dp.enabled with federation.selection='loss_gap': the accountant's epsilon assumes "
                "every round samples clients_per_round of the clients uniformly at random; "
                f"loss-gap selection picks them by the losses they report{probe}, which is neither "
                "uniform nor private, so the epsilon would be wrong: use selection='uniform'")
        if fed.round_policy == "deadline" and cfg.budgets is not None:
            raise ValueError(
                "dp.enabled with [budgets] under federation.round_policy='deadline': the server "
                "predicts each client-round from the shapes of the client's batches (its "
                "examples' lengths) and sends no work to a client predicted past the deadline, "
                "so who trains depends on the clients' data, outside the accountant: use "
                "round_policy='all' (a tier's seconds_per_round still fits each plan), or drop "
                "[budgets]")
        stats = method_cls.client_statistics(cfg)
        if stats is not None:
            raise ValueError(f"dp.enabled with {stats}: client statistics that reach the server "
                             "without noise and outside the accountant, so epsilon would not "
                             "cover them")

    @classmethod
    def from_config(cls, inner: Strategy, cfg: ExperimentConfig, role: str) -> Strategy:
        if role == "client":  # a client never aggregates: no accountant there
            return inner
        fed = cfg.federation
        # the server of a Flower deployment runs under Flower's DP wrapper, which adds the noise
        return cls(inner, Privacy(cfg.dp, fed.clients_per_round, fed.num_clients, fed.rounds, cfg.seed,
                                  external_noise=role == "server"))

    def combine(self, server_round: int, state: State, deltas: list[State], weights: list,
                replies: dict[int, Reply]) -> tuple[State, dict[str, Any]]:
        return self.privacy.aggregate(server_round, state, deltas, self.fed.server_lr,
                                      self.population)

    def state_dict(self) -> dict[str, Any]:
        return {**self.inner.state_dict(), "privacy": self.privacy.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)
        if "privacy" in state:
            self.privacy.load_state_dict(state["privacy"])


register_rule(name=DPFedAvg.name, rule_cls=DPFedAvg)
