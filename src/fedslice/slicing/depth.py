"""Adapter depth: a client trains the adapter tensors of the model's top blocks only.

The blocks of every stack, in forward order (an encoder's, then a decoder's), are numbered
0 .. L-1; a tensor inside block i sits at position i, a tensor outside the blocks at the number
of blocks whose tensors come before it in the model (the embeddings at 0, an encoder's final norm
between the stacks, the classifier and the LM head at L). A client at depth share ``d`` trains
the tensors at positions >= ``cut`` = L - max(1, round(d x L)) and freezes the trainable ones
below: the backward stops at the lowest trained block (nothing below it requires a gradient), so
its examples cost the forward of every block and the backward of the top ones only, and it sends
the top blocks' tensors (the server averages each tensor over the clients that trained it).

The server names the frozen tensors in a client's payload (``frozen_tensors``): a client needs no
architecture knowledge to freeze them, and the server checks the reply against the same list.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch.nn as nn

from fedslice.models.arch import ArchSpec


def block_positions(model: nn.Module, arch: ArchSpec) -> tuple[dict[str, int], int]:
    """(parameter name -> position, number of blocks L) of ``model`` (see the module doc)."""
    block_of: dict[int, int] = {}
    total = 0
    for k in range(len(arch.stacks)):
        for block in arch.blocks(model, k):
            for p in block.parameters():
                block_of.setdefault(id(p), total)
            total += 1
    out: dict[str, int] = {}
    seen = 0  # blocks whose tensors came before, in the model's order
    for name, p in model.named_parameters():
        i = block_of.get(id(p))
        if i is None:
            out[name] = seen
        else:
            out[name] = i
            seen = max(seen, i + 1)
    return out, total


def depth_cut(share: float, num_blocks: int) -> int:
    """The lowest block a client at depth ``share`` trains (at least the top one)."""
    if not 0 < share <= 1:
        raise ValueError(f"adapter depth {share} is not in (0, 1]")
    return num_blocks - max(1, min(num_blocks, round(share * num_blocks)))


def frozen_below(model: nn.Module, arch: ArchSpec, share: float | None) -> tuple[str, ...]:
    """The trainable tensors of ``model`` a client at depth ``share`` leaves frozen (below its
    cut), in the model's order; none at share None or 1."""
    if share is None or share >= 1:
        return ()
    positions, total = block_positions(model, arch)
    cut = depth_cut(share, total)
    return tuple(n for n, p in model.named_parameters() if p.requires_grad and positions[n] < cut)


@contextmanager
def frozen(model: nn.Module, names: Iterable[str]) -> Iterator[list[nn.Parameter]]:
    """``model``'s parameters ``names`` (those that train) frozen inside the block and thawed
    after, whatever happens; yields the parameters it froze."""
    done = freeze(model, names)
    try:
        yield done
    finally:
        for p in done:
            p.requires_grad_(True)


def freeze(model: nn.Module, names: Iterable[str]) -> list[nn.Parameter]:
    """Freeze ``model``'s parameters ``names`` that train; returns them (for the caller to thaw)."""
    wanted = set(names)
    done = [p for n, p in model.named_parameters() if n in wanted and p.requires_grad]
    for p in done:
        p.requires_grad_(False)
    return done
