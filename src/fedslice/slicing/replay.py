"""Replaying the blocks below a layer: what a pass that changes only layer l and above needs
not compute again.

Measuring each layer's sensitivity (:func:`fedslice.slicing.widths.layer_rise`) runs the
calibration batches once per (layer, width level) with that one layer cut. Blocks below the cut
compute exactly what they computed in the uncut pass, so :class:`BlockReplay` records every
block's output on the uncut pass of each batch and, in a pass cut at layer l, has blocks
0..l-1 return their recorded outputs instead of computing: a pass then costs the blocks from l
up (on average half of them). The model's own forward is untouched otherwise (embeddings,
masks, position embeddings, the head and the loss run as always), so this works for any
architecture whose blocks the architecture table names.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn


class BlockReplay:
    """The outputs of ``blocks`` (a model's transformer blocks, bottom first) on the uncut pass of
    each batch, replayed below a cut layer. One instance per model and set of batches."""

    def __init__(self, blocks: Sequence[nn.Module]):
        self.blocks = list(blocks)
        #: batch index -> each block's output on that batch's uncut pass
        self.outputs: dict[Any, list[Any]] = {}

    @contextmanager
    def __call__(self, batch: Any, below: int | None) -> Iterator[None]:
        """Inside, a forward of batch ``batch``: with ``below = None`` (the uncut pass) the blocks'
        outputs are recorded; with ``below = l`` blocks 0..l-1 return the recorded outputs (when
        the uncut pass of this batch was recorded; else everything computes)."""
        if below is None:
            with self._recording(batch):
                yield
        elif below > 0 and batch in self.outputs:
            with self._replaying(self.outputs[batch], below):
                yield
        else:
            yield

    @contextmanager
    def _recording(self, batch: Any) -> Iterator[None]:
        outs: list[Any] = [None] * len(self.blocks)

        def hook(i: int):
            def record(_module, _args, output):
                outs[i] = output
            return record

        handles = [b.register_forward_hook(hook(i)) for i, b in enumerate(self.blocks)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
        if all(o is not None for o in outs):
            self.outputs[batch] = outs

    @contextmanager
    def _replaying(self, outs: list[Any], below: int) -> Iterator[None]:
        def replay(output):
            def forward(*_args, **_kwargs):
                return _clone(output)  # the model may add to it in place
            return forward

        for i in range(below):
            self.blocks[i].forward = replay(outs[i])  # an instance attribute: nn.Module calls it
        try:
            yield
        finally:
            for i in range(below):
                del self.blocks[i].forward


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, tuple):
        return type(x)(*map(_clone, x)) if hasattr(x, "_fields") else tuple(map(_clone, x))
    return x
