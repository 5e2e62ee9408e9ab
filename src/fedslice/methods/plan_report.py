"""What a planned run shows: ``fedslice plan``'s lines, the summary's predicted against
measured costs per group of clients, the HTML report's view.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedslice.methods.plan_records import ClientPlan, sit_out_summary

_MB = 1e6


def plan_groups(plans: Mapping[int, ClientPlan]) -> list[tuple[list[int], ClientPlan]]:
    """Clients that share a budget and a plan, as (clients, one plan), in order of first client."""
    groups: dict[tuple, list[int]] = {}
    for c, p in sorted(plans.items()):
        key = (p.budget.name, p.budget.field if p.tier is not None else "", p.knobs,
               round(p.gflops_per_round, 6), round(p.memory_mb, 6), None if p.seconds is None else round(p.seconds, 6))
        groups.setdefault(key, []).append(c)
    return [(cs, plans[cs[0]]) for cs in groups.values()]


def render_plans(plans: Mapping[int, ClientPlan], client_sizes: Mapping[int, int] | None = None
                 ) -> list[str]:
    """Lines of ``fedslice plan``: one per group of clients with the same budget and plan, and
    (``client_sizes`` given) how many clients and what share of the examples sit out."""
    lines = []
    for clients, p in plan_groups(plans):
        shown = ", ".join(map(str, clients[:8])) + (", ..." if len(clients) > 8 else "")
        lines.append(f"  {p.budget.name} ({p.budget.describe()}): {len(clients)} client(s) [{shown}]")
        if p.sits_out is not None:
            lines.append(f"    sits out every round, never selected: {p.sits_out}")
            continue
        lines.append(f"    plan: {p.knobs.describe()}")
        lines.append(f"    predicted: {p.memory_mb:.1f} MiB peak, {p.gflops_per_round:.4g} GFLOPs/round, "
                     f"{p.upload_mb:.4g} MB up/round"
                     + (f", {p.seconds:.4g} s/round on its device" if p.seconds is not None else ""))
        lines.append(f"    why: {p.reason}")
        if p.flops_budget is not None:
            lines.append(f"    enforced: at most {p.flops_budget / 1e9:.4g} GFLOPs/round as it trains "
                         "(local steps past it are cut: budgets.enforce_flops)")
        if p.memory_budget is not None:
            lines.append(f"    enforced: at most {p.memory_budget:g} MiB as it trains (a step that would "
                         "pass it runs as micro-batches: budgets.enforce_memory)")
    if client_sizes is not None and (line := sit_out_summary(plans, client_sizes)):
        lines.append(f"  {line}")
    return lines


def plan_report(plans: Mapping[int, ClientPlan], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per group of clients with one budget and plan: the plan, its predicted costs and the
    measured ones over its client-rounds (peak memory: the largest; FLOPs and upload: the mean)."""
    every = [m for r in records for m in r.get("client_metrics", [])]
    per_client = [m for m in every if m.get("used", True)]
    out = []
    for clients, p in plan_groups(plans):
        ran = [m for m in per_client if m.get("client") in set(clients)]

        def values(key):
            return [float(m[key]) for m in ran if m.get(key) is not None]

        mem, up, cut, sim = values("memory_mb"), values("bytes_up"), values("steps_cut"), values("sim_s")
        down = values("plan_downgrades")
        skipped = [1 for m in every if m.get("client") in set(clients) and m.get("memory_skipped")]
        # training and the head stage's importance pass, per client-round
        flops = [float(m["flops_measured"]) + float(m.get("flops_importance") or 0.0)
                 for m in ran if m.get("flops_measured") is not None]
        out.append({"clients": clients, "budget_name": p.budget.name, "budget": p.budget.limits(),
                    "plan": p.knobs.to_dict(), "why": p.reason,
                    "predicted": {"memory_mb": p.memory_mb, "gflops_per_round": p.gflops_per_round,
                                  "upload_mb": p.upload_mb, "seconds": p.seconds},
                    "measured": {"client_rounds": len(ran),
                                 "memory_mb_max": max(mem) if mem else None,
                                 "gflops_per_round_mean": sum(flops) / len(flops) / 1e9 if flops else None,
                                 "upload_mb_mean": sum(up) / len(up) / _MB if up else None,
                                 # a client-round's simulated seconds (runs with devices)
                                 "seconds_mean": sum(sim) / len(sim) if sim else None,
                                 "seconds_max": max(sim) if sim else None,
                                 # client-rounds the FLOPs budget stopped early, steps cut in all
                                 "rounds_cut": sum(x > 0 for x in cut) if cut else None,
                                 "steps_cut": int(sum(cut)) if cut else None,
                                 # steps a memory budget ran as micro-batches, and client-rounds
                                 # it skipped (not one example at a time fitted)
                                 "plan_downgrades": int(sum(down)) if down else None,
                                 "memory_skipped": int(sum(skipped)) if skipped else None}})
    return out


def plans_view(groups: list[dict[str, Any]]):
    """The HTML report's view of a planned run (``summary["plans"]``): per group of clients, its
    budget, plan and why, predicted against measured peak memory, GFLOPs and upload per round."""
    from fedslice.viz import View, figure, svg

    names = [f"{g['budget_name']} ({len(g['clients'])})" for g in groups]
    fig, axes = figure(width=9.0, height=3.0, ncols=3)
    for ax, (key, mkey, label) in zip(axes, (("memory_mb", "memory_mb_max", "peak MiB"),
                                             ("gflops_per_round", "gflops_per_round_mean", "GFLOPs / round"),
                                             ("upload_mb", "upload_mb_mean", "MB up / round"))):
        xs = range(len(groups))
        ax.bar([x - 0.2 for x in xs], [g["predicted"][key] for g in groups], 0.4, label="predicted")
        ax.bar([x + 0.2 for x in xs], [g["measured"][mkey] or 0 for g in groups], 0.4, label="measured")
        ax.set_xticks(list(xs), names, fontsize=7, rotation=20)
        ax.set_title(label, fontsize=9)
    axes[0].legend(fontsize=7)
    rows = [{"group": n, "budget": ", ".join(f"{k} {v:g}" for k, v in g["budget"].items()),
             "plan": ", ".join(f"{k} {v}" for k, v in g["plan"].items() if v is not None),
             **{f"predicted {k}": v for k, v in g["predicted"].items()},
             **{f"measured {k}": v for k, v in g["measured"].items()}, "why": g["why"]}
            for n, g in zip(names, groups)]
    return View("Client plans ([budgets])", svg(fig), rows,
                "Each group of clients with one budget and plan (fedslice plan): predicted costs "
                "against those measured over its client-rounds (peak memory: the largest).")
