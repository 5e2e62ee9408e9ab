"""``server_opt.name``: a server optimizer around any strategy (Reddi et al. 2021, "Adaptive
Federated Optimization", Algorithm 2; Hsu et al. 2019 for FedAvgM; Flower's ``FedAvgM``,
``FedAdagrad``, ``FedAdam``, ``FedYogi``).

The wrapped combination (the method's weighted mean, a robust rule, DP-FedAvg's noisy mean)
gives a new global state; its difference from the old one is the round's pseudo-gradient
``delta`` (an ascent direction: the clients' mean update). The optimizer steps each tensor some
client trained this round along it; a tensor no client trained keeps its value and its moments.
Per element, with ``m``, ``v`` starting at 0 and ``t`` the optimizer's step (1, 2, ...):

* fedavgm:    m = b1 m + delta;                              x += lr m
* fedadagrad: m = b1 m + (1 - b1) delta;  v = v + delta^2;    x += lr m / (sqrt(v) + tau)
* fedadam:    m as fedadagrad;  v = b2 v + (1 - b2) delta^2;
              x += lr sqrt(1 - b2^t) / (1 - b1^t) m / (sqrt(v) + tau)   (Kingma & Ba's bias
              correction with the optimizer's own step; Flower 1.41 uses server_round + 1)
* fedyogi:    m as fedadagrad;  v = v - (1 - b2) delta^2 sign(v - delta^2);
              x += lr m / (sqrt(v) + tau)

The moments are server state: checkpointed (:meth:`state_dict`), never sent to clients, and
absent on a Flower client (``role="client"``). The rule wraps outermost. DP-FedAvg is refused: on
Flower its noise is added after the server's aggregation, so the moments would hold un-noised
updates.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fedslice.config import ExperimentConfig, ServerOptConfig
from fedslice.fl.rules.base import Rule, selected_rules
from fedslice.fl.strategy import Reply, State, Strategy
from fedslice.registry import register_rule


def moment_step(name: str, delta: torch.Tensor, m: torch.Tensor, v: torch.Tensor | None,
                beta1: float, beta2: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The new first and second moments of one tensor (``v`` None for fedavgm)."""
    if name == "fedavgm":
        return beta1 * m + delta, None
    m = beta1 * m + (1 - beta1) * delta
    sq = delta * delta
    if name == "fedadagrad":
        v = v + sq
    elif name == "fedadam":
        v = beta2 * v + (1 - beta2) * sq
    elif name == "fedyogi":
        v = v - (1 - beta2) * sq * torch.sign(v - sq)
    else:
        raise ValueError(f"unknown server optimizer {name!r}")
    return m, v


def direction(name: str, m: torch.Tensor, v: torch.Tensor | None, tau: float) -> torch.Tensor:
    """The step's direction before the step size: m (fedavgm), m / (sqrt(v) + tau) (the others)."""
    return m if v is None else m / (v.sqrt() + tau)


def step_size(opt: ServerOptConfig, t: int) -> float:
    """eta at step ``t`` (fedadam: with Adam's bias correction)."""
    if opt.name == "fedadam":
        return opt.step_size * math.sqrt(1 - opt.beta2 ** t) / (1 - opt.beta1 ** t)
    return opt.step_size


class ServerOpt(Rule):
    name = "server_opt"
    selected_by = "server_opt.name"
    order = 40  # outermost: it steps along whatever the rules below combined
    from_sums = True  # it steps along the mean, which secure aggregation's sums give

    def __init__(self, inner: Strategy, opt: ServerOptConfig):
        super().__init__(inner)
        self.opt = opt
        self.t = 0  # steps taken
        self.m: State = {}
        self.v: State = {}

    @classmethod
    def selected(cls, cfg: ExperimentConfig) -> bool:
        return cfg.server_opt.name != "none"

    @classmethod
    def setting(cls, cfg: ExperimentConfig) -> str:
        return f"server_opt.name={cfg.server_opt.name!r}"

    @classmethod
    def describe(cls, cfg: ExperimentConfig) -> str:
        o = cfg.server_opt
        adaptive = "" if o.name == "fedavgm" else f", beta2 {o.beta2:g}, tau {o.tau:g}"
        return f"{cls.setting(cfg)} (lr {o.step_size:g}, momentum {o.beta1:g}{adaptive})"

    @classmethod
    def check_config(cls, cfg: ExperimentConfig, method_cls: type) -> None:
        super().check_config(cfg, method_cls)
        if cfg.federation.server_lr != 1.0:
            raise ValueError(f"{cls.setting(cfg)} with federation.server_lr="
                             f"{cfg.federation.server_lr}: the optimizer's step size is "
                             "server_opt.lr; server_lr would scale the pseudo-gradient it reads "
                             "as well: leave federation.server_lr at 1")
        if why := method_cls.facts(cfg).reorders_state:
            raise ValueError(f"{cls.setting(cfg)} cannot combine with {why}: the optimizer's "
                             "per-element moments would no longer sit on their elements")
        for rule in selected_rules(cfg):
            if rule is not cls and (why := getattr(rule, "server_opt_refusal", "")):
                raise ValueError(f"{cls.setting(cfg)} cannot combine with {rule.setting(cfg)}: "
                                 f"{why}")

    @classmethod
    def from_config(cls, inner: Strategy, cfg: ExperimentConfig, role: str) -> Strategy:
        if role == "client":  # a client never aggregates: no moments there
            return inner
        return cls(inner, cfg.server_opt)

    def combine(self, server_round: int, state: State, deltas: list[State], weights: list,
                replies: dict[int, Reply]) -> tuple[State, dict[str, Any]]:
        new, metrics = self.inner.combine(server_round, state, deltas, weights, replies)
        trained = {k for d in deltas for k in d}
        keys = [k for k in new if k in trained and k in state and new[k].is_floating_point()]
        if not keys:
            return new, metrics
        self.t += 1
        o, lr = self.opt, step_size(self.opt, self.t)
        out = dict(new)
        for k in keys:
            x = state[k].float()
            delta = new[k].float() - x
            m = self.m[k] if k in self.m else torch.zeros_like(delta)
            v = None if o.name == "fedavgm" else self.v[k] if k in self.v else torch.zeros_like(delta)
            m, v = moment_step(o.name, delta, m, v, o.beta1, o.beta2)
            self.m[k] = m
            if v is not None:
                self.v[k] = v
            out[k] = (x + lr * direction(o.name, m, v, o.tau)).to(state[k].dtype)
        return out, {**metrics, "server_opt_step": self.t}

    def state_dict(self) -> dict[str, Any]:
        return {**self.inner.state_dict(),
                "server_opt": {"t": self.t, "m": dict(self.m), "v": dict(self.v)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)
        if "server_opt" in state:
            s = state["server_opt"]
            self.t, self.m, self.v = int(s["t"]), dict(s["m"]), dict(s["v"])


register_rule(name=ServerOpt.name, rule_cls=ServerOpt)
