"""What every section is built on: the section base class, method and adapter options, and the number checks budgets share.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, PrivateAttr

from fedslice.errors import ConfigError


log = logging.getLogger(__name__)


class Section(BaseModel):
    """A config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class MethodOptions(Section):
    """Base of a method's options (the ``[method]`` table): a subclass lives in the method's
    module, declares ``name: Literal["its-name"] = "its-name"`` and its own fields, and is
    registered with :func:`fedslice.registry.register_method`.

    One config serves several methods: options of another registered method (``keep_ratio``
    of fedpft when ``--set method.name=fedpetuning``) are set aside, not an error, and said
    (:attr:`set_aside`, logged when the config loads, listed by ``fedslice validate``); a key no
    method knows is an error."""

    name: str
    #: options of other methods in the table, left out of this method's: {key: the methods it is of}
    _set_aside: dict[str, list[str]] = PrivateAttr(default_factory=dict)

    @property
    def set_aside(self) -> dict[str, list[str]]:
        return dict(self._set_aside)

    def spelled_budgets(self, budgets_given: bool) -> dict[str, Any] | None:
        """The ``[budgets]`` table this method's own options spell (a dict for
        :class:`BudgetsConfig`, with ``field``: the option that spells it, or 'default'), or None
        (the method spells none: budgets come from ``[budgets]`` alone). ``budgets_given``: the
        config has a ``[budgets]`` table (a spelling that is only a default then gives way)."""
        return None

    #: the options :meth:`spelled_budgets` reads (left out of the config that holds the table)
    spelling_fields: ClassVar[tuple[str, ...]] = ()

    def knob_defaults(self) -> dict[str, Any]:
        """The method's value of each per-client knob a plan may set (by the field names of
        :class:`fedslice.fl.orders.Orders`), for a client whose plan sets none: the one rule
        "the plan's, else the method's" (:meth:`fedslice.methods.base.Method.orders`). A
        composition's options merge their parts'. Default: none."""
        return {}

    def set_aside_note(self) -> str | None:
        """One line naming the options set aside and whose they are; None when there are none."""
        if not self._set_aside:
            return None
        keys = ", ".join(f"method.{k} ({'/'.join(m)})" for k, m in self._set_aside.items())
        return f"options of other methods, not used by method {self.name!r}: {keys}"


class AdapterOptions(Section):
    """Base of an adapter's options (the config section named after the adapter, e.g.
    ``[lora]``), registered with :func:`fedslice.registry.register_peft_method`."""


def budget_number(v: Any) -> Any:
    """A budget as written: a finite number (not a boolean, not a string; None: no limit), else a
    ValueError saying what to write instead."""
    if v is None:
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        hint = ""
        if isinstance(v, str) and _finite(v):
            hint = " (a string: write the number without quotes)"
        raise ValueError(f"{v!r} is not a number{hint}")
    if math.isinf(v) or math.isnan(v):
        raise ValueError(f"{v} is not a budget (leave the field out for no limit)")
    return v


def _finite(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def check_fractions(values: list[float], what: str) -> list[float]:
    """``values`` if each is in (0, 1], else a ValueError naming the first that is not."""
    for x in values:
        if not 0 < x <= 1:
            raise ValueError(f"{what} {x} is not in (0, 1]")
    return values


def read_utf8(path: Path, what: str) -> str:
    """The text of ``path``; a file that is not UTF-8 is a ConfigError naming the byte's line."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigError(f"{what} {path} is not UTF-8 text: byte 0x{raw[e.start]:02x} at line "
                          f"{line}, column {column}; save the file as UTF-8") from None
