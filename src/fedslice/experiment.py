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
                             merge_variant, read_config_file)
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
    """Load and validate an experiment config file, applying ``--set`` style overrides."""
    data = read_config_file(path)
    data.pop("variants", None)
    return validate_config(apply_overrides(data, overrides or []), str(path))


def load_variants(path: str | Path, overrides: list[str] | None = None) -> list[ExperimentConfig]:
    """A suite file: base sections plus ``[[variants]]``, each a partial config merged on the base.

    A file without ``variants`` is one experiment.
    """
    data = read_config_file(path)
    variants = data.pop("variants", None)
    if variants is None:
        return [validate_config(apply_overrides(data, overrides or []), str(path))]
    if not isinstance(variants, list) or not variants:
        raise ConfigError(f"config file {path}: 'variants' must be a non-empty list of tables")
    out = []
    for i, variant in enumerate(variants):
        merged = merge_variant(data, variant)
        out.append(validate_config(apply_overrides(merged, overrides or []), f"{path} variants[{i}]"))
    return out
