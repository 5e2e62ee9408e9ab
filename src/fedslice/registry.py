"""The plug-in registries: methods, adapters (PEFT methods) and aggregation rules, by name.

This module sits at the bottom of the package (it imports nothing of fedslice but its errors),
so that :mod:`fedslice.config` can resolve ``method.name``, ``peft.method`` and
``aggregation.rule`` through it without importing a plug-in. Plug-ins sit above the config
layer and register themselves when their module is imported, like HF PEFT's tuners
(``register_peft_method(name=..., config_cls=..., model_cls=...)``)::

    register_method(name="fedavg", options_cls=FedAvgOptions, method_cls=FedAvg)
    register_peft_method(name="lora", config_cls=LoraConfig, adapter_cls=LoraAdapter)
    register_rule(name="median", rule_cls=Median)

Who imports the built-in plug-ins: :mod:`fedslice.plugins` (one import per package:
``fedslice.methods``, ``fedslice.peft``, ``fedslice.fl.rules``), which the layer that loads
configs (:mod:`fedslice.experiment`) imports first. Nothing below that layer imports a plug-in,
so no import circle appears, not even through a package's ``__init__``. A plug-in of your own
registers by being imported before its config is validated (see ``docs/design.md``).

The library asks a registered class for what it does (class attributes such as
``Method.sends_slices`` or ``Adapter.prefix``) instead of comparing names.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from fedslice.errors import ConfigError

E = TypeVar("E")


#: The kinds of method stages, in the order they compose (:mod:`fedslice.methods.compose`):
#: the model clients start from (the full model, FedPFT's proxy, FedOT's emulator), a
#: per-client sub-model of it (RaFFM), a per-client choice of heads inside that (heads).
STAGES = ("model", "submodel", "heads")


class ElasticExport(Protocol):
    """How a method whose trained model serves at several sizes (RaFFM's elastic sub-models)
    exports one of them as a smaller standalone checkpoint (``fedslice export --size``), given
    by the method's package when it registers (``register_method(elastic_export=...)``)."""

    def spec(self, run_dir: Path, size: float, finished: bool) -> Any:
        """The sub-model of ``size`` the finished (or not) run in ``run_dir`` saved; a ConfigError
        saying why there is none (listing the sizes there are)."""

    def save(self, model: Any, arch: Any, spec: Any, dest: Path, head: str) -> None:
        """Write the sub-model ``spec`` cut from the trained, merged ``model`` into ``dest`` as a
        transformers folder (weights and config; the tokenizer is the caller's)."""


@dataclass(frozen=True)
class MethodEntry:
    """A federated method: its options (the ``[method]`` section) and its class.

    ``stage``: the kind of stage the method is (:data:`STAGES`); ``stage_cls``: the stage class
    that puts it over a method of a lower stage (heads: ``HeadStage``,
    :class:`fedslice.methods.stage.Stage`), None when it is the bottom of a composition only; ``parts``: the methods a composed entry (``raffm+heads``) is
    made of, empty for a method of its own; ``elastic_export``: how a sub-model of one of its
    sizes is exported (:class:`ElasticExport`), None for a method of one size."""

    name: str
    options_cls: type
    method_cls: type
    stage: str = "model"
    stage_cls: type | None = None
    parts: tuple[str, ...] = ()
    elastic_export: ElasticExport | None = None


@dataclass(frozen=True)
class AdapterEntry:
    """An adapter (``peft.method``): its options (the config section named after it; None when
    it has no options, e.g. ``none``) and its class."""

    name: str
    config_cls: type | None
    adapter_cls: type


@dataclass(frozen=True)
class RuleEntry:
    """An aggregation rule that wraps a strategy (``aggregation.rule``, clipping, DP, ...)."""

    name: str
    rule_cls: type


class Registry(Generic[E]):
    """Name -> entry of one kind of plug-in, in registration order."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, E] = {}

    def register(self, name: str, entry: E) -> E:
        if not name or not isinstance(name, str):
            raise ValueError(f"a {self.kind} needs a non-empty name, got {name!r}")
        old = self._entries.get(name)
        if old is not None and old != entry:
            raise ValueError(f"{self.kind} {name!r} is already registered ({old}); "
                             "unregister it first to replace it")
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> None:
        """Remove ``name`` (tests that register a toy plug-in clean up with this)."""
        self._entries.pop(name, None)

    def get(self, name: str) -> E:
        """The entry of ``name``; a ConfigError listing the known names otherwise."""
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(self._entries) or "none registered (import fedslice.plugins)"
            raise ConfigError(f"unknown {self.kind} {name!r} (known: {known})") from None

    def names(self) -> list[str]:
        return list(self._entries)

    def entries(self) -> list[E]:
        return list(self._entries.values())

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)


METHODS: Registry[MethodEntry] = Registry("method")
ADAPTERS: Registry[AdapterEntry] = Registry("adapter")
RULES: Registry[RuleEntry] = Registry("aggregation rule")


def register_method(*, name: str, options_cls: type, method_cls: type, stage: str = "model",
                    stage_cls: type | None = None, parts: tuple[str, ...] = (),
                    elastic_export: ElasticExport | None = None) -> MethodEntry:
    """Register a federated method; ``options_cls`` validates its ``[method]`` section (a
    :class:`fedslice.config.MethodOptions` whose ``name`` is ``Literal[name]``); ``stage`` and
    ``stage_cls``: how it composes with others; ``elastic_export``: how it exports a sub-model
    of one of its sizes (:class:`MethodEntry`)."""
    tag = getattr(options_cls, "model_fields", {}).get("name")
    if tag is None or tag.default != name:
        raise ValueError(f"method {name!r}: {options_cls.__name__}.name must default to {name!r}")
    if stage not in STAGES:
        raise ValueError(f"method {name!r}: stage {stage!r} is not one of {STAGES}")
    return METHODS.register(name, MethodEntry(name, options_cls, method_cls, stage, stage_cls, parts,
                                              elastic_export))


#: {frozenset of two method names: why they do not compose}
REFUSED: dict[frozenset, str] = {}
#: {name: the name it stands for} (``fedpetuning+heads`` is ``heads``: the full model is implied)
ALIASES: dict[str, str] = {}


def refuse_composition(a: str, b: str, reason: str) -> None:
    """Declare that methods ``a`` and ``b`` cannot run as stages of one method, and why."""
    REFUSED[frozenset((a, b))] = reason


def method_name(name: str) -> str:
    """The registered name ``name`` stands for: itself, or for a composition written with ``+``
    (``heads+raffm``, ``raffm + heads``) its parts in stage order (``raffm+heads``). A
    ConfigError naming the parts when they do not compose (with the reason), or a part is
    unknown."""
    if "+" not in name:
        return ALIASES.get(name, name)
    parts = [p.strip() for p in name.split("+")]
    for p in parts:
        if p not in METHODS or METHODS.get(p).parts:
            known = ", ".join(n for n in METHODS.names() if not METHODS.get(n).parts)
            raise ConfigError(f"method.name={name!r}: {p!r} is not a method (known: {known})")
    entries = sorted((METHODS.get(p) for p in parts), key=lambda e: STAGES.index(e.stage))
    for i, a in enumerate(entries):
        for b in entries[i + 1:]:
            why = REFUSED.get(frozenset((a.name, b.name)))
            if why is not None:
                raise ConfigError(f"method.name={name!r}: {a.name} and {b.name} do not compose: {why}")
            if a.stage == b.stage:
                raise ConfigError(f"method.name={name!r}: {a.name} and {b.name} are both {a.stage} "
                                  "stages; a composition takes one of each kind "
                                  f"({' < '.join(STAGES)})")
    canonical = "+".join(e.name for e in entries)
    canonical = ALIASES.get(canonical, canonical)
    if canonical not in METHODS:
        raise ConfigError(f"method.name={name!r}: no composition {canonical!r} is registered "
                          f"(compositions: {', '.join(n for n in METHODS.names() if METHODS.get(n).parts) or 'none'})")
    return canonical


def register_peft_method(*, name: str, config_cls: type | None, adapter_cls: type) -> AdapterEntry:
    """Register an adapter (``peft.method = name``); ``config_cls`` validates the config section
    named ``name`` (None: the adapter takes no options)."""
    return ADAPTERS.register(name, AdapterEntry(name, config_cls, adapter_cls))


def register_rule(*, name: str, rule_cls: type) -> RuleEntry:
    """Register an aggregation rule (a :class:`fedslice.fl.rules.Rule` subclass)."""
    return RULES.register(name, RuleEntry(name, rule_cls))


def adapter_owning(tensor_name: str) -> Any | None:
    """The registered adapter class that owns a tensor, asked by its ``prefix`` class attribute
    (a tensor is an adapter's when one of its dotted name's segments starts with the prefix:
    ``...query.lora_A.default.weight`` is LoRA's); None for a tensor of the model itself."""
    segments = tensor_name.split(".")
    for entry in ADAPTERS.entries():
        prefix = getattr(entry.adapter_cls, "prefix", None)
        if prefix and any(s.startswith(prefix) for s in segments):
            return entry.adapter_cls
    return None


def adapter_of_module(module: Any) -> Any | None:
    """The registered adapter class that wraps ``module`` (asked by ``owns_module``), or None."""
    for entry in ADAPTERS.entries():
        if entry.adapter_cls.owns_module(module):
            return entry.adapter_cls
    return None
