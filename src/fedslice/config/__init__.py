"""Experiment configuration: typed pydantic models of the generic sections.

Every section forbids unknown keys, so a typo fails at load time with the field's dotted path.
Files are read by :mod:`fedslice.experiment` (``load_config``, ``validate_config``), the layer
above the plug-ins, which registers the built-in ones first::

    cfg = load_config("configs/fedpetuning_sst2.toml", overrides=["federation.rounds=5"])

Plug-in sections are resolved through :mod:`fedslice.registry`, never imported here (this module
sits below every plug-in):

* ``[method]``: ``name`` picks a registered method, whose own options class
  (a :class:`MethodOptions` defined in its module) validates the rest of the table; an unknown
  name fails with the list of the known ones; errors name the field (``method.sparsity``);
* ``[peft]``: ``method`` picks the adapter (``"lora"``, ``"none"`` = full fine-tuning, ...);
  unset, the method's own choice (``Method.default_adapter``: fedavg trains every weight, the
  others LoRA; raffm's ``method.tuning`` and fedot's ``method.adapter_tuning`` are older
  spellings of the same choice, and a contradiction fails naming both fields);
* one section per registered adapter with options, named after it: ``[lora]`` holds LoRA's
  options (as always), read only when the adapter is LoRA: ``[peft]`` chooses, ``[lora]``
  configures, so no key means two things;
* ``aggregation.rule`` (and ``aggregation.clip_norm``, ``dp.enabled``) pick registered rules;
  every plug-in checks the combination at load (``Method.check_config``,
  ``Rule.check_config``), naming both fields when it cannot work.

One module per section (:mod:`fedslice.config.data`, ...); every name is importable from
``fedslice.config``.
"""

from __future__ import annotations

from fedslice.config.base import AdapterOptions, MethodOptions, Section, budget_number, check_fractions, read_utf8
from fedslice.config.peft import PeftConfig
from fedslice.config.budgets import BUDGET_LIMITS, BudgetTier, BudgetsConfig, DEVICE_FIELDS, DeviceFields, DeviceTier, check_tier_shares
from fedslice.config.devices import DeviceTierConfig, DevicesConfig
from fedslice.config.data import DataConfig
from fedslice.config.model import ModelConfig, QUANTIZE_MODES, check_quantize_available, quantize_available, quantize_refusal
from fedslice.config.federation import FederationConfig
from fedslice.config.task import DistillConfig, TaskConfig
from fedslice.config.faults import FaultsConfig
from fedslice.config.aggregation import AggregationConfig, DPConfig, SERVER_OPT_DEFAULTS, ServerOptConfig
from fedslice.config.privacy import PrivacyConfig
from fedslice.config.output import EvaluationConfig, OutputConfig
from fedslice.config.compute import ComputeConfig
from fedslice.config.experiment import ExperimentConfig
from fedslice.config.files import CONFIG_FILE_FIELDS, apply_overrides, format_validation_error, merge_variant, read_config_file, resolve_file_fields

__all__ = ["AdapterOptions", "AggregationConfig", "BUDGET_LIMITS", "BudgetTier", "BudgetsConfig", "CONFIG_FILE_FIELDS", "ComputeConfig", "DEVICE_FIELDS", "DPConfig", "DataConfig", "DeviceFields", "DeviceTier", "DeviceTierConfig", "DevicesConfig", "DistillConfig", "EvaluationConfig", "ExperimentConfig", "FaultsConfig", "FederationConfig", "MethodOptions", "ModelConfig", "OutputConfig", "PeftConfig", "PrivacyConfig", "QUANTIZE_MODES", "SERVER_OPT_DEFAULTS", "Section", "ServerOptConfig", "TaskConfig", "apply_overrides", "budget_number", "check_fractions", "check_quantize_available", "check_tier_shares", "format_validation_error", "merge_variant", "quantize_available", "quantize_refusal", "read_config_file", "read_utf8", "resolve_file_fields"]
