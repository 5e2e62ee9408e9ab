"""Diagnostic (issue 35 part 2): does the full 72-head model that is evaluated differ from the
pruned sub-networks that ``prune = "forward"`` clients train?

``train``: runs one variant of ``bench/heads_modes.py`` in-process (same config, same figures;
20 SST-2 rounds of forward75-per_layer seed 0 scores what heads_modes.py scores; ``--task
e2e_rating --rounds 12``: its E2E customer-rating setting) and saves the
final global state to ``--out/states/STATE.pt``.

``probe``: loads that state into the global model and, for ``--clients`` clients (seeded), scores
their heads on their local data (Eq. 6, as a client of the next round would), cuts the sub-model
they would train and reports, on the 872 SST-2 validation sentences:

* test accuracy / loss / per-class accuracy of the full model and of each sub-model (with and
  without rescaling the kept heads' outputs by heads/kept per layer, as inverted dropout does);
* per layer, the norm of the attention output (o projection without its bias) under the mask and
  in the full model, their cosine, and the least-squares scale c* = <full, sub>/|sub|^2 that best
  maps the sub-model's attention output onto the full model's (inputs of the layer: the sub-model's
  own hidden states for "sub", the full model's for "full"; the per-layer comparison below feeds
  both the full model's layer input, so it isolates the layer's own head cut);
* cosine of the classifier's input (CLS after the last layer) between sub-model and full model.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/heads_forward_diag.py train --variant forward75-per_layer
    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/heads_forward_diag.py probe --variant forward75-per_layer
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from heads_modes import config, e2e_rating_data, variants  # noqa: E402

from fedslice.api import setup  # noqa: E402
from fedslice.experiment import validate_config  # noqa: E402
from fedslice.run.engine import Simulation  # noqa: E402
from fedslice.slicing.heads import mask_spec  # noqa: E402
from fedslice.slicing.surgery import extract_model  # noqa: E402
from fedslice.tasks.classification import evaluate_classifier  # noqa: E402


def make(args, variant: str, extra: dict | None = None):
    ns = SimpleNamespace(rounds=args.rounds, e2e_rounds=args.rounds, local_steps=10, clients_per_round=2,
                         e2e_clients=20, lr=args.lr, e2e_lr=3e-3, eval_every=args.rounds, dev_examples=256,
                         importance_examples=128, target=0.8, threads=1, track_test=False, server_opt="none", server_opt_lr=None,
                         seed=args.seed, out=args.out)
    opts = {**variants(per_layer=True)[variant], **(extra or {})}
    data_dir = e2e_rating_data(args.out)[0] if args.task == "e2e_rating" else None
    cfg = config(args.task, f"diag-{args.task}-{variant}-s{args.seed}", opts, ns, data_dir)
    cfg["compute"] = {"workers": 1}
    cfg = validate_config(cfg)
    return cfg, *setup(cfg)


def state_path(args, variant: str) -> Path:
    folder = args.out / "states"  # not committed (bench/results/*/*/)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{args.task}-{variant}-s{args.seed}-r{args.rounds}{args.tag}.pt"


def train(args) -> None:
    cfg, method, data = make(args, args.variant, json.loads(args.extra) if args.extra else None)
    state, records, summary = Simulation(cfg, method, data).run()
    torch.save(state, state_path(args, args.variant))
    print(json.dumps({"test_accuracy": summary["test_accuracy"],
                      "train_loss": [round(r["train_loss"], 4) for r in records if r.get("train_loss") is not None]}))


def o_module(arch, model, layer: int):
    return arch.part(model, layer, "o")


@torch.no_grad()
def capture(arch, model, batch, layers: int):
    """(per-layer o outputs without bias, CLS hidden state before the classifier)."""
    outs, hooks = {}, []
    for i in range(layers):
        o = o_module(arch, model, i)
        hooks.append(o.register_forward_hook(
            lambda m, inp, out, i=i: outs.__setitem__(i, (out - (m.bias if m.bias is not None else 0)).detach())))
    # (a forward hook that adds a shift shows here too: "sub" is then what the next layer gets)
    res = model(**batch, output_hidden_states=True)
    for h in hooks:
        h.remove()
    return outs, res.hidden_states[-1][:, 0], res.logits


def scale_hooks(arch, sub, kept: torch.Tensor):
    """Multiply the input of each pruned layer's o projection by heads/kept (inverted dropout)."""
    hs = []
    for i in range(kept.shape[0]):
        k = int(kept[i].sum())
        if 0 < k < kept.shape[1]:
            c = kept.shape[1] / k
            hs.append(o_module(arch, sub, i).register_forward_pre_hook(lambda m, a, c=c: (a[0] * c,) + a[1:]))
    return hs


@torch.no_grad()
def o_input_means(arch, model, data, n: int, seed: int, layers: int) -> list[torch.Tensor]:
    """Per layer, the mean input of the o projection (the heads' concatenated outputs) over the
    real tokens of (a seeded sample of ``n`` of) ``data``, in the full model."""
    from fedslice.data.batching import iter_batches
    from fedslice.data.partition import sample_rows
    if n < len(data):
        data = data.subset(sample_rows(len(data), n, seed))
    sums, count, cur = [0.0] * layers, 0, {}
    hs = [o_module(arch, model, i).register_forward_pre_hook(
        lambda m, a, i=i: sums.__setitem__(i, sums[i] + (a[0] * cur["m"][..., None]).sum((0, 1))))
        for i in range(layers)]
    for batch in iter_batches(data, torch.argsort(data.lengths, stable=True), 32, shuffle=False, generator=None):
        batch.pop("labels", None)
        cur["m"] = batch["attention_mask"].float()
        count += int(batch["attention_mask"].sum())
        model(**batch)
    for h in hs:
        h.remove()
    return [s / count for s in sums]


