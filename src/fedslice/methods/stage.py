"""A stage over the method below it, and a method made of a bottom method and the stages above
it, in one explicit list (bottom first): ``raffm+heads`` is ``Composition("raffm+heads", RaFFM,
(HeadStage,))``.

A :class:`Stage` holds the stage below it (``below``: the bottom method, or another stage) and
overrides the hooks it changes (:mod:`fedslice.methods.contract`), calling ``self.below.<hook>``
where it builds on the stage below's answer; everything else it reads (the model, the adapter,
the library's functions) is the bottom's, reached through ``below``. The bottom method builds its
stages first (each from the config and the loaded model only) and then itself, and calls every
hook through the top of the list (``Method.top``), so a hook the library calls from below (the
planner's ``plan_axes``, ``fit`` in ``train_client``, ``client_metrics`` and ``client_spec`` in the
cost record) is the top stage's. What is asked before anything is built (class hooks and class
facts) the :class:`Composition` answers from the list: the bottom's, folded through each stage in
order; a class fact a stage states (``sends_slices``, ``lora_aggregations``, ...) is the topmost
stating stage's.
"""

from __future__ import annotations

from typing import Any

from fedslice.config import ExperimentConfig
from fedslice.methods.facts import Facts


class Stage:
    """A stage over the method below it. Subclasses override hooks, calling ``self.below``;
    attributes they do not have are the stage below's."""

    def __init__(self, below: Any, cfg: ExperimentConfig, loaded: Any, task: Any):
        """``below``: the stage below (the bottom method is still being built: read none of its
        state here, only the config and the loaded model)."""
        self.below = below
        self.name = cfg.method.name  # the method run: the composition's registered name

    def __getattr__(self, name: str) -> Any:
        if name == "below":  # not set yet (or a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.below, name)

    # -- class hooks: the stage below's answer (``below``: its class) comes in -----------------
    @classmethod
    def facts(cls, cfg: ExperimentConfig, below: Facts) -> Facts:
        return below

    @classmethod
    def check_config(cls, cfg: ExperimentConfig, below: Any) -> None:
        """A ValueError naming the fields; ``below`` (the class of the stages below) has checked."""

    @classmethod
    def check_supported(cls, arch, task, below: Any) -> None:
        """A ConfigError before the weights load; ``below`` has checked."""

    @classmethod
    def report_views(cls, folder, config, metrics, summary) -> list:
        """The stage's own report sections (after the stage below's)."""
        return []


def stated(stage: type, name: str) -> bool:
    """``stage`` (a :class:`Stage` class) states ``name`` itself (a class fact or a hook)."""
    return any(name in vars(k) for k in stage.__mro__ if k not in (Stage, object))


class Composition:
    """The class of a method made of ``bottom`` (a :class:`~fedslice.methods.base.Method`
    subclass) and ``stages`` above it, bottom first: calling it builds the method and returns
    its top stage; class facts and class hooks are answered from the list."""

    def __init__(self, name: str, bottom: type, stages: tuple[type, ...]):
        if not stages:
            raise ValueError(f"{name}: a composition needs at least one stage over {bottom.__name__}")
        self.name, self.bottom, self.stages = name, bottom, tuple(stages)
        self.__name__ = bottom.__name__ + "".join(s.__name__.removesuffix("Stage") for s in stages)
        self.__doc__ = f"``{name}``: " + " over ".join(
            s.__name__ for s in reversed((bottom, *stages))) + " (:mod:`fedslice.methods.stage`)."

    def __repr__(self) -> str:
        return f"Composition({self.name!r}, {self.bottom.__name__}, {[s.__name__ for s in self.stages]})"

    def __call__(self, cfg: ExperimentConfig, loaded: Any, task: Any, role: str = "both",
                 client_sizes=None, **kw) -> Stage:
        return self.bottom(cfg, loaded, task, role, client_sizes, stages=self.stages, **kw).top

    def below(self, i: int) -> Any:
        """The class of everything below stage ``i``: the bottom, or a shorter composition."""
        return self.bottom if i == 0 else Composition(self.name, self.bottom, self.stages[:i])

    def parts(self) -> tuple[type, ...]:
        """Bottom first: the bottom method class, then each stage class."""
        return (self.bottom, *self.stages)

    def __getattr__(self, name: str) -> Any:
        """A class fact or class function: the topmost stage's that states it, else the bottom's."""
        if name.startswith("__"):
            raise AttributeError(name)
        for stage in reversed(self.stages):
            if stated(stage, name):
                return getattr(stage, name)
        return getattr(self.bottom, name)

    def facts(self, cfg: ExperimentConfig) -> Facts:
        out = self.bottom.facts(cfg)
        for stage in self.stages:
            out = stage.facts(cfg, out)
        return out

    def check_config(self, cfg: ExperimentConfig) -> None:
        self.bottom.check_config(cfg)
        for i, stage in enumerate(self.stages):
            stage.check_config(cfg, self.below(i))

    def check_supported(self, arch, task) -> None:
        self.bottom.check_supported(arch, task)
        for i, stage in enumerate(self.stages):
            stage.check_supported(arch, task, self.below(i))

    def report_views(self, folder, config, metrics, summary) -> list:
        views = self.bottom.report_views(folder, config, metrics, summary)
        for stage in self.stages:
            views = views + stage.report_views(folder, config, metrics, summary)
        return views

    def overrides(self, hook: str) -> bool:
        """The bottom method or a stage overrides ``hook``."""
        return self.bottom.overrides(hook) or any(stated(s, hook) for s in self.stages)
