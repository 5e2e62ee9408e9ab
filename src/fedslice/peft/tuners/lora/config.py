"""LoRA's options: the ``[lora]`` section (like HF PEFT's ``LoraConfig``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from fedslice.config import AdapterOptions

LoraTarget = Literal["q", "k", "v", "o", "ffn_in", "ffn_out", "all-linear"]

#: ``lora.aggregation``: how the server combines the clients' LoRA factors (each value is a rule
#: of :mod:`fedslice.fl.rules.lora`; docs/lora.md)
LoraAggregation = Literal["fedit", "ffa", "fedex", "flora", "svd", "fedsa"]


class LoraConfig(AdapterOptions):
    """LoRA settings for the methods that fine-tune with LoRA (like PEFT's ``LoraConfig``)."""

    r: int = Field(16, gt=0, description="Rank of the global adapter (with lora.ranks: the "
                   "largest rank; every client uses its scale alpha / r).")
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    targets: list[LoraTarget] = Field(default_factory=lambda: ["q", "v"], min_length=1,
                                      description="Logical modules from the architecture table.")
    target_modules: list[str] | None = Field(None, description="Raw module-name suffixes; overrides "
                                             "`targets`. Each must match at least one module.")
    train_classifier: bool = True
    aggregation: LoraAggregation = Field(
        "fedit", description="How the server combines LoRA factors (docs/lora.md): 'fedit' A and "
        "B averaged apart; 'ffa' A frozen at its seeded initialisation, only B trained and sent; "
        "'fedex' exact mean of B A, the residual folded into the frozen weight (sent densely); "
        "'flora' the weighted sum of the clients' B A merged into the base each round, clients "
        "restart from a fresh adapter; 'svd' (FlexLoRA) the mean of B A re-factorised by "
        "truncated SVD; 'fedsa' A shared, B kept on each client (personalised).")
    ranks: list[int] | None = Field(None, min_length=1, description="Ranks the budget planner may "
                                    "give a client (each <= r), chosen per client from its "
                                    "budget ([budgets]; method.tiers spells its tiers); unset: "
                                    "every client at r.")
    padding: Literal["holders", "zeros"] = Field(
        "holders", description="Clients of different ranks: each rank component is averaged over "
        "the clients that hold it ('holders', the default), or over every client with the "
        "components above its rank counted as zeros (HetLoRA's plain zero-padding).")
    personal_eval_clients: int = Field(8, ge=0, description="fedsa: clients (seeded sample of "
                                       "those that trained) whose personalised model is evaluated "
                                       "on test after training.")

    @property
    def scale(self) -> float:
        """alpha / r: the factor of B A in the effective weight W + (alpha / r) B A."""
        return self.alpha / self.r

    @field_validator("ranks")
    @classmethod
    def _ranks(cls, v):
        if v is not None:
            if any(r <= 0 for r in v):
                raise ValueError("ranks must be > 0")
            v = sorted(set(v))
        return v

    @model_validator(mode="after")
    def _ranks_below_r(self) -> "LoraConfig":
        if self.ranks is not None and max(self.ranks) > self.r:
            raise ValueError(f"lora.ranks {self.ranks} exceed lora.r={self.r}, the global "
                             "adapter's rank (the largest a client may hold)")
        return self
