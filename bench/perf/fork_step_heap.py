"""Like a fedslice worker (issue 34; BENCHMARKS.md, "Quantized base"): load SmolLM2 (+ int8 or not) and LoRA in this process, trim the heap,
fork a child that trains N steps (8 x 64, LM loss, AdamW on LoRA); the parent samples the child's
smaps_rollup: its peak Private_Dirty and Pss; the child prints its malloc statistics (mallinfo2:
peak bytes in use and heap size, sampled at every module forward and saved-tensor unpack), and
the parent compares the stopped child's pages with its own (pagemap: shared, copied on write, new;
root only). glibc only.

    PYTHONPATH=src OMP_NUM_THREADS=1 .venv/bin/python bench/perf/fork_step_heap.py smollm2 int8 4
"""
import json, os, sys, time, gc, signal
import numpy as np
PAGE = 4096
def pages(pid):
    out = {}
    with open(f"/proc/{pid}/pagemap", "rb") as f:
        for line in open(f"/proc/{pid}/maps"):
            p = line.split(None, 5)
            lo, hi = (int(a, 16) for a in p[0].split("-"))
            path = p[5].strip() if len(p) > 5 else ""
            if hi - lo > 2**34 or path.startswith("[v"): continue
            kind = "heap" if path == "[heap]" else "anon" if not path or path.startswith("[anon") else "file"
            f.seek(lo // PAGE * 8)
            v = np.frombuffer(f.read((hi - lo) // PAGE * 8), dtype=np.uint64)
            addr = np.arange(lo // PAGE, hi // PAGE, dtype=np.uint64)
            keep = (v >> np.uint64(63)) & np.uint64(1) == 1
            out.setdefault(kind, []).append((addr[keep], v[keep] & np.uint64((1 << 55) - 1)))
    return {k: (np.concatenate([a for a, _ in v]), np.concatenate([b for _, b in v])) for k, v in out.items()}
import ctypes
_libc = ctypes.CDLL("libc.so.6"); _libc.malloc.restype = ctypes.c_void_p; _libc.malloc.argtypes = [ctypes.c_size_t]; _libc.free.argtypes = [ctypes.c_void_p]
def mmap_threshold():
    """The smallest power-of-two-ish size glibc serves by mmap now (probe: a chunk's IS_MMAPPED bit)."""
    def mm(n):
        p = _libc.malloc(n); f = ctypes.c_size_t.from_address(p - 8).value; _libc.free(p); return bool(f & 2)
    lo, hi = 1 << 12, 1 << 26
    if not mm(hi): return None
    while hi - lo > 4096:
        mid = (lo + hi) // 2
        if mm(mid): hi = mid
        else: lo = mid
    return hi
def compare(ppid, cpid):
    P, C = pages(ppid), pages(cpid)
    res = {}
    for k in C:
        ca, cf = C[k]
        pa, pf = P.get(k, (np.array([], np.uint64), np.array([], np.uint64)))
        common, ci, pi = np.intersect1d(ca, pa, return_indices=True)
        cowed = int((cf[ci] != pf[pi]).sum())
        res[k] = {"child_mb": round(ca.size * PAGE / 2**20, 1), "shared_with_parent_mb": round(int((cf[ci] == pf[pi]).sum()) * PAGE / 2**20, 1),
                  "cow_copied_mb": round(cowed * PAGE / 2**20, 1), "new_mb": round((ca.size - common.size) * PAGE / 2**20, 1),
                  "parent_mb": round(pa.size * PAGE / 2**20, 1)}
    return res
import torch
from fedslice.experiment import validate_config
from fedslice.models.loading import load_model
from fedslice.models import quantize as Q
from fedslice.peft import make_adapter
from fedslice.heap import trim_heap

name, mode, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
batch, length = (8, 64) if name == "smollm2" else (32, 64)
torch.set_num_threads(1)
head = "sequence_classification" if name == "minilm" else "causal_lm"
cfg = validate_config({"model": {"name": name, "quantize": mode}, "lora": {"r": 16, "alpha": 32, "targets": ["q", "v"]}})
loaded = load_model(cfg.model, 2 if head != "causal_lm" else None, 0, head=head)
model, arch = loaded.model, loaded.arch
Q.quantize_base(model, mode, arch)
model = make_adapter(cfg, "lora", arch).apply(model)
model.train()
x = torch.randint(100, 20000, (batch, length), generator=torch.Generator().manual_seed(1))
labels = x if head == "causal_lm" else torch.randint(0, 2, (batch,))
gc.collect(); trim_heap(); gc.freeze()
def roll(pid):
    d = {}
    for line in open(f"/proc/{pid}/smaps_rollup"):
        p = line.split()
        if len(p) >= 3 and p[-1] == "kB":
            d[p[0].rstrip(":")] = int(p[1]) / 1024
    return d
parent = roll(os.getpid())
thr = mmap_threshold()
pid = os.fork()
if pid == 0:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    class MI(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
    _libc.mallinfo2.restype = MI
    top = {"uord_hblkhd": 0, "arena": 0}
    def rec(*a):
        m = _libc.mallinfo2()
        top["uord_hblkhd"] = max(top["uord_hblkhd"], m.uordblks + m.hblkhd); top["arena"] = max(top["arena"], m.arena)
    for mod in model.modules(): mod.register_forward_hook(lambda *a: rec())
    def unpack(t):
        rec(); return t
    for _ in range(steps):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            loss = model(input_ids=x, labels=labels).loss
            loss.backward()
        opt.step(); opt.zero_grad(set_to_none=True)
    m = _libc.mallinfo2()
    print(json.dumps({"child_in_use_peak_mb": round(top["uord_hblkhd"] / 2**20), "child_arena_peak_mb": round(top["arena"] / 2**20),
                      "child_end": {"arena": round(m.arena / 2**20), "in_use": round(m.uordblks / 2**20), "mmapped": round(m.hblkhd / 2**20), "free": round(m.fordblks / 2**20)}}), flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    os._exit(0)
cow = None
peak = {"Private_Dirty": 0, "Pss": 0, "Rss": 0}
while True:
    try:
        r = roll(pid)
        for k in peak: peak[k] = max(peak[k], r.get(k, 0))
    except OSError:
        pass
    done, st = os.waitpid(pid, os.WNOHANG | os.WUNTRACED)
    if done and os.WIFSTOPPED(st):
        cow = compare(os.getpid(), pid)
        os.kill(pid, signal.SIGKILL); os.waitpid(pid, 0); break
    if done: break
    time.sleep(0.02)
print(json.dumps({"model": name, "mode": mode, "steps": steps,
                  "parent_rss_mb": round(parent["Rss"]), "parent_private_dirty_mb": round(parent["Private_Dirty"]),
                  "child_peak": {k: round(v) for k, v in peak.items()}, "mmap_threshold_at_fork": thr, "child_end_vs_parent": cow}))
