"""Where a decoder client's time goes on a fast device (issue 36, target 5's decoder row): the
SmolLM2 client of bench/decoder_client.py, fedslice's ``Method.fit`` at 12 and 36 local steps
(the difference: the per-step cost; the rest: the fixed cost per client) with and without its two
measurements -- the saved-tensor accounting (:class:`fedslice.measure.PeakMemory`: since
2026-11-26 on the dominant batches only; "every step" is the earlier rule) and the first step's
FLOP count (:func:`fedslice.measure.count_flops`) -- and the Trainer + peft
client at the same step counts. The variants patch the two measurements out of
``fedslice.fl.client`` for this process only (an experiment, not a setting).

    python bench/decoder_overhead.py --device cuda --precision bf16 [--set model.name=FOLDER] [--variants ...] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "perf"))
import decoder_client as dc  # noqa: E402

import fedslice.fl.client as client  # noqa: E402
from fedslice.api import setup  # noqa: E402
from fedslice.experiment import load_config  # noqa: E402

PEAK, COUNT = client.PeakMemory, client.count_flops


class EveryStep(PEAK):
    """PeakMemory counting the saved tensors of every step (before 2026-11-26 18:00)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **{**kw, "saved_tensors": True})


class NoSavedTensors(PEAK):
    """PeakMemory without saved-tensor accounting (the RSS and CUDA peaks stay)."""

    def track(self):
        return contextlib.nullcontext()


def no_count(enabled=True, **kw):
    return COUNT(enabled=False, **kw)


VARIANTS = {"default": (PEAK, COUNT), "saved tensors every step": (EveryStep, COUNT),
            "no saved-tensor accounting": (NoSavedTensors, COUNT), "no FLOP count": (PEAK, no_count),
            "neither": (NoSavedTensors, no_count)}


def profiled(name: str, fn) -> None:
    """Print where ``fn()``'s time goes: torch.profiler's ops and kernels by self CUDA time and by
    self CPU time, and cProfile's Python functions by own time."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as p:
        fn()
    table = p.key_averages()
    print(f"== {name}: by self CUDA time", flush=True)
    print(table.table(sort_by="self_cuda_time_total", row_limit=25), flush=True)
    print(f"== {name}: by self CPU time", flush=True)
    print(table.table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    pr = cProfile.Profile()
    pr.enable()
    fn()
    pr.disable()
    print(f"== {name}: Python functions by own time", flush=True)
    pstats.Stats(pr).sort_stats("tottime").print_stats(30)


def timed_fit(method, data, start, steps: int, seed: int) -> float:
    method.load_state(method.trainable(), start)
    return dc.run_fedslice(method, data, steps, seed)["time_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--json")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--profile", action="store_true",
                    help="also print where a 12-step fedslice client's and Trainer's time goes")
    args = ap.parse_args()
    cfg = load_config("configs/e2e_smollm2.toml", [
        "compute.workers=1", f'compute.precision="{args.precision}"', "data.max_length=64",
        "task.max_target_length=64", "federation.batch_size=8", f'compute.device="{args.device}"', *args.sets])
    method, fed = setup(cfg)
    data = fed.client(0)
    start = {n: p.detach().clone() for n, p in method.trainable().items()}
    timed_fit(method, data, start, 12, 0)  # warm-up: kernels, allocator, first FLOP count
    out = {}
    for name in args.variants:
        peak, count = VARIANTS[name]
        client.PeakMemory, client.count_flops = peak, count
        t = {s: statistics.median(timed_fit(method, data, start, s, r + 1) for r in range(args.repeats))
             for s in (12, 36)}
        per_step = (t[36] - t[12]) / 24
        out[name] = {"t12_s": t[12], "t36_s": t[36], "per_step_ms": 1e3 * per_step,
                     "fixed_ms": 1e3 * (t[12] - 12 * per_step)}
        print(name, {k: round(v, 4) for k, v in out[name].items()}, flush=True)
    client.PeakMemory, client.count_flops = PEAK, COUNT
    trainer = {}
    for s in (12, 36):
        runs = []
        for r in range(args.repeats):
            method.load_state(method.trainable(), start)
            runs.append(dc.run_trainer(method, data, s, 8, 2e-3, args.precision, args.device, seed=r + 1)["time_s"])
        trainer[s] = statistics.median(runs)
    per_step = (trainer[36] - trainer[12]) / 24
    out["trainer"] = {"t12_s": trainer[12], "t36_s": trainer[36], "per_step_ms": 1e3 * per_step,
                      "fixed_ms": 1e3 * (trainer[12] - 12 * per_step)}
    print("trainer", {k: round(v, 4) for k, v in out["trainer"].items()}, flush=True)
    if args.profile:
        profiled("fedslice", lambda: timed_fit(method, data, start, 12, 9))
        method.load_state(method.trainable(), start)
        profiled("trainer", lambda: dc.run_trainer(method, data, 12, 8, 2e-3, args.precision, args.device, seed=9))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
