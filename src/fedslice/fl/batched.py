"""A round's clients trained together: one batched pass over the shared frozen backbone.

Clients that train the same tensors of the same model (LoRA on a shared backbone) differ only in
their adapters and data. Here each step stacks every active client's next batch into one batch
(right-padded to the longest, rows of client k at ``rows[k]``), runs the frozen backbone once on
it, applies each client's own adapter to its own rows (LoRA: ``B_k A_k x`` by a batched matmul;
a fully trained module such as the classifier: the module with client k's tensors on its rows),
and sums the clients' losses. No row of one client reaches another's loss, so the gradient of
client k's tensors is exactly the gradient of its own loss; each client keeps its own tensors,
AdamW state, gradient clipping, step count and data order (the same batches, from the same
seeded generator, as one-after-another training). The result equals training the clients one
after another (tested to 1e-5 in fp32) when dropout is off; with dropout, masks are drawn from
one generator over the stacked batch (same distribution, other draws).

What it buys: the backbone's matmuls see K times the rows (a GPU is otherwise starved by one
client's small batch) and the Python/kernel-launch overhead of a step is paid once for K clients.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from fedslice.compute import CPU, Compute
from fedslice.data.batching import TokenizedSplit, stack_batches
from fedslice.fl.client import LocalResult, flops_budget, local_batches, local_step_count, over_budget
from fedslice.fl.orders import Orders, OrdersLike
from fedslice.measure import LargestBatches, PeakMemory, count_flops
from fedslice.peft import Adapter
from fedslice.tasks.base import batch_examples, batch_head_positions, batch_real_tokens, batch_tokens

#: ``client_losses(model, stacked batch, rows) -> [loss of each client]`` (the task's)
ClientLosses = Callable[[nn.Module, dict[str, torch.Tensor], list[tuple[int, int]]], list[torch.Tensor]]


@dataclass
class Stack:
    """What the patched modules read during a step: the active clients' rows and tensors."""

    rows: list[tuple[int, int]] = field(default_factory=list)
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)


@dataclass
class _Client:
    tensors: dict[str, torch.Tensor]  # leaf tensors this client trains
    batches: Iterator[dict[str, torch.Tensor]]
    steps_left: int
    opt: torch.optim.Optimizer
    ref: dict[str, torch.Tensor] | None
    losses: list[torch.Tensor] = field(default_factory=list)
    tokens: int = 0
    real: Any = 0
    examples: int = 0
    head_positions: int = 0
    cut: int | None = None  # local steps a FLOPs budget cut


