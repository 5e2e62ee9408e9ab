"""Benchmark: the overhead of a FLOP counter on one MiniLM training step (8 x 64 tokens, 1 thread):
no counter, torch's FlopCounterMode, fedslice's lean counter (count_flops without a head split);
best of 3 each, with the totals (equal).

    .venv/bin/python bench/flop_counter_overhead.py
"""
import time, torch, sys
sys.path.insert(0, "tests")
from pathlib import Path
from transformers import AutoModelForSequenceClassification
from fedslice.models.loading import resolve_model_path
from torch.utils.flop_counter import FlopCounterMode
from fedslice.measure.flops import _attention_flop_mapping
torch.set_num_threads(1)
m = AutoModelForSequenceClassification.from_pretrained(resolve_model_path("minilm"), num_labels=2)
x = torch.randint(5, 1000, (8, 64)); y = torch.tensor([0,1]*4)
from fedslice.measure import count_flops
class _Lean:
    """count_flops() (no head split: the lean counter) as a reusable context."""
    def __enter__(self):
        self._cm = count_flops()
        self.fc = self._cm.__enter__()
        return self
    def __exit__(self, *exc):
        self._cm.__exit__(*exc)
        self.total = self.fc.total
def step(ctx):
    with ctx:
        m(input_ids=x, labels=y).loss.backward()
    m.zero_grad(set_to_none=True)
from contextlib import nullcontext
for i in range(2): step(nullcontext())
for name, mk in [("none", nullcontext), ("flopcounter", lambda: FlopCounterMode(display=False, custom_mapping=_attention_flop_mapping())), ("lean", _Lean)]:
    ts = []
    for _ in range(3):
        c = mk(); t = time.perf_counter(); step(c); ts.append(time.perf_counter() - t)
    tot = c.get_total_flops() if hasattr(c, "get_total_flops") else getattr(c, "total", 0)
    print(name, min(ts), tot)
