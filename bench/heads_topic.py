"""Benchmark + diagnosis: the two ``heads`` pruning modes on a 4-class topic task.

The task: a synthetic, locally built AG-News-like topic data set (world / sports / business /
sci-tech news sentences from topic vocabularies mixed with shared filler and 25% words of other
topics; headerless TSV, labels as words), so it runs offline. The set-up of issue 15: MiniLM-L6,
50 clients, Dirichlet 1.0, 5 per round, 10 rounds x 6 local steps, max length 64.

    .venv/bin/python bench/heads_topic.py data  --out /tmp/topic          # the TSV files
    .venv/bin/python bench/heads_topic.py run   --out /tmp/topic [--variants ...]
    .venv/bin/python bench/heads_topic.py probe --out /tmp/topic          # why 'forward' fails

``probe`` scores heads on one client's data as that client would, builds its 90% sub-model in
both modes and measures on 512 training sentences: the [CLS] vectors' spread across inputs and a
linear probe's accuracy (least squares on the pooled output, fitted on half, tested on the other)
-- whether the classifier can still see the text at all. ``results.md`` collects both.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

TOPICS = {
    "world": "government minister election president troops embassy treaty parliament protest "
             "refugees diplomats ceasefire border rebels sanctions capital opposition vote "
             "military summit prime war peace officials united nations".split(),
    "sports": "team coach season goal championship match player league tournament victory "
              "striker referee stadium fans olympic medal final cup quarterback innings score "
              "defender title race champion".split(),
    "business": "shares profit market company investors quarter earnings merger stocks bank "
                "revenue economy prices oil dollar sales retailer acquisition billion deal "
                "inflation growth bonds analysts firm".split(),
    "scitech": "software researchers computer internet launch space chip study scientists data "
               "microsoft google satellite nasa virus network phone genome robot browser "
               "security update laboratory planet wireless".split(),
}
FILLER = ("the a on in after before as said reported new first week year people two three "
          "some more over for with from about report officials monday tuesday thursday").split()
TEMPLATES = ["{a} {f} {b} {f} {c} {f} {d}", "{f} {a} {b} {f} {f} {c} {d} {f}",
             "{a} {b} {f} {c} {f} {f} {d} {e}", "{f} {f} {a} {f} {b} {c} {f} {d} {e} {f}"]


def sentence(rng: random.Random, topic: str) -> str:
    others = [t for t in TOPICS if t != topic]

    def word() -> str:
        pool = TOPICS[rng.choice(others)] if rng.random() < 0.25 else TOPICS[topic]
        return rng.choice(pool)
    text = rng.choice(TEMPLATES)
    while "{" in text:
        key = text[text.index("{") + 1]
        text = text.replace("{" + key + "}", rng.choice(FILLER) if key == "f" else word(), 1)
    return text.capitalize() + "."


def write_data(out: Path, sizes=(6000, 500, 1000), seed: int = 0) -> Path:
    rng = random.Random(seed)
    folder = out / "data"
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in zip(("train", "dev", "test"), sizes):
        rows = [(sentence(rng, t), t) for t in (rng.choice(list(TOPICS)) for _ in range(n))]
        (folder / f"{split}.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in rows))
    return folder


def config(out: Path, name: str, method: dict, rounds: int = 10) -> dict:
    method = dict(method)
    federation = method.pop("_federation", {})
    return {
        "name": name, "seed": 0, "threads": 1,
        "data": {"path": str(out / "data"), "header": False, "columns": ["text", "label"],
                 "text_columns": ["text"], "max_length": 64, "partition": "dirichlet", "alpha": 1.0,
                 "max_dev_examples": 256},
        "model": {"name": "minilm"},
        "lora": {"r": 16, "alpha": 32, "targets": ["q", "v"]},
        "federation": {"num_clients": 50, "clients_per_round": 5, "rounds": rounds,
                       "local_steps": 6, "batch_size": 16, "lr": 1e-3, **federation},
        "method": method,
        "evaluation": {"every": 1, "batch_size": 64},
        "output": {"dir": str(out / "runs"), "progress": False, "plots": False},
    }


VARIANTS = {
    "fedpetuning": {"name": "fedpetuning"},
    "heads90-parameters": {"name": "heads", "sparsity": 0.9, "prune": "parameters",
                           "importance_max_examples": 64},
    "heads90-forward": {"name": "heads", "sparsity": 0.9, "prune": "forward",
                        "importance_max_examples": 64},
    # Eq. 9 cold start: every client once first (default) vs a forward-only loss probe
    "heads90-lossgap": {"name": "heads", "sparsity": 0.9, "importance_max_examples": 64,
                        "_federation": {"selection": "loss_gap"}},
    "heads90-lossgap-probe": {"name": "heads", "sparsity": 0.9, "importance_max_examples": 64,
                              "_federation": {"selection": "loss_gap", "cold_start": "probe"}},
}


def run(out: Path, names: list[str], rounds: int) -> dict:
    from fedslice.api import run_experiment
    from fedslice.experiment import validate_config
    results = {}
    for name in names:
        folder = out / "runs" / name
        if not (folder / "summary.json").exists():
            run_experiment(validate_config(config(out, name, VARIANTS[name], rounds)))
        summary = json.loads((folder / "summary.json").read_text())
        records = [json.loads(l) for l in (folder / "metrics.jsonl").read_text().splitlines()]
        results[name] = {
            "test_accuracy": summary["test_accuracy"],
            "train_loss": [round(r["train_loss"], 3) for r in records],
            "bytes_up_mean": summary["bytes_up_mean"],
            "flops_measured_mean": summary["flops_measured_mean"],
            "flops_analytic_mean": summary["flops_analytic_mean"],
            "heads_kept_mean": summary.get("heads_kept_mean"),
            "headless_layers_mean": summary.get("headless_layers_mean"),
            "dev_accuracy": [r.get("dev_accuracy") for r in records],
            "probe_flops": sum(r.get("probe_flops", 0.0) for r in records),
        }
        print(name, json.dumps(results[name]), flush=True)
    (out / "runs.json").write_text(json.dumps(results, indent=1))
    return results


@torch.no_grad()
def probe(out: Path) -> dict:
    """Why 'forward' at 90% cannot learn: what of the input reaches the classifier."""
    from fedslice.api import setup
    from fedslice.experiment import validate_config
    from fedslice.data.batching import iter_batches
    from fedslice.slicing.heads import mask_spec
    cfg = validate_config(config(out, "probe", VARIANTS["heads90-forward"]))
    method, data = setup(cfg)
    client = max(range(len(data.partitions)), key=lambda c: len(data.partitions[c]))
    alpha, _ = method.importance(data.client(client), seed=0)
    kept = method.keep(alpha, seed=0)
    rows = torch.randperm(len(data.train), generator=torch.Generator().manual_seed(0))[:512]
    sample = data.train.subset(rows.tolist())
    result = {"client": client, "heads_kept": int(kept.sum()),
              "kept_per_layer": kept.sum(1).tolist(), "headless_layers": int((~kept.any(1)).sum())}
    for mode in ("dense", "parameters", "forward"):
        method.opts.prune = "forward" if mode == "forward" else "parameters"
        model = method.model if mode == "dense" else method.local_model(kept)
        model.eval()
        feats, labels, cls_attention = [], [], []
        for batch in iter_batches(sample, range(len(sample)), 64, shuffle=False, generator=None):
            labels.append(batch.pop("labels"))
            hf = model.get_base_model() if hasattr(model, "get_base_model") else model
            enc = getattr(hf, hf.base_model_prefix)
            o = enc(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            feats.append(o.pooler_output if o.pooler_output is not None else o.last_hidden_state[:, 0])
        x, y = torch.cat(feats).double(), torch.cat(labels)
        result[mode] = {**_spread(x), "probe_accuracy": _linear_probe(x, y)}
    result["across_clients"] = across_clients(method, data, sample)
    result["trained"] = trained_views(out, method, data, kept)
    (out / "probe.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return result


@torch.no_grad()
def across_clients(method, data, sample, n: int = 5) -> dict:
    """Do the 'forward' sub-models of different clients compute the same features? Each client's
    keep-mask (Eq. 6-7 on its own data), the overlap of the kept heads (Jaccard), and a linear
    probe fitted on client i's sub-model features, tested on client j's features of the same
    held-out sentences: FedAvg averages classifier/LoRA updates across these sub-models."""
    from fedslice.data.batching import iter_batches
    clients = sorted(range(len(data.partitions)), key=lambda c: -len(data.partitions[c]))[:n]
    method.opts.prune = "forward"
    masks, feats, y = [], [], None
    for c in clients:
        alpha, _ = method.importance(data.client(c), seed=0)
        masks.append(method.keep(alpha, seed=0))
        model = method.local_model(masks[-1]).eval()
        hf = model.get_base_model() if hasattr(model, "get_base_model") else model
        enc = getattr(hf, hf.base_model_prefix)
        xs, ys = [], []
        for batch in iter_batches(sample, range(len(sample)), 64, shuffle=False, generator=None):
            ys.append(batch.pop("labels"))
            xs.append(enc(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).pooler_output)
        feats.append(torch.cat(xs).double())
        y = torch.cat(ys)
    jac = [float((a & b).sum() / (a | b).sum()) for i, a in enumerate(masks) for b in masks[i + 1:]]
    self_acc = [_linear_probe(f, y) for f in feats]
    cross = [_linear_probe(feats[i], y, test_x=feats[j]) for i in range(n) for j in range(n) if i != j]
    return {"clients": clients, "kept_heads_jaccard_mean": sum(jac) / len(jac),
            "headless_layers": [int((~m.any(1)).sum()) for m in masks],
            "probe_same_submodel": sum(self_acc) / n, "probe_other_clients_submodel": sum(cross) / len(cross)}


def trained_views(out: Path, method, data, kept: torch.Tensor) -> dict:
    """Test accuracy of each run's final global state seen two ways: the full model (what the
    server evaluates) and the 'forward' sub-model of one client's keep-mask (what it trained)."""
    from safetensors.torch import load_file
    views = {}
    for name in ("heads90-forward", "heads90-parameters"):
        weights = out / "runs" / name / "final_trainable.safetensors"
        if not weights.exists():
            continue
        method.load_state(method.trainable(), load_file(str(weights)))
        method.opts.prune = "forward"
        views[name] = {
            "full_model": method.task.evaluate(method.model, data.test, 64)["accuracy"],
            "forward_submodel": method.task.evaluate(method.local_model(kept), data.test, 64)["accuracy"]}
    return views


