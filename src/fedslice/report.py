"""Tables and plots from run folders.

``report(path)`` re-renders the results table of one run folder, of several, or of a folder that
holds run folders (e.g. a compare folder), and regenerates the plots: ``accuracy.png`` and
``bytes.png`` in every run folder, and ``compare.png`` next to several runs.

Units: transfer in MB (10⁶ bytes) per client per round, compute in GFLOPs (10⁹ FLOPs) per client
per round, memory in MiB as measured by :class:`fedslice.measure.PeakMemory`.
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fedslice.errors import FedsliceError
from fedslice.output import HARNESS, SUMMARY, read_run
from fedslice.registry import METHODS

__all__ = [
    "COLUMNS",
    "find_runs",
    "figure",
    "markdown_table",
    "method_plots",
    "plot_compare",
    "plot_run",
    "render_table",
    "report",
    "rounds_of",
    "rounds_to_target",
    "save_figure",
    "summary_row",
]

DASH = "—"

COLUMNS = (
    "run",
    "method",
    "test metric",
    "rounds→target",
    "down MB/client/round",
    "up MB/client/round",
    "train GFLOPs/client/round (analytic)",
    "peak mem MB (activations)",
)


# --------------------------------------------------------------------------------------------
# Numbers
# --------------------------------------------------------------------------------------------


def _num(x: Any) -> float | None:
    if x is None or isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def primary_metric(summary: Mapping[str, Any]) -> str:
    """The task's primary metric (``accuracy``; ``rougeL`` for generation)."""
    return str(summary.get("primary_metric") or "accuracy")


def rounds_to_target(metrics: Iterable[Mapping[str, Any]], target: float | None,
                     primary: str = "accuracy") -> int | None:
    """The first round whose dev ``primary`` metric is ``>= target``; ``None`` if never (or no
    target)."""
    if target is None:
        return None
    for i, record in enumerate(metrics, 1):
        acc = _num(record.get(f"dev_{primary}"))
        if acc is not None and acc >= target:
            r = record.get("round")
            return int(r) if r is not None else i
    return None


def _fmt(x: Any, spec: str) -> str:
    v = _num(x)
    return DASH if v is None else format(v, spec)


def _fmt_flops(flops: float | None) -> str:
    """GFLOPs with about three significant digits, without exponents."""
    if flops is None:
        return DASH
    g = flops / 1e9
    if abs(g) >= 100:
        return f"{g:,.0f}"
    if abs(g) >= 10:
        return f"{g:.1f}"
    if abs(g) >= 1:
        return f"{g:.2f}"
    return f"{g:.3g}"


def summary_row(summary: Mapping[str, Any]) -> dict[str, str]:
    """One table row (column name → formatted text) from a run's ``summary.json``.

    Columns (:data:`COLUMNS`): run name, method, test accuracy (generation: ROUGE-L and BLEU), rounds to reach the target dev
    accuracy (``>N`` if not reached in N rounds, ``—`` without a target; with devices, the
    simulated seconds it took, or the run took), MB down and up per client
    per round, measured training GFLOPs per client per round with the analytic estimate in
    parentheses, and peak memory in MiB (RSS, or CUDA) with the peak activation memory in
    parentheses.
    """
    if summary.get("target_accuracy") is None:
        r2t = DASH
    elif summary.get("rounds_to_target") is not None:
        r2t = str(summary["rounds_to_target"])
    else:
        rounds = summary.get("rounds")
        r2t = f">{rounds}" if rounds is not None else "not reached"
    sim = _num(summary.get("sim_time_to_target_s"))
    if sim is None and summary.get("rounds_to_target") is None:
        sim = _num(summary.get("sim_time_s"))  # the simulated clock's: ">N rounds" in this time
    if sim is not None and r2t != DASH:
        r2t += f" ({sim:,.0f} s simulated)"

    measured, analytic = _num(summary.get("flops_measured_mean")), _num(summary.get("flops_analytic_mean"))
    flops = _fmt_flops(measured)
    if analytic is not None:
        flops += f" ({_fmt_flops(analytic)})"

    mem = _fmt(summary.get("peak_rss_mb_max"), ".1f")
    act = _num(summary.get("activation_mb_max"))
    if act is not None:
        mem += f" ({act:.1f})"

    down, up = _num(summary.get("bytes_down_mean")), _num(summary.get("bytes_up_mean"))
    return {
        "run": str(summary.get("name") or DASH),
        "method": str(summary.get("method") or DASH),
        "test metric": _test_metric(summary),
        "rounds→target": r2t,
        "down MB/client/round": _fmt(down / 1e6 if down is not None else None, ".3f"),
        "up MB/client/round": _fmt(up / 1e6 if up is not None else None, ".3f"),
        "train GFLOPs/client/round (analytic)": flops,
        "peak mem MB (activations)": mem,
    }


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------


