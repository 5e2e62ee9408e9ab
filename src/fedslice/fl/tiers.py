"""Clients placed in tiers by shares: the one placement ``[budgets]`` tiers and ``[devices]``
tiers share, so that a client's budget tier and device tier are the same draw."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def tier_of_clients(shares: Sequence[float], num_clients: int, seed: int) -> list[int]:
    """Each client's tier: tier i gets ``shares[i] * num_clients`` clients (largest remainders for
    the rounding), placed at random, reproducible from ``seed``."""
    rng = np.random.default_rng([seed, 0x7A11])
    exact = [x * num_clients for x in shares]
    counts = [math.floor(x) for x in exact]
    for i in sorted(range(len(shares)), key=lambda i: counts[i] - exact[i])[: num_clients - sum(counts)]:
        counts[i] += 1
    labels = np.repeat(np.arange(len(shares)), counts)
    rng.shuffle(labels)
    return labels.tolist()
