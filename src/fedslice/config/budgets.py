"""The ``[budgets]`` section: client budgets (tiers, a CSV, a drawn share) and the planner's knobs (docs/planner.md).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from fedslice.config.base import Section, budget_number, check_fractions


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
        "cheapest plan's cost ('error'), or the client sits out every round ('sit_out'): it is "
        "never selected (as an offline device), said in the log, fedslice plan and the run's "
        "summary (sat_out) with the share of clients and examples left out (fewer left than "
        "federation.clients_per_round: each round trains all of them); an error still when "
        "every client would.")
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
        "whole batches, and below the fewest steps the shares give, those steps on "
        "round(share x federation.batch_size) examples each: a budget one whole step does not "
        "fit still trains; needs federation.local_steps).")

    max_local_work: float = Field(
        1.0, ge=1.0, le=16.0,
        description="Up to this multiple of federation.local_steps for a client whose "
        "most-training plan (the whole round, every other knob at its best) fits its limits "
        "with room to spare: it trains the most whole local steps, up to "
        "floor(max_local_work x local_steps), that still fit its FLOPs and time limits (a fast "
        "device spends the round's time instead of waiting for the deadline: on SST-2, 4 local "
        "steps per round learn 2-4 points more per round than 2; BENCHMARKS.md, issue 59). A "
        "client that needs any cut never gets more. 1.0: every client trains at most the "
        "round's local steps. Needs federation.local_steps and a FLOPs or time limit (a memory "
        "or upload limit alone says nothing of how many steps fit).")

    fit_rounds: bool = Field(
        False, description="With a time limit (a tier's seconds_per_round, or round_deadline_s) or "
        "a FLOPs budget held as clients train (enforce_flops), a client-round whose batches, "
        "predicted before it is sent, are longer than its plan's mean round (so its FLOPs guard "
        "would drop a local step, its first step alone would pass the deadline and it would sit "
        "out, or its first step alone would pass its FLOPs budget, which the guard cannot cut) is "
        "sent with fewer examples per step: the number that trains the most examples within the "
        "limits, when that is more than the round as planned trains (recorded in the round's "
        "rounds_fitted). In-process engine, synchronous policies. False: the plan's round, cut "
        "by the guard.")

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

    upload_dtypes: list[Literal["fp32", "fp16"]] | None = Field(
        None, min_length=1,
        description="Upload precisions the planner may give a client, most precise first "
        "(federation.upload_dtype's choices): with ['fp32', 'fp16'], a client whose upload or "
        "round time the fp32 reply does not fit sends its trained tensors in half precision "
        "(half the bytes; each value rounded to 11 significant bits, restored to fp32 at the "
        "server) before the planner cuts its rank, heads, adapter depth, local work or sub-model "
        "(tried after the base's precision, before a lower rank). None: every client sends in "
        "federation.upload_dtype.")

    step_cache: str | None = Field(
        None, description="A folder where the planner keeps the training steps it measures, by "
        "everything that determines them (the planned model's structure and config, the measured "
        "rows, the task's loss settings, torch's and transformers' versions, fedslice's sources, "
        "the threads), so later runs (a benchmark's rows, reruns) take them instead of measuring "
        "again (plans unchanged). '~' is expanded; a relative path is relative to the working "
        "directory. None: nothing kept.")

    @field_validator("precisions")
    @classmethod
    def _precisions(cls, v):
        return sorted(set(v), key=v.index)

    @field_validator("upload_dtypes")
    @classmethod
    def _upload_dtypes(cls, v):
        return None if v is None else sorted(set(v), key=("fp32", "fp16").index)  # most precise first

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

    @property
    def source(self) -> str:
        """The option that spelled this table, or 'budgets' (see ``_source``)."""
        return self._source

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
