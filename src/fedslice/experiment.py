"""Loading experiment configs: the layer above the plug-ins.

:mod:`fedslice.config` describes the sections and resolves plug-in sections (``[method]``,
``[peft]``, ``[lora]``, ``aggregation.rule``) through :mod:`fedslice.registry`; this module
imports :mod:`fedslice.plugins` first, so every built-in method, adapter and rule is registered
before a config is validated::

    from fedslice.experiment import load_config
    cfg = load_config("configs/fedpetuning_sst2.toml", overrides=["federation.rounds=5"])

A plug-in of your own registers by being imported before you validate (``docs/design.md``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pydantic import ValidationError

import fedslice.plugins  # noqa: F401  (registers the built-in methods, adapters and rules)
from fedslice.config import (ExperimentConfig, apply_overrides, format_validation_error,
                             merge_variant, read_config_file, resolve_file_fields)
from fedslice.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["ExperimentConfig", "apply_overrides", "load_config", "load_variants",
           "read_config_file", "validate_config"]


def validate_config(data: dict[str, Any], source: str = "<dict>") -> ExperimentConfig:
    """A config dict validated into an :class:`ExperimentConfig` (a ConfigError naming every
    wrong field otherwise). Options of another method than ``method.name`` are set aside and
    logged (:meth:`fedslice.config.MethodOptions.set_aside_note`)."""
    try:
        cfg = ExperimentConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source)) from None
    note = cfg.method.set_aside_note()
    if note:
        log.warning("%s: %s", source, note)
    return cfg


def load_config(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    """Load and validate an experiment config file, applying ``--set`` style overrides. A file
    the config names (``budgets.csv``) is relative to the config's folder when written in the
    file, to the working directory when given as an override; both become absolute here."""
    data = read_config_file(path)
    data.pop("variants", None)
    return _from_file(data, path, overrides, str(path))


def _from_file(data: dict[str, Any], path: str | Path, overrides: list[str] | None,
               source: str) -> ExperimentConfig:
    """A config read from file ``path``, validated, and the files it names read: a bad
    ``budgets.csv`` fails here, before any model or data is loaded."""
    cfg = validate_config(_with_overrides(data, path, overrides), source)
    if cfg.budgets is not None and cfg.budgets.csv is not None:
        from fedslice.methods.budgets import read_budget_csv
        read_budget_csv(Path(cfg.budgets.csv), cfg.federation.num_clients)
    if cfg.devices is not None:  # devices.csv and devices.trace, read now
        from fedslice.fl.devices import check_devices
        check_devices(cfg)
    return cfg


def _with_overrides(data: dict[str, Any], path: str | Path, overrides: list[str] | None
                    ) -> dict[str, Any]:
    """The file's ``data`` with its relative file paths resolved against its folder, then the
    overrides applied, theirs resolved against the working directory."""
    data = resolve_file_fields(data, Path(path).parent)
    return resolve_file_fields(apply_overrides(data, overrides or []), Path.cwd())


def load_variants(path: str | Path, overrides: list[str] | None = None) -> list[ExperimentConfig]:
    """A suite file: base sections plus ``[[variants]]``, each a partial config merged on the base.

    A file without ``variants`` is one experiment.
    """
    data = read_config_file(path)
    variants = data.pop("variants", None)
    if variants is None:
        return [_from_file(data, path, overrides, str(path))]
    if not isinstance(variants, list) or not variants:
        raise ConfigError(f"config file {path}: 'variants' must be a non-empty list of tables")
    out = []
    for i, variant in enumerate(variants):
        merged = merge_variant(data, variant)
        out.append(_from_file(merged, path, overrides, f"{path} variants[{i}]"))
    return out
