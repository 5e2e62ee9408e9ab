"""The cold-start probe of loss-gap selection (Eq. 9, ``federation.selection``): the global
model's loss on a client's data, forward only, with its measured FLOPs.
"""

from __future__ import annotations

import torch

from fedslice import measure
from fedslice.data.batching import TokenizedSplit, iter_batches
from fedslice.data.partition import sample_rows
from fedslice.fl.strategy import State
from fedslice.tasks.base import batch_examples


@torch.no_grad()
def probe_loss(method, state: State, data: TokenizedSplit, max_examples: int,
               seed: int) -> tuple[float, float]:
    """``method``'s global model's mean task loss on (a seeded sample of) a client's data and its
    measured FLOPs: the cold-start probe of loss-gap selection (forward only)."""
    if max_examples < len(data):
        data = data.subset(sample_rows(len(data), max_examples, seed))
    model = method.eval_model(state)
    was_training = model.training
    model.eval()
    total = 0.0
    with measure.count_flops() as fc:
        for batch in iter_batches(data, range(len(data)), 32, shuffle=False, generator=None):
            total += float(method.task.loss(model, batch)) * batch_examples(batch)
    model.train(was_training)
    return total / max(len(data), 1), float(fc.total)
