"""Client selection: which clients train in a round. Usable by every method.

A selector has two calls: ``select(round, candidates)`` and ``observe(round, client_losses,
global_loss)`` after the round, so feedback-driven selectors (loss gap) fit the same loop.
"""

from __future__ import annotations

import math
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
        """Uniform selection ignores feedback."""

    def state_dict(self) -> dict:
        """What a checkpoint keeps (the RNG state) so a resumed run draws the same clients."""
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]

    def unknown(self, candidates: Sequence[int]) -> list[int]:
        """Candidates whose loss the selector needs and lacks (none: it uses no losses)."""
        return []

    def observe_probe(self, losses: dict[int, float]) -> None:
        """Losses of the global model on clients' data, asked for before their first selection."""


class LossGapSelector(UniformSelector):
    """Eq. 9 of the heads paper: the K clients with the largest (last local loss - global loss).

    Cold start (``federation.cold_start``): a client whose loss is unknown has loss +inf, so
    every client is tried before any is picked twice ('unseen_first': with N clients and K per
    round the first N/K rounds are uniform sampling without replacement); ties are broken by the
    seeded RNG. With 'probe' the engine first asks the clients of :meth:`unknown` for the global
    model's loss on a few of their examples (:meth:`observe_probe`), so Eq. 9 ranks from round 1.
    The global loss is the latest one observed (the server's evaluation loss, else the mean of
    the clients' reported losses).
    """

    def __init__(self, k: int, seed: int):
        super().__init__(k, seed)
        self.last_loss: dict[int, float] = {}
        self.global_loss = 0.0

    def gap(self, client: int) -> float:
        return self.last_loss.get(client, math.inf) - self.global_loss

    def select(self, server_round: int, candidates: Sequence[int]) -> list[int]:
        shuffled = [int(c) for c in self.rng.permutation(np.asarray(candidates))]
        ranked = sorted(shuffled, key=self.gap, reverse=True)  # stable: RNG order breaks ties
        return sorted(ranked[: min(self.k, len(ranked))])

    def unknown(self, candidates: Sequence[int]) -> list[int]:
        return [int(c) for c in candidates if int(c) not in self.last_loss]

    def observe_probe(self, losses: dict[int, float]) -> None:
        self.last_loss.update({c: v for c, v in losses.items() if math.isfinite(v)})
        if losses and not self.global_loss:
            vals = [v for v in losses.values() if math.isfinite(v)]
            self.global_loss = float(np.mean(vals)) if vals else 0.0

    def observe(self, server_round: int, client_losses: dict[int, float], global_loss: float | None) -> None:
        finite = {c: v for c, v in client_losses.items() if math.isfinite(v)}
        self.last_loss.update(finite)
        if global_loss is not None and math.isfinite(global_loss):
            self.global_loss = global_loss
        elif finite:
            self.global_loss = float(np.mean(list(finite.values())))

    def state_dict(self) -> dict:
        return {**super().state_dict(), "last_loss": {str(c): v for c, v in self.last_loss.items()},
                "global_loss": self.global_loss}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.last_loss = {int(c): float(v) for c, v in state["last_loss"].items()}
        self.global_loss = float(state["global_loss"])


SELECTORS = {"uniform": UniformSelector, "random": UniformSelector, "loss_gap": LossGapSelector}


def make_selector(name: str, k: int, seed: int) -> UniformSelector:
    if name not in SELECTORS:
        raise ValueError(f"unknown selection {name!r}: choose one of {', '.join(SELECTORS)}")
    return SELECTORS[name](k, seed)
