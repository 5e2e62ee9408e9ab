"""Benchmark (issue 35, part 5): how good a feature extractor is FedPFT's proxy on DINOv2-S +
Fashion-MNIST, against its layer-KD budget and its neuron choice, without federated training.

FedPFT's clients train LoRA on a proxy (25% of the FFN neurons of layers 1-10) and the LoRA is
plugged into the full model. On images the proxy trained to 6.5-15.6 pt under FedPETuning after
5 rounds (BENCHMARKS.md, "Fashion-MNIST + DINOv2-S"). This separates the proxy's own quality from
the federated budget: a linear probe (multinomial logistic regression, L-BFGS, the probe of
``bench/fmnist_resolution.py``) of the frozen features the classifier reads ([CLS] ++ mean of the
patch tokens) of

* the full model (the ceiling the proxy is distilled towards),
* the proxy after ``--kd`` layer-KD steps (0 = no distillation; the others are read from the
  distillation cache that ``bench/fmnist_dinov2.py``'s ``fedpft_kd<N>`` rows filled, or distilled
  now: the same config, so the same cache entry),
* at 0 steps, the proxy with other neuron choices: ``random`` (a seeded random 25%) and
  ``activation`` (the neurons with the largest mean |act(W1 x)| on the probe's training images:
  a data-aware choice, an upper reference for Eq. 8's weight-norm saliency),

plus the relative error of the proxy's features against the full model's on the test images
(||f_proxy - f_full|| / ||f_full||, mean over images). The config is the one of
``bench/fmnist_dinov2.py`` (42 px, seed 0, IID partition), so the proxies are exactly the
benchmark's. Probe: the images of ``--train-clients`` clients (about 513 each) / the benchmark's
2,000 test images.

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python bench/fmnist_proxy_probe.py --kd 0 100 1000 \\
        --out bench/results/fmnist_proxy_probe
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fmnist_dinov2 import config as bench_config  # noqa: E402
from fmnist_resolution import probe  # noqa: E402

from fedslice.api import setup  # noqa: E402
from fedslice.experiment import validate_config  # noqa: E402
from fedslice.methods.fedpft.proxy import build_proxy, proxy_slice  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def bench_args(kd: int):
    return argparse.Namespace(threads=1, test_examples=2000, dev_examples=500, image_size=42, rounds=5,
                              local_steps=4, clients_per_round=5, align_every=3, kd_steps=kd,
                              out=ROOT / "bench" / "results" / "fmnist_kd")


def method_for(kd: int):
    cfg = bench_config("fedpft", "iid", 0, bench_args(kd))
    if kd == 0:
        cfg["method"]["kd"] = "none"
    return setup(validate_config(cfg))


@torch.no_grad()
def features(model, split, batch: int = 100) -> torch.Tensor:
    """The classifier's input (Dinov2ForImageClassification: [CLS] ++ mean of the patch tokens)."""
    head = [m for n, m in model.named_modules() if n.endswith("classifier") and isinstance(m, torch.nn.Linear)][-1]
    got = []
    hook = head.register_forward_pre_hook(lambda m, inp: got.append(inp[0].detach()))
    try:
        model.eval()
        for lo in range(0, len(split), batch):
            b = split.collate(range(lo, min(lo + batch, len(split))))
            model(pixel_values=b["pixel_values"])
    finally:
        hook.remove()
    return torch.cat(got)


