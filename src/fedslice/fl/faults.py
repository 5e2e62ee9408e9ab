"""Faults injected into the in-process simulation (``[faults]`` of the config).

Which client of a round gets which fault is drawn from ``(seed, round)`` alone, so a run with
faults is reproducible and resumes bit-identically (no RNG state to checkpoint):

- ``dropout``: the client never replies (it is not trained; nothing of it is counted);
- ``stragglers``: its reply arrives ``straggler_delay_s`` late; past ``deadline_s`` it is
  discarded (it was trained: its costs are recorded as unused);
- ``nan`` / ``overreport``: its update is NaN / its ``num_examples`` is multiplied (validation
  rejects both: :mod:`fedslice.fl.validation`);
- ``attack``: ``round(attackers * k)`` of the ``k`` clients send ``global - scale * update``
  (sign flip) or ``global + N(0, scale^2)`` (Gaussian) for every tensor of their slice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from fedslice.config import FaultsConfig
from fedslice.fl.strategy import Reply, State

_TAG = 0xFA017


@dataclass
class RoundFaults:
    dropped: set[int] = field(default_factory=set)
    late: dict[int, float] = field(default_factory=dict)  # client -> simulated delay (s)
    nan: set[int] = field(default_factory=set)
    overreport: set[int] = field(default_factory=set)
    attackers: set[int] = field(default_factory=set)

    def kind(self, client: int) -> str | None:
        for name in ("nan", "overreport", "attackers"):
            if client in getattr(self, name):
                return name
        return None


def _rng(seed: int, server_round: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, server_round, _TAG, *keys]))


def plan_faults(f: FaultsConfig, seed: int, server_round: int, clients: list[int]) -> RoundFaults:
    """The faults of one round's ``clients`` (pure: the same inputs give the same faults)."""
    out = RoundFaults()
    rng = _rng(seed, server_round)
    u = {name: rng.random(len(clients)) for name in ("dropout", "stragglers", "nan", "overreport")}
    for i, c in enumerate(clients):
        if u["dropout"][i] < f.dropout:
            out.dropped.add(c)
            continue
        if u["stragglers"][i] < f.stragglers:
            out.late[c] = f.straggler_delay_s
        if u["nan"][i] < f.nan:
            out.nan.add(c)
        elif u["overreport"][i] < f.overreport:
            out.overreport.add(c)
    honest = [c for c in clients if c not in out.dropped and c not in out.nan and c not in out.overreport]
    n = min(len(honest), int(round(f.attackers * len(clients))))
    if f.attack != "none" and n:
        out.attackers = {int(c) for c in rng.choice(np.asarray(honest), size=n, replace=False)}
    return out


def missed_deadline(f: FaultsConfig, faults: RoundFaults) -> dict[int, float]:
    """Stragglers whose reply arrives after the deadline (none without a deadline)."""
    if f.deadline_s is None:
        return {}
    return {c: d for c, d in faults.late.items() if d > f.deadline_s}


def corrupt(f: FaultsConfig, kind: str, reply: Reply, sent: State, seed: int, server_round: int,
            client: int) -> Reply:
    """The reply a faulty client sends instead of ``reply``; ``sent`` are the tensors of its
    slice as it received them (``Strategy.expected_update``)."""
    if kind == "overreport":
        return Reply(reply.arrays, int(round(reply.num_examples * f.overreport_factor)), reply.metrics)
    gen = torch.Generator().manual_seed(int(_rng(seed, server_round, client).integers(2**62)))
    arrays = dict(reply.arrays)
    for k, t in reply.arrays.items():
        if k not in sent or not t.is_floating_point():
            continue
        g = sent[k].to(t.dtype)
        if kind == "nan":
            arrays[k] = torch.full_like(t, float("nan"))
        elif f.attack == "sign_flip":
            arrays[k] = g - f.attack_scale * (t - g)
        else:
            arrays[k] = g + f.attack_scale * torch.randn(t.shape, generator=gen, dtype=t.dtype)
    return Reply(arrays, reply.num_examples, {**reply.metrics, "attacker": 1} if kind == "attackers"
                 else reply.metrics)
