"""Scale on a GPU (issue 22, target 8): a LLaMA-shaped 1B-parameter model (random weights from
the TinyLlama config: 22 layers, hidden 2048, 32 query / 4 key-value heads, SwiGLU 5632, vocab
32000) trains one federated round of LoRA (r16 on q, k, v, o) in bf16 through fedslice's batched
pass: K clients' batches of ``--batch`` sequences of ``--seq`` tokens per step, each client with
its own LoRA and optimizer. Reports training tokens/s, peak GPU memory (per client: the batched
pass's peak divided by K, next to one client alone), and the achieved FLOP/s (measured FLOPs of a
step / its time) as a fraction of a bf16 matmul peak measured on the same GPU in the same run:
for the pass of ``--steps`` steps, and in the steady state (the extra steps of a pass of 3x as many:
the fixed cost per pass -- the first step's FLOP count, first-shape warm-up -- cancels).

    python bench/gpu_scale.py [--clients 8] [--batch 4] [--seq 512] [--steps 6] [--checkpointing] [--profile]
    python bench/gpu_scale.py --tiny      # the same code on a 2-layer model on the CPU (a check)

Needs a CUDA GPU with bf16 (no weights are downloaded: the model is built from its config).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "perf"))
from common import machine, save  # noqa: E402

from fedslice.compute import Compute, to_device  # noqa: E402
from fedslice.fl.batched import train_batched  # noqa: E402
from fedslice.measure import count_flops  # noqa: E402
from fedslice.models.arch import arch_for  # noqa: E402
from fedslice.peft import LoraAdapter, LoraConfig  # noqa: E402
from fedslice.data.batching import TokenizedSplit  # noqa: E402


def llama_config(tiny: bool):
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                           num_key_value_heads=2, intermediate_size=128, max_position_embeddings=1024)
    return LlamaConfig(vocab_size=32000, hidden_size=2048, num_hidden_layers=22, num_attention_heads=32,
                       num_key_value_heads=4, intermediate_size=5632, max_position_embeddings=2048,
                       rms_norm_eps=1e-5, tie_word_embeddings=False)


def matmul_peak(device, dtype, n=8192, reps=20) -> float:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize() if device.type == "cuda" else None
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize() if device.type == "cuda" else None
    return 2 * n**3 * reps / (time.perf_counter() - t)


def lm_losses(model, batch, rows):
    """Per-client causal LM loss (every position is a target here). The batched pass hands the
    host batch over; a task's loss moves it to the model's device, and so does this one."""
    batch = to_device(batch, next(model.parameters()).device)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                           batch["input_ids"][:, 1:].flatten(), reduction="none")
    per = ce.view(logits.shape[0], -1).mean(1)
    return [per[lo:hi].mean() for lo, hi in rows]


def profile(fn) -> None:
    """The CUDA kernels and CPU ops of ``fn()`` by total time (torch.profiler), top 30 each."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        fn()
    table = p.key_averages()
    print(table.table(sort_by="cuda_time_total", row_limit=30), flush=True)
    print(table.table(sort_by="self_cpu_time_total", row_limit=15), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--profile", action="store_true", help="also print the CUDA kernels of a 2-step pass, by time")
    ap.add_argument("--json", help="also write the results here (bench/gpu_check.py)")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    if args.tiny:
        args.seq, args.clients, args.batch, args.steps = 32, 3, 2, 2
    compute = Compute(device=torch.device("cpu" if args.tiny else "cuda"),
                      precision="fp32" if args.tiny else "bf16", batched=True)
    dev = compute.device
    config = llama_config(args.tiny)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16
                                                 if not args.tiny else torch.float32)
    for p in model.parameters():
        p.requires_grad_(False)
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    adapter = LoraAdapter(LoraConfig(r=16, alpha=32, targets=["q", "k", "v", "o"], train_classifier=False),
                          arch_for(config))
    model = adapter.apply(model)
    for n, p in model.named_parameters():
        if p.requires_grad:
            p.data = p.data.float()  # fp32 master LoRA weights
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    start = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    gen = torch.Generator().manual_seed(0)
    long_steps = 3 * args.steps
    n_rows = args.batch * long_steps
    datas = []
    for _ in range(args.clients):
        ids = torch.randint(3, config.vocab_size, (n_rows, args.seq), generator=gen)
        datas.append(TokenizedSplit(list(ids), None, torch.zeros(n_rows, dtype=torch.int64), 0))

    def timed_pass(k: int, steps: int) -> dict:
        """One batched pass of ``k`` clients, ``steps`` local steps each (the first step's FLOP
        count and any first-shape warm-up included)."""
        cfg = {"lr": 1e-4, "local_steps": steps, "batch_size": args.batch, "max_grad_norm": 1.0}
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t = time.perf_counter()
        out = train_batched(model, names, [start] * k, datas[:k], cfg, list(range(k)), lm_losses,
                            adapter, compute)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if dev.type == "cuda" else None
        return {"wall_s": wall, "tokens": sum(r.tokens for _, r in out),
                "flops": sum(r.flops_measured for _, r in out), "peak_gpu_mb": peak}

    results = {}
    timed_pass(1, 1)  # warm-up (CUDA context, kernels, allocator): not in the first row's short pass
    for k in (1, args.clients):
        short, long = timed_pass(k, args.steps), timed_pass(k, long_steps)
        # the steady state: what the longer pass's extra steps cost (the fixed cost per pass --
        # the first step's FLOP count, first-shape warm-up -- cancels)
        extra_s = max(long["wall_s"] - short["wall_s"], 1e-9)
        extra = long_steps - args.steps
        steady_flops = (long["flops"] - short["flops"]) / extra_s
        results[k] = {"clients": k, "wall_s": short["wall_s"], "tokens_per_s": short["tokens"] / short["wall_s"],
                      "flops_per_s": short["flops"] / short["wall_s"], "peak_gpu_mb": short["peak_gpu_mb"],
                      "peak_gpu_mb_per_client": short["peak_gpu_mb"] / k if short["peak_gpu_mb"] else None,
                      "steady_step_s": extra_s / extra,
                      "steady_tokens_per_s": (long["tokens"] - short["tokens"]) / extra_s,
                      "steady_flops_per_s": steady_flops,
                      "fixed_s": short["wall_s"] - args.steps * extra_s / extra}
        print(results[k], flush=True)
    if args.profile and dev.type == "cuda":
        profile(lambda: timed_pass(args.clients, 2))
    peak_flops = matmul_peak(dev, torch.float32 if args.tiny else torch.bfloat16, n=512 if args.tiny else 8192)
    for r in results.values():
        r["fraction_of_matmul_peak"] = r["flops_per_s"] / peak_flops
        r["steady_fraction_of_matmul_peak"] = r["steady_flops_per_s"] / peak_flops
    out = {"machine": machine(), "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None,
           "args": vars(args), "params": sum(p.numel() for p in model.parameters()),
           "matmul_peak_flops": peak_flops, "results": results}
    r = results[args.clients]
    print(f"batched pass of {args.clients}: {r['tokens_per_s']:.0f} tokens/s, "
          f"{r['fraction_of_matmul_peak']:.0%} of the {peak_flops / 1e12:.1f} TFLOP/s matmul peak; "
          f"steady state {r['steady_tokens_per_s']:.0f} tokens/s, {r['steady_fraction_of_matmul_peak']:.0%}; "
          f"fixed cost per pass {r['fixed_s']:.2f} s")
    if not args.tiny:
        save("gpu_scale", out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