def _spread(x: torch.Tensor) -> dict:
    """How much the pooled [CLS] vector depends on the input: the ratio of the variance across
    inputs to the squared norm of the mean vector, and the mean pairwise cosine similarity."""
    mean = x.mean(0)
    var = ((x - mean) ** 2).sum(1).mean()
    xn = torch.nn.functional.normalize(x, dim=1)
    cos = (xn @ xn.T).mean()
    return {"variance_over_mean_norm2": float(var / (mean @ mean)), "mean_cosine": float(cos)}


def _linear_probe(x: torch.Tensor, y: torch.Tensor, ridge: float = 1e-3,
                  test_x: torch.Tensor | None = None) -> float:
    """Ridge least squares onto one-hot labels, fitted on the first half, accuracy on the second
    (of ``test_x``, e.g. another model's features of the same sentences, when given)."""
    n = len(x) // 2
    test_x = x if test_x is None else test_x
    mu, sd = x[:n].mean(0), x[:n].std(0) + 1e-8
    ones = torch.ones(len(x), 1, dtype=x.dtype)
    x, t = torch.cat([(x - mu) / sd, ones], 1), torch.cat([(test_x - mu) / sd, ones], 1)
    onehot = torch.nn.functional.one_hot(y, int(y.max()) + 1).double()
    a = x[:n]
    w = torch.linalg.solve(a.T @ a + ridge * n * torch.eye(a.shape[1], dtype=x.dtype), a.T @ onehot[:n])
    return float(((t[n:] @ w).argmax(1) == y[n:]).double().mean())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("data", "run", "probe"))
    ap.add_argument("--out", type=Path, default=Path("bench/results/heads_topic"))
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--rounds", type=int, default=10)
    a = ap.parse_args(argv)
    if a.what == "data" or not (a.out / "data" / "train.tsv").exists():
        print("data:", write_data(a.out))
    if a.what == "run":
        run(a.out, a.variants, a.rounds)
    elif a.what == "probe":
        probe(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
