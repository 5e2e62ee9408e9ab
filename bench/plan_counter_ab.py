"""Benchmark: `fedslice plan` with torch's FlopCounterMode against the lean counter (issue 34,
planning time). CONFIG: a config with [budgets] (e.g. the frontier's planned row written to TOML).
Alternates the two counters in one process, two runs each; reports the minimum of each.

    OMP_NUM_THREADS=1 .venv/bin/python bench/plan_counter_ab.py CONFIG
"""
import sys, time, contextlib, os
import fedslice.measure.flops as F
from fedslice.cli import main
real = F.count_flops
@contextlib.contextmanager
def torchs(enabled=True, head=()):
    with real(enabled=enabled, head=head or ("__none__",)) as fc:  # a head part: FlopCounterMode's path
        yield fc
import fedslice.slicing.planner as SP, fedslice.methods.planner as MP
out = {}
for rep in range(2):
    for name in ("torch", "lean"):
        SP.count_flops = torchs if name == "torch" else real
        MP.measure.count_flops = torchs if name == "torch" else real
        t = time.perf_counter()
        with contextlib.redirect_stdout(open(os.devnull, "w")):
            main(["plan", sys.argv[1]])
        out.setdefault(name, []).append(time.perf_counter() - t)
        print(name, rep, round(out[name][-1], 1), flush=True)
print({k: min(v) for k, v in out.items()})
