"""The simulated clock: how long client-rounds and rounds take, what a round policy keeps, and
the staleness weight of asynchronous aggregation. Pure functions over numbers, so the
in-process engine, the planner (a plan's predicted seconds) and the benchmarks share them.

=============  ===============================================================================
policy         a synchronous round started at ``t0`` with its clients' replies arriving at
               ``t0 + seconds[c]``
=============  ===============================================================================
``all``        waits for every reply: the round takes ``max(seconds)``
``deadline``   keeps the first ``needed`` replies that arrive by ``deadline_s``; the round ends
               at the ``needed``-th of them, at the last reply, or at the deadline, whichever
               is first; the others are dropped and their work is wasted
``async``      FedBuff (Nguyen et al., AISTATS 2022): no rounds; the engine keeps
               ``concurrency`` clients training and aggregates every ``buffer_size`` replies,
               a reply ``s`` model versions old weighted by :func:`staleness_weight`
=============  ===============================================================================
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedslice.fl.devices import Device

POLICIES = ("all", "deadline", "async")


def staleness_weight(staleness: int, exponent: float = 0.5) -> float:
    """The polynomial staleness weight s(τ) = (1 + τ)^-a (FedAsync's, Xie et al. 2019), a =
    ``exponent``: FedBuff's 1/sqrt(1 + τ) by default, 0 weights every reply alike. A
    reply trained from a model ``staleness`` versions older than the one it is aggregated into
    scales its update by this (1 when fresh)."""
    if staleness < 0:
        raise ValueError(f"staleness {staleness} is negative")
    if exponent < 0:
        raise ValueError(f"staleness exponent {exponent} is negative")
    if exponent == 0.5:  # the default, exactly as 1 / sqrt
        return 1.0 / math.sqrt(1.0 + staleness)
    return (1.0 + staleness) ** -exponent


def client_seconds(device: Device, metrics: Mapping[str, Any],
                   host_gflops_per_s: float | None = None) -> float:
    """One client-round on ``device`` from its reply's measured costs: bytes_down / download +
    (flops_measured + flops_importance) / speed + bytes_up / upload (``flops_importance``: a
    forward pass the client ran before training, the head stage's importance pass)."""
    flops = float(metrics.get("flops_measured") or 0.0) + float(metrics.get("flops_importance") or 0.0)
    return device.seconds(flops,
                          float(metrics.get("bytes_down") or 0.0),
                          float(metrics.get("bytes_up") or 0.0), host_gflops_per_s)


@dataclass
class Settled:
    """What a synchronous round keeps: ``used`` (client order), ``dropped`` (client -> why) and
    the round's length in simulated seconds."""

    used: list[int]
    dropped: dict[int, str] = field(default_factory=dict)
    seconds: float = 0.0


def settle_round(policy: str, seconds: Mapping[int, float], *, deadline_s: float | None = None,
                 needed: int | None = None, offline_at: Mapping[int, float] | None = None) -> Settled:
    """The replies a round under ``policy`` keeps, from each client's reply time (``seconds``,
    from the round's start); ``offline_at``: when a client goes offline (its reply is lost if
    that comes first). Ties arrive in client order."""
    offline_at = offline_at or {}
    dropped: dict[int, str] = {}
    arrivals = []
    for c, s in sorted(seconds.items(), key=lambda cs: (cs[1], cs[0])):
        if offline_at.get(c, math.inf) < s:
            dropped[c] = (f"went offline at {offline_at[c]:.3g} s, before its reply at {s:.3g} s "
                          "(simulated clock)")
        else:
            arrivals.append((s, c))
    if policy == "all":
        last = max([s for s, _ in arrivals] + [min(offline_at.get(c, 0.0), seconds[c]) for c in dropped],
                   default=0.0)
        return Settled(sorted(c for _, c in arrivals), dropped, last)
    if policy != "deadline":
        raise ValueError(f"settle_round: policy {policy!r} is not a synchronous one (all, deadline)")
    if deadline_s is None:
        raise ValueError("the deadline policy needs deadline_s")
    needed = len(seconds) if needed is None else needed
    used, end = [], None
    for s, c in arrivals:
        if s > deadline_s:
            dropped[c] = f"reply at {s:.3g} s, past the {deadline_s:g} s round deadline"
        elif len(used) >= needed:
            dropped[c] = (f"reply at {s:.3g} s, after the {needed} replies the round needed "
                          "(over-selected)")
        else:
            used.append(c)
            if len(used) == needed:
                end = s
    if end is None:  # fewer than needed by the deadline: it waited for the last, up to the deadline
        pending = [s for s, _ in arrivals] + [offline_at[c] for c in dropped if c in offline_at]
        end = min(deadline_s, max(pending, default=0.0))
    return Settled(sorted(used), dropped, end)


def measure_host_gflops(seconds: float = 0.2, n: int = 512) -> float:
    """This host's fp32 matmul GFLOP/s, measured once (what ``speed`` factors multiply): the
    best of repeated ``n x n`` products for about ``seconds``."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    best, t_end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        a @ b
        dt = time.perf_counter() - t0
        if dt > 0:
            best = max(best, 2 * n ** 3 / dt / 1e9)
    return best


@dataclass
class SimClock:
    """The run's simulated time (seconds since its start) and the host's GFLOP/s that speed
    factors multiply (measured once, kept on resume)."""

    now: float = 0.0
    host_gflops_per_s: float | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"now": self.now, "host_gflops_per_s": self.host_gflops_per_s}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.now = float(state["now"])
        h = state.get("host_gflops_per_s")
        self.host_gflops_per_s = None if h is None else float(h)
