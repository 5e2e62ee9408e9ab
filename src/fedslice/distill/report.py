"""Distillation loss curves in a run folder: ``<name>.json`` (every step's loss parts and the
costs) and ``<name>.png`` (one panel per distillation phase)."""

from __future__ import annotations

from pathlib import Path

from fedslice.distill.loop import DistillLog
from fedslice.output import write_json_atomic


def write_curves(folder: Path, name: str, phases: dict[str, DistillLog], extra: dict | None = None,
                 plot: bool = True) -> list[Path]:
    """Write the curves of ``phases`` (phase name -> log); returns the written paths."""
    phases = {k: v for k, v in phases.items() if v is not None and v.losses}
    if not phases:
        return []
    out = [write_json_atomic(folder / f"{name}.json",
                             {**(extra or {}), "phases": {k: v.to_dict() for k, v in phases.items()}})]
    if plot:
        out.append(_plot(folder / f"{name}.png", phases))
    return out


def _plot(path: Path, phases: dict[str, DistillLog]) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.5 * len(phases), 3.2), layout="constrained")
    FigureCanvasAgg(fig)
    for i, (phase, log) in enumerate(phases.items()):
        ax = fig.add_subplot(1, len(phases), i + 1)
        for part in log.losses[0]:
            if not any(s[part] > 0 for s in log.losses):
                continue  # e.g. the weight term with mu = 0: nothing to show on a log axis
            ax.plot(range(1, len(log.losses) + 1), [s[part] for s in log.losses], label=part)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(phase)
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)
    return path
