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
    """``elastic.png`` (:func:`elastic_figure`) written to ``out_path``."""
    return save_figure(elastic_figure(elastic, title, series, fig_axes), Path(out_path))


def elastic_figure(elastic: Sequence[Mapping[str, Any]], title: str = "", series: str | None = None,
                   fig_axes=None):
    """Test (and dev) primary metric of the global model evaluated at several sub-model sizes,
    against the size (FLOPs fraction) and against forward GFLOPs per example."""
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
    return fig


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def elastic_views(summary: Mapping[str, Any], title: str = "") -> list:
    """The report's view of elastic inference (``elastic.png``): the primary metric of the
    global model at every evaluated size."""
    from fedslice.viz import figure_view
    rows = [e for e in summary.get("elastic") or [] if "metric" in e]
    if not rows:
        return []
    metric = rows[0]["metric"]
    table = [{"size": e["size"], f"test {metric}": e.get(f"test_{metric}"),
              f"dev {metric}": e.get(f"dev_{metric}"),
              **{k: e.get(k) for k in ("params", "forward_gflops_per_example", "forward_flops_ratio",
                                       "heads", "ffn")}} for e in rows]
    return [figure_view("Elastic inference (raffm)", elastic_figure(summary["elastic"], title), table,
                        "The trained global model cut to each elastic size (leading heads and "
                        "neurons); `fedslice export --size S` writes one.", png="elastic.png")]


def tier_summary(plans: Mapping[int, Any], per_client: Sequence[Mapping[str, Any]], cost_of) -> list[dict[str, Any]]:
    """Per budget tier of the plans: its clients, the rounds they trained or sat out, the
    sub-model and rank they share (if one), the planned cost (``cost_of(spec)``) and the means
    of the aggregated client costs."""
    import numpy as np

    from fedslice.measure import ClientCost
    tiers = []
    groups = sorted({cp.tier for cp in plans.values()}, key=lambda t: (t is None, t))
    for tier in groups:
        cps = [cp for cp in plans.values() if cp.tier == tier]
        ran = [m for m in per_client if m.get("tier") == tier and not m.get("sat_out")]
        trains = [cp for cp in cps if cp.sits_out is None]
        specs = {cp.knobs.spec for cp in trains}
        entry = {"tier": tier, "budget": cps[0].budget.describe() if tier is not None else cps[0].budget.name,
                 "clients": len(cps), "clients_without_submodel": len(cps) - len(trains),
                 "client_rounds": len(ran),
                 "sat_out_rounds": sum(1 for m in per_client if m.get("tier") == tier and m.get("sat_out"))}
        if len(specs) == 1:
            spec = next(iter(specs))
            entry.update({"spec": spec.describe(), "planned": cost_of(spec).to_dict()})
        tier_ranks = {cp.knobs.rank for cp in trains}
        if len(tier_ranks) == 1 and None not in tier_ranks:
            entry["lora_rank"] = next(iter(tier_ranks))  # summary["plans"] has the plan's costs
        for k in (*ClientCost.AGGREGATED, "bytes_down_frozen"):
            vals = [m[k] for m in ran if m.get(k) is not None]
            entry[f"{k}_mean"] = float(np.mean(vals)) if vals else None
        tiers.append(entry)
    return tiers
