"""Options of ``fedpetuning`` (the ``[method]`` table with ``name = "fedpetuning"``). See :mod:`fedslice.methods.fedpetuning`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from fedslice.config import DeviceTier, MethodOptions, check_tier_shares


class FedPETuningMethod(MethodOptions):
    """LoRA on the full model, FedAvg of the LoRA weights and the classifier."""

    name: Literal["fedpetuning"] = "fedpetuning"
    tiers: list[DeviceTier] | None = Field(
        None, description="An older spelling of [budgets] tiers (read as budgets.tiers with "
        "flops -> flops_share, memory_mb kept; said in the log): each client trains LoRA at the "
        "largest of lora.ranks whose predicted training fits its tier's budget. Unset: every "
        "client at lora.r.")

    @field_validator("tiers")
    @classmethod
    def _shares(cls, v):
        return check_tier_shares(v)

    spelling_fields: ClassVar[tuple[str, ...]] = ("tiers",)

    def spelled_budgets(self, budgets_given: bool) -> dict[str, Any] | None:
        """``method.tiers`` as the ``[budgets]`` table it means (the rank is the one axis)."""
        if self.tiers is None:
            return None
        return {"tiers": [{"share": t.share, "name": t.name,
                           **({"flops_share": t.flops} if t.flops is not None else {"memory_mb": t.memory_mb})}
                          for t in self.tiers], "field": "method.tiers",
                "local_work": [1.0], "micro_batches": [1], "checkpointing": False}
