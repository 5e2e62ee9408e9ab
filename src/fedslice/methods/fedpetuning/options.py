"""Options of ``fedpetuning`` (the ``[method]`` table with ``name = "fedpetuning"``). See :mod:`fedslice.methods.fedpetuning`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from fedslice.config import DeviceTier, MethodOptions, check_tier_shares


class FedPETuningMethod(MethodOptions):
    """LoRA on the full model, FedAvg of the LoRA weights and the classifier."""

    name: Literal["fedpetuning"] = "fedpetuning"
    tiers: list[DeviceTier] | None = Field(
        None, description="Device tiers (share and FLOPs or memory budget, as raffm's): each "
        "client trains LoRA at the largest of lora.ranks whose measured training step fits its "
        "tier's budget. Unset: every client at lora.r.")

    @field_validator("tiers")
    @classmethod
    def _shares(cls, v):
        return check_tier_shares(v)
