"""How a round's clients are trained: one after another in this process, by forked worker
processes (CPU, :mod:`fedslice.fl.workers`; the clients with the most tokens to train handed
out first: :func:`longest_first`), or together in one batched pass over the shared
backbone (:mod:`fedslice.fl.batched`, chosen by the method for clients that train the same
shapes). The engine calls :meth:`ClientRunner.fit`; the result is the same replies whichever
path trains them (the batched pass and the workers are tested against the sequential path).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from fedslice import progress
from fedslice.compute import CPU, Compute
from fedslice.data.batching import TokenizedSplit
from fedslice.methods import Method
from fedslice.fl.client import planned_tokens
from fedslice.fl.strategy import Payload, Reply
from fedslice.fl.workers import WorkerLost, run_forked


log = logging.getLogger(__name__)

#: ``on_reply(client, reply_or_lost)``, called in the main process as each client finishes
OnReply = Callable[[int, "Reply | WorkerLost"], None]


class ClientRunner:
    """Trains the clients of a round with the method's ``fit`` (or ``fit_batched``)."""

    def __init__(self, compute: Compute = CPU):
        self.compute = compute

    def mode(self, method: Method, n: int) -> str:
        """'batched', 'workers' or 'sequential' for a round of ``n`` clients of ``method``."""
        if self.compute.batched and method.batched_clients and method.adapter.batched_clients and n > 1:
            return "batched"
        if self.compute.workers > 1 and method.parallel_clients and n > 1 \
                and self.compute.device.type == "cpu":
            return "workers"
        return "sequential"

    def fit(self, method: Method, clients: list[int], payloads: dict[int, Payload],
            data: Callable[[int], TokenizedSplit], seeds: dict[int, int], on_reply: OnReply) -> str:
        """Train ``clients``; ``on_reply`` receives each reply (or :class:`WorkerLost`) as it
        arrives. Returns the mode used."""
        mode = self.mode(method, len(clients))
        if mode == "batched":
            jobs = [(c, payloads[c], data(c), seeds[c]) for c in clients]
            method.fit_batched(jobs, self.compute, on_reply)
        elif mode == "workers":
            method.prepare_clients(payloads)
            run_forked(lambda c: method.train_client(payloads[c], data(c), seeds[c]),
                       longest_first(clients, payloads, data, seeds), self.compute.workers,
                       on_result=on_reply, on_start=progress.silence)
        else:
            for c in clients:
                on_reply(c, method.train_client(payloads[c], data(c), seeds[c]))
        return mode


def longest_first(clients: list[int], payloads: dict[int, Payload],
                  data: Callable[[int], TokenizedSplit], seeds: dict[int, int]) -> list[int]:
    """``clients`` in the order forked workers take them: the most tokens to train first
    (:func:`fedslice.fl.client.planned_tokens`; ties in selection order), so a round does not
    end on one worker's long last client while the others wait (longest-processing-time-first).
    Which worker trains a client, and when, changes nothing in its reply."""
    tokens = {c: planned_tokens(data(c), payloads[c].orders, seeds[c]) for c in clients}
    return sorted(clients, key=lambda c: -tokens[c])
