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


def distill_view(folder: Path, name: str, title: str):
    """The report section of ``<name>.json``: each phase's loss per step (None: no file)."""
    import json

    from fedslice.viz import line_view
    path = Path(folder) / f"{name}.json"
    if not path.is_file():
        return None
    phases = json.loads(path.read_text()).get("phases") or {}
    steps = max((len(p["losses"]) for p in phases.values()), default=0)
    series = {ph: [p["losses"][i]["loss"] if i < len(p["losses"]) else None for i in range(steps)]
              for ph, p in phases.items()}
    return line_view(title, list(range(1, steps + 1)), series, xlabel="step", ylabel="loss",
                     x_key="step", log_y=True, caption="Distillation loss per step, per phase "
                     f"(every loss part in {name}.json).")
