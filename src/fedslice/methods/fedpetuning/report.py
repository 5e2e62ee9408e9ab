"""What ``fedpetuning`` reports after a run (plots, tables), apart from its training code. See
:mod:`fedslice.methods.fedpetuning`.
"""

from __future__ import annotations
import numpy as np



def mean_of(values) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return float(np.mean(vals)) if vals else None
