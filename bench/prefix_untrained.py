"""Issue 35 part 6: is prefix tuning's collapse under pruning its untrained prefix?

The E2E set-up of bench/adapters/e2e_smollm2.toml trained at lr 1e-12 for one round, so every
adapter stays at its initialisation: an untrained prefix (20 virtual tokens, peft's random
init) against an untrained LoRA (B = 0: the base model exactly), both scored on the same 50 test
MRs. If the untrained prefix scores far below the base model, a head whose prefix entries stay
untrained (pruned under ``prune = "parameters"`` by every client that held it) is a head that
attends to noise. Writes ``bench/results/adapters_e2e/untrained_adapters.json``.

    OMP_NUM_THREADS=1 .venv/bin/python bench/prefix_untrained.py prefix lora-r16
    OMP_NUM_THREADS=1 .venv/bin/python bench/prefix_untrained.py prefix:zeros   # prefix.init = "zeros"
"""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

from fedslice.api import run_experiment
from fedslice.experiment import validate_config


def main(names: list[str]) -> None:
    base = tomllib.loads(Path("bench/adapters/e2e_smollm2.toml").read_text())
    variants = {v["name"]: v for v in base.pop("variants")}
    out = {}
    for name in names:
        variant, _, init = name.partition(":")
        v = {k: val for k, val in variants[variant].items() if k != "name"}
        if init:
            v["prefix"] = {**v.get("prefix", {}), "init": init}
        cfg = json.loads(json.dumps(base))
        for k, val in v.items():
            cfg[k] = {**cfg.get(k, {}), **val}
        cfg["name"] = f"{name.replace(':', '-')}-untrained"
        cfg["method"] = {"name": "fedpetuning"}
        cfg["federation"].update(rounds=1, lr=1e-12)
        cfg["evaluation"]["every"] = 1
        runs = Path("/tmp/prefix-untrained-runs")
        cfg["output"]["dir"] = str(runs)
        run = run_experiment(validate_config(cfg), runs, progress=False)
        s = json.loads((run / "summary.json").read_text())
        out[name] = {k: s[k] for k in s if "rouge" in k or "bleu" in k}
        print(name, out[name], flush=True)
    dest = Path("bench/results/adapters_e2e/untrained_adapters.json")
    old = json.loads(dest.read_text()) if dest.is_file() else {}
    dest.write_text(json.dumps({**old, **out}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:] or ["prefix", "lora-r16"])
