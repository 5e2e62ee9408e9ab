"""Options of ``heads`` (the ``[method]`` table with ``name = "heads"``). See :mod:`fedslice.methods.heads`.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from fedslice.config import MethodOptions


class HeadsMethod(MethodOptions):
    """FedPETuning + per-client attention-head pruning, head-weighted aggregation ("Assortment of
    Attention Heads": Eq. 6-8). Client selection is ``federation.selection`` ('loss_gap' = Eq. 9)."""

    name: Literal["heads"] = "heads"
    sparsity: float = Field(0.9, ge=0, lt=1, description="Fraction s of attention heads each client "
                            "prunes (Eq. 7): it keeps round((1-s)*heads), in [0, 1).")
    pruning: Literal["importance", "random", "none"] = Field(
        "importance", description="Which heads a client keeps: its most important ones (Eq. 6), "
        "random ones (baseline B2), or all (baseline B1).")
    scope: Literal["global", "per_layer"] | None = Field(
        None, description="Rank heads over all layers (a layer may keep none) or per layer (every "
        "layer keeps the same share). Default: 'per_layer' under prune = 'forward' (a layer left "
        "without heads in a client's sub-model cost E2E customer rating 30 points at 90% "
        "sparsity: BENCHMARKS.md, issue 35 part 2), 'global' under 'parameters' (the paper).")
    prune: Literal["parameters", "forward"] = Field(
        "parameters", description="'parameters' (the paper's §3.1): a pruned head's trainable "
        "tensors are neither trained nor sent, the frozen head stays in the forward pass (saves "
        "their backward/optimizer work); 'forward': pruned heads leave the sub-model (saves "
        "forward and backward, but at high sparsity each client trains a different network and "
        "accuracy falls far behind: README, 'Head pruning').")
    fill: Literal["zero", "mean", "linear"] = Field(
        "zero", description="prune = 'forward': what a pruned head adds to its layer's attention "
        "output in the client's sub-model while it trains. 'zero': nothing (it is sliced away); "
        "'mean': its mean output, measured in the model the client received over the importance "
        "examples (the importance pass's own forward; with pruning = 'random' a forward of its "
        "own, counted in flops_importance), added to the output projection as a constant (mean "
        "ablation), so what the clients train is closer to the all-heads model the server "
        "evaluates: +1.6 / +1.4 pt on SST-2 at 75% / 90%, but a delayed start on E2E customer "
        "rating (BENCHMARKS.md, issue 35 part 2). 'linear': per layer, the rank-fill_rank "
        "linear map of the layer's attention input (what q reads, plus a constant) that best "
        "predicts the pruned heads' output over the same examples (ridge least squares, fitted "
        "from moments the importance forward collects), added to the output projection: on "
        "SmolLM2 at 90% it brings the sub-model's starting loss from 5.4 ('mean') to 3.3 "
        "(the full model 2.7) for 2 x hidden x fill_rank multiply-adds per token and layer, "
        "and the evaluated model's ROUGE-L by 3.8 and 6.6 over 'mean' on two seeds at a ridge "
        "of 1e-3 (32.9 and 32.8; dense 59.9 and 62.4), 29.1 and 34.3 at the cross-validated "
        "one (BENCHMARKS.md, issue 35 part 2). No effect under prune = 'parameters'.")
    fill_rank: int = Field(64, gt=0, description="Rank of fill = 'linear' (at most the hidden "
                           "size; the moments cost (hidden + 1)^2 float64 per layer on the client).")
    fill_ridge: float | None = Field(
        None, gt=0, description="Ridge of fill = 'linear', relative to the mean diagonal of the "
        "inputs' second moments. Default: per layer, the one of 1e-4 / 1e-3 / 1e-2 / 1e-1 that "
        "predicts best across the two halves of the importance examples (two-fold "
        "cross-validation from the moments; the moments of one half cost as much memory again).")
    aggregation: Literal["head_weighted", "fedavg"] = Field(
        "head_weighted", description="Head-tied LoRA slices: importance-weighted mean (Eq. 8) or "
        "example-weighted mean over the clients that kept the head (Eq. 5).")
    eps: float = Field(1e-8, ge=0, description="epsilon of Eq. 8.")
    importance_batch_size: int = Field(64, gt=0)
    sink_keys: int = Field(
        0, ge=0, description="Causal self-attention: the first N real tokens of an example are "
        "not counted as keys of Eq. 6 (decoder heads park attention on the first token, an "
        "attention sink, and look confident; README, 'Head pruning'). 0: the paper's rule.")
    importance_max_examples: int | None = Field(
        None, gt=0, description="Score heads on at most this many local examples (seeded sample); "
        "default: all of them, as in the paper.")
    importance_source: Literal["pass", "first_step", "training"] = Field(
        "pass", description="Where Eq. 6's attention weights come from: 'pass' (the paper): a "
        "separate inference forward over the (sampled) local examples before training, counted "
        "in flops_importance; 'first_step': the client's first training batch, captured from "
        "that step's own forward (eager attention for that step only, weights after attention "
        "dropout), so no extra forward runs and flops_importance is 0. The first step trains "
        "every head-tied row and the pruned rows' gradients are zeroed, so their values never "
        "change; the weight gradients of the pruned rows are computed (training FLOPs are "
        "dense's). Needs prune='parameters' (a 'forward' client's sub-model needs its mask "
        "before its first forward) and federation.weight_decay = 0; packed batches are scored "
        "per example (each query's keys its own example's). 'training' "
        "(not the paper's rule): every training step's forward is captured (eager attention), "
        "the client trains every head and, after training, keeps and sends the top heads of "
        "the scores over all its training batches (no separate forward, flops_importance 0, "
        "training FLOPs dense's; the pruned heads' local training is discarded); needs "
        "prune='parameters'.")
    plot_rounds: int = Field(10, ge=0, description="Rounds drawn in head_importance.png.")

    @model_validator(mode="after")
    def _scope_by_mode(self) -> "HeadsMethod":
        if self.scope is None:
            self.scope = "per_layer" if self.prune == "forward" else "global"
        return self

    @property
    def count_mode(self) -> str:
        """The keep rule of a mask whose size, not which heads, matters (the planner's
        upload, the server's check of a reply's count): every head when the method does not
        prune, else the top-k of the sparsity."""
        return "none" if self.pruning == "none" else "importance"

    def knob_defaults(self) -> dict[str, Any]:
        return {**super().knob_defaults(), "sparsity": self.sparsity,
                "importance_source": self.importance_source}

    def spelled_budgets(self, budgets_given: bool) -> dict[str, Any] | None:
        """The stage below's spelling, with this stage's knobs fixed at the method's own (a
        spelling plans what the stage below varies, nothing of the head stage's)."""
        out = super().spelled_budgets(budgets_given)
        if out is not None:
            out.update(sparsities=[self.sparsity], importance_sources=["pass"])
        return out


def kept_count(num_rows: int, num_heads: int, sparsity: float, scope: str) -> int:
    """Heads kept per pool (every (family, layer) row for 'global', one row for 'per_layer')."""
    pool = num_rows * num_heads if scope == "global" else num_heads
    return int(np.round((1 - sparsity) * pool))


def max_sparsity(pool: int) -> float:
    """The largest sparsity, at 4 decimals, that keeps a head of a pool of ``pool`` (1 - 1/pool,
    rounded down so that the value printed in messages is valid as written)."""
    return math.floor((1 - 1 / pool) * 1e4) / 1e4
