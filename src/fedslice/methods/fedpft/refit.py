"""Server-side re-fit of the plugged-in model's classification head (``method.head_refit_steps``).

After FL the LoRA + classifier trained on the proxy are plugged into the full model. The LoRA
moves the two models' features differently, and the classifier, co-adapted to the proxy's, reads
the full model's worse (BENCHMARKS.md, issue 35 part 5). The re-fit distils the proxy's
predictions into the full model's head: the proxy's class probabilities on the server's
distillation corpus (``method.distill.corpus``: text the server holds, or for an image task the
training images it keeps apart) are the soft labels, the full model's head (the trainable tensors
the adapter does not own: the classifier) is trained to match them, everything else frozen. No
ground-truth label is read and no client data is used.

The proxy shares its classifier module with the full model, so the soft labels are computed once,
before the head changes (:func:`soft_targets`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from fedslice.compute import model_device, to_device
from fedslice.distill.loop import DistillLog, input_tokens, train_only
from fedslice.measure import count_flops


def head_params(trainable: dict[str, nn.Parameter], owns: Callable[[str], bool]) -> dict[str, nn.Parameter]:
    """The head among the trainable parameters: those the adapter does not own (the classifier)."""
    return {k: p for k, p in trainable.items() if not owns(k)}


def _inputs(split, idx: list[int]) -> dict[str, torch.Tensor]:
    batch = split.collate(idx)
    batch.pop("labels", None)  # never read: the proxy's predictions are the targets
    return batch


def _logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**to_device(batch, model_device(model))).logits.float()  # (B, C)


@torch.no_grad()
def soft_targets(model: nn.Module, split, batch_size: int) -> tuple[torch.Tensor, float, int]:
    """``model``'s logits (N, C) on every example of ``split`` (eval mode), their FLOPs (the
    first batch measured, scaled by tokens) and the tokens read."""
    was, out, tokens, per_token = model.training, [], 0, 0.0
    model.eval()
    for lo in range(0, len(split), batch_size):
        batch = _inputs(split, list(range(lo, min(lo + batch_size, len(split)))))
        with count_flops(enabled=lo == 0) as fc:
            out.append(_logits(model, batch).cpu())
        if lo == 0:
            per_token = fc.total / input_tokens(batch)
        tokens += input_tokens(batch)
    model.train(was)
    return torch.cat(out), per_token * tokens, tokens


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 KL(softmax(teacher / T) || softmax(student / T)), mean over the batch; (B, C) logits."""
    t = temperature
    log_p = F.log_softmax(student / t, -1)  # (B, C)
    log_q = F.log_softmax(teacher / t, -1)  # (B, C)
    return (log_q.exp() * (log_q - log_p)).sum(-1).mean() * t * t


@torch.no_grad()
def mean_kl(model: nn.Module, split, targets: torch.Tensor, temperature: float, batch_size: int) -> float:
    """:func:`kd_loss` of ``model`` against ``targets`` (N, C) over all of ``split``."""
    was, total = model.training, 0.0
    model.eval()
    for lo in range(0, len(split), batch_size):
        idx = list(range(lo, min(lo + batch_size, len(split))))
        s = _logits(model, _inputs(split, idx)).cpu()
        total += float(kd_loss(s, targets[idx], temperature)) * len(idx)
    model.train(was)
    return total / max(len(split), 1)


def _index_batches(n: int, batch_size: int, gen: torch.Generator) -> Iterator[list[int]]:
    """Seeded batches of indices: successive permutations of range(n), cut in ``batch_size``."""
    while True:
        order = torch.randperm(n, generator=gen).tolist()
        for lo in range(0, n, batch_size):
            yield order[lo:lo + batch_size]


def refit_head(model: nn.Module, head: dict[str, nn.Parameter], split, targets: torch.Tensor, *,
               steps: int, lr: float, batch_size: int, temperature: float, seed: int) -> DistillLog:
    """Train ``head`` (parameters of ``model``; every other parameter frozen, eval mode) for
    ``steps`` AdamW steps (no weight decay, constant lr) so that ``model``'s predictions on
    ``split`` match ``targets`` (N, C logits, :func:`soft_targets`). FLOPs: the first step
    measured, scaled by tokens. ``steps = 0``: nothing changes."""
    log = DistillLog()
    if steps <= 0 or not head:
        return log
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(head.values(), lr=lr, weight_decay=0.0)
    batches = _index_batches(len(split), batch_size, gen)
    t0, per_token = time.perf_counter(), 0.0
    with train_only([model], head):
        for step in range(steps):
            idx = next(batches)
            batch = _inputs(split, idx)
            with count_flops(enabled=step == 0) as fc:
                loss = kd_loss(_logits(model, batch), targets[idx].to(model_device(model)), temperature)
                loss.backward()
            if step == 0:
                per_token = fc.total / input_tokens(batch)
            opt.step()
            opt.zero_grad(set_to_none=True)
            log.losses.append({"loss": float(loss.detach())})
            log.tokens += input_tokens(batch)
    log.steps = steps
    log.flops = per_token * log.tokens
    log.time_s = time.perf_counter() - t0
    return log
