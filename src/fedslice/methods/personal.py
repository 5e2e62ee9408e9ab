"""Tensors each client keeps for itself and never sends: the LoRA rule's
``Strategy.personal_tensors`` (FedSA-LoRA's B). The library honours them for every method, in a
client's training (one client or a batched pass), its costs and what a client or the server keeps
between rounds, so no method re-implements them.

A client trains its own copy (what it kept, else their initial values, at its LoRA rank) beside the
global tensors of its payload; its reply leaves them out, and they are kept here by client (the
simulation holds every client's; a Flower node restores its own from ``Context.state``). A client
whose loss diverged keeps what it had.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from fedslice.fl.strategy import Payload, Reply, State
from fedslice.peft.tuners.lora.aggregate import at_rank


class PersonalTensors(Mapping[int, State]):
    """client -> the tensors it keeps (``names``), their initial values ``init`` where it kept
    none yet."""

    def __init__(self, names: Iterable[str], init: State):
        self.names = frozenset(names)
        self.init = {k: t.detach().cpu().clone() for k, t in init.items() if k in self.names}
        self._by_client: dict[int, State] = {}
        self._received: State | None = None  # what a Flower node kept (restore)
        self._last: int | None = None

    def __getitem__(self, client: int) -> State:
        return self._by_client[client]

    def __iter__(self) -> Iterator[int]:
        return iter(self._by_client)

    def __len__(self) -> int:
        return len(self._by_client)

    def with_kept(self, payload: Payload) -> Payload:
        """``payload`` with its client's own tensors added (at the client's rank)."""
        if not self.names:
            return payload
        kept = self._received if self._received is not None else self._by_client.get(payload.orders.client)
        self._received = None
        mine = {k: t.clone() for k, t in at_rank(kept or self.init, payload.orders.lora_rank).items()}
        return Payload({**payload.arrays, **mine}, payload.config, payload.model)

    def keep(self, client: int, reply: Reply) -> Reply:
        """``reply`` without the client's own tensors, which it keeps (unless its loss diverged)."""
        if not any(k in reply.arrays for k in self.names):
            return reply
        loss = reply.metrics.get("loss")
        if not (isinstance(loss, float) and not math.isfinite(loss)):
            self._by_client[client] = {k: reply.arrays[k].detach().cpu().clone()
                                       for k in self.names if k in reply.arrays}
            self._last = client
        return Reply(self.strip(reply.arrays), reply.num_examples, reply.metrics)

    def strip(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """``tensors`` without the kept ones (neither received nor sent: not counted)."""
        return {k: t for k, t in tensors.items() if k not in self.names}

    def state(self, side: str) -> dict[str, Any]:
        """The server's: every client's kept tensors (the simulation holds them). A client's:
        its own, after it trained."""
        if side == "server":
            return {"personal": {str(c): dict(t) for c, t in self._by_client.items()}} if self._by_client else {}
        if not self.names or self._last is None:
            return {}
        return dict(self._by_client.get(self._last, {}))

    def restore(self, side: str, state: dict[str, Any]) -> None:
        if side == "server":
            self._by_client = {int(c): dict(t) for c, t in (state.get("personal") or {}).items()}
        else:
            self._received = dict(state)
