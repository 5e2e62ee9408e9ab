"""What an aggregation rule is: a :class:`~fedslice.fl.strategy.Strategy` that wraps any other
and delegates every hook to it, like Flower's ``DifferentialPrivacyServerSideFixedClipping``
(``strategy``) — so a rule composes with any method's weighting (RaFFM's holders, heads' Eq. 8)
and with other rules, without a class per combination.

A rule overrides the hook it changes, usually :meth:`combine` (median instead of the method's
mean; DP-FedAvg's noisy clipped sum; clipping transforms the deltas and calls the wrapped
``combine``) or :meth:`min_valid`. It is registered by name (:func:`fedslice.registry.register_rule`)
and declares, as class attributes and classmethods the config layer asks:

* ``selected(cfg)``: whether the config asks for it (default: ``aggregation.rule`` is its name);
* ``check_config(cfg, method_cls)``: a ValueError naming both fields when it cannot combine with
  the method (``needs_same_shaped`` refuses a method whose ``sends_slices``), or with other
  settings;
* ``from_config(inner, cfg, role)``: the rule around ``inner`` (its options passed to
  ``__init__``); ``order``: rules wrap innermost first (combining rules, then clipping, then DP).

:func:`wrap_rules` builds the chain a config asks for around a method's strategy.
"""

from __future__ import annotations

from typing import Any, ClassVar

from fedslice.config import ExperimentConfig
from fedslice.fl.strategy import TEMPLATES, Payload, Reply, State, Strategy
from fedslice.registry import RULES


class Rule(Strategy):
    """A rule around ``inner`` (any strategy, or another rule): every hook delegates to it."""

    name: ClassVar[str] = ""
    #: what selects the rule in a config: "aggregation.rule" (its name is the value), or the
    #: field a rule tests itself in :meth:`selected` (for messages)
    selected_by: ClassVar[str] = "aggregation.rule"
    #: wrap order, innermost first: 10 combining rules, 20 clipping, 30 DP
    order: ClassVar[int] = 10
    #: the rule needs every client to send every element (Krum, DP-FedAvg)
    needs_same_shaped: ClassVar[bool] = False
    #: what to use instead, in the message refusing a method that sends slices
    slices_hint: ClassVar[str] = ""

    def __init__(self, inner: Strategy):
        if not isinstance(inner, Rule):
            overridden = [t for t in TEMPLATES if getattr(type(inner), t) is not getattr(Strategy, t)]
            if overridden:
                raise TypeError(f"{type(inner).__name__} overrides {overridden}: a strategy wrapped "
                                "by rules keeps the templates and overrides hooks")
        self.inner = inner
        self.sent: list[int] = []

    # -- config ------------------------------------------------------------------------------
    @classmethod
    def selected(cls, cfg: ExperimentConfig) -> bool:
        return cfg.aggregation.rule == cls.name

    @classmethod
    def setting(cls, cfg: ExperimentConfig) -> str:
        """How the config asks for the rule, for messages (``aggregation.rule='krum'``)."""
        return f"aggregation.rule={cls.name!r}"

    @classmethod
    def check_config(cls, cfg: ExperimentConfig, method_cls: type) -> None:
        if cls.needs_same_shaped and getattr(method_cls, "sends_slices", False):
            raise ValueError(f"{cls.setting(cfg)} needs same-shaped updates; method "
                             f"{cfg.method.name} sends slices{cls.slices_hint}")

    @classmethod
    def from_config(cls, inner: Strategy, cfg: ExperimentConfig, role: str) -> Strategy:
        return cls(inner)

    # -- the wrapped strategy ----------------------------------------------------------------
    @property
    def fed(self):
        return self.inner.fed

    @property
    def client_sizes(self) -> dict[int, int]:
        return self.inner.client_sizes

    def unwrap(self) -> Strategy:
        """The method's own strategy under every rule."""
        return self.inner.unwrap() if isinstance(self.inner, Rule) else self.inner

    # -- hooks: delegated ----------------------------------------------------------------------
    def train_config(self, server_round: int) -> dict[str, Any]:
        return self.inner.train_config(server_round)

    def payload_for(self, server_round: int, state: State, client: int, config: dict) -> Payload:
        return self.inner.payload_for(server_round, state, client, config)

    def forget(self, client: int) -> None:
        self.inner.forget(client)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def expected_update(self, state: State, payload: Payload, reply: Reply) -> dict:
        return self.inner.expected_update(state, payload, reply)

    def absent(self, payload: Payload) -> str | None:
        return self.inner.absent(payload)

    def check_reply(self, state: State, payload: Payload, reply: Reply) -> str | None:
        return self.inner.check_reply(state, payload, reply)

    def client_updates(self, server_round: int, state: State, payloads: dict[int, Payload],
                       replies: dict[int, Reply]) -> tuple[list[State], list]:
        return self.inner.client_updates(server_round, state, payloads, replies)

    def mean(self, server_round: int, state: State, deltas: list[State], weights: list) -> State:
        return self.inner.mean(server_round, state, deltas, weights)

    def combine(self, server_round: int, state: State, deltas: list[State], weights: list,
                replies: dict[int, Reply]) -> tuple[State, dict[str, Any]]:
        return self.inner.combine(server_round, state, deltas, weights, replies)

    def after_aggregate(self, server_round: int, state: State) -> State:
        return self.inner.after_aggregate(server_round, state)

    def min_valid(self) -> int:
        return self.inner.min_valid()

    def min_valid_reason(self) -> str:
        return self.inner.min_valid_reason()


def selected_rules(cfg: ExperimentConfig) -> list[type[Rule]]:
    """The registered rules ``cfg`` asks for, innermost first."""
    rules = [e.rule_cls for e in RULES.entries() if e.rule_cls.selected(cfg)]
    return sorted(rules, key=lambda r: r.order)


def wrap_rules(strategy: Strategy, cfg: ExperimentConfig, role: str = "both") -> Strategy:
    """``strategy`` inside every rule ``cfg`` asks for (``role='client'``: a client never
    aggregates, rules with server state, e.g. DP's accountant, leave themselves out)."""
    for rule in selected_rules(cfg):
        strategy = rule.from_config(strategy, cfg, role)
    return strategy


def find_rule(strategy: Strategy, rule_cls: type[Rule]) -> Rule | None:
    """The rule of type ``rule_cls`` in a chain (None if the chain has none)."""
    while isinstance(strategy, Rule):
        if isinstance(strategy, rule_cls):
            return strategy
        strategy = strategy.inner
    return None


def unwrap(strategy: Strategy) -> Strategy:
    """The method's own strategy under any rules."""
    return strategy.unwrap() if isinstance(strategy, Rule) else strategy
