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

from typing import ClassVar

from fedslice.config import ExperimentConfig
from fedslice.fl.strategy import TEMPLATES, Strategy, Wrapper
from fedslice.registry import RULES


class Rule(Wrapper):
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
    #: ``from_config`` takes the model's architecture (``arch=``: e.g. its weight layout)
    takes_arch: ClassVar[bool] = False
    #: why a server optimizer (``server_opt``) cannot step along what the rule combines ("":
    #: it can)
    server_opt_refusal: ClassVar[str] = ""
    #: the rule combines from the sums of the clients' weighted updates and weights alone, so
    #: it runs under secure aggregation (``privacy.secure_aggregation``)
    from_sums: ClassVar[bool] = False
    #: what to do instead, in the message refusing the rule under secure aggregation
    secagg_hint: ClassVar[str] = ""
    #: ``from_config`` takes the names of the tensors the clients train (``trainable=``)
    takes_trainable: ClassVar[bool] = False
    #: why the rule needs the replies of one synchronous round ("": it takes a buffer of replies
    #: trained from different model versions, ``federation.round_policy = 'async'``)
    same_round: ClassVar[str] = ""

    def __init__(self, inner: Strategy):
        if not isinstance(inner, Rule):
            overridden = [t for t in TEMPLATES if getattr(type(inner), t) is not getattr(Strategy, t)]
            if overridden:
                raise TypeError(f"{type(inner).__name__} overrides {overridden}: a strategy wrapped "
                                "by rules keeps the templates and overrides hooks")
        super().__init__(inner)

    # -- config ------------------------------------------------------------------------------
    @classmethod
    def selected(cls, cfg: ExperimentConfig) -> bool:
        return cfg.aggregation.rule == cls.name

    @classmethod
    def setting(cls, cfg: ExperimentConfig) -> str:
        """How the config asks for the rule, for messages (``aggregation.rule='krum'``)."""
        return f"aggregation.rule={cls.name!r}"

    @classmethod
    def describe(cls, cfg: ExperimentConfig) -> str:
        """The rule with its options, for ``fedslice validate`` (default: :meth:`setting`)."""
        return cls.setting(cfg)

    @classmethod
    def check_config(cls, cfg: ExperimentConfig, method_cls: type) -> None:
        if cls.same_round and cfg.federation.round_policy == "async":
            raise ValueError(f"{cls.setting(cfg)} cannot combine with federation.round_policy = "
                             f"'async': {cls.same_round}")
        if cls.needs_same_shaped and getattr(method_cls, "sends_slices", False):
            raise ValueError(f"{cls.setting(cfg)} needs same-shaped updates; method "
                             f"{cfg.method.name} sends slices{cls.slices_hint}")
        if cls.needs_same_shaped and cfg.budgets is not None and cfg.budgets.adapter_depths != [1.0]:
            raise ValueError(f"{cls.setting(cfg)} needs same-shaped updates; with "
                             f"budgets.adapter_depths={cfg.budgets.adapter_depths} a client sends "
                             f"its top blocks' tensors only{cls.slices_hint}")

    @classmethod
    def from_config(cls, inner: Strategy, cfg: ExperimentConfig, role: str) -> Strategy:
        return cls(inner)

    # -- the wrapped strategy ----------------------------------------------------------------
    def unwrap(self) -> Strategy:
        """The method's own strategy under every rule."""
        return self.inner.unwrap() if isinstance(self.inner, Rule) else self.inner


def selected_rules(cfg: ExperimentConfig) -> list[type[Rule]]:
    """The registered rules ``cfg`` asks for, innermost first."""
    rules = [e.rule_cls for e in RULES.entries() if e.rule_cls.selected(cfg)]
    return sorted(rules, key=lambda r: r.order)


def describe_rules(cfg: ExperimentConfig) -> str:
    """How the server combines a round's updates under ``cfg``: the method's weighting, then
    each rule it asks for, innermost first."""
    rules = selected_rules(cfg)
    return "the method's weighted mean" + "".join(f", then {r.describe(cfg)}" for r in rules)


def wrap_rules(strategy: Strategy, cfg: ExperimentConfig, role: str = "both", arch=None,
               trainable: list[str] | None = None) -> Strategy:
    """``strategy`` inside every rule ``cfg`` asks for (``role='client'``: a client never
    aggregates, rules with server state, e.g. DP's accountant, leave themselves out); ``arch``:
    the model's :class:`~fedslice.models.arch.ArchSpec`, for rules that ask it (``takes_arch``);
    ``trainable``: the names of the tensors the clients train (``takes_trainable``)."""
    for rule in selected_rules(cfg):
        if rule.takes_trainable:
            strategy = rule.from_config(strategy, cfg, role, trainable=list(trainable or []))
        elif rule.takes_arch:
            strategy = rule.from_config(strategy, cfg, role, arch=arch)
        else:
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