def _columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    cols: list[str] = []
    for row in rows:
        for k in row:
            if k not in cols:
                cols.append(k)
    return cols


def render_table(rows: Sequence[Mapping[str, Any]], title: str | None = None, *, color: bool | None = None) -> str:
    """The rows as a rich table, returned as text.

    ``color=None`` uses colour only if standard output is a terminal.
    """
    from rich.console import Console
    from rich.table import Table

    if color is None:
        color = sys.stdout.isatty()
    table = Table(title=title, show_lines=False)
    cols = _columns(rows)
    for c in cols:
        numeric = c not in ("run", "method")
        table.add_column(c, justify="right" if numeric else "left", overflow="fold")
    for row in rows:
        table.add_row(*(str(row.get(c, "")) for c in cols))
    buf = io.StringIO()
    console = Console(
        file=buf,
        width=240,
        force_terminal=bool(color),
        color_system="auto" if color else None,
        no_color=not color,
        highlight=False,
        legacy_windows=False,
    )
    console.print(table)
    text = buf.getvalue()
    if not color:
        text = "\n".join(line.rstrip() for line in text.splitlines()) + "\n"
    return text


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows as a GitHub-flavoured markdown table (for BENCHMARKS.md)."""
    cols = _columns(rows)
    if not cols:
        return ""

    def cell(x: Any) -> str:
        return str(x).replace("|", "\\|").replace("\n", " ")

    numeric = [c not in ("run", "method") for c in cols]
    lines = [
        "| " + " | ".join(cell(c) for c in cols) + " |",
        "|" + "|".join("---:" if n else ":---" for n in numeric) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(cell(row.get(c, "")) for c in cols) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------


def figure(ncols: int = 1, width: float = 6.0, height: float = 4.0):
    """A matplotlib figure with ``ncols`` axes side by side (integer round ticks)."""
    # The object-oriented API with the Agg canvas: no pyplot, no global backend switch.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(width * ncols, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds
    return fig, axes


def save_figure(fig, path: Path) -> Path:
    """Write ``fig`` to ``path`` atomically (a temporary file, then a rename)."""
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)
    return path


def rounds_of(metrics: Sequence[Mapping[str, Any]]) -> list[int]:
    """The round number of each record (its position when a record has none)."""
    return [int(m.get("round", i)) for i, m in enumerate(metrics, 1)]


def _test_metric(summary: Mapping[str, Any]) -> str:
    primary = primary_metric(summary)
    if primary == "accuracy":
        return _fmt(summary.get("test_accuracy"), ".4f")
    shown = [primary] + (["bleu"] if primary != "bleu" and "test_bleu" in summary else [])
    return ", ".join(f"{k} {_fmt(summary.get(f'test_{k}'), '.2f')}" for k in shown)


def _accuracy_series(metrics: Sequence[Mapping[str, Any]],
                     primary: str = "accuracy") -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r, m in zip(rounds_of(metrics), metrics):
        acc = _num(m.get(f"dev_{primary}"))
        if acc is not None:
            xs.append(r)
            ys.append(acc)
    return xs, ys


def _bytes_series(metrics: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[float], list[float]]:
    """Rounds, cumulative MB down and cumulative MB up per client."""
    xs, down, up = [], [], []
    d = u = 0.0
    for r, m in zip(rounds_of(metrics), metrics):
        d += _num(m.get("bytes_down_mean")) or 0.0
        u += _num(m.get("bytes_up_mean")) or 0.0
        xs.append(r)
        down.append(d / 1e6)
        up.append(u / 1e6)
    return xs, down, up


def run_label(summary: Mapping[str, Any], run_dir: Path) -> str:
    """A run's name in plot titles: its name (the folder's when unnamed) and method."""
    name = summary.get("name") or run_dir.name
    method = summary.get("method")
    return f"{name} ({method})" if method and method != name else str(name)


def _final_round(metrics: Sequence[Mapping[str, Any]], summary: Mapping[str, Any]) -> float:
    rounds = rounds_of(metrics)
    if rounds:
        return rounds[-1]
    return _num(summary.get("rounds")) or 0


def _plot_accuracy(ax, metrics, summary, label: str | None = None, color=None) -> None:
    primary = primary_metric(summary)
    xs, ys = _accuracy_series(metrics, primary)
    line = None
    if xs:
        (line,) = ax.plot(xs, ys, marker="o", markersize=3, label=label or f"dev {primary}",
                          color=color)
    test = _num(summary.get(f"test_{primary}"))
    if test is not None:
        ax.plot(
            [_final_round(metrics, summary)],
            [test],
            marker="*",
            markersize=12,
            linestyle="none",
            color=line.get_color() if line is not None else color,
            label=None if label else f"test {primary}",
        )


def plot_run(run_dir: str | os.PathLike) -> list[Path]:
    """Write ``accuracy.png`` (the primary metric, e.g. ``rougeL.png`` for generation: dev per
    round, test as a star at the last round,
    target as a dashed line) and ``bytes.png`` (cumulative MB per client, down, up and total) into
    the run folder. Returns the two paths."""
    run_dir = Path(run_dir)
    config, metrics, summary = read_run(run_dir)
    title = run_label(summary, run_dir)

    fig, (ax,) = figure()
    _plot_accuracy(ax, metrics, summary)
    target = _num(summary.get("target_accuracy"))
    if target is not None:
        ax.axhline(target, linestyle="--", color="grey", linewidth=1, label=f"target {target:g}")
    primary = primary_metric(summary)
    ax.set_xlabel("round")
    ax.set_ylabel(primary)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower right")
    acc_path = save_figure(fig, run_dir / f"{primary}.png")
    per = summary.get("test_accuracy_per_class")
    if per:
        fig, (ax,) = figure()
        names = list(per)
        ax.bar(range(len(names)), [_num(per[n]) or 0.0 for n in names], color="tab:blue")
        ax.set_xticks(range(len(names)), names, rotation=30 if len(names) > 4 else 0, ha="right"
                      if len(names) > 4 else "center")
        ax.set_ylim(0, 1)
        ax.set_ylabel("test accuracy on the class's examples")
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
        save_figure(fig, run_dir / "classes.png")

    fig, (ax,) = figure()
    xs, down, up = _bytes_series(metrics)
    if xs:
        ax.plot(xs, [d + u for d, u in zip(down, up)], marker="o", markersize=3, label="total")
        ax.plot(xs, down, linestyle="--", label="down")
        ax.plot(xs, up, linestyle=":", label="up")
        ax.legend(loc="upper left")
    ax.set_xlabel("round")
    ax.set_ylabel("cumulative MB per client")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    bytes_path = save_figure(fig, run_dir / "bytes.png")
    return [acc_path, bytes_path] + method_plots(run_dir, config, metrics, summary)


def method_plots(run_dir: Path, config: Mapping[str, Any], metrics: Sequence[Mapping[str, Any]],
                 summary: Mapping[str, Any]) -> list[Path]:
    """The plots the run's method contributes: its report views that name a PNG
    (:meth:`fedslice.methods.base.Method.report_views`: RaFFM's elastic sizes, heads' importance
    maps), asked through the registry; none when the method is not registered in this process
    (the built-in ones are, once :mod:`fedslice.plugins` is imported, as ``fedslice report``
    does)."""
    name = summary.get("method") or (config.get("method") or {}).get("name")
    if name not in METHODS:
        return []
    views = METHODS.get(name).method_cls.report_views(run_dir, dict(config), list(metrics), dict(summary))
    return [save_figure(v.figure, run_dir / v.png) for v in views if v.png and v.figure is not None]


def plot_compare(run_dirs: Sequence[str | os.PathLike], out_path: str | os.PathLike) -> Path:
    """One figure with two panels overlaying several runs: dev accuracy per round (test accuracy
    as a star) and cumulative MB (down + up) per client. Returns ``out_path``."""
    run_dirs = [Path(p) for p in run_dirs]
    if not run_dirs:
        raise FedsliceError("plot_compare: no run folders given")
    import matplotlib

    palette = matplotlib.rcParams["axes.prop_cycle"].by_key().get("color") or ["C0"]
    fig, (ax_acc, ax_bytes) = figure(ncols=2)
    for i, run_dir in enumerate(run_dirs):
        _, metrics, summary = read_run(run_dir)
        label = run_label(summary, run_dir)
        color = palette[i % len(palette)]
        _plot_accuracy(ax_acc, metrics, summary, label=label, color=color)
        xs, down, up = _bytes_series(metrics)
        if xs:
            ax_bytes.plot(xs, [d + u for d, u in zip(down, up)], marker="o", markersize=3, label=label, color=color)
    ax_acc.set_xlabel("round")
    ax_acc.set_ylabel(f"dev {primary_metric(summary)} (★ test)")
    ax_acc.grid(True, alpha=0.3)
    ax_bytes.set_xlabel("round")
    ax_bytes.set_ylabel("cumulative MB per client (down + up)")
    ax_bytes.grid(True, alpha=0.3)
    if ax_bytes.get_legend_handles_labels()[0]:
        ax_bytes.legend(loc="upper left", fontsize="small")
    elif ax_acc.get_legend_handles_labels()[0]:
        ax_acc.legend(loc="lower right", fontsize="small")
    return save_figure(fig, Path(out_path))


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def find_runs(path: str | os.PathLike) -> list[Path]:
    """The run folders at ``path``: ``[path]`` if it holds ``summary.json``, else its sub-folders
    that do (sorted by name; hidden staging folders are skipped)."""
    path = Path(path)
    if not path.is_dir():
        raise FedsliceError(f"run folder {path} does not exist")
    if (path / SUMMARY).is_file():
        return [path]
    runs = sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / SUMMARY).is_file())
    if not runs:
        raise FedsliceError(f"{path} holds no finished run: no {SUMMARY} in it or in its sub-folders")
    return runs


def report(
    run_dir_or_dirs: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    title: str | None = None,
    plots: bool = True,
    compare_path: str | os.PathLike | None = None,
    color: bool | None = None,
) -> str:
    """Re-render the results table (one row per run) and regenerate the plots; return the table.

    ``run_dir_or_dirs`` is a run folder, a folder of run folders (a compare folder), or a list of
    either. Each run gets ``accuracy.png`` and ``bytes.png``. With several runs, ``compare.png``
    is written to ``compare_path`` or, when a single folder of runs was given, into that folder.
    (``fedslice report`` also writes the HTML reports: :func:`fedslice.html_report.write_reports`.)
    """
    if isinstance(run_dir_or_dirs, (str, os.PathLike)):
        roots = [Path(run_dir_or_dirs)]
    else:
        roots = [Path(p) for p in run_dir_or_dirs]
    if not roots:
        raise FedsliceError("report: no run folder given")
    runs: list[Path] = []
    for root in roots:
        runs.extend(find_runs(root))

    rows = []
    for run in runs:
        _, metrics, summary = read_run(run)
        summary = dict(summary)
        if "rounds_to_target" not in summary and summary.get("target_accuracy") is not None:
            summary["rounds_to_target"] = rounds_to_target(metrics, _num(summary["target_accuracy"]),
                                                           primary_metric(summary))
        if not summary.get("name"):
            summary["name"] = run.name
        rows.append(summary_row(summary))
        if plots:
            plot_run(run)

    if plots and len(runs) > 1:
        if compare_path is None and len(roots) == 1 and roots[0] not in runs:
            compare_path = roots[0] / "compare.png"
        if compare_path is not None:
            plot_compare(runs, compare_path)

    if title is None:
        title = f"fedslice results: {roots[0].name}" if len(roots) == 1 else "fedslice results"
    return (render_table(rows, title, color=color) + "".join(per_class_lines(runs))
            + "".join(harness_lines(runs)))


def harness_rows(run: Path) -> list[dict[str, Any]] | None:
    """The run's lm-evaluation-harness scores (``harness.json``), one row per task and metric:
    trained, base (``--baseline``), change; None when it has none, [] when the file is damaged."""
    path = Path(run) / HARNESS
    if not path.is_file():
        return None
    try:
        tasks = json.loads(path.read_text(encoding="utf-8"))["tasks"]
        items = sorted(tasks.items())
    except (ValueError, KeyError, TypeError, AttributeError):
        return []
    rows = []
    for task, e in items:
        base = (e.get("baseline") or {}).get("metrics") or {}
        for metric, v in (e.get("metrics") or {}).items():
            b = base.get(metric)
            rows.append({"task": task, "metric": metric, "trained": v, "base": b,
                         "change": v - b if _num(v) is not None and _num(b) is not None else None,
                         "examples": e.get("samples"), "shots": e.get("num_fewshot")})
    return rows


def harness_lines(runs: Sequence[Path]) -> list[str]:
    """Per run, its lm-evaluation-harness scores (and the untrained model's, when measured)."""
    out = []
    for run in runs:
        rows = harness_rows(run)
        if rows is None:
            continue
        if not rows:
            out.append(f"\nlm-evaluation-harness ({run.name}): {HARNESS} is damaged")
            continue
        cells = "; ".join(f"{r['task']} {r['metric']} {_fmt(r['trained'], '.4f')}"
                          + (f" (base {_fmt(r['base'], '.4f')})" if r["base"] is not None else "")
                          for r in rows)
        out.append(f"\nlm-evaluation-harness ({run.name}): {cells}")
    return out


def per_class_lines(runs: Sequence[Path]) -> list[str]:
    """One line per run with its test accuracy on each class, by class name."""
    out = []
    for run in runs:
        per = read_run(run)[2].get("test_accuracy_per_class")
        if per:
            cells = ", ".join(f"{name} {_fmt(acc, '.3f')}" for name, acc in per.items())
            out.append(f"\ntest accuracy per class ({run.name}): {cells}")
    return out
