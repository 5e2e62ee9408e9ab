"""Options of ``fedpft`` (the ``[method]`` table with ``name = "fedpft"``). See :mod:`fedslice.methods.fedpft`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from fedslice.config import DistillConfig, MethodOptions


KD_BEFORE = ("both", "before")


UPDATE_PREFIX = "proxy_update."


KD_DURING = ("both", "during")


class FedPFTMethod(MethodOptions):
    """FedPFT (Peng et al. 2024): FFN-compressed proxy, two-step distillation, LoRA on attention."""

    name: Literal["fedpft"] = "fedpft"
    keep_ratio: float = Field(0.25, description="Fraction of FFN neurons kept (the most salient: `salience`) "
                              "in each compressed layer, in (0, 1].")
    salience: Literal["l2", "activation"] = Field(
        "l2", description="Which FFN neurons the proxy keeps: 'l2' ranks a neuron by the L2 norm of "
        "its weights (Eq. 8, the paper); 'activation' by mean |a_j| (its input to W_out) x the L1 "
        "norm of W_out's column j over `calibration_examples` passages of the distillation corpus "
        "(data the server holds, never a client's): data-aware, not in the paper.")
    calibration_examples: int = Field(32, gt=0, description="Corpus passages (or images) the "
                                      "full model reads for salience = 'activation'.")
    whole_layers: list[int] = Field(default_factory=lambda: [0, -1], description="Layers kept "
                                    "whole (negative: from the end); the others are compressed.")
    kd: Literal["both", "before", "during", "none"] = Field(
        "both", description="Ablations: layer-level KD before FL and/or neuron-level KD during FL "
        "(FedPFT, FedPFT_B, FedPFT_D, FedPFT_N).")
    distill: DistillConfig = Field(default_factory=DistillConfig)
    align_every: int = Field(10, gt=0, description="t: neuron-level KD after every t-th round.")
    align_proportion: float = Field(0.5, description="p: fraction of each compressed layer's "
                                    "neurons re-distilled (highest aggregated APoZ), in (0, 1].")
    align_steps: int = Field(50, ge=0, description="Optimizer steps of each neuron-level KD.")
    align_lr: float | None = Field(None, gt=0, description="Default: distill.lr.")
    align_mu: float = Field(0.0, ge=0, description="Weight term during neuron-level KD (the "
                            "public code uses hidden states only).")
    apoz_tau: float = Field(0.05, ge=0, description="An FFN activation (gated: act(gate x) * up x) "
                            "counts as zero when |a| <= tau (Eq. 14 counts exact zeros, which GELU/SiLU "
                            "almost never give; 0: exact zeros, e.g. ReLU).")
    apoz_max_examples: int | None = Field(None, gt=0, description="APoZ on a seeded sample of "
                                          "this many local examples (default: all, as the paper).")
    head_refit_steps: int = Field(0, ge=0, description="After the last round, AdamW steps that "
                                  "re-fit the plugged-in full model's classifier to the proxy's "
                                  "predictions (soft labels, no ground-truth labels) on the "
                                  "distillation corpus (distill.corpus: data the server holds), "
                                  "the rest frozen; 0: off (the paper's plug-in). Classifier heads "
                                  "only (not generation or label_words).")
    head_refit_lr: float = Field(1e-3, gt=0, description="Learning rate of the head re-fit "
                                 "(constant).")
    head_refit_temperature: float = Field(1.0, gt=0, description="Softmax temperature of the "
                                          "head re-fit's KL (the loss is scaled by T^2).")

    @field_validator("keep_ratio", "align_proportion")
    @classmethod
    def _fraction(cls, v, info):
        what = {"keep_ratio": "keeps no FFN neuron (any ratio > 0 keeps at least one per layer)",
                "align_proportion": "re-distils no neuron"}
        if not 0 < v <= 1:
            bound = (f"{v:g} {what[info.field_name]}" if v <= 0 else
                     f"{v:g} is more than every neuron; the largest valid value is 1 (all of them)")
            raise ValueError(f"{info.field_name} must be in (0, 1]: {bound}")
        return v
