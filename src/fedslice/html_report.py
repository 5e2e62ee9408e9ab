"""A self-contained HTML report of a run folder (``report.html``) and of a compare folder.

One file, no network: figures are inline SVG (text drawn as paths), styles inline, no script.
It reads on a phone-width window (figures scale, wide tables scroll inside their box). Sections:
the results, the metric and loss curves, bytes and FLOPs per round, per-client costs, the
partition's label histogram, the method's own views (:meth:`Method.report_views`), the resolved
config; every figure comes with the table of the numbers it draws.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedslice.output import read_run
from fedslice.report import harness_rows, primary_metric, summary_row
from fedslice.viz import View, figure, line_view, svg

REPORT = "report.html"

_CSS = """
:root { color-scheme: light; --fg: #1d2330; --muted: #5b6475; --line: #d9dee7; --accent: #2456a6; }
* { box-sizing: border-box; }
body { margin: 0 auto; max-width: 980px; padding: 12px 16px 48px; color: var(--fg);
       font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; }
h1 { font-size: 1.5em; margin: 0.4em 0 0.1em; overflow-wrap: anywhere; }
h2 { font-size: 1.15em; margin: 1.8em 0 0.4em; border-bottom: 1px solid var(--line); }
p.sub, figcaption, .caption { color: var(--muted); font-size: 0.9em; }
nav { display: flex; flex-wrap: wrap; gap: 4px 12px; font-size: 0.9em; }
a { color: var(--accent); }
figure { margin: 0; }
svg.figure { display: block; width: 100%; height: auto; }
.views { display: grid; grid-template-columns: repeat(auto-fit, minmax(min(100%, 440px), 1fr));
         gap: 0 24px; }
.views > section.wide { grid-column: 1 / -1; }
.scroll { overflow-x: auto; max-width: 100%; }
table { border-collapse: collapse; font-size: 0.85em; font-variant-numeric: tabular-nums; }
th, td { border: 1px solid var(--line); padding: 3px 8px; text-align: right; white-space: nowrap; }
th:first-child, td:first-child { text-align: left; }
thead th { background: #f3f5f9; }
details { margin: 6px 0 0; }
summary { cursor: pointer; color: var(--accent); font-size: 0.9em; }
pre { background: #f6f8fa; padding: 8px; overflow-x: auto; font-size: 0.8em; }
"""


def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        if not math.isfinite(v):
            return "—"
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:,.0f}"
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return str(v)


def table(rows: Sequence[dict[str, Any]], cls: str = "data") -> str:
    if not rows:
        return "<p class=caption>(no data)</p>"
    cols = list(dict.fromkeys(k for r in rows for k in r))
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c)))}</td>" for c in cols) + "</tr>"
                   for r in rows)
    return f'<div class=scroll><table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def section(view: View, anchor: str) -> str:
    wide = " wide" if not view.svg else ""
    parts = [f'<section class="view{wide}" id="{anchor}"><h2>{html.escape(view.title)}</h2>']
    if view.svg:
        parts.append(f"<figure>{view.svg}")
        if view.caption:
            parts.append(f"<figcaption>{html.escape(view.caption)}</figcaption>")
        parts.append("</figure>")
        parts.append(f"<details><summary>data ({len(view.rows)} rows)</summary>{table(view.rows)}</details>")
    else:
        if view.caption:
            parts.append(f"<p class=caption>{html.escape(view.caption)}</p>")
        parts.append(table(view.rows))
    parts.append("</section>")
    return "".join(parts)


def page(title: str, subtitle: str, views: list[View], extra: str = "") -> str:
    anchors = [f"s{i}" for i in range(len(views))]
    nav = "".join(f'<a href="#{a}">{html.escape(v.title)}</a>' for a, v in zip(anchors, views))
    body = "".join(section(v, a) for v, a in zip(views, anchors))
    return ("<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
            '<meta name=viewport content="width=device-width, initial-scale=1">'
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"
            f"<h1>{html.escape(title)}</h1><p class=sub>{html.escape(subtitle)}</p>"
            f"<nav>{nav}</nav><div class=views>{body}</div>{extra}</body></html>")


# --------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------

def _series(metrics: list[dict], key: str, scale: float = 1.0) -> list[float | None]:
    out = []
    for m in metrics:
        v = m.get(key)
        out.append(None if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)
                   else v * scale)
    return out


def _results_view(summary: dict[str, Any]) -> View:
    keep = {k: v for k, v in summary.items() if not isinstance(v, (list, dict))}
    return View("Results", None, [{"quantity": k, "value": v} for k, v in keep.items()],
                "summary.json: test metrics, rounds, the mean per-client costs.")


#: characters of a sample's prompt shown (its end: the turn answered)
PROMPT_CHARS = 400


def _samples_view(samples: list[dict[str, Any]]) -> View:
    """The first test generations: the prompt's end, the model's answer, the reference(s)."""
    rows = [{"prompt": ("..." if len(s["prompt"]) > PROMPT_CHARS else "") + s["prompt"][-PROMPT_CHARS:],
             "generated": s["generated"], "reference": " | ".join(s.get("references") or [])}
            for s in samples]
    return View("Generations (test sample)", None, rows,
                "Greedy answers of the final model to the first test prompts (summary.json: samples).")


def _client_costs(metrics: list[dict]) -> View:
    per: dict[int, dict[str, Any]] = {}
    for r in metrics:
        for c in r.get("client_metrics") or []:
            if not c.get("used", True):
                continue
            row = per.setdefault(int(c["client"]), {"client": int(c["client"]), "rounds": 0,
                                                    "examples": 0, "MB down": 0.0, "MB up": 0.0,
                                                    "GFLOPs (analytic)": 0.0, "peak RSS MB": 0.0})
            row["rounds"] += 1
            row["examples"] += int(c.get("num_examples") or 0)
            row["MB down"] += (c.get("bytes_down") or 0) / 1e6
            row["MB up"] += (c.get("bytes_up") or 0) / 1e6
            row["GFLOPs (analytic)"] += (c.get("flops_analytic") or 0) / 1e9
            row["peak RSS MB"] = max(row["peak RSS MB"], c.get("peak_rss_mb") or 0.0)
    rows = [per[c] for c in sorted(per)]
    fig, (ax_b, ax_f) = figure(ncols=2, width=7.5)
    xs = list(range(len(rows)))
    ax_b.bar(xs, [r["MB up"] for r in rows], label="up", color="tab:orange")
    ax_b.bar(xs, [r["MB down"] for r in rows], bottom=[r["MB up"] for r in rows], label="down",
             color="tab:blue", alpha=0.6)
    ax_b.set_ylabel("MB over the run")
    ax_b.legend(fontsize=8)
    ax_f.bar(xs, [r["GFLOPs (analytic)"] for r in rows], color="tab:green")
    ax_f.set_ylabel("training GFLOPs over the run")
    for ax in (ax_b, ax_f):
        ax.set_xlabel("client")
        ticks = xs if len(xs) <= 20 else xs[:: max(1, len(xs) // 10)]
        ax.set_xticks(ticks, [str(rows[i]["client"]) for i in ticks], fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
    return View("Per-client costs", svg(fig), rows,
                "Totals over the rounds each client's reply was used (client_metrics in metrics.jsonl).")


def _partition_view(folder: Path, labels: list[str] | None) -> View | None:
    path = folder / "partition.json"
    if not path.is_file():
        return None
    part = json.loads(path.read_text())
    sizes = part.get("partition_sizes") or []
    hist = part.get("label_histograms")
    fig, (ax,) = figure()
    xs = list(range(len(sizes)))
    if hist:
        k = max((len(h) for h in hist), default=0)
        names = labels if labels and len(labels) >= k else [str(i) for i in range(k)]
        bottom = [0] * len(hist)
        for j in range(k):
            ys = [h[j] if j < len(h) else 0 for h in hist]
            ax.bar(xs, ys, bottom=bottom, label=names[j])
            bottom = [b + y for b, y in zip(bottom, ys)]
        if k <= 12:
            ax.legend(fontsize=7, title="label")
        rows = [{"client": i, "examples": sizes[i], **{names[j]: (h[j] if j < len(h) else 0) for j in range(k)}}
                for i, h in enumerate(hist)]
        caption = "Training examples of each label per client (the partition)."
    else:
        ax.bar(xs, sizes)
        rows = [{"client": i, "examples": s} for i, s in enumerate(sizes)]
        caption = "Training examples per client (label histograms not kept for this run)."
    ax.set_xlabel("client")
    ticks = xs if len(xs) <= 20 else xs[:: max(1, len(xs) // 10)]
    ax.set_xticks(ticks, [str(i) for i in ticks], fontsize=7)
    ax.set_ylabel("examples")
    ax.grid(True, axis="y", alpha=0.3)
    if part.get("natural_ids"):  # data.partition = 'natural': each client's value, the spread
        for row, value in zip(rows, part["natural_ids"]):
            row[part.get("client_column") or "value"] = value
        spread = part.get("size_spread") or {}
        caption = (f"One client per value of {part.get('client_column')!r} (natural partition); "
                   + ", ".join(f"{k} {v:g}" for k, v in spread.items()) + " examples per client"
                   + (f"; {part['left_out_clients']} clients below min_partition_size left out"
                      if part.get("left_out_clients") else "") + ".")
    return View("Partition: label histogram", svg(fig), rows, caption)


def run_views(folder: Path) -> tuple[dict, list[dict], dict, list[View]]:
    config, metrics, summary = read_run(folder)
    primary = primary_metric(summary)
    rounds = [m.get("round", i + 1) for i, m in enumerate(metrics)]
    views = [_results_view(summary)]
    test_final = summary.get(f"test_{primary}")
    curves = {f"dev {primary}": _series(metrics, f"dev_{primary}")}
    if any(v is not None for v in _series(metrics, f"test_{primary}")):
        curves[f"test {primary}"] = _series(metrics, f"test_{primary}")
    views.append(line_view(f"{primary} per round", rounds, curves, xlabel="round", ylabel=primary,
                           caption=f"Final test {primary}: {_fmt(test_final)}."))
    if metrics and all(m.get("sim_time_s") is not None for m in metrics):  # [devices]
        views.append(line_view(f"{primary} against simulated time", _series(metrics, "sim_time_s"),
                               curves, xlabel="simulated seconds", ylabel=primary,
                               x_key="simulated s", caption=(
                                   "Devices on the simulated clock (docs/time.md): each round "
                                   f"ends when its policy stops waiting; the run took "
                                   f"{_fmt(summary.get('sim_time_s'))} simulated s, "
                                   f"{summary.get('wasted_share') or 0:.1%} of the client FLOPs "
                                   "wasted on dropped replies.")))
    views.append(line_view("Loss per round", rounds, {"train (clients' mean)": _series(metrics, "train_loss"),
                                                       "dev": _series(metrics, "dev_loss")},
                           xlabel="round", ylabel="loss"))
    views.append(line_view("Bytes per round", rounds,
                           {"down MB/client": _series(metrics, "bytes_down_mean", 1e-6),
                            "up MB/client": _series(metrics, "bytes_up_mean", 1e-6)},
                           xlabel="round", ylabel="MB per client",
                           caption="Mean over the clients whose reply was used."))
    views.append(line_view("FLOPs per round", rounds,
                           {"analytic GFLOPs/client": _series(metrics, "flops_analytic_mean", 1e-9),
                            "measured GFLOPs/client": _series(metrics, "flops_measured_mean", 1e-9)},
                           xlabel="round", ylabel="training GFLOPs per client"))
    views.append(_client_costs(metrics))
    labels = None
    if (folder / "labels.json").is_file():
        labels = json.loads((folder / "labels.json").read_text()).get("names")
    part = _partition_view(folder, labels)
    if part is not None:
        views.append(part)
    if summary.get("plans"):
        from fedslice.methods.plan_report import plans_view
        views.append(plans_view(summary["plans"]))
    if summary.get("samples"):
        views.append(_samples_view(summary["samples"]))
    views.extend(method_views(folder, config, metrics, summary))
    harness = _harness_view(folder)
    if harness is not None:
        views.append(harness)
    views.append(View("Config", None, [], "The resolved experiment config (config.json)."))
    return config, metrics, summary, views


def _harness_view(folder: Path) -> View | None:
    rows = harness_rows(folder)
    if rows is None:
        return None
    caption = ("harness.json (fedslice evaluate --harness): lm-evaluation-harness scores of the "
               "trained model; base: the untrained model on the same examples (--baseline)."
               if rows else "harness.json is damaged: evaluate again with --harness.")
    return View("lm-evaluation-harness", None, rows, caption)


def method_views(folder: Path, config: dict, metrics: list[dict], summary: dict) -> list[View]:
    from fedslice.methods import METHODS, method_class
    name = (config.get("method") or {}).get("name")
    if name not in METHODS:
        return []
    return list(method_class(name).report_views(folder, config, metrics, summary))


def write_run_report(folder: str | Path) -> Path:
    """Write ``report.html`` into a finished run folder; return its path."""
    folder = Path(folder)
    config, metrics, summary, views = run_views(folder)
    cfg_view = views[-1]
    views = views[:-1]
    config_html = (f'<section class=view id="config"><h2>{html.escape(cfg_view.title)}</h2>'
                   f"<p class=caption>{html.escape(cfg_view.caption)}</p>"
                   f"<pre>{html.escape(json.dumps(config, indent=2))}</pre></section>")
    files = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != REPORT)
    links = "".join(f'<li><a href="{html.escape(n)}">{html.escape(n)}</a></li>' for n in files)
    extra = config_html + f'<section id="files"><h2>Files</h2><ul>{links}</ul></section>'
    model = (config.get("model") or {}).get("name")
    sub = (f"method {summary.get('method')}, task {summary.get('task')}, model {model}, "
           f"{summary.get('rounds')} rounds, seed {summary.get('seed')}")
    text = page(f"fedslice run: {summary.get('name') or folder.name}", sub, views, extra)
    out = folder / REPORT
    tmp = out.with_name(f".{REPORT}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(out)
    return out


# --------------------------------------------------------------------------------------------
# Several runs
# --------------------------------------------------------------------------------------------

def write_compare_report(runs: Sequence[Path], out: str | Path, title: str = "fedslice compare") -> Path:
    """One page over several run folders: the results table, dev metric and cumulative MB per
    round overlaid, links to each run's own report."""
    runs = [Path(r) for r in runs]
    out = Path(out)
    data = [read_run(r) for r in runs]
    rows = []
    for r, (_, _, summary) in zip(runs, data):
        row = summary_row({**summary, "name": summary.get("name") or r.name})
        rows.append(row)
    views = [View("Results", None, rows, "One row per run (same partition and seed).")]
    primary = primary_metric(data[0][2]) if data else "accuracy"
    fig, (ax_m, ax_b) = figure(ncols=2, width=8.0)
    metric_rows, byte_rows = [], []
    for r, (_, metrics, summary) in zip(runs, data):
        name = summary.get("name") or r.name
        xs = [m.get("round", i + 1) for i, m in enumerate(metrics)]
        ys = _series(metrics, f"dev_{primary}")
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
        if pts:
            ax_m.plot(*zip(*pts), marker="o", markersize=3, label=name)
        total, cum = 0.0, []
        for m in metrics:
            total += ((m.get("bytes_down_mean") or 0) + (m.get("bytes_up_mean") or 0)) / 1e6
            cum.append(total)
        ax_b.plot(xs, cum, label=name)
        metric_rows += [{"run": name, "round": x, f"dev {primary}": y} for x, y in zip(xs, ys)]
        byte_rows += [{"run": name, "round": x, "cumulative MB/client": c} for x, c in zip(xs, cum)]
    for ax, label in ((ax_m, f"dev {primary}"), (ax_b, "cumulative MB per client (down + up)")):
        ax.set_xlabel("round")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    views.append(View(f"dev {primary} and communication per round", svg(fig), metric_rows + byte_rows))
    if data and all(ms and all(m.get("sim_time_s") is not None for m in ms) for _, ms, _ in data):
        views.append(_time_to_accuracy(runs, data, primary))
    links = "".join(f'<li><a href="{html.escape(_rel(r / REPORT, out.parent))}">'
                    f"{html.escape(r.name)}</a></li>" for r in runs if (r / REPORT).is_file())
    extra = f'<section id="runs"><h2>Run reports</h2><ul>{links}</ul></section>' if links else ""
    text = page(title, f"{len(runs)} runs", views, extra)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(out)
    return out


def _time_to_accuracy(runs: Sequence[Path], data: list, primary: str) -> View:
    """Runs with devices (docs/time.md): the dev metric against simulated time, overlaid."""
    fig, (ax,) = figure()
    rows = []
    for r, (_, metrics, summary) in zip(runs, data):
        name = summary.get("name") or r.name
        pts = [(m["sim_time_s"], m[f"dev_{primary}"]) for m in metrics
               if m.get(f"dev_{primary}") is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", markersize=3, label=name)
        rows += [{"run": name, "simulated s": t, f"dev {primary}": y} for t, y in pts]
    ax.set_xlabel("simulated seconds")
    ax.set_ylabel(f"dev {primary}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return View(f"dev {primary} against simulated time", svg(fig), rows,
                "Time to accuracy on the simulated clock: each run's devices, round policy and "
                "wasted work are in its summary (sim_time_s, sim_time_to_target_s, wasted_share).")


def _rel(path: Path, start: Path) -> str:
    import os
    return os.path.relpath(path, start)


def write_reports(paths: Sequence[str | Path]) -> list[Path]:
    """``report.html`` in every run folder found at ``paths`` (run folders or folders of runs),
    and a compare report in a single folder of several runs (``fedslice report``)."""
    from fedslice.report import find_runs
    roots = [Path(p) for p in paths]
    runs = [r for root in roots for r in find_runs(root)]
    out = [write_run_report(r) for r in runs]
    if len(runs) > 1 and len(roots) == 1 and roots[0] not in runs:
        out.append(write_compare_report(runs, roots[0] / REPORT, f"fedslice compare: {roots[0].name}"))
    return out
