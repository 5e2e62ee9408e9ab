"""Probe (issue 35 part 2): can a cheap stand-in for the pruned heads make SmolLM2's 90% forward
sub-model a language model again?

SmolLM2-135M-Instruct + E2E NLG (``configs/e2e_smollm2.toml``), client 0's data. Per layer the
heads method keeps its ``--keep`` most confident query heads (Eq. 6 on 32 local examples; the
per-layer ranking forward mode uses), and the pruned heads' part of the attention output
(their slices of ``o_proj``'s input times their columns of its weight: ``y``, (tokens, hidden))
is replaced by

* ``zero``: nothing (``method.fill = "zero"``, what a forward sub-model computes);
* ``mean``: its mean over calibration tokens (``method.fill = "mean"``);
* ``linear-rN``: a rank-N linear map of the layer's attention input (the normed hidden state
  that ``q_proj`` reads, plus a constant), fitted by ridge least squares on calibration tokens
  of the full model and truncated to rank N by reduced-rank regression (2 x hidden x N
  multiply-adds per token, against the pruned heads' q and o projections and attention).

Reported: the task loss on held-out examples of client 0 for the full model and each stand-in
(all layers at once, each layer's map fitted on the full model's own inputs), and its FLOPs per
token per layer. No training; a few minutes at 1 thread::

    OMP_NUM_THREADS=1 .venv/bin/python bench/heads_linear_fill.py --out bench/results/heads_linear_fill
"""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager
from pathlib import Path

import torch

from fedslice.api import setup
from fedslice.experiment import load_config, validate_config

ROOT = Path(__file__).resolve().parents[1]


def decoder_layers(model) -> list:
    """SmolLM2 (LLaMA): the decoder blocks (peft wraps the model; ``layers`` is unique)."""
    return next(m for n, m in model.named_modules() if n.endswith("model.layers"))


@contextmanager
def captured(layers):
    """Per layer: q_proj's input (the attention input) and o_proj's input (heads concatenated)."""
    h: dict[int, list] = {i: [] for i in range(len(layers))}
    x: dict[int, list] = {i: [] for i in range(len(layers))}
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.self_attn.q_proj.register_forward_pre_hook(
            lambda m, a, i=i: h[i].append(a[0].detach())))
        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(
            lambda m, a, i=i: x[i].append(a[0].detach())))
    try:
        yield h, x
    finally:
        for k in hooks:
            k.remove()


@contextmanager
def substituted(layers, masks, fills):
    """o_proj sees only the kept heads' slices; its output gets ``fills[i](attention input)``."""
    h: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        hooks.append(attn.q_proj.register_forward_pre_hook(lambda m, a, i=i: h.__setitem__(i, a[0])))
        hooks.append(attn.o_proj.register_forward_pre_hook(lambda m, a, i=i: (a[0] * masks[i],)))
        if fills[i] is not None:
            hooks.append(attn.o_proj.register_forward_hook(lambda m, a, out, i=i: out + fills[i](h[i])))
    try:
        yield
    finally:
        for k in hooks:
            k.remove()


def fit_fills(h: torch.Tensor, y: torch.Tensor, ranks: list[int], ridge: float) -> dict:
    """h: (N, D) attention inputs, y: (N, D) the pruned heads' output: the mean, and rank-r ridge maps."""
    out = {"mean": y.mean(0)}
    hb = torch.cat([h, torch.ones(len(h), 1, dtype=h.dtype)], 1).double()        # (N, D + 1)
    gram = hb.T @ hb + ridge * len(h) * torch.eye(hb.shape[1], dtype=torch.float64)
    a = torch.linalg.solve(gram, hb.T @ y.double())                               # (D + 1, D)
    _, _, vh = torch.linalg.svd(hb @ a, full_matrices=False)                      # reduced-rank
    for r in ranks:
        v = vh[:r].T                                                              # (D, r)
        out[f"linear-r{r}"] = ((a @ v).float(), v.T.float())                      # (D+1, r), (r, D)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keep", type=int, default=1, help="query heads kept per layer (1 of 9: 90%%)")
    p.add_argument("--calibration", type=int, default=64, help="client 0's examples the fills fit on")
    p.add_argument("--examples", type=int, default=16, help="held-out examples of client 0 scored")
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 576])
    p.add_argument("--ridge", type=float, default=1e-3)
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
    layers = decoder_layers(model)
    heads = model.config.num_attention_heads
    hd = model.config.hidden_size // heads
    alpha, _ = method.importance(split, 0)                                        # (L, H)
    kept = torch.zeros_like(alpha, dtype=torch.bool)
    kept.scatter_(1, alpha.argsort(1, descending=True)[:, :args.keep], True)
    masks = [kept[i].repeat_interleave(hd).float() for i in range(len(layers))]   # (H * hd,)
    held = split.collate(list(range(args.calibration, args.calibration + args.examples)))

    def loss(fills) -> float:
        with torch.no_grad(), substituted(layers, masks, fills):
            return float(method.task.loss(model, held))

    full = float(method.task.loss(model, held).detach())
    fitted: list[dict] = []
    with torch.no_grad(), captured(layers) as (hs, xs):
        for lo in range(0, args.calibration, 8):
            b = split.collate(list(range(lo, min(lo + 8, args.calibration))))
            model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
            real = b["attention_mask"].bool()
            for i in range(len(layers)):
                hs[i][-1], xs[i][-1] = hs[i][-1][real], xs[i][-1][real]           # (tokens, D)
        for i, layer in enumerate(layers):
            x = torch.cat(xs[i]) * (1 - masks[i])                                 # pruned slices only
            y = x @ layer.self_attn.o_proj.weight.T                               # (N, D)
            fitted.append(fit_fills(torch.cat(hs[i]), y, args.ranks, args.ridge))

    def linear(pair):
        a, v = pair
        return lambda h: (h @ a[:-1] + a[-1]) @ v

    rows = [{"fill": "none (the full model)", "loss": full, "flops_per_token_layer": 0}]
    rows.append({"fill": "zero", "loss": loss([None] * len(layers)), "flops_per_token_layer": 0})
    rows.append({"fill": "mean", "loss": loss([(lambda h, m=f["mean"]: m) for f in fitted]),
                 "flops_per_token_layer": 0})
    d = model.config.hidden_size
    for r in args.ranks:
        rows.append({"fill": f"linear-r{r}", "loss": loss([linear(f[f"linear-r{r}"]) for f in fitted]),
                     "flops_per_token_layer": 2 * 2 * d * r})
    pruned = heads - args.keep
    kv = model.config.num_key_value_heads
    saved = 2 * (d * pruned * hd * 2)  # the pruned heads' q and o projections (fwd, 2 FLOPs per MAC)
    for r in rows:
        print(r, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(
        {"rows": rows, "keep": args.keep, "heads": heads, "kv_heads": kv, "calibration": args.calibration,
         "examples": args.examples, "ridge": args.ridge,
         "pruned_q_o_flops_per_token_layer": saved}, indent=1))
    md = ["| stand-in for the pruned heads | loss on held-out examples | its FLOPs per token per layer "
          f"(the pruned heads' q + o projections: {saved:,}) |", "|---|---:|---:|"]
    md += [f"| {r['fill']} | {r['loss']:.3f} | {r['flops_per_token_layer']:,} |" for r in rows]
    (args.out / "results.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
