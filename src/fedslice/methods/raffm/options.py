"""Options of ``raffm`` (the ``[method]`` table with ``name = "raffm"``). See :mod:`fedslice.methods.raffm`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from fedslice.config import DeviceTier, MethodOptions, Section, check_fractions, check_tier_shares


RaFFMTier = DeviceTier  # the older name


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


def _default_tiers() -> list[RaFFMTier]:
    return [RaFFMTier(share=0.25, flops=f) for f in (0.25, 0.5, 0.75, 1.0)]


class RaFFMMethod(MethodOptions):
    """Resource-aware sub-models: salience-ordered heads/neurons, leading slices per budget,
    slice aggregation (RaFFM, Yu et al. 2023)."""

    name: Literal["raffm"] = "raffm"
    tuning: Literal["full", "lora"] = Field("lora", description="Full fine-tuning of the "
                                            "sub-model, or LoRA (settings in [lora]) on it.")
    tiers: list[RaFFMTier] = Field(default_factory=_default_tiers, min_length=1)
    budget_distribution: BudgetDistribution | None = Field(
        None, description="If set, each client's FLOPs budget is drawn from it (tiers unused).")
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
        "sit_out", description="A client whose budget is below the smallest sub-model sits out "
        "(recorded), or the run fails naming the tier and clients.")
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
