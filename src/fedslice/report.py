"""Tables and plots from run folders.

``report(path)`` re-renders the results table of one run folder, of several, or of a folder that
holds run folders (e.g. a compare folder), and regenerates the plots: ``accuracy.png`` and
``bytes.png`` in every run folder, and ``compare.png`` next to several runs.

Units: transfer in MB (10⁶ bytes) per client per round, compute in GFLOPs (10⁹ FLOPs) per client
per round, memory in MiB as measured by :class:`fedslice.measure.PeakMemory`.
"""

from __future__ import annotations

import io
import math
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fedslice.errors import FedsliceError
from fedslice.output import SUMMARY, read_run

__all__ = [
    "COLUMNS",
    "find_runs",
    "markdown_table",
    "plot_compare",
    "plot_elastic",
    "plot_head_importance",
    "plot_run",
    "render_table",
    "report",
    "rounds_to_target",
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
    accuracy (``>N`` if not reached in N rounds, ``—`` without a target), MB down and up per client
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


def _figure(ncols: int = 1, width: float = 6.0, height: float = 4.0):
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


def _save(fig, path: Path) -> Path:
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)
    return path


def _rounds(metrics: Sequence[Mapping[str, Any]]) -> list[int]:
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
    for r, m in zip(_rounds(metrics), metrics):
        acc = _num(m.get(f"dev_{primary}"))
        if acc is not None:
            xs.append(r)
            ys.append(acc)
    return xs, ys


def _bytes_series(metrics: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[float], list[float]]:
    """Rounds, cumulative MB down and cumulative MB up per client."""
    xs, down, up = [], [], []
    d = u = 0.0
    for r, m in zip(_rounds(metrics), metrics):
        d += _num(m.get("bytes_down_mean")) or 0.0
        u += _num(m.get("bytes_up_mean")) or 0.0
        xs.append(r)
        down.append(d / 1e6)
        up.append(u / 1e6)
    return xs, down, up


def _label(summary: Mapping[str, Any], run_dir: Path) -> str:
    name = summary.get("name") or run_dir.name
    method = summary.get("method")
    return f"{name} ({method})" if method and method != name else str(name)


def _final_round(metrics: Sequence[Mapping[str, Any]], summary: Mapping[str, Any]) -> float:
    rounds = _rounds(metrics)
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
    title = _label(summary, run_dir)

    fig, (ax,) = _figure()
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
    acc_path = _save(fig, run_dir / f"{primary}.png")
    per = summary.get("test_accuracy_per_class")
    if per:
        fig, (ax,) = _figure()
        names = list(per)
        ax.bar(range(len(names)), [_num(per[n]) or 0.0 for n in names], color="tab:blue")
        ax.set_xticks(range(len(names)), names, rotation=30 if len(names) > 4 else 0, ha="right"
                      if len(names) > 4 else "center")
        ax.set_ylim(0, 1)
        ax.set_ylabel("test accuracy on the class's examples")
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
        _save(fig, run_dir / "classes.png")

    fig, (ax,) = _figure()
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
    bytes_path = _save(fig, run_dir / "bytes.png")
    paths = [acc_path, bytes_path]
    if summary.get("elastic"):
        paths.append(plot_elastic(summary["elastic"], run_dir / "elastic.png", title))
    plot_rounds = (config.get("method") or {}).get("plot_rounds", 10)
    return paths + plot_head_importance(metrics, run_dir, plot_rounds, title)


def plot_elastic(elastic: Sequence[Mapping[str, Any]], out_path: str | os.PathLike,
                 title: str = "", series: str | None = None, fig_axes=None) -> Path:
    """``elastic.png``: test (and dev) primary metric of the global model evaluated at several sub-model
    sizes, against the size (FLOPs fraction) and against forward GFLOPs per example."""
    from matplotlib.ticker import AutoLocator

    fig, (ax_size, ax_flops) = fig_axes or _figure(ncols=2, width=5.0)
    metric = next((e["metric"] for e in elastic if "metric" in e), "accuracy")
    rows = [e for e in elastic if _num(e.get(f"test_{metric}")) is not None]
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
    return _save(fig, Path(out_path))


def _importance_by_round(metrics: Sequence[Mapping[str, Any]]) -> list[tuple[int, list[tuple[int, Any]]]]:
    """[(round, [(client, (L, H) importance array), ...]), ...] for rounds whose clients report a
    ``head_importance`` (the ``heads`` method); clients in id order."""
    import numpy as np

    out = []
    for r, m in zip(_rounds(metrics), metrics):
        clients = [(int(c["client"]), np.reshape(c["head_importance"], (-1, int(c["num_heads"]))))
                   for c in m.get("client_metrics") or [] if c.get("head_importance")]
        if clients:
            out.append((r, sorted(clients, key=lambda x: x[0])))
    return out


