"""Options of ``fedot`` (the ``[method]`` table with ``name = "fedot"``). See :mod:`fedslice.methods.fedot`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedslice.config import DistillConfig, MethodOptions


class FedOTMethod(MethodOptions):
    """FedOT: Offsite-Tuning (Xiao et al. 2023) with FedAvg. Bottom/top layers are the trainable
    adapter; the middle layers are replaced by a uniform layer-drop emulator (frozen)."""

    name: Literal["fedot"] = "fedot"
    bottom_layers: int | None = Field(None, ge=0, description="Adapter layers at the bottom "
                                      "(default max(1, round(L/6)): 2 of 12, as in the paper).")
    top_layers: int | None = Field(None, ge=0, description="Adapter layers at the top (same default).")
    emulator_layers: int | None = Field(None, gt=0, description="Middle layers kept by uniform "
                                        "layer drop (default max(1, round(3/8 * middle)): 8 -> 3).")
    adapter_tuning: Literal["lora", "full"] = Field("lora", description="LoRA ([lora], on the "
                                                    "adapter layers only) or full fine-tuning.")
    lora_r: int | None = Field(None, gt=0, description="LoRA rank on the adapter (default "
                               "lora.r; lora.alpha is scaled with it, so alpha/r is unchanged); "
                               "raise it to match the trainable parameters of LoRA on every layer.")
    distill_emulator: bool = Field(False, description="Distil the emulator to the middle layers "
                                   "before FL (settings in `distill`; mu is not used).")
    distill: DistillConfig = Field(default_factory=DistillConfig)
