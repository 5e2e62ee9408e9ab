"""Units cut by masking: a sub-model's function computed on the full model.

Zeroing the inputs of a self-attention output projection (W_o) past the kept heads' channels, and
of an FFN output projection (W_out) past the kept units, computes exactly the sub-model that keeps
those heads and units (a dropped query head's output, a dropped unit's activation, never reaches
the residual stream; key/value heads nobody reads do nothing). RaFFM's sandwich rule and its
measured per-layer widths (:mod:`.widths`) use it to score many sub-models without building them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

#: (module, kept input channels): the first n, or these indices
Mask = tuple[nn.Module, int | Sequence[int]]


class masked_inputs:
    """Within the block, each module's input keeps only its mask's channels (zeros elsewhere)."""

    def __init__(self, masks: Sequence[Mask]):
        self.masks, self.handles = list(masks), []

    def __enter__(self):
        def hook(kept):
            def fn(module, args):
                x = args[0]  # (..., in)
                keep = torch.zeros(x.shape[-1], dtype=x.dtype, device=x.device)
                if isinstance(kept, int):
                    keep[:kept] = 1
                else:
                    keep[torch.as_tensor(list(kept), dtype=torch.long, device=x.device)] = 1
                return (x * keep, *args[1:])
            return fn
        self.handles = [m.register_forward_pre_hook(hook(k)) for m, k in self.masks]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return False
