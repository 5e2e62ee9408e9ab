"""The server side of ``fedpetuning``: its strategy (payloads, weighting, server state). See
:mod:`fedslice.methods.fedpetuning`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fedslice.config import FederationConfig
from fedslice.fl.strategy import Payload, State, Strategy
from fedslice.peft.tuners.lora.aggregate import rank_axis, truncate_rank
from fedslice.slicing.planner import Budget, SpecCost


@dataclass(frozen=True)
class RankPlan:
    """A client's device tier, budget, LoRA rank and the measured cost of a step at that rank."""

    tier: int
    budget: Budget
    rank: int
    cost: SpecCost


class RankedStrategy(Strategy):
    """FedAvg whose clients train LoRA at their tier's rank (``client_rank``; the payloads are
    truncated and the replies padded by the ``lora_ranks`` rule around it)."""

    def __init__(self, fed: FederationConfig, plans: Mapping[int, RankPlan],
                 client_sizes: Mapping[int, int] | None = None):
        super().__init__(fed, client_sizes)
        self.plans = dict(plans)

    def client_rank(self, client: int) -> int | None:
        return self.plans[client].rank

    def payload_for(self, server_round: int, state: State, client: int, config: dict) -> Payload:
        p = super().payload_for(server_round, state, client, config)
        cp = self.plans[client]
        p.config.update(tier=cp.tier, budget=cp.budget.describe())
        return p


def at_rank(state: State, rank: int | None) -> State:
    """``state`` with its LoRA factors truncated to ``rank`` (None: as it is)."""
    if rank is None:
        return state
    return {k: truncate_rank(t, rank_axis(k), rank) if rank_axis(k) is not None and t.dim() == 2
            else t for k, t in state.items()}
