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
from dataclasses import dataclass, replace

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


def fit_round(method, plan, payload: Payload, data, seed: int, device,
              host_gflops_per_s: float | None, limit_s: float | None
              ) -> tuple[Payload, RoundPrediction | None] | None:
    """``budgets.fit_rounds``: a client-round the client's FLOPs guard would cut (a local step
    dropped: its batches are longer than its plan's mean round), that would reply past
    ``limit_s`` after its first step alone, or whose first step alone passes its FLOPs budget
    (the guard cannot cut a round's first step: a one-step round would overshoot), sent with
    fewer examples per step instead: the number whose round, predicted from its own batches,
    trains the most examples within its limits, when that is more than the round as planned
    trains (0 where it would pass them). ``limit_s`` None (no time limit; ``device`` unused):
    the plan's FLOPs budget alone. Returns the payload with that ``batch_size`` and its
    prediction on ``device`` (None without a time limit); None: the round is sent as planned."""
    cost = getattr(plan, "round_cost", None)
    if cost is None or plan.sits_out is not None:
        return None
    orders = method.orders(payload)
    if limit_s is None and orders.flops_budget is None:
        return None

    def trial(batch: int) -> tuple[int, RoundPrediction | None, bool]:
        o = replace(orders, batch_size=batch)
        steps = planned_steps(data, o, seed, pack=method.packs(o),
                              virtual_tokens=method.adapter.virtual_tokens)
        flops, run = cost.flops(steps, o.flops_budget)
        within = o.flops_budget is None or flops <= o.flops_budget * (1 + 1e-9)
        pred = None
        if limit_s is not None:
            seconds, first = cost.seconds(device, steps, o.flops_budget, host_gflops_per_s)
            within = within and seconds <= limit_s * (1 + 1e-9)
            pred = RoundPrediction(seconds, first)
        # (examples it trains within its limits, its prediction, every step runs within them)
        return (batch * run if within else 0), pred, run == len(steps) and within

    batch = orders.batch_size
    kept, _, whole = trial(batch)
    if whole:
        return None
    best = None
    for b in range(batch - 1, 0, -1):
        examples, pred, whole = trial(b)
        if examples > (kept if best is None else best[0]):
            best = (examples, b, pred)
        if whole:  # every smaller batch runs every step too: fewer examples
            break
    if best is None:
        return None
    _, b, pred = best
    return Payload(payload.arrays, {**payload.config, "batch_size": b}, payload.model), pred
