"""Plot: the accuracy-versus-budget frontier (issue 34, part 3) from bench/frontier.py's rows.

Reads the seed-0 rows of ``bench/results/frontier_sst2`` and ``bench/results/frontier_e2e`` (the
rows whose budget is one share of every resource: ``<row>@<f>``) and draws, per task, each row's
test metric against the budget share, dense at 1.0 and its target band (SST-2: 1.5 points, E2E:
3 ROUGE-L). A row whose budget no plan fits is drawn as an open marker at the bottom edge.

    .venv/bin/python bench/frontier_plot.py --out docs/img/frontier.png
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: task -> (results folder, metric key, scale, label, target band)
TASKS = {"sst2": ("bench/results/frontier_sst2", "accuracy", 100, "SST-2 / MiniLM-L6: test accuracy (%)", 1.5),
         "e2e": ("bench/results/frontier_e2e", "rougeL", 1, "E2E / SmolLM2-135M: test ROUGE-L", 3.0)}
#: the rows drawn, in legend order (each method alone, then the planner's compositions)
ROWS = ["heads", "raffm", "int8", "int8-work", "planned", "planned-work", "planned-int8-work",
        "planned-depth-work", "planned-int8-depth-work"]
BUDGET = re.compile(r"^(?P<row>[a-z0-9-]+)@(?P<f>[0-9.]+)$")


def read_rows(folder: Path) -> tuple[dict, dict[str, dict[float, dict]]]:
    """(dense row, row -> budget share -> row) of one results folder."""
    dense = json.loads((folder / "dense.json").read_text())
    rows: dict[str, dict[float, dict]] = {}
    for path in folder.glob("*@*.json"):
        m = BUDGET.match(path.stem)
        if m and m["row"] in ROWS:
            rows.setdefault(m["row"], {})[float(m["f"])] = json.loads(path.read_text())
    return dense, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs/img/frontier.png")
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(ROWS, plt.get_cmap("tab10").colors))
    markers = dict(zip(ROWS, "s^Dvo*PXh"))
    fig, axes = plt.subplots(1, len(TASKS), figsize=(11, 4.6))
    handles = {}
    for ax, (task, (folder, key, scale, label, band)) in zip(axes, TASKS.items()):
        dense, rows = read_rows(ROOT / folder)
        ref = scale * dense[key]
        handles["band"] = ax.axhspan(ref - band, ref, color="0.9", label="dense − target (1.5 / 3)")
        handles["dense"] = ax.axhline(ref, color="k", lw=1, label="dense LoRA")
        misses = {}
        for name in ROWS:
            pts = rows.get(name, {})
            fits = sorted((f, scale * r[key]) for f, r in pts.items() if r.get("fits"))
            misses[name] = sorted(f for f, r in pts.items() if not r.get("fits"))
            if fits:
                handles[name], = ax.plot([f for f, _ in fits], [v for _, v in fits], "-", label=name,
                                         marker=markers[name], ms=7, color=colors[name],
                                         lw=2.4 if name.startswith("planned") else 1.2)
        bottom = ax.get_ylim()[0]
        for i, (name, fs) in enumerate(misses.items()):
            if fs:  # side by side at the bottom edge
                handles.setdefault(name, ax.plot([], [], "-", marker=markers[name], color=colors[name],
                                                 label=name)[0])
                ax.plot([f + 0.006 * (i - 3) for f in fs], [bottom] * len(fs), markers[name], mfc="none",
                        ms=8, color=colors[name], clip_on=False)
        ax.set_ylim(bottom, None)
        ax.set_xlabel("client budget (share of dense's memory, FLOPs and upload)")
        ax.set_title(label, fontsize=10)
        ax.set_xticks([0.3, 0.5])
        ax.set_xlim(0.25, 0.55)
        ax.grid(alpha=0.3)
    order = ["dense", "band"] + [n for n in ROWS if n in handles]
    fig.legend([handles[n] for n in order], [handles[n].get_label() for n in order], fontsize=8,
               loc="lower center", ncol=5)
    fig.suptitle("fedslice: accuracy vs client budget (seed 0; open markers on the axis: no plan fits)",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
