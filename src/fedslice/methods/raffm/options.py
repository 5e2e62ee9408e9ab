"""Options of ``raffm`` (the ``[method]`` table with ``name = "raffm"``). See :mod:`fedslice.methods.raffm`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from fedslice.config import DeviceTier, MethodOptions, Section, check_fractions, check_tier_shares


RaFFMTier = DeviceTier  # the older name

#: RaFFM's clients without a ``[budgets]`` table: four tiers of a quarter of the clients each, at
#: 0.25, 0.5, 0.75 and 1.0 of the whole model's training FLOPs
DEFAULT_TIERS = [{"share": 0.25, "flops_share": f} for f in (0.25, 0.5, 0.75, 1.0)]


class BudgetDistribution(Section):
    """Per-client FLOPs budgets drawn uniformly from [low, high] (fractions of the full model)."""

    kind: Literal["uniform"] = "uniform"
    low: float
    high: float

    @field_validator("low", "high")
    @classmethod
    def _fraction(cls, v):
        if not 0 < v <= 1:
            raise ValueError("budget must be a fraction of the full model's FLOPs in (0, 1]")
        return v

    @model_validator(mode="after")
    def _ordered(self) -> "BudgetDistribution":
        if self.low > self.high:
            raise ValueError(f"low={self.low} is larger than high={self.high}")
        return self


class RaFFMMethod(MethodOptions):
    """Resource-aware sub-models: salience-ordered heads/neurons, leading slices per budget,
    slice aggregation (RaFFM, Yu et al. 2023)."""

    name: Literal["raffm"] = "raffm"
    tuning: Literal["full", "lora"] = Field("lora", description="Full fine-tuning of the "
                                            "sub-model, or LoRA (settings in [lora]) on it.")
    tiers: list[RaFFMTier] | None = Field(
        None, min_length=1, description="An older spelling of [budgets] tiers (read as budgets.tiers "
        "with flops -> flops_share, memory_mb kept; said in the log). Without it and without a "
        "[budgets] table, RaFFM's clients get four tiers of 0.25, 0.5, 0.75 and 1.0 of the whole "
        "model's training FLOPs (flops_share).")
    budget_distribution: BudgetDistribution | None = Field(
        None, description="An older spelling of budgets.flops_share_range = [low, high].")
    salience: Literal["l1", "l2", "activation"] = Field(
        "l1", description="How heads/neurons are ranked: L1 or L2 weight norm (RaFFM's, no data), "
        "or 'activation': mean |input| x L1 column norm of the output projection over a "
        "calibration batch (keeps a decoder's massive-activation FFN units in the small sizes).")
    calibration: Literal["dev", "profile"] = Field(
        "dev", description="salience = 'activation': the calibration batch is the server's dev "
        "split (real examples) or the planner's synthetic profile batch (random tokens: no data).")
    calibration_examples: int = Field(32, gt=0, description="salience = 'activation': examples "
                                      "in the calibration batch.")
    size_weight: float = Field(0.0, ge=0, description="Slice aggregation weighs a client by "
                               "examples x f^p, f = its sub-model's planned FLOPs fraction, p = "
                               "this (RaFFM Eq. 7's per-configuration step eta_c); 0: examples only.")
    reorder: bool = Field(True, description="Salience-order heads/neurons before round 1 "
                          "(false: leading slices of the checkpoint's order, an ablation).")
    reorder_every: int = Field(0, ge=0, description="Re-order every R rounds (0: only once).")
    width_steps: int = Field(48, gt=0, description="Width grid of the planner: sub-models keep "
                             "round(w*H) heads and round(w*F) neurons, w = 1/steps .. 1.")
    widths: Literal["uniform", "measured"] = Field(
        "uniform", description="Per-layer widths of the planner's sub-models: the same share of "
        "heads and FFN units in every layer (RaFFM's), or 'measured': at each width's linear "
        "parameters, the per-layer widths that least raise the loss of the calibration batch "
        "(each layer cut alone to each of width_levels widths first: layers x levels forward "
        "passes on the server, once; one-stack models).")
    width_levels: int | list[float] = Field(
        8, description="widths = 'measured': the widths a layer may keep, n: 1/n, 2/n, .. or all "
        "of its heads and FFN units; a list: those fractions (ascending, in (0, 1)) or all, e.g. "
        "[0.0625, 0.125, 0.25, 0.375, 0.5, 0.75] for finer cuts at the small end.")
    elastic_depth: bool = Field(False, description="The planner may also drop layers.")
    elastic_sizes: list[float] = Field(default_factory=lambda: [0.25, 0.5, 0.75, 1.0],
                                       description="FLOPs fractions evaluated after training.")
    on_infeasible: Literal["sit_out", "error"] = Field(
        "sit_out", description="With RaFFM's default tiers or method.tiers: budgets.on_infeasible "
        "(a client whose budget is below the smallest sub-model sits out, recorded, or the run "
        "fails naming the tier and clients). With a [budgets] table, its own on_infeasible.")
    sandwich: bool = Field(False, description="Sandwich rule: every local step also trains the "
                           "smallest elastic size nested in the client's sub-model (its leading "
                           "heads/FFN units; the others' outputs masked), loss = own + smallest. "
                           "Costs a second forward/backward of the client's sub-model per step.")
    profile_batch_size: int | None = Field(None, gt=0, description="Batch the planner measures "
                                           "(default: federation.batch_size).")
    profile_seq_len: int | None = Field(None, gt=1, description="Sequence length the planner "
                                        "measures (default: data.max_length, the worst case).")

    @model_validator(mode="after")
    def _widths(self) -> "RaFFMMethod":
        if self.widths == "measured" and self.elastic_depth:
            raise ValueError("widths = 'measured' and elastic_depth = true do not combine: the "
                             "measured widths keep every layer")
        if self.widths == "measured" and self.sandwich:
            raise ValueError("widths = 'measured' and sandwich = true do not combine: the "
                             "sandwich's smallest size is planned in each client's process, "
                             "which measures no widths")
        return self

    @field_validator("width_levels")
    @classmethod
    def _levels(cls, v):
        if isinstance(v, int):
            if v < 2:
                raise ValueError(f"an integer number of levels must be at least 2, got {v}")
            return v
        if not v or not all(0 < a < b <= 1 for a, b in zip(v, list(v[1:]) + [1.0])):
            raise ValueError(f"a list of widths must ascend strictly within (0, 1), got {v}")
        return v

    @field_validator("elastic_sizes")
    @classmethod
    def _sizes(cls, v):
        return check_fractions(v, "size (a fraction of the full model's FLOPs)")

    @field_validator("tiers")
    @classmethod
    def _shares(cls, v):
        return check_tier_shares(v)

    spelling_fields: ClassVar[tuple[str, ...]] = ("tiers", "budget_distribution")

    def spelled_budgets(self, budgets_given: bool) -> dict[str, Any] | None:
        """``method.tiers`` / ``method.budget_distribution`` (or, without them and without
        ``[budgets]``, :data:`DEFAULT_TIERS`) as the ``[budgets]`` table they mean: the tier
        planner's FLOPs fractions as ``flops_share``, its grid of widths, every client training
        the whole round as one batch (no local-work, split or checkpointing axes)."""
        if self.budget_distribution is not None:
            d = self.budget_distribution
            out = {"flops_share_range": [d.low, d.high], "field": "method.budget_distribution"}
        elif self.tiers is not None:
            out = {"tiers": [{"share": t.share, "name": t.name,
                              **({"flops_share": t.flops} if t.flops is not None else {"memory_mb": t.memory_mb})}
                             for t in self.tiers], "field": "method.tiers"}
        elif budgets_given:
            return None
        else:
            out = {"tiers": DEFAULT_TIERS, "field": "default"}
        return {**out, "width_steps": self.width_steps, "local_work": [1.0], "micro_batches": [1],
                "checkpointing": False, "on_infeasible": self.on_infeasible}
