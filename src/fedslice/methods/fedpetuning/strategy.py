"""A ``fedpetuning`` client's LoRA tensors at its rank (its strategy is the planner's
:class:`~fedslice.methods.plan_strategy.PlannedStrategy`, or FedAvg). See :mod:`fedslice.methods.fedpetuning`.
"""

from __future__ import annotations

from fedslice.fl.strategy import State
from fedslice.peft.tuners.lora.aggregate import rank_axis, truncate_rank


def at_rank(state: State, rank: int | None) -> State:
    """``state`` with its LoRA factors truncated to ``rank`` (None: as it is)."""
    if rank is None:
        return state
    return {k: truncate_rank(t, rank_axis(k), rank) if rank_axis(k) is not None and t.dim() == 2
            else t for k, t in state.items()}
