"""Which modules an adapter wraps: logical targets of the architecture table (``q``, ``v``,
``ffn_out``, ``all-linear``, ...) or raw module-name suffixes, resolved to the exact module names
of every block of every stack (encoder, decoder, cross-attention), and checked: a raw name must
match a linear module (peft silently accepts a list of which only some names match).

Shared by the adapters that wrap linear maps (LoRA, DoRA, IA3); errors name the adapter's own
config section (``ia3.targets``), so each adapter's messages point at the key the user wrote.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn

from fedslice.errors import ConfigError
from fedslice.models.arch import PART_NAMES, ArchSpec, is_linear

#: logical parts whose module's *input* features are heads / neurons (the others: its outputs)
IN_SIDE_PARTS = ("o", "ffn_out")


def logical(targets: Sequence[str]) -> list[str]:
    """``targets`` with ``all-linear`` expanded to every part of the table."""
    return list(PART_NAMES) if "all-linear" in targets else list(targets)


def matching_modules(model: nn.Module, suffixes: Sequence[str]) -> list[str]:
    """Names of the linear modules whose name is, or ends with ``.`` + , one of ``suffixes``."""
    names = [n for n, m in model.named_modules() if is_linear(m)]
    return [n for n in names if any(n == t or n.endswith("." + t) for t in suffixes)]


def _base(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def resolve(model: nn.Module, arch: ArchSpec, section: str, targets: Sequence[str],
            target_modules: Sequence[str] | None,
            layers: list[int] | list[list[int]] | None = None) -> list[str]:
    """Module names for peft's ``target_modules``: raw ``target_modules`` (each must match a
    linear module; they cannot be limited to ``layers``), else the logical ``targets`` in every
    block (or the blocks ``layers``). Errors name ``<section>.targets`` / ``.target_modules``."""
    if target_modules is not None and layers is not None:
        raise ConfigError(f"{section}.target_modules cannot be limited to some layers: use "
                          f"{section}.targets")
    if target_modules is not None:
        for t in target_modules:
            if not matching_modules(model, [t]):
                raise ConfigError(f"{section}.target_modules: {t!r} matches no linear module of "
                                  f"the model (e.g. {arch.parts['q']!r}, {arch.parts['ffn_in']!r})")
        return list(target_modules)
    base = _base(model)
    names = arch.module_names(base, logical(targets), layers)
    modules = dict(base.named_modules())
    missing = [n for n in names if n not in modules or not is_linear(modules[n])]
    if missing or not names:
        raise ConfigError(f"{section}.targets {list(targets)}: no linear module at "
                          f"{missing[:3] or 'any layer'} in this {arch.model_type} model")
    return names


def in_side_modules(model: nn.Module, arch: ArchSpec, names: Sequence[str]) -> list[str]:
    """Those of the resolved module ``names`` (full names or suffixes) that are an ``o`` or
    ``ffn_out`` part: their input features are the heads / FFN neurons."""
    base = _base(model)
    inside = set(arch.module_names(base, list(IN_SIDE_PARTS)))
    full = matching_modules(base, list(names))
    hits = {n for n in full if n in inside}
    return [t for t in names if any(n == t or n.endswith("." + t) for n in hits)]


def check_rank(model: nn.Module, arch: ArchSpec, section: str, r: int,
               names: Sequence[str]) -> None:
    """A ConfigError naming the first module (and its shape) whose smaller dimension is below
    the rank ``r``: a rank-``r`` update of an (out, in) map needs ``r <= min(out, in)``."""
    lay = arch.layout
    for name in matching_modules(_base(model), list(names)):
        m = _base(model).get_submodule(name)
        out_f, in_f = m.weight.shape[lay.out_axis], m.weight.shape[lay.in_axis]
        if r > min(out_f, in_f):
            raise ConfigError(f"{section}.r={r} is larger than module {name} "
                              f"({out_f} x {in_f}, out x in) allows: a rank-r update of it has "
                              f"rank <= {min(out_f, in_f)}; lower {section}.r or drop that target")
