"""The planner's prediction of each client-round on the simulated clock, and the clients a
deadline round does not send work it cannot finish.

A plan's ``seconds`` is a mean round's; a round's batches vary in length (on SST-2 a round's
padded tokens run 0.4-1.9x its plan's mean), and a client knows its coming round before it
trains: its orders (the plan's examples per step, local steps and FLOPs budget), the seed the
server sends and its examples' lengths give its batches. The client reports their shapes (each
step's rows, padded length and head positions; in the in-process engine read from its split),
and the plan's measured FLOP rates (:class:`fedslice.methods.plan_records.RoundCost`) turn them
into the round's FLOPs, cut where the client's own guard cuts them, and its seconds on the
client's device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fedslice.fl.client import planned_steps
from fedslice.fl.strategy import Payload


@dataclass(frozen=True)
class RoundPrediction:
    """A client-round as predicted before it is sent: its seconds on the client's device, and
    those of a reply after its first step alone (what the client's guard cannot cut)."""

    seconds: float
    first_step_seconds: float


def predict_round(method, plan, payload: Payload, data, seed: int, device,
                  host_gflops_per_s: float | None) -> RoundPrediction | None:
    """``plan``'s client-round with ``payload`` on ``device``, from its own batches
    (:func:`fedslice.fl.client.planned_steps`); None where the plan has no round cost."""
    cost = getattr(plan, "round_cost", None)
    if cost is None or plan.sits_out is not None:
        return None
    orders = method.orders(payload)
    steps = planned_steps(data, orders, seed, pack=method.packs(orders),
                          virtual_tokens=method.adapter.virtual_tokens)
    seconds, first = cost.seconds(device, steps, orders.flops_budget, host_gflops_per_s)
    return RoundPrediction(seconds, first)


def past_deadline(predicted: Mapping[int, RoundPrediction], deadline_s: float) -> dict[int, str]:
    """The clients whose reply is predicted past ``deadline_s``: sent, they would train work the
    round drops. Under a FLOPs budget (``budgets.enforce_flops``) the client's guard stops
    before every later step that would pass its time limit, so these are the clients whose
    first step alone passes it. Each with why, for the round's ``excluded``."""
    return {c: (f"its reply is predicted at {p.seconds:.4g} s (after its first local step alone: "
                f"{p.first_step_seconds:.4g} s), past the {deadline_s:g} s round deadline "
                "(simulated clock): sat the round out, sent no work")
            for c, p in sorted(predicted.items()) if p.seconds > deadline_s * (1 + 1e-9)}
