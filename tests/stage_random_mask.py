"""A new stage written against the stage contract (docs/design.md, "The stage contract"): each
client trains and sends a seeded random share of the trainable tensors, a baseline for the head
stage's importance-chosen heads. It overrides one hook (``make_strategy``, around the stage
below's) and states two facts as attributes; freezing, training, sending only what trained and averaging each tensor over
the clients that sent it are the library's (a plan's ``frozen_tensors``, FedAvg over holders)."""

from __future__ import annotations

import random

from fedslice.fl.orders import order_fields
from fedslice.fl.strategy import Payload, Wrapper
from fedslice.methods.stage import Stage


class RandomMasks(Wrapper):
    """Around the stage below's strategy: each payload freezes the trainable tensors its client
    does not draw (``frozen_tensors``, as a plan's adapter depth does)."""

    def __init__(self, inner, trainable: list[str], share: float, seed: int):
        super().__init__(inner)
        self.trainable, self.share, self.seed = trainable, share, seed

    def kept(self, server_round: int, client: int) -> set[str]:
        """The tensors ``client`` trains in ``server_round``: a seeded draw of ``share`` of them."""
        rng = random.Random(f"{self.seed}/{server_round}/{client}")
        return set(rng.sample(self.trainable, max(1, round(self.share * len(self.trainable)))))

    def payload_for(self, server_round, state, client, config) -> Payload:
        p = self.inner.payload_for(server_round, state, client, config)
        kept = self.kept(server_round, client)
        frozen = set(p.orders.frozen_tensors) | {n for n in self.trainable if n not in kept}
        return Payload(p.arrays, {**p.config, **order_fields(frozen_tensors=sorted(frozen))}, p.model)


class RandomMaskStage(Stage):
    """The stage, over any method whose clients train the shared model's tensors by name."""

    sends_slices = True  # an element is held by some clients only: whole-vector rules refuse it
    batched_clients = False  # each client trains its own tensors
    keep_share = 0.5

    def make_strategy(self):
        trainable = [n for n, p in self.model.named_parameters() if p.requires_grad]
        return RandomMasks(self.below.make_strategy(), trainable, self.keep_share, self.cfg.seed)
