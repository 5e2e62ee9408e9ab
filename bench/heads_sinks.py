"""Probe (issue 15): which heads Eq. 6 keeps on a decoder, and what a forward sub-model of them is.

SmolLM2-135M-Instruct + E2E NLG (``configs/e2e_smollm2.toml``), client 0's data: the heads
method's importance (Eq. 6, on ``--importance-examples`` local examples) with ``sink_keys`` 0 (the
paper's rule) and 1 (the first real token is not a key), then the task loss on ``--examples``
training examples of the ``prune="forward"`` sub-model that keeps the most confident heads, a
random set and the least confident set of the same size, at each ``--sparsity``. Also the Spearman
correlation between a head's confidence and its share of attention on the first real token (the
attention-sink test). No training; a few minutes at 1 thread. Writes ``results.json``/``.md``::

    OMP_NUM_THREADS=1 .venv/bin/python bench/heads_sinks.py --out bench/results/heads_sinks
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from fedslice.api import setup
from fedslice.experiment import load_config, validate_config
from fedslice.slicing.heads import ensure_eager_attention

ROOT = Path(__file__).resolve().parents[1]


def first_token_share(model, batch) -> torch.Tensor:
    """(L, H) mean attention probability on each example's first real token, over later queries."""
    ensure_eager_attention(model)
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    output_attentions=True)
    att = torch.stack(out.attentions)                                   # (L, B, H, T, T)
    mask = batch["attention_mask"].bool()
    share = torch.zeros(att.shape[0], att.shape[2])
    for b in range(att.shape[1]):
        real = mask[b].nonzero().flatten()
        share += att[:, b, :, real[1:], real[0]].mean(-1)                # (L, H)
    return share / att.shape[1]


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = (x.flatten().argsort().argsort().double() for x in (a, b))
    return float(np.corrcoef(ra.numpy(), rb.numpy())[0, 1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sparsity", type=float, nargs="+", default=[0.5, 0.9])
    p.add_argument("--examples", type=int, default=8)
    p.add_argument("--importance-examples", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("bench/results/heads_sinks"))
    args = p.parse_args()
    cfg = load_config(ROOT / "configs/e2e_smollm2.toml").model_dump(mode="json")
    cfg["threads"] = args.threads
    rows, corr = [], {}
    for sink in (0, 1):
        cfg["method"] = {"name": "heads", "prune": "forward", "sparsity": args.sparsity[0],
                         "importance_max_examples": args.importance_examples, "sink_keys": sink}
        method, data = setup(validate_config(cfg))
        split = data.client(0)
        batch = split.collate(list(range(args.examples)))

        def loss(model) -> float:
            model.eval()
            with torch.no_grad():
                return float(method.task.loss(model, batch))

        alpha, _ = method.importance(split, 0)                          # (R, H)
        if sink == 0:
            rows.append({"sink_keys": "-", "sparsity": 0.0, "kept": "all (full model)",
                         "heads": alpha.numel(), "loss": loss(method.model)})
        share = first_token_share(method.model, batch)
        corr[sink] = spearman(alpha, share)
        order = alpha.flatten().argsort(descending=True)
        for s in args.sparsity:
            k = int(round((1 - s) * alpha.numel()))
            g = torch.Generator().manual_seed(0)
            sets = {"most confident (Eq. 7)": order[:k], "random": torch.randperm(alpha.numel(), generator=g)[:k],
                    "least confident": order[-k:]}
            if sink == 1:
                sets = {"most confident (Eq. 7)": sets["most confident (Eq. 7)"]}
            for name, idx in sets.items():
                kept = torch.zeros(alpha.numel(), dtype=torch.bool)
                kept[idx] = True
                kept = kept.view_as(alpha)
                rows.append({"sink_keys": sink, "sparsity": s, "kept": name, "heads": k,
                             "headless_layers": int((~kept.any(1)).sum()),
                             "first_token_share": float(share.flatten()[idx].mean()),
                             "loss": loss(method.local_model(kept))})
                print(rows[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"rows": rows, "spearman": corr}, indent=1))
    md = ["| sink_keys | sparsity | heads kept | which | layers without heads | their attention on the "
          "first token | loss on client 0's first examples |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['sink_keys']} | {r['sparsity']:.0%} | {r['heads']} | {r['kept']} | "
                  f"{r.get('headless_layers', 0)} | {r.get('first_token_share', float('nan')):.2f} | "
                  f"{r['loss']:.3f} |")
    md += ["", "Spearman(confidence, attention on the first token): "
           + ", ".join(f"sink_keys={k}: {v:.3f}" for k, v in corr.items())]
    (args.out / "results.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
