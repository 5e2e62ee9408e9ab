"""Probe (issue 35 part 2): where do a forward-mode client's updates stop helping the full model?

SmolLM2-135M-Instruct + E2E NLG (``configs/e2e_smollm2.toml``, LoRA r16 on q and v). One client
(client 0) trains one round from the pretrained model, the server aggregates its reply alone,
and the global model's task loss is measured on ``--examples`` examples of client 1 (held out)
for:

* the pretrained model (no update);
* the update as the server applies it (every trained tensor);
* the update of ``q`` only (the ``v`` tensors put back to the pretrained model's) and of ``v``
  only;
* the client's own training model on the same examples, before and after its local steps (the
  heads variants: the model ``local_model`` built, caught on its way into training; under
  ``"forward"`` the sub-model with its stand-in, under ``"parameters"`` the full forward).

Variants (``--variants``): ``dense`` (fedpetuning: the whole model, every head), ``parameters``
(heads at 90%, pruned heads frozen but in the forward pass) and ``forward-linear`` (heads at 90%,
``prune = "forward"``, ``fill = "linear"``: the client trains a sub-model of one query head per
layer with a linear stand-in for the other eight). SmolLM2 groups 3 query heads on each key /
value head (GQA): under ``"forward"`` a client's ``v`` update of a kept query head's value head
also changes the two query heads of its group that the client pruned, which it never saw. If
the ``v`` update is what does not carry over, ``q``-only recovers the loss.

    OMP_NUM_THREADS=1 .venv/bin/python bench/heads_forward_transfer.py --out bench/results/heads_forward_transfer
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fedslice.api import setup
from fedslice.data.batching import iter_batches
from fedslice.data.partition import sample_rows
from fedslice.experiment import load_config, validate_config
from fedslice.tasks.base import batch_examples

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "dense": {"name": "fedpetuning"},
    "parameters": {"name": "heads", "prune": "parameters", "sparsity": 0.9},
    "forward-linear": {"name": "heads", "prune": "forward", "sparsity": 0.9, "fill": "linear"},
}


def only(state: dict, base: dict, part: str) -> dict:
    """``state`` with every tensor not of module ``part`` (``q_proj`` / ``v_proj``) put back to
    ``base``'s."""
    return {k: (v if part in k else base[k]) if k in base else v for k, v in state.items()}


@torch.no_grad()
def task_loss(method, model, data) -> float:
    was = model.training
    model.eval()
    total = sum(float(method.task.loss(model, b)) * batch_examples(b)
                for b in iter_batches(data, range(len(data)), 32, shuffle=False, generator=None))
    model.train(was)
    return total / len(data)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--local-steps", type=int, default=12)
    p.add_argument("--examples", type=int, default=64, help="client 1's examples the loss is measured on")
    p.add_argument("--importance-examples", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench/results/heads_forward_transfer"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    for name in args.variants:
        cfg = load_config(ROOT / "configs/e2e_smollm2.toml").model_dump(mode="json")
        cfg.update(threads=args.threads, seed=args.seed)
        cfg["federation"]["local_steps"] = args.local_steps
        cfg["method"] = dict(VARIANTS[name])
        if cfg["method"]["name"] == "heads":
            cfg["method"]["importance_max_examples"] = args.importance_examples
        method, data = setup(validate_config(cfg))
        held = data.client(1)
        held = held.subset(sample_rows(len(held), args.examples, 0))  # probe_loss's sample
        caught = {}
        if hasattr(method, "local_model"):  # a probe: catch the model the client trains
            build = method.local_model

            def local_model(*a, **kw):
                sub = build(*a, **kw)
                caught.update(model=sub, before=task_loss(method, sub, held))
                return sub
            method.local_model = local_model
        state0 = method.initial_state()
        payload = method.strategy.configure_train(1, state0, [0])[0]
        reply = method.fit(payload, data.client(0), args.seed)
        state1 = method.strategy.aggregate_train(1, state0, {0: payload}, {0: reply}).state
        changed = sorted(k for k in state1 if not torch.equal(state1[k], state0[k]))

        def loss(state) -> float:
            return method.probe_loss(state, held, args.examples, 0)[0]
        row = {"client_loss": reply.metrics.get("loss"), "pretrained": loss(state0),
               "update": loss(state1), "q_only": loss(only(state1, state0, "q_proj")),
               "v_only": loss(only(state1, state0, "v_proj")), "tensors_changed": len(changed),
               "client_model_before": caught.get("before"),
               "client_model_after": task_loss(method, caught["model"], held) if caught else None,
               "local_steps": args.local_steps, "seed": args.seed}
        print(name, row, flush=True)
        results[f"{name}@seed{args.seed}"] = row
        path.write_text(json.dumps(results, indent=1))
    def f(x) -> str:
        return "" if x is None else f"{x:.3f}"
    md = ["| variant | client's training loss | held-out loss: pretrained | the update | q only | v only "
          "| the client's model, before / after training |", "|---|---:|---:|---:|---:|---:|---|"]
    md += [f"| {k} | {f(r['client_loss'])} | {f(r['pretrained'])} | {f(r['update'])} | {f(r['q_only'])} "
           f"| {f(r['v_only'])} | {f(r.get('client_model_before'))} / {f(r.get('client_model_after'))} |"
           for k, r in results.items()]
    (args.out / "results.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
