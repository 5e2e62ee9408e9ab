"""Clients of the same shapes trained together in one batched pass (``compute.batched_clients``):
the grouping by :meth:`~fedslice.methods.base.Method.batch_key` and the pass
(:func:`fedslice.fl.batched.train_batched`), each reply's metrics as the method reports them.
"""

from __future__ import annotations

from fedslice.compute import Compute
from fedslice.data.batching import TokenizedSplit
from fedslice.fl.batched import can_stack, train_batched
from fedslice.fl.strategy import Payload, Reply


def fit_batched(method, jobs: list[tuple[int, Payload, TokenizedSplit, int]], compute: Compute,
                on_reply) -> None:
    """Train ``jobs`` (client, payload, data, seed) and call ``on_reply(client, reply)`` for
    each. Clients with the same :meth:`~fedslice.methods.base.Method.batch_key` go through
    :func:`fedslice.fl.batched.train_batched` together (at most ``compute.max_batched`` at a
    time); the others, and groups whose tensors cannot stack, train one after another
    (:meth:`~fedslice.methods.base.Method.train_client`). A batched client trains the tensors it
    keeps for itself (:attr:`~fedslice.methods.base.Method.personal`) beside its payload's, as
    :meth:`~fedslice.methods.base.Method.fit` does."""
    groups: dict = {}
    for job in jobs:
        key = method.batch_key(job[1])
        groups.setdefault(("alone", job[0]) if key is None else ("key", key), []).append(job)
    size = compute.max_batched or len(jobs)
    for group in groups.values():
        if len(group) == 1:
            c, payload, data, seed = group[0]
            on_reply(c, method.train_client(payload, data, seed))
            continue
        kept = [(c, method.personal.with_kept(p), d, s) for c, p, d, s in group]
        model, params = method.client_model(kept[0][1])
        names = [n for n in params if n in kept[0][1].arrays]
        if not can_stack(model, names, method.adapter):
            for c, payload, data, seed in group:
                on_reply(c, method.train_client(payload, data, seed))
            continue
        for lo in range(0, len(kept), size):
            chunk = kept[lo:lo + size]
            results = train_batched(model, names, [p.arrays for _, p, _, _ in chunk],
                                    [d for _, _, d, _ in chunk], method.orders(chunk[0][1]),
                                    [s for _, _, _, s in chunk], method.task.client_losses,
                                    method.adapter, compute)
            for (c, payload, data, _), (tensors, result) in zip(chunk, results):
                arrays = {n: t.clone() for n, t in tensors.items()}
                metrics = method.client_metrics(model, tensors, payload, arrays, result)
                metrics["batched_clients"] = len(chunk)
                on_reply(c, method.personal.keep(c, Reply(arrays=arrays, num_examples=len(data),
                                                          metrics=metrics)))
