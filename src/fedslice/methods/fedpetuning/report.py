"""What ``fedpetuning`` reports after a run (plots, tables), apart from its training code. See
:mod:`fedslice.methods.fedpetuning`.
"""

from __future__ import annotations
from collections.abc import Mapping
from typing import Any
import numpy as np

from fedslice.measure import ClientCost
from fedslice.methods.fedpetuning.strategy import RankPlan


def mean_of(values) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return float(np.mean(vals)) if vals else None


def rank_tiers(plans: Mapping[int, RankPlan], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per tier: its budget, rank, planned cost and the mean measured costs of its client-rounds."""
    per_client = [m for r in records for m in r["client_metrics"] if m.get("used", True)]
    out = []
    for tier in sorted({p.tier for p in plans.values()}):
        cps = {c: p for c, p in plans.items() if p.tier == tier}
        p = next(iter(cps.values()))
        ran = [m for m in per_client if m["client"] in cps]
        entry = {"tier": tier, "budget": p.budget.describe(), "rank": p.rank, "clients": len(cps),
                 "client_rounds": len(ran), "planned": p.cost.to_dict()}
        for k in ClientCost.AGGREGATED:
            entry[f"{k}_mean"] = mean_of(m.get(k) for m in ran)
        out.append(entry)
    return out
