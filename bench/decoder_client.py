"""A decoder-LLM client: fedslice against the usual Trainer + peft client (issue 22, targets 7, 10).

One client's local training of SmolLM2-135M-Instruct + LoRA r16 on q/v on E2E NLG (prompt
"Describe the restaurant: {mr}\\n" + reference + EOS; loss on the reference tokens only; prompts
<= 64 tokens, targets <= 64), batch 8, ``--steps`` AdamW steps at lr 2e-3, fp32, all cores:

* ``trainer``: written as FlowerTune's client does it: ``transformers.Trainer`` over the peft
  model, a collator padding to the longest sequence of the batch with labels -100 on prompt and
  padding (the loss then takes logits at every position), no length grouping.
* ``fedslice``: ``Method.fit`` of fedpetuning on the same client's examples (logits only at
  target positions, length-grouped batches, SDPA attention, no per-client model rebuild).

Both see the same tokenized examples (fedslice's encoding of the E2E train split, client 0 of 20
IID clients). Reported: real (non-pad) tokens per second of training, median of ``--repeats``
alternating runs, the ratio, and fedslice's achieved training FLOP/s (measured FLOPs / time)
next to an fp32 matmul peak measured on the same cores and threads.

    .venv/bin/python bench/decoder_client.py [--steps 12] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "perf"))
from common import machine, save  # noqa: E402

from fedslice.api import setup  # noqa: E402
from fedslice.experiment import load_config  # noqa: E402
from fedslice.run.engine import client_seed  # noqa: E402


def matmul_peak(threads: int, n: int = 2048, reps: int = 10) -> float:
    """fp32 GEMM FLOP/s on this machine at ``threads`` threads (best of ``reps``)."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = max(best, 2 * n**3 / (time.perf_counter() - t))
    return best


def cuda_matmul_peak(dtype, n: int = 8192, reps: int = 20) -> float:
    """GEMM FLOP/s of the GPU in ``dtype`` (bench/gpu_scale.py's measure)."""
    from gpu_scale import matmul_peak as gpu_peak

    return gpu_peak(torch.device("cuda"), dtype, n, reps)


class Examples(torch.utils.data.Dataset):
    def __init__(self, split):
        self.split = split

    def __len__(self):
        return len(self.split)

    def __getitem__(self, i):
        p, t = self.split.prompts[i], self.split.targets[i]
        return {"input_ids": torch.cat([p, t]), "labels": torch.cat([torch.full_like(p, -100), t])}


def collate(pad: int):
    def fn(rows):
        ids = torch.nn.utils.rnn.pad_sequence([r["input_ids"] for r in rows], batch_first=True, padding_value=pad)
        labels = torch.nn.utils.rnn.pad_sequence([r["labels"] for r in rows], batch_first=True, padding_value=-100)
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(r["input_ids"]) for r in rows], batch_first=True)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return fn


def run_trainer(method, data, steps: int, batch: int, lr: float, precision: str = "fp32",
                device: str = "cpu", seed: int = 0) -> dict:
    """``seed``: the batch order (each repeat takes another, as fedslice's client does: a repeat
    of the same order would find its shapes' kernels and plans already made)."""
    from transformers import Trainer, TrainingArguments

    model = method.model  # the same peft model (LoRA on q/v), state reset by the caller
    seen = {"tokens": 0}
    base = collate(data.pad_token_id)

    def counted(rows):
        out = base(rows)
        seen["tokens"] += int(out["attention_mask"].sum())
        return out

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, per_device_train_batch_size=batch, max_steps=steps,
                                 learning_rate=lr, weight_decay=0.0, max_grad_norm=1.0,
                                 lr_scheduler_type="constant", warmup_steps=0, report_to=[],
                                 save_strategy="no", logging_strategy="no", use_cpu=device == "cpu",
                                 dataloader_num_workers=0, remove_unused_columns=False, seed=seed,
                                 bf16=precision == "bf16")
        trainer = Trainer(model=model, args=args, train_dataset=Examples(data), data_collator=counted)
        t = time.perf_counter()
        trainer.train()
        elapsed = time.perf_counter() - t
    return {"time_s": elapsed, "tokens": seen["tokens"], "tokens_per_s": seen["tokens"] / elapsed}


def run_fedslice(method, data, steps: int, seed: int) -> dict:
    state = method.initial_state()
    payload = method.strategy.configure_train(1, state, [0])[0]
    payload.config["local_steps"] = steps
    reply = method.fit(payload, data, seed)
    m = reply.metrics
    tokens = m["tokens_real"]  # non-padding tokens of the batches trained on
    return {"time_s": m["train_time_s"], "tokens": tokens, "tokens_per_s": tokens / m["train_time_s"],
            "flops_measured": m["flops_measured"], "padded_tokens": m["tokens"],
            "flops_per_s": m["flops_measured"] / m["train_time_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (both clients train there)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="more config overrides (bench/gpu_check.py --dry: a tiny model)")
    ap.add_argument("--json", help="also write the results here (bench/gpu_check.py)")
    ap.add_argument("--peak-size", type=int, default=2048, help="the CPU matmul peak's matrix size "
                    "(bench/gpu_check.py --dry: a small one; the figure is not kept)")
    args = ap.parse_args()
    info = machine()
    torch.set_num_threads(args.threads)
    cfg = load_config("configs/e2e_smollm2.toml", [
        f"threads={args.threads}", "compute.workers=1", f"compute.precision={args.precision!r}".replace("'", '"'),
        "data.max_length=64", "task.max_target_length=64", "federation.batch_size=8",
        f'compute.device="{args.device}"', *args.sets])
    method, fed = setup(cfg)
    data = fed.client(0)
    start = {n: p.detach().clone() for n, p in method.trainable().items()}
    rows = {"trainer": [], "fedslice": []}
    for rep in range(args.repeats):
        for name in ("trainer", "fedslice"):
            method.load_state(method.trainable(), start)
            r = run_trainer(method, data, args.steps, 8, 2e-3, args.precision, args.device, seed=rep + 1) if name == "trainer" else \
                run_fedslice(method, data, args.steps, client_seed(0, rep + 1, 0))
            rows[name].append(r)
            print(f"{name} #{rep}: {r['tokens_per_s']:.0f} real tokens/s ({r['time_s']:.1f} s)", flush=True)
    peak = matmul_peak(args.threads, args.peak_size) if args.device == "cpu" else cuda_matmul_peak(torch.bfloat16 if args.precision == "bf16" else torch.float32)
    med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in rows.items()}
    fps = statistics.median(r["flops_per_s"] for r in rows["fedslice"])
    out = {"machine": {**info, "loadavg_end": __import__("os").getloadavg()[0]}, "args": vars(args),
           "runs": rows, "median_tokens_per_s": med, "ratio": med["fedslice"] / med["trainer"],
           "matmul_peak_flops": peak, "fedslice_flops_per_s": fps, "fraction_of_peak": fps / peak}
    print(f"fedslice {med['fedslice']:.0f} vs Trainer {med['trainer']:.0f} real tokens/s: "
          f"{out['ratio']:.2f}x; fedslice {fps / 1e9:.1f} GFLOP/s = {fps / peak:.0%} of the "
          f"{peak / 1e9:.0f} GFLOP/s matmul peak")
    if not args.sets:  # the standard workload only: another model or data set keeps its own file
        print("saved", save(f"decoder_client_{args.precision}_{args.device}_t{args.threads}"
                            if args.device != "cpu" else f"decoder_client_{args.precision}_t{args.threads}", out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
