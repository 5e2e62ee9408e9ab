"""Head importance on images: is the class token a key of Eq. 6 or not? (issue 26, heads).

``heads`` scores a head by its confidence: the max attention probability over the allowed keys,
averaged over the queries (Voita et al.; Eq. 6 of the heads paper). In text, special tokens
([CLS], [SEP]) are not allowed keys: heads park attention on them as a no-op. This measures on
pretrained DINOv2-S/14 and Fashion-MNIST (56 px: 16 patches + the class token), per head over
``--images`` training images: the share of attention on the class token (mean over queries),
the confidence with the class token as a key and without it (fedslice's rule), and how the two
rankings of the 72 heads agree (Spearman) — and which heads a 90% sparsity would keep under each.

    .venv/bin/python bench/fmnist_heads_cls.py --images 256 --out bench/results/fmnist_heads_cls
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from fedslice.config import DataConfig, ModelConfig
from fedslice.data.images import Preprocessor, encode_images, load_image_splits
from fedslice.data.partition import sample_rows
from fedslice.models.loading import load_model
from fedslice.slicing.heads import confidence, head_importance, keep_mask

ROOT = Path(__file__).resolve().parents[1]


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=256)
    p.add_argument("--size", type=int, default=56)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fmnist_heads_cls")
    args = p.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig(name=str(ROOT.parent / "shared" / "models" / "dinov2-small"), attn_implementation="eager")
    loaded = load_model(cfg, 10, 0, head="image_classification")
    model, arch = loaded.model.eval(), loaded.arch
    raw = load_image_splits(DataConfig(path="fashion_mnist"), seed=0)["train"]
    raw = raw.select(sample_rows(len(raw), args.images, 0))
    data = encode_images({"train": raw}, Preprocessor(loaded.tokenizer, args.size, 3),
                         lambda h, w: arch.image.tokens(model.config, h, w), skip_bad=False,
                         cache_dir=None)["train"]
    ours = head_importance(model, data, [], batch_size=64)["encoder.self"]  # (L, H): keys = patches
    with_cls = torch.zeros_like(ours)
    cls_share = torch.zeros_like(ours)
    with torch.no_grad():
        for lo in range(0, len(data), 64):
            batch = data.collate(range(lo, min(lo + 64, len(data))))
            atts = model(**{k: v for k, v in batch.items() if k != "labels"}, output_attentions=True).attentions
            mask = batch["attention_mask"]
            with_cls += confidence(atts, mask, mask).sum(0)
            cls_share += torch.stack([a[..., 0].mean(-1) for a in atts], 1).sum(0)  # (L, H)
    with_cls, cls_share = with_cls / len(data), cls_share / len(data)
    a, b = ours.flatten().numpy(), with_cls.flatten().numpy()
    keep_ours = keep_mask(ours, 0.9)
    keep_cls = keep_mask(with_cls, 0.9)
    top_cls_share = cls_share.flatten()[keep_cls.flatten()].mean().item()
    res = {"images": len(data), "tokens": data.tokens, "spearman_with_vs_without_cls": spearman(a, b),
           "mean_cls_share": cls_share.mean().item(), "max_cls_share": cls_share.max().item(),
           "heads_kept_at_90": int(keep_ours.sum()),
           "kept_in_common_at_90": int((keep_ours & keep_cls).sum()),
           "cls_share_of_heads_kept_with_cls_key": top_cls_share,
           "cls_share_of_heads_kept_without": cls_share.flatten()[keep_ours.flatten()].mean().item(),
           "corr_confidence_with_cls_vs_cls_share": float(np.corrcoef(b, cls_share.flatten().numpy())[0, 1]),
           "corr_confidence_without_cls_vs_cls_share": float(np.corrcoef(a, cls_share.flatten().numpy())[0, 1]),
           "per_layer_cls_share": cls_share.mean(1).tolist()}
    (args.out / "results.json").write_text(json.dumps(res, indent=1))
    lines = [f"DINOv2-S/14, {len(data)} Fashion-MNIST training images at {args.size} px ({data.tokens} tokens), "
             "72 heads; Eq. 6 confidence with and without the class token as a key.", "",
             "| measure | value |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" if isinstance(v, float) else f"| {k} | {v} |"
              for k, v in res.items() if k != "per_layer_cls_share"]
    lines += ["", "attention share on the class token per layer: "
              + ", ".join(f"{x:.2f}" for x in res["per_layer_cls_share"])]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
