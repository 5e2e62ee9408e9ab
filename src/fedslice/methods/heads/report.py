"""What ``heads`` reports after a run (plots, tables), apart from its training code. See
:mod:`fedslice.methods.heads`.
"""

from __future__ import annotations
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal
from fedslice.report import figure, rounds_of, save_figure


def _importance_by_round(metrics: Sequence[Mapping[str, Any]]) -> list[tuple[int, list[tuple[int, Any]]]]:
    """[(round, [(client, (L, H) importance array), ...]), ...] for rounds whose clients report a
    ``head_importance`` (the ``heads`` method); clients in id order."""
    import numpy as np

    out = []
    for r, m in zip(rounds_of(metrics), metrics):
        clients = [(int(c["client"]), np.reshape(c["head_importance"], (-1, int(c["num_heads"]))))
                   for c in m.get("client_metrics") or [] if c.get("head_importance")]
        if clients:
            out.append((r, sorted(clients, key=lambda x: x[0])))
    return out


def plot_head_importance(metrics: Sequence[Mapping[str, Any]], run_dir: str | os.PathLike,
                         rounds: int = 10, title: str = "", max_clients: int = 4) -> list[Path]:
    """``head_importance.png`` and ``head_distance.png`` (:func:`importance_views`) written into
    ``run_dir``; returns the paths ([] when no client reported head importance)."""
    return [save_figure(v.figure, Path(run_dir) / v.png)
            for v in importance_views(metrics, rounds, title, max_clients)]


def importance_views(metrics: Sequence[Mapping[str, Any]], rounds: int = 10, title: str = "",
                     max_clients: int = 4) -> list:
    """``head_importance.png``: a heatmap (rows: layers per attention family; columns: heads)
    of each selected client's importance in the first ``rounds`` rounds (at most ``max_clients``
    per round; kept heads dotted), and ``head_distance.png``: the Euclidean distance between two
    clients' importance vectors per round (the heads paper's Fig. 5), with the mean pairwise
    distance when more clients train; [] when no client reported head importance."""
    import numpy as np

    from fedslice.viz import figure_view
    data = _importance_by_round(metrics)
    if not data or rounds <= 0:
        return []
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
    kept_of = {(r, int(c["client"])): c.get("head_kept") for r, m in zip(rounds_of(metrics), metrics)
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
    cells = [{"round": r, "client": c, "mean importance": float(imp.mean()),
              "heads kept": None if kept_of.get((r, c)) is None else int(np.sum(kept_of[(r, c)]))}
             for r, clients in shown for c, imp in clients[:ncols]]
    heat = figure_view("Head importance per client (heads method)", fig, cells,
                       f"Each client's Eq. 6 importance in the first {len(shown)} rounds (at most "
                       f"{ncols} clients a round; dots: the heads it kept).", png="head_importance.png")

    fig, (ax,) = figure()
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
    rows = [{"round": r, "first two clients": a, "mean over client pairs": b} for r, a, b in zip(xs, two, mean)]
    return [heat, figure_view("Distance between clients' head importance (heads method)", fig, rows,
                              "Euclidean distance of two clients' importance vectors per round "
                              "(the heads paper's Fig. 5).", png="head_distance.png")]


Peft = Literal["lora", "ia3", "prompt_tuning", "p_tuning", "none"]


def table6_rows(hidden: int, tokens: float, rank: int = 0, prompt_tokens: int = 0) -> dict[str, float]:
    """Per-layer OPs of each Table 6 row, forward + backward, exactly as printed."""
    d, T, r, Tp = float(hidden), float(tokens), float(rank), float(prompt_tokens)
    S = Tp + T
    return {
        "qkv": T * d**3 + (T * d**3 + T * d**2),
        "attention": (T**2 * d**2 + T**3 * d) + (T**2 * d**2 + T**3 * d + T**3 * d + T**3 * d),
        "fc": T * d**3 + (T * d**3 + T * d**2),
        "lora": (T * d**2 * r + T * r**2 * d)
                + (T * d**2 * r + T * r * d + T * d * r + T * r**2 * d + T * d**3),
        "ia3": T * d + (T * d + T * d),
        "prompt": (Tp * d**3 + S**2 * d**2 + S**3 * d)
                  + (Tp * d**3 + S**2 * d**2 + S**3 * d + S**3 * d + S**3 * d),
    }


def paper_ops(num_layers: int, hidden: int, tokens: float, *, rank: int = 0, peft: Peft = "lora",
              kept: float | Sequence[float] = 1.0, prompt_tokens: int = 0) -> dict[str, float]:
    """OPs (MACs) of one training step on one sequence of ``tokens`` tokens (Table 6).

    ``kept`` is the fraction of heads kept, one number for every layer or one per layer. Returns
    the summed rows ``qkv``, ``attention``, ``fc``, ``peft`` and their ``total``.
    """
    ks = [float(kept)] * num_layers if isinstance(kept, (int, float)) else [float(k) for k in kept]
    if len(ks) != num_layers:
        raise ValueError(f"kept has {len(ks)} entries for {num_layers} layers")
    row = table6_rows(hidden, tokens, rank, prompt_tokens)
    per_layer_peft = {"lora": row["lora"], "ia3": row["ia3"], "p_tuning": row["prompt"],
                      "prompt_tuning": 0.0, "none": 0.0}[peft]
    out = {"qkv": row["qkv"] * sum(ks), "attention": row["attention"] * sum(ks),
           "fc": row["fc"] * num_layers, "peft": per_layer_peft * sum(ks)}
    if peft == "prompt_tuning":  # printed without the factor L: the prompt enters once
        out["peft"] = row["prompt"] * (sum(ks) / num_layers)
    out["total"] = out["qkv"] + out["attention"] + out["fc"] + out["peft"]
    return out


def head_views(metrics: Sequence[Mapping[str, Any]]) -> list:
    """The report's views of the head stage: Eq. 6 importance per head (mean over every
    client-round that scored heads) and how often each head was kept."""
    import numpy as np

    from fedslice.viz import heatmap_view
    imp, kept = [], []
    for r in metrics:
        for c in r.get("client_metrics") or []:
            if c.get("head_importance") and c.get("num_heads"):
                imp.append(np.reshape(c["head_importance"], (-1, int(c["num_heads"]))))
            if c.get("head_kept") and c.get("num_heads"):
                kept.append(np.reshape(c["head_kept"], (-1, int(c["num_heads"]))))
    views = []
    if imp:
        m = np.mean(imp, axis=0)
        names = [f"row {i}" for i in range(m.shape[0])]
        views.append(heatmap_view(
            "Head importance (heads method)", m, xlabel="head", ylabel="attention layer",
            row_names=names, value="mean importance (Eq. 6)",
            caption=f"Mean over {len(imp)} client-rounds; rows: one per (attention family, "
                    "layer), stack by stack."))
    if kept:
        m = np.mean(kept, axis=0)
        views.append(heatmap_view(
            "Heads kept (heads method)", m, xlabel="head", ylabel="attention layer",
            row_names=[f"row {i}" for i in range(m.shape[0])], value="share of client-rounds kept",
            caption=f"Share of {len(kept)} client-rounds that trained each head."))
    return views
