"""One attention layer's forward + backward on the CPU at 1 thread (issue 36, target 2): MiniLM's
12 heads x 32, packed rows (8 x 64) against a padded batch (32 x 17), with and without dropout,
torch sdpa with a bool, float or no mask, and eager attention. CPU milliseconds per call.

    .venv/bin/python bench/perf/attention_cpu.py
"""
import torch, time
import torch.nn.functional as F
torch.set_num_threads(1)
def bench(R, T, drop, maskkind, n=20):
    q = torch.randn(R, 12, T, 32, requires_grad=True); k = torch.randn(R, 12, T, 32, requires_grad=True); v = torch.randn(R, 12, T, 32, requires_grad=True)
    m = torch.rand(R, 1, T, T) > 0.3
    m = m | torch.eye(T, dtype=torch.bool)
    if maskkind == "float": m = torch.zeros(R,1,T,T).masked_fill(~m, torch.finfo(torch.float32).min)
    if maskkind == "none": m = None
    def f():
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=drop)
        o.sum().backward()
    f()
    t0 = time.process_time()
    for _ in range(n): f()
    return (time.process_time() - t0) / n * 1e3
def eager(R, T, drop, n=20):
    q = torch.randn(R, 12, T, 32, requires_grad=True); k = torch.randn(R, 12, T, 32, requires_grad=True); v = torch.randn(R, 12, T, 32, requires_grad=True)
    m = torch.rand(R, 1, T, T) > 0.3
    m = torch.zeros(R,1,T,T).masked_fill(~(m | torch.eye(T, dtype=torch.bool)), torch.finfo(torch.float32).min)
    def f():
        w = (q @ k.transpose(-1, -2)) * 32**-0.5 + m
        w = F.dropout(w.softmax(-1), drop, True)
        (w @ v).sum().backward()
    f(); t0 = time.process_time()
    for _ in range(n): f()
    return (time.process_time() - t0) / n * 1e3
for R, T in ((8, 64), (32, 17)):
    for drop in (0.0, 0.1):
        print(R, T, drop, {mk: round(bench(R, T, drop, mk), 2) for mk in ("bool", "float", "none")}, "eager", round(eager(R, T, drop), 2))
