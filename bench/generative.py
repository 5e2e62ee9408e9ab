"""Benchmark: generative models (issue 14). Four parts, each writes a markdown table:

* ``e2e``: SmolLM2-135M-Instruct + LoRA on E2E NLG (``configs/e2e_smollm2.toml``): zero-shot,
  centralized LoRA (one client holding all of train) and federated FedPETuning (20 IID clients,
  4 per round) at an equal number of training examples seen (same steps x batch). BLEU,
  ROUGE-L, test loss on the same test MRs.
* ``sst2``: SST-2 text-to-text on SmolLM2 (``configs/sst2_smollm2.toml``): zero-shot label-word
  accuracy, FedPETuning accuracy; MiniLM FedPETuning (classification head) at equal steps.
* ``costs``: one client-round (6 LoRA steps, batch 8, E2E prompts+targets) of each architecture:
  seconds, measured training FLOPs, bytes down/up, peak memory. SmolLM2 and MiniLM are the real
  checkpoints; GPT-2 (124M), T5-small and BART-base are built from their published configs with
  random weights (costs do not depend on weight values; no offline weights exist here).
* ``logits``: what computing the LM head only at target positions saves: a SmolLM2 LoRA step at
  8 x 128 tokens with 32 target tokens per sequence, full logits vs target-only (median of 5).

    .venv/bin/python bench/generative.py --parts e2e sst2 costs logits --out bench/results/generative
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from fedslice.api import run_experiment, setup
from fedslice.experiment import load_config, validate_config

ROOT = Path(__file__).resolve().parents[1]


def _cfg(path: str, args, **sets) -> dict:
    """A config file as a dict with overrides (dotted keys) and the benchmark's output settings."""
    cfg = load_config(ROOT / path).model_dump(mode="json")
    for key, value in sets.items():
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    cfg["threads"] = args.threads
    cfg["output"].update(dir=str(args.out), progress=False, plots=False, save_weights=False)
    return cfg


def zero_shot(cfg: dict) -> dict:
    """The pretrained model's test metrics (LoRA B = 0: the adapter is the identity)."""
    c = validate_config(cfg)
    method, data = setup(c)
    t0 = time.perf_counter()
    test = method.evaluate(method.initial_state(), data.test, c.evaluation.batch_size)
    return {"name": f"{c.run_name}-zero-shot", **{f"test_{k}": v for k, v in test.items()
                                                  if not isinstance(v, list)},
            "wall_time_s": time.perf_counter() - t0, "examples_seen": 0,
            "samples": getattr(method.task, "last_samples", None)}


def run(cfg: dict) -> dict:
    path = run_experiment(validate_config(cfg), progress=False)
    s = json.loads((path / "summary.json").read_text())
    f = cfg["federation"]
    s["examples_seen"] = f["rounds"] * f["clients_per_round"] * f["local_steps"] * f["batch_size"]
    s["run_dir"] = str(path)
    return s


def _row(s: dict, keys: list[str]) -> str:
    cells = []
    for k in keys:
        v = s.get(k)
        cells.append("—" if v is None else (f"{v:.4f}" if isinstance(v, float) and abs(v) < 10
                                           else f"{v:.2f}" if isinstance(v, float) else str(v)))
    return "| " + " | ".join(cells) + " |"


