"""The strategy of a planned run whose clients all train the one model: each payload
carries its client's plan (:func:`plan_config`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedslice.fl.orders import order_fields
from fedslice.fl.strategy import Payload, State, Strategy
from fedslice.methods.plan_records import ClientPlan


class PlannedStrategy(Strategy):
    """FedAvg whose clients train their plans: each payload's config carries the client's knobs
    (:meth:`Knobs.payload_config`), its tier and budget; its LoRA rank is the plan's
    (``client_rank``: the ``lora_ranks`` rule truncates payloads and pads replies)."""

    def __init__(self, fed, plans: Mapping[int, ClientPlan], client_sizes: Mapping[int, int] | None = None):
        super().__init__(fed, client_sizes)
        self.plans = dict(plans)

    def client_rank(self, client: int) -> int | None:
        p = self.plans.get(client)
        return None if p is None else p.knobs.rank

    def payload_for(self, server_round: int, state: State, client: int, config: dict) -> Payload:
        plan = self.plans.get(client)
        if plan is not None and plan.sits_out is not None:  # (never selected by the engines:
            # a caller that sends it anyway gets no work and no reply counted, as raffm's)
            return Payload(arrays={}, config={**config, **order_fields(client=client, sit_out=plan.sits_out)})
        p = super().payload_for(server_round, state, client, config)
        p.config.update(plan_config(plan))
        return p


def plan_config(plan: ClientPlan | None) -> dict[str, Any]:
    """What a payload's config carries of a client's plan (nothing without one)."""
    if plan is None:
        return {}
    return order_fields(
        **plan.knobs.payload_config(), tier=plan.tier, budget=plan.budget.describe(),
        **({"frozen_tensors": list(plan.frozen)} if plan.frozen else {}),
        **({"flops_budget": plan.flops_budget} if plan.flops_budget is not None else {}),
        **({"memory_budget": plan.memory_budget} if plan.memory_budget is not None else {}),
        **({"memory_reference": plan.memory_reference.to_config()}
           if plan.memory_budget is not None and plan.memory_reference is not None else {}))
