"""Which image size for DINOv2-S/14 on Fashion-MNIST on CPU (issue 26's resolution choice).

DINOv2 cuts images into 14 px patches and interpolates its position table to any grid, so the
tokens per image, and every cost with them, are (S / 14)^2 + 1: 10 at 42 px, 17 at 56 px, 65 at
112 px, 257 at 224 px. The 28 px originals carry no detail above 28 px, but the backbone was
trained on 224-518 px images. This measures, for each size S: a linear probe of the frozen
backbone's features ([CLS] ++ mean of the patch tokens, what Dinov2ForImageClassification's
classifier reads) trained on ``--train`` images and scored on ``--test`` test images (seeded
samples; full-batch multinomial logistic regression, L-BFGS), the measured forward FLOPs per image,
the forward time per image and a full fine-tuning step of 32 images (1 thread, the load stated). Images go through fedslice's
pipeline (IDX reader, DINOv2's image processor at size S).

    .venv/bin/python bench/fmnist_resolution.py --sizes 42 56 112 --out bench/results/fmnist_resolution
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from fedslice.config import DataConfig, ModelConfig
from fedslice.data.images import Preprocessor, encode_images, load_image_splits
from fedslice.data.partition import sample_rows
from fedslice.measure import count_flops
from fedslice.models.loading import load_model

ROOT = Path(__file__).resolve().parents[1]


def probe(train_x, train_y, test_x, test_y, classes: int = 10, l2: float = 1e-3) -> float:
    """Test accuracy of a multinomial logistic regression on standardised features."""
    mu, sd = train_x.mean(0), train_x.std(0) + 1e-6
    a, b = (train_x - mu) / sd, (test_x - mu) / sd
    w = torch.zeros(a.shape[1], classes, requires_grad=True)
    bias = torch.zeros(classes, requires_grad=True)
    opt = torch.optim.LBFGS([w, bias], max_iter=500, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(a @ w + bias, train_y) + l2 * w.square().sum()
        loss.backward()
        return loss
    opt.step(closure)
    with torch.no_grad():
        return float(((b @ w + bias).argmax(1) == test_y).float().mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", type=int, default=[42, 56, 112])
    p.add_argument("--train", type=int, default=2000)
    p.add_argument("--test", type=int, default=1000)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fmnist_resolution")
    args = p.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    loaded = load_model(ModelConfig(name=str(ROOT.parent / "shared" / "models" / "dinov2-small")), 10, 0,
                        head="image_classification")
    model, arch = loaded.model.eval(), loaded.arch
    raw = load_image_splits(DataConfig(path="fashion_mnist"), seed=0)
    raw = {"train": raw["train"].select(sample_rows(len(raw["train"]), args.train, 0)),
           "test": raw["test"].select(sample_rows(len(raw["test"]), args.test, 0))}
    rows = []
    for size in args.sizes:
        data = encode_images(raw, Preprocessor(loaded.tokenizer, size, 3),
                             lambda h, w: arch.image.tokens(model.config, h, w), skip_bad=False,
                             cache_dir=None)
        load0, t0 = os.getloadavg()[0], time.perf_counter()
        feats = {}
        with torch.no_grad():
            for split, d in data.items():
                out = []
                for lo in range(0, len(d), 100):
                    h = model.dinov2(d.collate(range(lo, min(lo + 100, len(d))))["pixel_values"]).last_hidden_state
                    out.append(torch.cat([h[:, 0], h[:, 1:].mean(1)], 1))
                feats[split] = torch.cat(out)
        per_image = (time.perf_counter() - t0) / sum(len(d) for d in data.values())
        with torch.no_grad(), count_flops() as fc:
            model.dinov2(data["train"].collate([0])["pixel_values"])
        acc = probe(feats["train"], data["train"].labels, feats["test"], data["test"].labels)
        model.train()
        batch = data["train"].collate(range(32))
        times = []
        for _ in range(3):
            t = time.perf_counter()
            model(**{k: v for k, v in batch.items() if k != "attention_mask"}).loss.backward()
            times.append(time.perf_counter() - t)
        model.zero_grad(set_to_none=True)
        model.eval()
        rows.append({"size": size, "tokens": data["train"].tokens, "probe_test_accuracy": acc,
                     "forward_ms_per_image": 1000 * per_image, "forward_gflops_per_image": fc.total / 1e9, "train_step_s_b32": min(times[1:]),
                     "loadavg": [load0, os.getloadavg()[0]]})
        print(rows[-1], flush=True)
    lines = [f"Linear probe of frozen DINOv2-S/14 features on Fashion-MNIST ({args.train} train / "
             f"{args.test} test images, seeded), 1 thread.", "",
             "| size px | tokens | probe test acc % | forward GFLOPs/image (measured) | forward ms/image "
             "| full FT step (32 images) s | load |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['size']} | {r['tokens']} | {100 * r['probe_test_accuracy']:.1f} | "
              f"{r['forward_gflops_per_image']:.2f} | {r['forward_ms_per_image']:.1f} | {r['train_step_s_b32']:.2f} | "
              f"{r['loadavg'][0]:.1f}/{r['loadavg'][1]:.1f} |" for r in rows]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
