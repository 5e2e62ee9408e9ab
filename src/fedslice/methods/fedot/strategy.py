"""The server side of ``fedot``: its strategy (payloads, weighting, server state). See
:mod:`fedslice.methods.fedot`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fedslice.fl.orders import order_fields
from fedslice.fl.strategy import Payload, Reply, State, Strategy
from fedslice.methods.fedot.layout import FROZEN_PREFIX
from fedslice.models.arch import ArchSpec
from fedslice.slicing.aggregate import client_delta
from fedslice.slicing.spec import ModelSlice, SliceSpec
from fedslice.slicing.state import extract_state, scatter


class SubModelStrategy(Strategy):
    """Each client gets its sub-model's slice of the global state; slices are scattered back to
    full-model names and averaged where held (a depth spec holds whole tensors).

    ``frozen`` (sub-model names) are tensors the server made that a client cannot rebuild from the
    checkpoint (the distilled emulator), ``base`` the sub-model's other frozen tensors: a client
    holds no copy of the model, so both go to a client at its first participation (``frozen`` as
    ``emulator.<name>``, ``base`` as the payload's ``model``), and again after a round it did not
    reply to (it may have lost them)."""

    def __init__(self, fed, spec: SliceSpec | ModelSlice, arch: ArchSpec, shapes: dict[str, torch.Size],
                 frozen: State | None = None, base: State | None = None,
                 client_sizes: Mapping[int, int] | None = None):
        super().__init__(fed, client_sizes)
        self.spec, self.arch, self.shapes = spec, arch, shapes
        self.frozen, self.base = dict(frozen or {}), dict(base or {})
        self.holders: set[int] = set()  # clients that were sent ``frozen`` and ``base``

    def payload_for(self, server_round: int, state: State, client: int, config: dict) -> Payload:
        arrays, model = extract_state(state, self.spec, self.arch), {}
        if (self.frozen or self.base) and client not in self.holders:
            arrays.update({FROZEN_PREFIX + k: t for k, t in self.frozen.items()})
            model = self.base
            self.holders.add(client)
        return Payload(arrays=arrays, config={**config, **order_fields(client=client)}, model=model)

    def forget(self, client: int) -> None:
        self.holders.discard(client)

    def expected_update(self, state: State, payload: Payload, reply: Reply) -> State:
        return {k: t for k, t in payload.arrays.items() if not k.startswith(FROZEN_PREFIX)}

    def client_view(self, payload: Payload, shapes) -> tuple[State, dict]:
        """The sub-model's trainable tensors at their places in the full model, held there."""
        arrays = self.expected_update({}, payload, Reply({}, 0))
        return scatter(arrays, self.spec, self.arch, {**self.shapes, **shapes})

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "holders": sorted(self.holders)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.holders = {int(c) for c in state["holders"]}

    def client_updates(self, server_round: int, state: State, payloads: dict[int, Payload],
                       replies: dict[int, Reply]) -> tuple[list[State], list]:
        deltas, weights = [], []
        for c in sorted(replies):
            full, masks = scatter(replies[c].arrays, self.spec, self.arch, self.shapes)
            deltas.append(client_delta(state, full))
            weights.append({k: replies[c].num_examples * m for k, m in masks.items()})
        return deltas, weights