def part_e2e(args) -> str:
    fed = _cfg("configs/e2e_smollm2.toml", args, **{"federation.rounds": args.rounds})
    f = fed["federation"]
    # one client holding all of train, K x S steps a round: the same examples seen per round
    central = _cfg("configs/e2e_smollm2.toml", args, name="e2e-smollm2-centralized",
                   **{"federation.num_clients": 1, "federation.clients_per_round": 1,
                      "federation.rounds": f["rounds"],
                      "federation.local_steps": f["clients_per_round"] * f["local_steps"]})
    rows = [zero_shot(fed), run(central), run(fed)]
    keys = ["name", "examples_seen", "test_bleu", "test_rougeL", "test_rouge1", "test_rouge2",
            "test_loss", "test_perplexity", "wall_time_s"]
    table = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    table += [_row(r, keys) for r in rows]
    ratio = rows[2]["test_rougeL"] / rows[1]["test_rougeL"]
    table.append(f"\nfederated / centralized ROUGE-L: **{ratio:.3f}** (target >= 0.95); "
                 f"federated - zero-shot ROUGE-L: {rows[2]['test_rougeL'] - rows[0]['test_rougeL']:+.2f}")
    samples = rows[0].get("samples") or []
    if samples:
        table.append("\nzero-shot samples: " + json.dumps(samples[:2])[:800])
    return "\n".join(table)


def part_sst2(args) -> str:
    t2t = _cfg("configs/sst2_smollm2.toml", args, **{"federation.rounds": args.rounds})
    f = t2t["federation"]
    minilm = _cfg("configs/fedpetuning_sst2.toml", args, name="sst2-minilm-equal-steps",
                  **{"federation.rounds": f["rounds"], "federation.local_steps": f["local_steps"],
                     "federation.batch_size": f["batch_size"], "federation.num_clients": f["num_clients"],
                     "federation.clients_per_round": f["clients_per_round"],
                     "data.max_dev_examples": t2t["data"]["max_dev_examples"],
                     "evaluation.every": t2t["evaluation"]["every"]})
    rows = [zero_shot(t2t), run(t2t), run(minilm)]
    keys = ["name", "examples_seen", "test_accuracy", "test_loss", "bytes_up_mean",
            "flops_measured_mean", "wall_time_s"]
    table = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return "\n".join(table + [_row(r, keys) for r in rows])


def _arch_dirs(tmp: Path) -> dict[str, str]:
    """Published configs of GPT-2 (124M), T5-small, BART-base with random weights, SmolLM2's
    tokenizer (vocabulary 49,152 instead of their own: stated in the table)."""
    import transformers as T

    from fedslice.models.loading import resolve_model_path

    tok = T.AutoTokenizer.from_pretrained(resolve_model_path("smollm2"))
    v, pad, eos = len(tok), tok.pad_token_id, tok.eos_token_id
    configs = {
        "gpt2 (124M config)": (T.AutoModelForCausalLM, T.GPT2Config(vocab_size=v, bos_token_id=eos,
                                                                    eos_token_id=eos, pad_token_id=pad)),
        "t5-small (config)": (T.AutoModelForSeq2SeqLM, T.T5Config(
            vocab_size=v, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8,
            decoder_start_token_id=pad, pad_token_id=pad, eos_token_id=eos)),
        "bart-base (config)": (T.AutoModelForSeq2SeqLM, T.BartConfig(
            vocab_size=v, d_model=768, encoder_layers=6, decoder_layers=6,
            encoder_attention_heads=12, decoder_attention_heads=12, encoder_ffn_dim=3072,
            decoder_ffn_dim=3072, pad_token_id=pad, bos_token_id=eos, eos_token_id=eos,
            decoder_start_token_id=eos, forced_eos_token_id=None)),
    }
    out = {}
    for name, (auto, config) in configs.items():
        folder = tmp / name.split()[0]
        if not (folder / "config.json").exists():
            torch.manual_seed(0)
            auto.from_config(config).save_pretrained(folder)
            tok.save_pretrained(folder)
        out[name] = str(folder)
    return out


