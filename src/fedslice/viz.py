"""Figures for the HTML report: matplotlib drawn to inline SVG, and the data behind each.

A :class:`View` is one figure with the table of numbers it shows (what a reader checks, copies or
re-plots). The run report builds the common views; a method contributes its own through
:meth:`fedslice.methods.base.Method.report_views`, with these helpers.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass
class View:
    """One section of a report: a title, an inline SVG figure (or none) and its data rows. A
    view with a ``png`` name is also a plot ``fedslice report`` writes into the run folder (from
    its matplotlib ``figure``)."""

    title: str
    svg: str | None
    rows: list[dict[str, Any]] = field(default_factory=list)
    caption: str = ""
    png: str | None = None
    figure: Any = field(default=None, repr=False, compare=False)


def figure_view(title: str, fig, rows: list[dict[str, Any]], caption: str = "",
                png: str | None = None) -> View:
    """A view of a drawn matplotlib figure (kept for its ``png`` when it has one)."""
    return View(title, svg(fig), rows, caption, png, fig if png else None)


def figure(width: float = 6.0, height: float = 3.4, ncols: int = 1):
    """A matplotlib Figure (no global pyplot state) and its axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, axes


_SIZE = re.compile(r'(<svg[^>]*?)\s(width|height)="[^"]*"')


def svg(fig) -> str:
    """The figure as SVG markup that scales with its container (viewBox kept, fixed size
    dropped), text as paths: no font or file is referenced."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "path", "svg.hashsalt": "fedslice"}):
        fig.savefig(buf, format="svg")
    text = buf.getvalue()
    text = text[text.index("<svg"):]  # drop the XML prolog and doctype (inline in HTML)
    for _ in range(2):
        text = _SIZE.sub(r"\1", text, count=1)
    return text.replace("<svg", '<svg class="figure" role="img"', 1)


def line_view(title: str, xs: list, series: dict[str, list], *, xlabel: str, ylabel: str,
              caption: str = "", x_key: str = "round", log_y: bool = False) -> View:
    """Lines (one per series, None = gap) over ``xs``, and the table x | series..."""
    fig, (ax,) = figure()
    for name, ys in series.items():
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", markersize=3, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if x_key in ("round", "step"):
        from matplotlib.ticker import MaxNLocator
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if log_y:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    rows = [{x_key: x, **{n: ys[i] for n, ys in series.items()}} for i, x in enumerate(xs)]
    return View(title, svg(fig), rows, caption)


def heatmap_view(title: str, matrix, *, xlabel: str, ylabel: str, row_names: list[str],
                 caption: str = "", value: str = "value") -> View:
    """A heatmap of ``matrix`` (rows x columns) and its cells as a table."""
    import numpy as np

    m = np.asarray(matrix, dtype=float)
    fig, (ax,) = figure(width=min(9.0, 2.0 + 0.5 * m.shape[1]), height=min(8.0, 1.2 + 0.35 * m.shape[0]))
    image = ax.imshow(m, cmap="viridis", aspect="auto")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_yticks(range(len(row_names)), row_names, fontsize=7)
    fig.colorbar(image, ax=ax, shrink=0.8, label=value)
    rows = [{"row": row_names[i], **{f"{xlabel} {j}": float(m[i, j]) for j in range(m.shape[1])}}
            for i in range(m.shape[0])]
    return View(title, svg(fig), rows, caption)
