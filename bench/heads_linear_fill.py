"""Probe (issue 35 part 2): can a cheap stand-in for the pruned heads make SmolLM2's 90% forward
sub-model a language model again?

SmolLM2-135M-Instruct + E2E NLG (``configs/e2e_smollm2.toml``), client 0's data. Per layer the
heads method keeps its ``--keep`` most confident query heads (Eq. 6 on 32 local examples; the
per-layer ranking forward mode uses), and the pruned heads' part of the attention output
(their slices of ``o_proj``'s input times their columns of its weight: ``y``, (tokens, hidden))
is replaced by

* ``zero``: nothing (``method.fill = "zero"``, what a forward sub-model computes);
* ``mean``: its mean over calibration tokens (``method.fill = "mean"``);
* ``linear-rN``: ``method.fill = "linear"`` at ``fill_rank = N``: a rank-N linear map of the
  layer's attention input (the normed hidden state that ``q_proj`` reads, plus a constant),
  ridge least squares on calibration tokens of the full model (the ridge ``--ridge``, default
  each layer's own, chosen by two-fold cross-validation over the calibration examples:
  ``method.fill_ridge`` unset), reduced-rank (:func:`fedslice.slicing.heads.linear_fill`; 2 x hidden x N multiply-adds per token, against
  the pruned heads' q and o projections and attention).

Each stand-in is the library's own path: the moments and means collected by
``output_means(..., regression=True)`` over the calibration examples, the sub-model cut by
``extract_model`` and filled by ``fill_pruned_heads``, as a ``prune = "forward"`` client does.
Reported: the task loss on held-out examples of client 0 for the full model and each stand-in
(all layers at once, each layer's map fitted on the full model's own inputs), and its FLOPs per
token per layer, and the ridges the layers chose. No training; a few minutes at 1 thread::

    OMP_NUM_THREADS=1 .venv/bin/python bench/heads_linear_fill.py --out bench/results/heads_linear_fill
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fedslice.api import setup
from fedslice.experiment import load_config, validate_config
from fedslice.slicing.head_fill import fill_pruned_heads, fill_ridge, output_means
from fedslice.slicing.heads import mask_spec
from fedslice.slicing.surgery import extract_model

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keep", type=int, default=1, help="query heads kept per layer (1 of 9: 90%%)")
    p.add_argument("--calibration", type=int, default=64, help="client 0's examples the fills fit on")
    p.add_argument("--examples", type=int, default=16, help="held-out examples of client 0 scored")
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 576])
    p.add_argument("--ridge", type=float, default=None,
                   help="method.fill_ridge (default: unset, each layer's cross-validated ridge)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("bench/results/heads_linear_fill"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(ROOT / "configs/e2e_smollm2.toml").model_dump(mode="json")
    cfg["threads"] = args.threads
    cfg["method"] = {"name": "heads", "prune": "forward", "sparsity": 0.9, "importance_max_examples": 32}
    method, data = setup(validate_config(cfg))
    model = method.model.eval()
    split = data.client(0)
    assert len(split) >= args.calibration + args.examples, len(split)
    arch, dims = method.arch, method.all_dims
    heads, d = model.config.num_attention_heads, model.config.hidden_size
    hd = d // heads
    alpha, _ = method.importance(split, 0)                                        # (L, H)
    kept = torch.zeros_like(alpha, dtype=torch.bool)
    kept.scatter_(1, alpha.argsort(1, descending=True)[:, :args.keep], True)
    held = split.collate(list(range(args.calibration, args.calibration + args.examples)))
    with torch.no_grad(), output_means(model, arch, regression=True) as means:
        for lo in range(0, args.calibration, 8):
            b = split.collate(list(range(lo, min(lo + 8, args.calibration))))
            model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])

    chosen = []  # each layer's cross-validated ridge (what the fill uses without --ridge)
    att = arch.stacks[0].attention[0]
    for j, block in enumerate(arch.blocks(model, 0)):
        o = block.get_submodule(att.o)
        basis = torch.diag((~kept[j].repeat_interleave(hd)).float())             # pruned columns
        with torch.no_grad():
            chosen.append(fill_ridge(means.moments[(0, 0, j)], o(basis) - o(torch.zeros_like(basis[:1]))))
    print("ridges chosen per layer:", chosen, flush=True)

    def loss(fill: str | None, rank: int | None = None) -> float:
        sub = extract_model(model, mask_spec(kept, dims), arch).eval()
        if fill is not None:
            fill_pruned_heads(sub, model, kept, dims, means, arch, rank=rank, ridge=args.ridge)
        with torch.no_grad():
            return float(method.task.loss(sub, held))

    with torch.no_grad():
        full = float(method.task.loss(model, held))
    rows = [{"fill": "none (the full model)", "loss": full, "flops_per_token_layer": 0},
            {"fill": "zero", "loss": loss(None), "flops_per_token_layer": 0},
            {"fill": "mean", "loss": loss("mean"), "flops_per_token_layer": 0}]
    for r in args.ranks:
        rows.append({"fill": f"linear-r{r}", "loss": loss("linear", r),
                     "flops_per_token_layer": 2 * 2 * d * min(r, d)})
    pruned = heads - args.keep
    kv = model.config.num_key_value_heads
    saved = 2 * (d * pruned * hd * 2)  # the pruned heads' q and o projections (fwd, 2 FLOPs per MAC)
    for r in rows:
        print(r, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(
        {"rows": rows, "keep": args.keep, "heads": heads, "kv_heads": kv, "calibration": args.calibration,
         "examples": args.examples, "ridge": args.ridge, "chosen_ridges": chosen,
         "pruned_q_o_flops_per_token_layer": saved}, indent=1))
    md = ["| stand-in for the pruned heads | loss on held-out examples | its FLOPs per token per layer "
          f"(the pruned heads' q + o projections: {saved:,}) |", "|---|---:|---:|"]
    md += [f"| {r['fill']} | {r['loss']:.3f} | {r['flops_per_token_layer']:,} |" for r in rows]
    (args.out / "results.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