@torch.no_grad()
def activation_saliency(method, split, batch: int = 100) -> list[torch.Tensor]:
    """Mean |act(W1 x)| per FFN neuron of every layer of the full model on ``split``."""
    arch, model = method.arch, method.model
    L = arch.all_dims(model.config)[0]["num_layers"]
    sums, hooks = [None] * L, []
    for l in range(L):
        def pre(m, inp, l=l):
            a = inp[0].abs().sum(dim=(0, 1))
            sums[l] = a if sums[l] is None else sums[l] + a
        hooks.append(arch.part(model, l, "ffn_out").register_forward_pre_hook(pre))
    try:
        features(model, split, batch)
    finally:
        for h in hooks:
            h.remove()
    return sums


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kd", nargs="+", type=int, default=[0, 100, 1000])
    p.add_argument("--choices", nargs="*", default=["random", "activation"])
    p.add_argument("--train-clients", type=int, default=4)
    p.add_argument("--test-limit", type=int, default=None, help="first N test images (a smoke run)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fmnist_proxy_probe")
    args = p.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    rows, full = [], None
    for kd in args.kd:
        t0, load0 = time.perf_counter(), os.getloadavg()[0]
        method, data = method_for(kd)
        train = [data.client(c) for c in range(args.train_clients)]
        train_y = torch.cat([s.labels for s in train])
        if args.test_limit:
            data.test = data.test.subset(range(args.test_limit))
        test_y = data.test.labels
        if full is None:
            f_tr = torch.cat([features(method.model, s) for s in train])
            f_te = features(method.model, data.test)
            full = {"te": f_te}
            rows.append({"model": "full DINOv2-S", "kd_steps": None, "choice": None,
                         "probe_test_accuracy": probe(f_tr, train_y, f_te, test_y), "feature_rel_error": 0.0})
            print(rows[-1], flush=True)
        proxies = [("l2 (Eq. 8)", method.proxy)]
        if kd == 0:
            all_dims = method.arch.all_dims(method.model.config)
            L, F = all_dims[0]["num_layers"], all_dims[0]["ffn"]
            for choice in args.choices:
                if choice == "random":
                    g = torch.Generator().manual_seed(0)
                    sal = [torch.rand(F, generator=g) for _ in range(L)]
                else:
                    sal = [s.float() for s in activation_saliency(method, train[0])]
                spec = proxy_slice([sal], all_dims, method.opts.keep_ratio, method.opts.whole_layers)
                proxies.append((choice, build_proxy(method.model, spec, method.arch)))
        for choice, proxy in proxies:
            p_tr = torch.cat([features(proxy, s) for s in train])
            p_te = features(proxy, data.test)
            err = float(((p_te - full["te"]).norm(dim=1) / full["te"].norm(dim=1)).mean())
            row = {"model": "proxy", "kd_steps": kd, "choice": choice,
                   "probe_test_accuracy": probe(p_tr, train_y, p_te, test_y), "feature_rel_error": err,
                   "kd_before_flops": (method.kd_before.flops if method.kd_before is not None and choice.startswith("l2") else None),
                   "kd_before_cached": method.kd_cached, "wall_s": time.perf_counter() - t0,
                   "loadavg": [load0, os.getloadavg()[0]],
                   "proxy_param_fraction": None}
            print(row, flush=True)
            rows.append(row)
    meta = {"train_images": int(sum(len(data.client(c)) for c in range(args.train_clients))),
            "test_images": len(data.test), "date": time.strftime("%Y-%m-%d %H:%M"), "threads": 1}
    lines = [f"Linear probe of frozen features, DINOv2-S/14 + Fashion-MNIST 42 px, {meta['train_images']} "
             f"train images (clients 0-{args.train_clients - 1}, IID seed 0) / {meta['test_images']} test "
             f"images; proxy = 25% of the FFN neurons of layers 1-10; {meta['date']}.", "",
             "| model | layer-KD steps | neuron choice | probe test acc % | feature rel. error vs full | KD TFLOPs |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        kdf = r.get("kd_before_flops")
        lines.append(f"| {r['model']} | {'—' if r['kd_steps'] is None else r['kd_steps']} | {r['choice'] or '—'} | "
                     f"{100 * r['probe_test_accuracy']:.2f} | {r['feature_rel_error']:.3f} | "
                     f"{'—' if not kdf else f'{kdf / 1e12:.1f}'} |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
