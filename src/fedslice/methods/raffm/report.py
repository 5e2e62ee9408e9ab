"""What ``raffm`` reports after a run (plots, tables), apart from its training code. See
:mod:`fedslice.methods.raffm`.
"""

from __future__ import annotations
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from fedslice.report import figure, save_figure


def plot_elastic(elastic: Sequence[Mapping[str, Any]], out_path: str | os.PathLike,
                 title: str = "", series: str | None = None, fig_axes=None) -> Path:
    """``elastic.png``: test (and dev) primary metric of the global model evaluated at several sub-model
    sizes, against the size (FLOPs fraction) and against forward GFLOPs per example."""
    from matplotlib.ticker import AutoLocator

    fig, (ax_size, ax_flops) = fig_axes or figure(ncols=2, width=5.0)
    metric = next((e["metric"] for e in elastic if "metric" in e), "accuracy")
    rows = [e for e in elastic if _finite(e.get(f"test_{metric}"))]
    label = series or "test"
    for split, style in (("test", "-o"), ("dev", ":x")):
        if series and split == "dev":
            continue
        ys = [e.get(f"{split}_{metric}") for e in rows]
        lab = label if split == "test" else "dev"
        ax_size.plot([e["size"] for e in rows], ys, style, label=lab)
        ax_flops.plot([e["forward_gflops_per_example"] for e in rows], ys, style, label=lab)
    ax_size.set_xlabel("size (fraction of full-model training FLOPs)")
    ax_flops.set_xlabel("forward GFLOPs per example (profile batch)")
    for ax in (ax_size, ax_flops):
        ax.xaxis.set_major_locator(AutoLocator())  # sizes and GFLOPs are not rounds
        ax.set_ylabel(metric)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower right")
    ax_size.set_title(f"{title}: elastic inference" if title else "elastic inference")
    return save_figure(fig, Path(out_path))


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
