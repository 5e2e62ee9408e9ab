"""The ideas of issue 36 target 2, measured on one client's packed steps (forward, loss, backward,
clip, AdamW) of the workload bench/perf/minilm_sst2.toml, CPU seconds at 1 thread, 8 clients:

    .venv/bin/python bench/perf/client_ideas.py eager [ROW_TOKENS]   # packed, sdpa (the default)
    .venv/bin/python bench/perf/client_ideas.py nodrop               # every dropout off (upper bound)
    .venv/bin/python bench/perf/client_ideas.py eagerattn            # model.attn_implementation = eager
    .venv/bin/python bench/perf/client_ideas.py compile              # torch.compile(dynamic=True)
    .venv/bin/python bench/perf/client_ideas.py cprofile             # where the Python time is
    .venv/bin/python bench/perf/client_ideas.py fastdrop             # dropout masks from uniform_ (not bernoulli_)
    .venv/bin/python bench/perf/client_ideas.py eagerfastdrop        # eager attention + those masks
    .venv/bin/python bench/perf/client_ideas.py packedtraining       # what train_local does: fedslice.data.packing.packed_training
"""
import sys, time, os
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
import torch
from client_step import build
from fedslice.fl.strategy import host_state
from fedslice.fl.client import local_batches
mode = sys.argv[1]
import fedslice.data.packing as P
if len(sys.argv) > 2: P.ROW_TOKENS = int(sys.argv[2])
cfg, method, data = build(100, {"model.attn_implementation": "eager"} if mode.startswith("eager") and mode != "eager" else {})
if mode.endswith("fastdrop"):  # every F.dropout (nn.Dropout, eager attention's) from a uniform_ mask
    import torch.nn.functional as F
    def fast_dropout(input, p=0.5, training=True, inplace=False):
        if not training or p == 0.0:
            return input
        return input * torch.empty_like(input).uniform_().ge_(p).mul_(1.0 / (1.0 - p))
    F.dropout = fast_dropout
state = host_state(method.initial_state())
pls = method.strategy.configure_train(1, state, [0, 1, 2, 3], cfg.federation.num_clients)
model, params = method.client_model(pls[0])
model.train()
def batches(c):
    part = data.train.subset(data.partitions[c])
    return list(local_batches(part, dict(pls[c].config), torch.Generator().manual_seed(c), True))
B = {c: batches(c) for c in range(4)}
loss_fn = method.task.loss
opt = torch.optim.AdamW(params.values(), lr=1e-3)
def run(bs):
    from contextlib import nullcontext
    from fedslice.data.packing import packed_training
    t0 = time.process_time()
    with packed_training(model) if mode == "packedtraining" else nullcontext():
      for x in bs:
        l = loss_fn(model, x); l.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
        opt.step(); opt.zero_grad(set_to_none=True)
    return time.process_time() - t0
print(mode, "load", os.getloadavg()[0])
if mode == "nodrop":
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout): m.p = 0.0
        if hasattr(m, "dropout") and isinstance(getattr(m, "dropout"), float): m.dropout = 0.0
    for m in model.modules():
        for a in ("attention_dropout", "dropout_prob"):
            if isinstance(getattr(m, a, None), float): setattr(m, a, 0.0)
if mode == "compile":
    t0 = time.perf_counter(); c0 = time.process_time()
    model.compile(dynamic=True)
    first = run(B[0]); print("compile+first client cpu", round(first, 1), "wall", round(time.perf_counter() - t0, 1))
if mode == "cprofile":
    import cProfile, pstats
    pr = cProfile.Profile(); pr.enable(); run(B[0]); pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
run(B[0])
ts = [run(B[c]) for c in range(4)] + [run(B[c]) for c in range(4)]
print(mode, "cpu s per client", [round(t, 2) for t in ts], "sum", round(sum(ts), 2), "load", os.getloadavg()[0])
