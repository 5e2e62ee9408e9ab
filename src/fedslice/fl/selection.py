"""Client selection: which clients train in a round. Usable by every method."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class UniformSelector:
    """K clients uniformly at random without replacement, from a seeded RNG."""

    def __init__(self, k: int, seed: int):
        self.k = k
        self.rng = np.random.default_rng(seed)

    def select(self, server_round: int, candidates: Sequence[int]) -> list[int]:
        k = min(self.k, len(candidates))
        return sorted(int(c) for c in self.rng.choice(np.asarray(candidates), size=k, replace=False))

    def observe(self, server_round: int, client_losses: dict[int, float], global_loss: float | None) -> None:
        """Uniform selection ignores feedback (the hook exists for loss-based selectors)."""


def make_selector(name: str, k: int, seed: int) -> UniformSelector:
    if name == "uniform":
        return UniformSelector(k, seed)
    raise ValueError(f"unknown selection {name!r}")