def part_costs(args) -> str:
    base = _cfg("configs/e2e_smollm2.toml", args, **{
        "federation.rounds": 1, "federation.clients_per_round": 1, "federation.num_clients": 20,
        "data.max_dev_examples": 2, "data.max_test_examples": 2, "evaluation.dev_generations": 1,
        "task.max_new_tokens": 4})
    models = {"smollm2 (SmolLM2-135M)": "smollm2", **_arch_dirs(args.out / "arch-configs")}
    rows = []
    for label, name in models.items():
        cfg = json.loads(json.dumps(base))
        cfg["model"]["name"] = name
        cfg["name"] = "cost-" + label.split()[0]
        s = run(cfg)
        rows.append({"arch": label, "seconds": s["train_time_s_mean"],
                     "GFLOPs measured": s["flops_measured_mean"] / 1e9,
                     "GFLOPs analytic": s["flops_analytic_mean"] / 1e9,
                     "MB down": s["bytes_down_mean"] / 1e6, "MB up": s["bytes_up_mean"] / 1e6,
                     "peak RSS MB": s["peak_rss_mb_max"], "activations MB": s["activation_mb_max"]})
    sst = _cfg("configs/fedpetuning_sst2.toml", args, name="cost-minilm", **{
        "federation.rounds": 1, "federation.clients_per_round": 1, "federation.local_steps": 6,
        "federation.batch_size": 8, "data.max_dev_examples": 8, "data.max_test_examples": 8})
    s = run(sst)
    rows.insert(0, {"arch": "minilm (MiniLM-L6, SST-2 classification)", "seconds": s["train_time_s_mean"],
                    "GFLOPs measured": s["flops_measured_mean"] / 1e9,
                    "GFLOPs analytic": s["flops_analytic_mean"] / 1e9,
                    "MB down": s["bytes_down_mean"] / 1e6, "MB up": s["bytes_up_mean"] / 1e6,
                    "peak RSS MB": s["peak_rss_mb_max"], "activations MB": s["activation_mb_max"]})
    keys = list(rows[0])
    table = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return "\n".join(table + [_row(r, keys) for r in rows])


def part_logits(args) -> str:
    """Full logits (HF's labels loss) vs logits at the 32 target positions only."""
    from fedslice.config import ModelConfig
    from fedslice.peft import LoraConfig
    from fedslice.models.loading import load_model
    from fedslice.peft import apply_lora
    from fedslice.tasks.lm import lm_loss

    torch.set_num_threads(args.threads)
    loaded = load_model(ModelConfig(name="smollm2"), None, 0, head="causal_lm")
    model = apply_lora(loaded.model, loaded.arch, LoraConfig(r=16, alpha=32, targets=["q", "v"]))
    model.train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 49000, (8, 128), generator=g)
    labels = ids.clone()
    labels[:, :96] = -100  # 32 target tokens per sequence
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    ways = {"full logits (HF labels loss)": lambda: model(**batch).loss,
            "target positions only": lambda: lm_loss(model, batch, "causal")}
    times = {k: [] for k in ways}
    for _ in range(args.repeats):
        for k, f in ways.items():  # interleaved, so load changes hit both alike
            t0 = time.perf_counter()
            f().backward()
            model.zero_grad(set_to_none=True)
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    full, ours = med["full logits (HF labels loss)"], med["target positions only"]
    lines = ["| variant | median s/step | steps |", "|---|---:|---:|"]
    lines += [f"| {k} | {v:.3f} | {len(times[k])} |" for k, v in med.items()]
    lines.append(f"\ntarget-only / full: **{ours / full:.3f}** (saves {100 * (1 - ours / full):.1f}% of the step)")
    return "\n".join(lines)


PARTS = {"e2e": part_e2e, "sst2": part_sst2, "costs": part_costs, "logits": part_logits}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench/results/generative"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    head = (f"date {time.strftime('%Y-%m-%d %H:%M')}, {platform.processor() or platform.machine()}, "
            f"{args.threads} thread(s) per run, torch {torch.__version__}")
    for part in args.parts:
        t0 = time.perf_counter()
        text = PARTS[part](args)
        text = f"### {part}\n\n{head}; part took {(time.perf_counter() - t0) / 60:.1f} min\n\n{text}\n"
        print(text, flush=True)
        (args.out / f"results-{part}.md").write_text(text)


if __name__ == "__main__":
    main()
