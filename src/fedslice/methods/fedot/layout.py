"""FedOT's layout: which layers are the adapter and which the emulator. See
:mod:`fedslice.methods.fedot`.
"""

from __future__ import annotations
from fedslice.errors import ConfigError


FROZEN_PREFIX = "emulator."


def default_adapter_layers(num_layers: int) -> int:
    """Adapter layers at each end: the paper's 2 of 12, scaled to the depth (at least 1)."""
    return max(1, round(num_layers / 6))


def default_emulator_layers(middle: int) -> int:
    """Emulator layers: the paper's 3 of 8 middle layers, scaled (at least 1)."""
    return max(1, round(3 * middle / 8))


def emulator_indices(middle: list[int], k: int) -> list[int]:
    """Uniform layer drop: ``k`` of the ``middle`` layers at ``round(i * (m-1) / (k-1))``."""
    m = len(middle)
    if not 1 <= k <= m:
        raise ValueError(f"cannot keep {k} of {m} middle layers")
    if k == 1:
        return [middle[round((m - 1) / 2)]]
    stride = (m - 1) / (k - 1)
    return [middle[round(i * stride)] for i in range(k)]


def fedot_layout(num_layers: int, bottom: int | None, top: int | None,
                 emulator: int | None) -> tuple[list[int], list[int], list[int]]:
    """(bottom adapter layers, emulator layers, top adapter layers) of a ``num_layers`` model."""
    b = default_adapter_layers(num_layers) if bottom is None else bottom
    t = default_adapter_layers(num_layers) if top is None else top
    if b + t >= num_layers:
        raise ConfigError(f"method.bottom_layers={b} + method.top_layers={t} adapter layers leave "
                          f"no emulator in a {num_layers}-layer model (need at most "
                          f"{num_layers - 1} together)")
    if b + t == 0:
        raise ConfigError("method.bottom_layers and method.top_layers are both 0: no adapter to train")
    middle = list(range(b, num_layers - t))
    k = default_emulator_layers(len(middle)) if emulator is None else emulator
    if k > len(middle):
        raise ConfigError(f"method.emulator_layers={k} is more than the {len(middle)} middle layers")
    return list(range(b)), emulator_indices(middle, k), list(range(num_layers - t, num_layers))
