"""The ``[peft]`` section: which adapter trains.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from fedslice.registry import ADAPTERS
from fedslice.config.base import Section


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
