"""Issue 35 part 1: how few examples does heads' importance (Eq. 6) need to rank heads as the
default pass does? Rank agreement of the score on n local examples with the score on 128.

MiniLM-L6 (6 x 12 heads) on SST-2: 8 clients' partitions (100 IID clients); for each, the Eq. 6
score on the first n in {8, 16, 32, 64} of a seeded 128-example sample against the 128-example
score: Spearman rank correlation over the 72 heads, and the overlap of the kept sets at sparsity
0.5 and 0.9 (global top-k). One forward per example in every case; a training step costs about
three forwards, so 32 examples cost about a third of one 32-example step.

    .venv/bin/python bench/heads_importance_sample.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fedslice.api import setup
from fedslice.data.partition import sample_rows
from fedslice.experiment import validate_config
from fedslice.slicing.heads import keep_mask

OUT = Path("bench/results/heads_importance_sample")


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = a.flatten().argsort().argsort().float(), b.flatten().argsort().argsort().float()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def main() -> None:
    torch.set_num_threads(1)
    cfg = validate_config({
        "seed": 0, "data": {"path": "sst2", "max_length": 64, "partition": "iid"},
        "model": {"name": "minilm"}, "lora": {"r": 16, "alpha": 32, "targets": ["q", "v"]},
        "federation": {"num_clients": 100, "clients_per_round": 2, "rounds": 1},
        "method": {"name": "heads", "sparsity": 0.5}})
    method, data = setup(cfg)
    rows = []
    for c in range(8):
        split = data.client(c)
        sample = split.subset(sample_rows(len(split), 128, c))
        ref, _ = method.importance(sample, c)
        for n in (8, 16, 32, 64):
            got, fl = method.importance(sample.subset(torch.arange(n)), c)
            row = {"client": c, "n": n, "spearman": spearman(got, ref), "gflops": fl / 1e9}
            for s in (0.5, 0.9):
                a, b = keep_mask(got, s), keep_mask(ref, s)
                row[f"overlap_{s}"] = float((a & b).sum() / b.sum())
            rows.append(row)
            print(row, flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(rows, indent=1))
    lines = ["| n examples | Spearman vs 128 (mean, min) | kept overlap s=0.5 | kept overlap s=0.9 | GFLOPs |",
             "|---|---|---|---|---|"]
    for n in (8, 16, 32, 64):
        r = [x for x in rows if x["n"] == n]
        mean = lambda k: sum(x[k] for x in r) / len(r)  # noqa: E731
        lines.append(f"| {n} | {mean('spearman'):.3f}, {min(x['spearman'] for x in r):.3f} | "
                     f"{mean('overlap_0.5'):.3f} | {mean('overlap_0.9'):.3f} | {mean('gflops'):.1f} |")
    (OUT / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
