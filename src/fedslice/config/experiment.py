"""The whole config (:class:`ExperimentConfig`): its sections and the checks across them.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from pydantic import ConfigDict, Field, SerializeAsAny, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails

from fedslice.errors import ConfigError
from fedslice.registry import ADAPTERS, METHODS, RULES, method_name
from fedslice.config.aggregation import AggregationConfig, DPConfig, ServerOptConfig
from fedslice.config.base import AdapterOptions, MethodOptions, Section, log
from fedslice.config.budgets import BudgetsConfig, DEVICE_FIELDS
from fedslice.config.compute import ComputeConfig
from fedslice.config.data import DataConfig
from fedslice.config.devices import DevicesConfig
from fedslice.config.faults import FaultsConfig
from fedslice.config.federation import FederationConfig
from fedslice.config.model import ModelConfig, check_quantize_available, quantize_refusal
from fedslice.config.output import EvaluationConfig, OutputConfig
from fedslice.config.peft import PeftConfig
from fedslice.config.privacy import PrivacyConfig
from fedslice.config.task import TaskConfig


class ExperimentConfig(Section):
    """An experiment. Besides the fields below, one section per registered adapter with options,
    named after it (``lora``: :class:`fedslice.peft.LoraConfig`), validated by its options class
    and stored as a pydantic extra (``cfg.lora``)."""

    # extras: the adapters' option sections only (``_plugin_sections`` refuses any other key)
    model_config = ConfigDict(extra="allow", validate_assignment=True)
    __pydantic_extra__: dict[str, SerializeAsAny[AdapterOptions]] = Field(init=False)

    DEFAULT_METHOD: ClassVar[str] = "fedpetuning"

    name: str | None = None
    seed: int = 0
    threads: int | None = Field(None, gt=0, description="torch intra-op threads of the main "
                                "process (default: torch's); client worker processes use one each.")
    compute: ComputeConfig = Field(default_factory=ComputeConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    peft: PeftConfig = Field(default_factory=PeftConfig)
    federation: FederationConfig = Field(default_factory=FederationConfig)
    method: SerializeAsAny[MethodOptions] = Field(
        default_factory=lambda: {"name": ExperimentConfig.DEFAULT_METHOD}, validate_default=True,
        description="A registered method by `name`, with its options.")
    faults: FaultsConfig = Field(default_factory=FaultsConfig)
    aggregation: AggregationConfig = Field(default_factory=AggregationConfig)
    dp: DPConfig = Field(default_factory=DPConfig)
    server_opt: ServerOptConfig = Field(default_factory=ServerOptConfig)
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)
    budgets: BudgetsConfig | None = Field(None, description="Client budgets and the planner "
                                          "(unset: every client trains the same plan).")
    devices: DevicesConfig | None = Field(None, description="Client devices on a simulated "
                                          "clock (unset: no simulated time; docs/time.md).")

    @field_validator("method", mode="before")
    @classmethod
    def _method_options(cls, v):
        """The registered method's own options class validates the table (its errors are
        located under ``method``: ``method.sparsity``)."""
        return _method_table(v)

    @model_validator(mode="before")
    @classmethod
    def _plugin_sections(cls, data: Any) -> Any:
        """Every registered adapter's section (its defaults when absent), validated by its options
        class; any other unknown top-level key is an error, as in every section."""
        if not isinstance(data, dict):
            return data
        data, errors = dict(data), []
        sections = {e.name: e.config_cls for e in ADAPTERS.entries() if e.config_cls is not None}
        for key in data:
            if key not in cls.model_fields and key not in sections:
                errors.append(InitErrorDetails(type="extra_forbidden", loc=(key,), input=data[key]))
        for key, options_cls in sections.items():
            value = data.get(key, {})
            if isinstance(value, options_cls):
                continue
            try:
                data[key] = options_cls.model_validate(value)
            except ValidationError as e:
                errors += [InitErrorDetails(type=x["type"], loc=(key, *x["loc"]), input=x["input"],
                                            ctx=x.get("ctx", {})) for x in e.errors()]
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return data

    @model_validator(mode="after")
    def _data_columns(self) -> "ExperimentConfig":
        """With ``data.columns`` (headerless files), the columns the task reads must be among
        them: its text columns, or for an image task its image column."""
        image = self.task.kind == "image_classification"
        try:
            inputs = [self.data.image_column] if image else (self.data.text_columns or [])
            self.data.check_columns(inputs)
        except ValueError as e:
            raise ValueError(f"data: {e}") from None
        return self

    @model_validator(mode="after")
    def _plugins_agree(self) -> "ExperimentConfig":
        """What the plug-ins check together, named by field: the method its options with the
        adapter (``Method.check_config``), every selected rule its fit with the method
        (``Rule.check_config``). Architecture-dependent checks (layer counts, modules) happen
        when the model is loaded."""
        method = METHODS.get(self.method.name).method_cls
        method.check_config(self)
        for entry in RULES.entries():
            if entry.rule_cls.selected(self):
                entry.rule_cls.check_config(self, method)
        return self

    @model_validator(mode="wrap")
    @classmethod
    def _spelled_budgets(cls, data, handler):
        """One planner: a method's own spelling of client budgets (raffm's and fedpetuning's
        ``method.tiers``, raffm's ``method.budget_distribution`` and default tiers) is read as
        the ``[budgets]`` table it means (:meth:`MethodOptions.spelled_budgets`, said in the
        log): the table is derived from the method table before the config is validated, and
        the config is validated once, with that table and without the spelling, so that it
        holds one way to say it and a config written back reads the same. (A table that does
        not validate is reported as before: the config's own errors as written first, then the
        table's, located under ``budgets``.)"""
        spelled = _spelling(data, cls.DEFAULT_METHOD)
        if spelled is None:
            return handler(data)
        field, table, method = spelled
        if data.get("budgets") is not None:
            handler(data)  # the config's own errors first
            raise ValueError(f"{field} and budgets: the budgets section plans every client "
                             f"(width, rank, ...): remove {field}")
        try:
            budgets = BudgetsConfig.model_validate(table)
            budgets._source = field  # the method's checks (``check_config``) read where it came from
        except ValidationError:
            handler(data)  # the config's own errors first, as written
            budgets = table  # then the table's, under budgets
        cfg = handler({**data, "method": method, "budgets": budgets})
        cfg.budgets._source = field
        if field != "default":
            log.info("%s is read as this [budgets] table (write it so): %s", field,
                     json.dumps(cfg.budgets.model_dump(exclude_defaults=True)))
        return cfg

    @model_validator(mode="after")
    def _clock(self) -> "ExperimentConfig":
        """Devices come from one place; a round policy other than 'all' needs them; the faults
        and methods each policy cannot take (docs/time.md)."""
        fed, tiers = self.federation, (self.budgets.tiers if self.budgets is not None else None) or []
        in_budgets = [f"budgets.tiers[{i}]" for i, t in enumerate(tiers) if t.device_fields()]
        if in_budgets and self.devices is not None:
            raise ValueError(f"{in_budgets[0]} sets a device and [devices] is given: give the "
                             "devices one way")
        if in_budgets and len(in_budgets) < len(tiers):
            missing = next(i for i, t in enumerate(tiers) if not t.device_fields())
            raise ValueError(f"budgets.tiers[{missing}] sets no device ({', '.join(DEVICE_FIELDS)}) "
                             f"and {in_budgets[0]} does: give every tier its device")
        policy = f"federation.round_policy = {fed.round_policy!r}"
        f = self.faults
        if fed.round_policy == "deadline" and f.deadline_s is not None:
            raise ValueError(f"{policy} with faults.deadline_s: two deadlines; use "
                             "federation.round_deadline_s")
        if fed.round_policy == "async":
            set_faults = [k for k in ("dropout", "stragglers", "nan", "overreport", "attackers")
                          if getattr(f, k)] + (["deadline_s"] if f.deadline_s is not None else [])
            if set_faults:
                raise ValueError(f"{policy} with faults.{set_faults[0]}: injected faults are "
                                 "drawn per synchronous round; not under 'async' yet")
            method = METHODS.get(self.method.name).method_cls
            if why := method.facts(self).reorders_state:
                raise ValueError(f"{policy} with {why}: a stale reply's update would be "
                                 "applied to re-ordered elements")
        return self

    @model_validator(mode="after")
    def _budgets(self) -> "ExperimentConfig":
        """Micro-batches divide the batch; local work by steps needs local steps."""
        if self.budgets is None:
            return self
        bs = self.federation.batch_size
        bad = [k for k in self.budgets.micro_batches if bs % k]
        if bad:
            raise ValueError(f"budgets.micro_batches {bad} do not divide federation.batch_size = {bs}")
        if self.budgets.local_work != [1.0] and self.budgets.local_work_by == "steps" and \
                not self.federation.local_steps:
            raise ValueError("budgets.local_work_by = 'steps': shares of federation.local_steps, "
                             "which is not set (the run trains local epochs): set "
                             "federation.local_steps or budgets.local_work_by = 'batch'")
        if self.budgets.max_local_work > 1 and not self.federation.local_steps:
            raise ValueError(f"budgets.max_local_work = {self.budgets.max_local_work:g}: a multiple of "
                             "federation.local_steps, which is not set (the run trains local "
                             "epochs): set federation.local_steps or max_local_work = 1")
        return self

    @model_validator(mode="after")
    def _planned_precisions(self) -> "ExperimentConfig":
        """``budgets.precisions`` beyond the run's base: quantized copies of an fp32 base, in a
        mode this device runs, under a method and adapter that train over a quantized base."""
        b = self.budgets
        if b is None or b.precisions == ["none"]:
            return self
        lower = [m for m in b.precisions if m != "none"]
        if self.model.quantize != "none":
            raise ValueError(f"budgets.precisions = {b.precisions}: a client's quantized copy is made "
                             f"from the fp32 base, but model.quantize = {self.model.quantize!r} "
                             "quantizes the base of every client already: set one of them")
        for mode in lower:
            try:
                check_quantize_available(mode, self.compute.device)
            except ValueError as e:
                raise ValueError(f"budgets.precisions: {e}") from None
        method = METHODS.get(self.method.name).method_cls  # one that plans budgets: an adapter's
        # the method's own answer (raffm quantizes each client's slice though its global state
        # holds fp32 base tensors); by default, whether it trains over a quantized base at all
        why = method.facts(self).precision_refusal
        if why:
            raise ValueError(f"budgets.precisions = {b.precisions} does not compose with method.name = "
                             f"{self.method.name!r}: {why}")
        if folding := self._base_folding_rule():
            raise ValueError(f"budgets.precisions = {b.precisions} does not compose with {folding}: "
                             "that rule folds the clients' updates into the fp32 base every round, "
                             "which a client's quantized copy would not follow")
        return self

    def _base_folding_rule(self) -> str | None:
        """The setting of a selected aggregation rule that folds updates into the base weights
        on the server (``changes_base``), None when none is selected."""
        for entry in RULES.entries():
            rule = entry.rule_cls
            if getattr(rule, "changes_base", False) and rule.selected(self):
                return rule.setting(self)
        return None

    @model_validator(mode="after")
    def _quantized_base(self) -> "ExperimentConfig":
        """``model.quantize``: the backend runs on ``compute.device``, the adapter keeps the base
        frozen, and the method's clients train the shared model (its global state holds no base
        tensor). Checked at load, before anything is read or trained."""
        mode = self.model.quantize
        if mode == "none":
            return self
        check_quantize_available(mode, self.compute.device)
        method = METHODS.get(self.method.name).method_cls
        adapter = method.adapter_name(self)
        if ADAPTERS.get(adapter).adapter_cls.trains_base:
            raise ValueError(f"model.quantize = {mode!r} needs a frozen base, but peft.method = "
                             f"{adapter!r} (method {self.method.name}) trains the model's own "
                             "weights: use an adapter (lora, dora, ia3, ...) or model.quantize = 'none'")
        why = quantize_refusal(method)
        if why:
            raise ValueError(f"model.quantize = {mode!r} does not compose with method.name = "
                             f"{self.method.name!r} yet: {why}")
        if folding := self._base_folding_rule():
            raise ValueError(f"model.quantize = {mode!r} does not compose with {folding}: that rule "
                             "folds the clients' updates into the frozen base weights on the server "
                             "every round, and a quantized base is never re-quantized")
        return self

    def adapter_options(self, name: str) -> AdapterOptions | None:
        """The options section of adapter ``name`` (None for an adapter without options)."""
        return (self.__pydantic_extra__ or {}).get(name)

    @property
    def run_name(self) -> str:
        return self.output.name or self.name or self.method.name


def _method_table(v: Any) -> MethodOptions:
    """The ``[method]`` table validated by the registered method's options class (a ValueError
    or ValidationError saying what is wrong); options of other registered methods are set aside."""
    if isinstance(v, MethodOptions):
        return v
    if not isinstance(v, dict) or not isinstance(v.get("name"), str):
        raise ValueError("give the method as a table with a `name`, e.g. {name = \"fedavg\"}")
    try:
        v = {**v, "name": method_name(v["name"])}  # a composition in stage order
    except ConfigError as e:
        raise ValueError(str(e)) from None
    if v["name"] not in METHODS:
        raise ValueError(f"unknown method {v['name']!r} (known: {', '.join(METHODS.names())})")
    options_cls = METHODS.get(v["name"]).options_cls
    others = {k: [e.name for e in METHODS.entries() if k in e.options_cls.model_fields and not e.parts]
              for k in v if k not in options_cls.model_fields}
    aside = {k: names for k, names in others.items() if names}
    options = options_cls.model_validate({k: x for k, x in v.items() if k not in aside})
    options._set_aside = aside
    return options


def _spelling(data: Any, default_method: str) -> tuple[str, dict[str, Any], Any] | None:
    """What a config's method table spells of ``[budgets]`` (:meth:`MethodOptions.spelled_budgets`):
    (the option that spells it, the table, the method table without the spelling), or None (no
    spelling, not a dict, or a method table that does not validate: its field says why)."""
    if not isinstance(data, dict):
        return None
    method = data.get("method", {"name": default_method})
    try:
        options = _method_table(method)
    except ValueError:  # a ValidationError too: the method field reports it
        return None
    table = options.spelled_budgets(data.get("budgets") is not None)
    if table is None:
        return None
    field = table.pop("field")
    cleared = {k: None for k in options.spelling_fields}
    if isinstance(method, MethodOptions):
        method = method.model_copy(update=cleared)
    else:
        method = {k: v for k, v in method.items() if k not in cleared}
    return field, table, method


def _not_default(section: Section, name: str) -> bool:
    """``section`` has field ``name`` set to something else than its default (a config written
    back with every default, as Flower's ServerApp sends it, sets them all)."""
    field = type(section).model_fields.get(name)
    if field is None or name not in section.model_fields_set:
        return False
    default = field.get_default(call_default_factory=True)
    return getattr(section, name) != default
