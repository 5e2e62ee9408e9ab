"""A training loss that scores heads (Eq. 6) from the attention of the steps training runs
anyway: ``method.importance_source = "first_step"`` and ``"training"``. See
:meth:`fedslice.methods.heads.method.HeadStage.first_step_loss`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from fedslice.compute import model_device, to_device
from fedslice.errors import ModelError
from fedslice.slicing.heads import batch_confidence_sums, ensure_eager_attention, num_rows
from fedslice.data.batching import TokenizedSplit
from fedslice.fl.strategy import Payload
from fedslice.tasks.base import batch_examples

TaskLoss = Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]


class CapturingLoss:
    """``task_loss`` whose first call (every call with ``every_step``) runs with eager attention
    and ``output_attentions=True``, scores the heads on that batch (Eq. 6, as
    :func:`fedslice.slicing.heads.head_importance` scores them, on the training-mode weights:
    after attention dropout) and hands the (R, H) scores to ``on_scores`` (``on_scores(alpha)``,
    or ``on_scores(alpha, examples)`` with ``every_step``) before returning the loss, so before
    that step's backward. The model's own attention comes back at the next call, or at
    :meth:`restore` (call it after training): only once the captured step's backward has run,
    which under gradient checkpointing recomputes that forward and must run it as it ran.

    :attr:`step_key` names what a step computes (the task's loss, captured on the first or every
    step), not this client's callback: the training loop's per-model caches (packed FLOP rates,
    saved-tensor peaks) key on it, so a round's later clients reuse the first one's measurements
    as they do with the task's plain loss (the captured forward is the step's own, and eager
    attention counts as sdpa does; on packed batches the first client's count also holds the
    scoring's per-example einsum, about 0.1% of a tiny model's step)."""

    def __init__(self, task_loss: TaskLoss, outputs: Sequence[str], special_ids: Sequence[int],
                 sink_keys: int, on_scores: Callable[..., None], every_step: bool = False) -> None:
        self.task_loss = task_loss
        self.outputs = list(outputs)  # the attention outputs scored, in mask-row order
        self.special_ids = list(special_ids)
        self.sink_keys = sink_keys
        self.on_scores = on_scores
        self.every_step = every_step
        self._done = False
        self._pending: list[tuple[nn.Module, str]] = []  # (model, the attention eager replaced)

    @property
    def step_key(self) -> tuple:
        return (CapturingLoss, self.task_loss, self.every_step)

    def restore(self) -> None:
        while self._pending:
            m, previous = self._pending.pop()
            base = m.get_base_model() if hasattr(m, "get_base_model") else m
            base.set_attn_implementation(previous)

    def __call__(self, m: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.restore()  # the previous call's backward has run
        if self._done and not self.every_step:
            return self.task_loss(m, batch)
        self._done = True
        loss, out = self._captured(m, batch)
        device = model_device(m)
        special = torch.tensor(self.special_ids, dtype=torch.int64, device=device)
        with torch.no_grad():
            sums = batch_confidence_sums(out, to_device(batch, device), m, special, self.sink_keys)
        if missing := [n for n in self.outputs if n not in sums]:
            raise ModelError(f"no attention scores for {missing} (got {sorted(sums)})")
        n = max(batch_examples(batch), 1)
        alpha = torch.cat([sums[k].float().cpu() for k in self.outputs]) / n  # (R, H)
        if self.every_step:
            self.on_scores(alpha, n)
        else:
            self.on_scores(alpha)
        return loss

    def _captured(self, m: nn.Module, batch: dict[str, torch.Tensor]):
        """(the task's loss, the model's output with attention weights) of one eager forward."""
        outs: list = []
        forward = m.forward

        def capture(*args, **kwargs):
            out = forward(*args, **{**kwargs, "output_attentions": True})
            outs.append(out)
            return out

        previous = ensure_eager_attention(m)
        if previous != "eager":
            self._pending.append((m, previous))
        m.forward = capture  # an instance attribute for this one call: the task calls m(...)
        try:
            loss = self.task_loss(m, batch)
        finally:
            del m.forward
        if not outs:
            raise ModelError("importance from training steps: the task's loss did not call the model")
        return loss, outs[-1]


def fit_first_step(method, model: nn.Module, payload: Payload, data: TokenizedSplit, seed: int,
                    dims, outer):
    """``importance_source = "first_step"`` (``prune = "parameters"``): train ``model``'s
    every trainable tensor; the first step's forward runs with eager attention and returns
    its attention weights, which score the heads (Eq. 6 on that batch, :meth:`~fedslice.methods.heads.method.HeadStage.first_step_loss`);
    the keep-mask follows, and before that step's backward every tensor the mask prunes (the
    pruned heads' rows, a headless layer's attention adapter) gets a gradient hook that zeroes
    its gradient, so with AdamW and no weight decay it keeps its value exactly. Returns
    (alpha, kept, the parameter-pruned model, its trained tensors, the training result): the
    model and tensors are those the method's ``local_model`` and ``local_params`` give, built from
    the trained model."""
    shape = (num_rows(dims), dims[0]["num_heads"])
    full = method.local_params(model, torch.ones(shape, dtype=torch.bool), dims)
    handles: list = []
    found: dict[str, torch.Tensor] = {}

    def on_scores(alpha: torch.Tensor) -> None:
        kept = method.keep(alpha, seed, method.orders(payload).sparsity, None if outer is None else dims)
        found.update(alpha=alpha, kept=kept)
        for name, mask in method.gradient_masks(model, kept, payload, dims, full).items():
            m = mask.to(full[name].dtype)  # once: multiplied into every step's gradient
            handles.append(full[name].register_hook(lambda g, m=m: g * m))

    result = method._train_capturing(model, full, data, payload, seed,
                                   method.first_step_loss(on_scores), handles)
    if "kept" not in found:
        raise ModelError("importance_source='first_step': training ran no step to score heads on")
    alpha, kept = found["alpha"], found["kept"]
    sub = method.local_model(model, kept, payload, dims)
    return alpha, kept, sub, method.local_params(sub, kept, dims), result

def fit_training(method, model: nn.Module, payload: Payload, data: TokenizedSplit, seed: int,
                  dims, outer):
    """``importance_source = "training"``: train every trainable tensor of ``model``, every
    step's forward captured (:meth:`~fedslice.methods.heads.method.HeadStage.first_step_loss` with ``every_step``); after training,
    the keep-mask of the mean scores over all training batches, and the kept heads' tensors
    of the trained model (the method's ``local_model``, ``local_params``) as the upload."""
    shape = (num_rows(dims), dims[0]["num_heads"])
    full = method.local_params(model, torch.ones(shape, dtype=torch.bool), dims)
    total: dict[str, torch.Tensor] = {}

    def on_scores(alpha: torch.Tensor, n: int) -> None:
        total["sum"] = total.get("sum", 0) + alpha * n
        total["n"] = total.get("n", 0) + n

    result = method._train_capturing(model, full, data, payload, seed,
                                   method.first_step_loss(on_scores, every_step=True))
    if not total:
        raise ModelError("importance_source='training': training ran no step to score heads on")
    alpha = total["sum"] / total["n"]
    kept = method.keep(alpha, seed, method.orders(payload).sparsity, None if outer is None else dims)
    sub = method.local_model(model, kept, payload, dims)
    return alpha, kept, sub, method.local_params(sub, kept, dims), result