@contextlib.contextmanager
def _swapped(module: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """``module``'s parameters (by local name) replaced by ``tensors`` within the block."""
    saved = {}
    for name, t in tensors.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        saved[(owner, leaf)] = owner._parameters[leaf]
        owner._parameters[leaf] = t
    try:
        yield
    finally:
        for (owner, leaf), p in saved.items():
            owner._parameters[leaf] = p


def _per_client_forward(module: nn.Module, local: dict[str, str], stack: Stack) -> Callable:
    """A forward for a module trained whole (e.g. the classifier): on each client's rows, the
    module with that client's tensors. Its inputs must be batch-first."""
    cls_forward = type(module).forward

    def forward(*args, **kwargs):
        outs = []
        for (lo, hi), p in zip(stack.rows, stack.params):
            a = [x[lo:hi] if isinstance(x, torch.Tensor) else x for x in args]
            kw = {k: v[lo:hi] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            with _swapped(module, {leaf: p[full] for leaf, full in local.items()}):
                outs.append(cls_forward(module, *a, **kw))
        return torch.cat(outs)

    return forward


def _adapted(model: nn.Module, names: list[str], adapter: Adapter) -> dict[str, list[str]]:
    """Adapted module name -> the full names of its per-client tensors, for the modules whose
    tensors are all among ``names``."""
    todo = set(names)
    out = {}
    for mname, module in adapter.adapted_modules(model).items():
        full = [f"{mname}.{t}" for t in adapter.client_tensor_names(module)]
        if full and set(full) <= todo:
            out[mname] = full
    return out


@contextlib.contextmanager
def stacked(model: nn.Module, names: list[str], stack: Stack, adapter: Adapter) -> Iterator[None]:
    """Within the block, ``model`` applies the tensors ``names`` per client as ``stack`` says.

    The adapter's modules keep one frozen base for the batch (:meth:`Adapter.stacked_forward`);
    any other module holding a trained tensor runs once per client (it must take batch-first
    inputs: a classification head does)."""
    todo = set(names)
    patched: list[nn.Module] = []
    try:
        for mname, full in _adapted(model, names, adapter).items():
            module = model.get_submodule(mname)
            module.forward = adapter.stacked_forward(module, full, stack)
            patched.append(module)
            todo -= set(full)
        owners: dict[str, dict[str, str]] = {}
        for n in sorted(todo):
            owner, _, leaf = n.rpartition(".")
            owners.setdefault(owner, {})[leaf] = n
        for owner in _roots(owners):  # the outermost owner runs per client (a RoBERTa head)
            module = model.get_submodule(owner)
            local = {k[len(owner) + 1:]: k for k in names if k.startswith(owner + ".") and k in todo}
            module.forward = _per_client_forward(module, local, stack)
            patched.append(module)
        yield
    finally:
        for m in patched:
            m.__dict__.pop("forward", None)


def _roots(owners: dict[str, Any]) -> list[str]:
    """The owners not inside another owner."""
    return [o for o in owners if not any(o.startswith(p + ".") for p in owners if p != o)]


def can_stack(model: nn.Module, names: list[str], adapter: Adapter) -> bool:
    """Whether the adapter stacks per client and owns some of ``names``, and every other trained
    tensor lives in a module outside the adapter's modules (a head: it runs per client)."""
    if not adapter.batched_clients:
        return False
    adapted = _adapted(model, names, adapter)
    owned = {n for full in adapted.values() for n in full}
    rest = [n for n in names if n not in owned]
    return bool(owned) and all(not any(m.startswith(n.rpartition(".")[0] + ".") for m in adapted)
                               for n in rest)


def train_batched(model: nn.Module, names: list[str], starts: list[dict[str, torch.Tensor]],
                  datas: list[TokenizedSplit], cfg: OrdersLike, seeds: list[int],
                  client_losses: ClientLosses, adapter: Adapter, compute: Compute = CPU
                  ) -> list[tuple[dict[str, torch.Tensor], LocalResult]]:
    """Train the tensors ``names`` of ``model`` for each client (its starting values ``starts[k]``,
    data ``datas[k]``, seed ``seeds[k]``) in one batched pass per step; returns each client's
    trained tensors and its :class:`LocalResult`, as :func:`fedslice.fl.client.train_local`
    would for that client alone. The model's own tensors ``names`` are not used or changed.
    The clients share ``cfg`` (:meth:`fedslice.fl.orders.Orders.train_key`); under its
    ``flops_budget`` a client leaves the pass before the step that would pass it, as alone."""
    cfg = Orders.of(cfg)
    mu, clip = cfg.fedprox_mu, cfg.max_grad_norm
    budget = flops_budget(cfg)
    clients = []
    for start, data, seed in zip(starts, datas, seeds):
        tensors = {n: start[n].detach().to(compute.device, torch.float32).clone().requires_grad_(True)
                   for n in names}
        gen = torch.Generator().manual_seed(seed)
        clients.append(_Client(
            tensors=tensors, batches=iter(local_batches(data, cfg, gen)), steps_left=local_step_count(data, cfg),
            opt=torch.optim.AdamW(tensors.values(), lr=cfg.lr, weight_decay=cfg.weight_decay),
            ref={n: t.detach().clone() for n, t in tensors.items()} if mu > 0 else None,
            cut=None if budget is None else 0))
    torch.manual_seed(seeds[0])  # dropout masks (one generator for the stacked batch)
    pad = datas[0].pad_token_id
    scaler = compute.grad_scaler()
    stack = Stack()
    was_training = model.training
    model.train()
    flops_per_token = 0.0
    padded_total = 0
    optimizer_bytes = 3 * sum(t.numel() * t.element_size() for c in clients for t in c.tensors.values())
    t0 = time.perf_counter()
    measured = LargestBatches()  # the stacked batches whose saved tensors are counted (the peak's)
    with PeakMemory(model, extra_bytes=optimizer_bytes, interval_s=0.01, saved_tensors=False) as mem, \
            stacked(model, names, stack, adapter):
        step = 0
        while True:
            active = [c for c in clients if c.steps_left > 0]
            if not active:
                break
            own = [next(c.batches) for c in active]
            if budget is not None:  # a client whose next step would pass its budget stops
                stop = [over_budget(flops_per_token * c.tokens, flops_per_token * batch_tokens(b),
                                    budget, len(c.losses)) for c, b in zip(active, own)]
                for c, s in zip(active, stop):
                    if s:
                        c.cut, c.steps_left = c.steps_left, 0
                active = [c for c, s in zip(active, stop) if not s]
                own = [b for b, s in zip(own, stop) if not s]
                if not active:
                    break
            batch, rows = stack_batches(own, pad)  # on the host: the task's loss moves it
            stack.rows, stack.params = rows, [c.tensors for c in active]
            with count_flops(enabled=step == 0) as fc, (mem.track() if measured(batch) else contextlib.nullcontext()):
                with compute.autocast():
                    losses = client_losses(model, batch, rows)
                total = sum(losses)
                for c in active:
                    if c.ref is not None:
                        total = total + 0.5 * mu * sum(((t - c.ref[n]) ** 2).sum() for n, t in c.tensors.items())
                (scaler.scale(total) if scaler else total).backward()
            if step == 0:
                flops_per_token = fc.total / batch_tokens(batch)
            padded_total += batch_tokens(batch)
            for c, b, loss in zip(active, own, losses):
                c.losses.append(loss.detach())
                c.steps_left -= 1  # a diverged client trains on (read once at the end: no host sync)
                if scaler:
                    scaler.unscale_(c.opt)
                if clip > 0:
                    torch.nn.utils.clip_grad_norm_(c.tensors.values(), clip)
                if scaler:
                    scaler.step(c.opt)
                else:
                    c.opt.step()
                c.opt.zero_grad(set_to_none=True)
                c.tokens += batch_tokens(b)
                c.real = c.real + batch_real_tokens(b)
                c.examples += batch_examples(b)
                c.head_positions += batch_head_positions(b)
            if scaler:
                scaler.update()
            step += 1
    model.train(was_training)
    elapsed = time.perf_counter() - t0
    own_total = max(1, sum(c.tokens for c in clients))
    out = []
    for c in clients:
        share = c.tokens / own_total  # a client's part of the stacked pass (time, memory)
        mean = float(torch.stack(c.losses).mean()) if c.losses else math.nan  # nan if a step's was
        out.append(({n: t.detach() for n, t in c.tensors.items()}, LocalResult(
            loss=mean, steps=len(c.losses), examples=c.examples,
            head_positions=c.head_positions, tokens=c.tokens,
            flops_measured=flops_per_token * c.tokens,
            peak_rss_mb=(mem.rss_peak_mb or 0.0) * share, activation_mb=mem.tensor_peak_mb * share,
            time_s=elapsed * share, nonfinite=not math.isfinite(mean), tokens_real=int(c.real),
            steps_cut=c.cut)))
    return out