def mean_hooks(arch, sub, model, kept: torch.Tensor, means, head_dim: int):
    """Add the pruned heads' mean contribution W_o[:, pruned] @ mean (mean-ablation) to each
    pruned layer's o output in the sub-model."""
    hs = []
    for i in range(kept.shape[0]):
        if bool(kept[i].all()):
            continue
        pruned = ~torch.repeat_interleave(kept[i], head_dim)
        shift = o_module(arch, model, i).weight[:, pruned] @ means[i][pruned]
        hs.append(o_module(arch, sub, i).register_forward_hook(lambda m, a, out, s=shift: out + s))
    return hs


def probe(args) -> None:
    cfg, method, data = make(args, args.variant)
    state = torch.load(state_path(args, args.variant))
    model = method.eval_model(state)
    model.eval()
    arch = method.arch
    L = method.all_dims[0]["num_layers"]
    out = {"full": evaluate_classifier(model, data.test, 256)}
    print("full", out["full"], flush=True)
    g = torch.Generator().manual_seed(args.seed + 1234)
    clients = torch.randperm(len(data.partitions), generator=g)[:args.clients].tolist()
    # one batch of test sentences for the activation statistics
    from fedslice.data.batching import iter_batches
    from fedslice.tasks.base import length_order
    batch = next(iter(iter_batches(data.test, length_order(data.test)[::3][:256], 256, shuffle=False, generator=None)))
    batch.pop("labels", None)
    mask = batch["attention_mask"].bool()
    f_outs, f_cls, f_logits = capture(arch, model, batch, L)
    rows = []
    for cid in clients:
        alpha, _ = method.importance(data.client(cid), args.seed, model)
        kept = method.keep(alpha, args.seed)
        sub = extract_model(model, mask_spec(kept, method.all_dims), arch)
        sub.eval()
        row = {"client": cid, "kept": kept.sum(1).tolist()}
        means = o_input_means(arch, model, data.client(cid), 128, args.seed, L)
        for key in ("plain", "scaled", "mean"):
            hs = scale_hooks(arch, sub, kept) if key == "scaled" else \
                mean_hooks(arch, sub, model, kept, means, method.all_dims[0]["head_dim"]) if key == "mean" else []
            row[key] = evaluate_classifier(sub, data.test, 256)
            s_outs, s_cls, s_logits = capture(arch, sub, batch, L)
            per = []
            for i in range(L):
                a, b = s_outs[i][mask], f_outs[i][mask]  # (tokens, hidden)
                per.append({"norm_sub": float(a.norm(dim=-1).mean()), "norm_full": float(b.norm(dim=-1).mean()),
                            "cos": float(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean()),
                            "c_star": float((a * b).sum() / (a * a).sum())})
            row[key]["layers"] = per
            row[key]["cls_cos"] = float(torch.nn.functional.cosine_similarity(s_cls, f_cls, dim=-1).mean())
            row[key]["cls_norm_ratio"] = float(s_cls.norm(dim=-1).mean() / f_cls.norm(dim=-1).mean())
            row[key]["pos_rate"] = float((s_logits.argmax(-1) == 1).float().mean())
            for h in hs:
                h.remove()
        # the layer's own cut: every layer fed the full model's input, o output of kept heads only
        row["isolated"] = []
        for i in range(L):
            cols = torch.repeat_interleave(kept[i], method.all_dims[0]["head_dim"])
            o = o_module(arch, model, i)
            captured = {}
            hk = o.register_forward_pre_hook(lambda m, a: captured.__setitem__("x", a[0]))
            with torch.no_grad():
                model(**batch)
            hk.remove()
            x = captured["x"][mask]
            full = x @ o.weight.T
            part = (x * cols) @ o.weight.T
            part_mean = part + (means[i] * ~cols) @ o.weight.T
            row["isolated"].append({"ratio_norm": float(part.norm(dim=-1).mean() / full.norm(dim=-1).mean()),
                                    "cos_mean": float(torch.nn.functional.cosine_similarity(part_mean, full, dim=-1).mean()),
                                    "ratio_norm_mean": float(part_mean.norm(dim=-1).mean() / full.norm(dim=-1).mean()),
                                    "cos": float(torch.nn.functional.cosine_similarity(part, full, dim=-1).mean()),
                                    "c_star": float((part * full).sum() / (part * part).sum())})
        rows.append(row)
        print(json.dumps({k: (v if k in ("client", "kept") else
                              ({kk: vv for kk, vv in v.items() if kk != "layers"} if isinstance(v, dict) else
                               [{kk: round(vv, 3) for kk, vv in d.items()} for d in v]))
                          for k, v in row.items()}), flush=True)
        for key in ("plain", "scaled", "mean"):
            print(key, [{k: round(v, 3) for k, v in d.items()} for d in row[key]["layers"]], flush=True)
    full_pos = float((f_logits.argmax(-1) == 1).float().mean())
    out["full"]["pos_rate_batch"] = full_pos
    out["clients"] = rows
    (args.out / f"probe-{state_path(args, args.variant).stem}.json").write_text(json.dumps(out, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["train", "probe"])
    p.add_argument("--variant", default="forward75-per_layer")
    p.add_argument("--task", default="sst2", choices=["sst2", "e2e_rating"],
                   help="e2e_rating: lr 3e-3 and 20 clients, as heads_modes.py (probe: SST-2 only)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3, help="federation.lr of SST-2 (e2e_rating: 3e-3)")
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--extra", default="", help="JSON of extra method options (train)")
    p.add_argument("--tag", default="", help="suffix of the state file")
    p.add_argument("--out", type=Path, default=Path("bench/results/heads_forward_diag"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    {"train": train, "probe": probe}[args.what](args)


if __name__ == "__main__":
    main()