def plot_head_importance(metrics: Sequence[Mapping[str, Any]], run_dir: str | os.PathLike,
                         rounds: int = 10, title: str = "", max_clients: int = 4) -> list[Path]:
    """``head_importance.png``: a heatmap (rows: layers per attention family; columns: heads)
    of each selected client's importance in the first ``rounds`` rounds (at most ``max_clients`` per round; kept heads dotted), and
    ``head_distance.png``: the Euclidean distance between two clients' importance vectors per
    round (the heads paper's Fig. 5), with the mean pairwise distance when more clients train.
    Returns the paths written ([] when no client reported head importance)."""
    import numpy as np

    data = _importance_by_round(metrics)
    if not data or rounds <= 0:
        return []
    run_dir = Path(run_dir)
    shown = data[:rounds]
    ncols = min(max_clients, max(len(cs) for _, cs in shown))
    vmin = min(float(a.min()) for _, cs in shown for _, a in cs[:ncols])
    vmax = max(float(a.max()) for _, cs in shown for _, a in cs[:ncols])
    L, H = shown[0][1][0][1].shape
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(1.2 + 0.35 * H * ncols, 0.6 + 0.28 * L * len(shown) + 0.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(shown), ncols, squeeze=False)
    kept_of = {(r, int(c["client"])): c.get("head_kept") for r, m in zip(_rounds(metrics), metrics)
               for c in m.get("client_metrics") or []}
    image = None
    for i, (r, clients) in enumerate(shown):
        for j in range(ncols):
            ax = axes[i][j]
            ax.set_xticks([])
            ax.set_yticks([])
            if j >= len(clients):
                ax.axis("off")
                continue
            c, imp = clients[j]
            image = ax.imshow(imp, vmin=vmin, vmax=vmax, cmap="viridis", aspect="auto")
            kept = kept_of.get((r, c))
            if kept is not None:
                ys, xs = np.nonzero(np.reshape(kept, (L, H)))
                ax.scatter(xs, ys, s=4, c="white", marker="o")
            ax.set_title(f"r{r} c{c}", fontsize=7)
    fig.colorbar(image, ax=axes, shrink=0.6, label="importance (rows: layers, per attention family; • kept)")
    fig.suptitle(f"{title}: head importance" if title else "head importance", fontsize=9)
    heat = _save(fig, run_dir / "head_importance.png")

    fig, (ax,) = _figure()
    xs, two, mean = [], [], []
    for r, clients in data:
        if len(clients) < 2:
            continue
        vecs = [a.flatten() for _, a in clients]
        pairs = [float(np.linalg.norm(vecs[a] - vecs[b]))
                 for a in range(len(vecs)) for b in range(a + 1, len(vecs))]
        xs.append(r)
        two.append(pairs[0])
        mean.append(float(np.mean(pairs)))
    ax.plot(xs, two, marker="o", markersize=3, label="first two clients")
    if any(abs(a - b) > 1e-12 for a, b in zip(two, mean)):
        ax.plot(xs, mean, linestyle="--", label="mean over client pairs")
    ax.set_xlabel("round")
    ax.set_ylabel("Euclidean distance of importance vectors")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if xs:
        ax.legend(loc="upper right")
    return [heat, _save(fig, run_dir / "head_distance.png")]


def plot_compare(run_dirs: Sequence[str | os.PathLike], out_path: str | os.PathLike) -> Path:
    """One figure with two panels overlaying several runs: dev accuracy per round (test accuracy
    as a star) and cumulative MB (down + up) per client. Returns ``out_path``."""
    run_dirs = [Path(p) for p in run_dirs]
    if not run_dirs:
        raise FedsliceError("plot_compare: no run folders given")
    import matplotlib

    palette = matplotlib.rcParams["axes.prop_cycle"].by_key().get("color") or ["C0"]
    fig, (ax_acc, ax_bytes) = _figure(ncols=2)
    for i, run_dir in enumerate(run_dirs):
        _, metrics, summary = read_run(run_dir)
        label = _label(summary, run_dir)
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
    return _save(fig, Path(out_path))


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
    either. Each run gets ``accuracy.png``, ``bytes.png`` and ``report.html``. With several runs,
    ``compare.png`` is written to ``compare_path`` or, when a single folder of runs was given,
    into that folder, with the compare ``report.html`` beside it.
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
            from fedslice.html_report import write_run_report
            plot_run(run)
            write_run_report(run)

    if plots and len(runs) > 1:
        if compare_path is None and len(roots) == 1 and roots[0] not in runs:
            compare_path = roots[0] / "compare.png"
        if compare_path is not None:
            from fedslice.html_report import REPORT, write_compare_report
            plot_compare(runs, compare_path)
            write_compare_report(runs, Path(compare_path).with_name(REPORT))

    if title is None:
        title = f"fedslice results: {roots[0].name}" if len(roots) == 1 else "fedslice results"
    return render_table(rows, title, color=color) + "".join(per_class_lines(runs))


def per_class_lines(runs: Sequence[Path]) -> list[str]:
    """One line per run with its test accuracy on each class, by class name."""
    out = []
    for run in runs:
        per = read_run(run)[2].get("test_accuracy_per_class")
        if per:
            cells = ", ".join(f"{name} {_fmt(acc, '.3f')}" for name, acc in per.items())
            out.append(f"\ntest accuracy per class ({run.name}): {cells}")
    return out
