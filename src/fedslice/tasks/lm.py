"""Language-model losses and decoding shared by the generative tasks.

Logits are computed only where a loss or a score is taken: a forward pre-hook on the model's
output embedding (the LM head) selects the hidden states of the target positions before the
``(d, vocab)`` product, so no full-vocabulary logits are formed over prompt or padding
positions (the LM head is about a fifth of SmolLM2's forward FLOPs). The hook sits on the HF
module that every causal and seq2seq model of the table calls last, so family-specific steps
before it (T5's rescaling) and after it (BART's final logits bias) are kept.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from fedslice.compute import model_device, to_device
from fedslice.data.pairs import IGNORE, PairSplit
from fedslice.data.packing import is_packed, model_inputs
from fedslice.models.arch import unwrap_model


@contextmanager
def logits_at(model: nn.Module, at: torch.Tensor, length: int) -> Iterator[None]:
    """Within the block, the LM head of ``model`` maps only the hidden states at the flat
    positions ``at`` (N,) of the last ``length`` positions of each row (row-major, ``b * length
    + t``, on the model's device): its output is ``(N, vocab)`` in that order. Positions a
    model prepends to the sequence (an adapter's virtual tokens: prompt tuning) come first and
    are skipped. A gather of a known size: no host sync (a boolean mask would need one)."""
    head = unwrap_model(model).get_output_embeddings()

    def select(module, args):
        (hidden,) = args  # (B, P + T, d)
        last = hidden[:, hidden.shape[1] - length:]  # (B, T, d)
        return (last.reshape(-1, last.shape[-1]).index_select(0, at),)  # (N, d)

    handle = head.register_forward_pre_hook(select)
    try:
        yield
    finally:
        handle.remove()


def target_positions(labels: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(flat positions (N,), target tokens (N,))`` of a ``(B, T)`` label batch, row-major:
    where the loss is taken (causal: the hidden state at t predicts token t + 1)."""
    if layout == "causal":
        nxt = labels[:, 1:]
        mask = torch.zeros_like(labels, dtype=torch.bool)
        mask[:, :-1] = nxt != IGNORE
        targets = nxt[nxt != IGNORE]
    else:
        mask = labels != IGNORE
        targets = labels[mask]
    return mask.flatten().nonzero()[:, 0], targets


def target_logits(model: nn.Module, batch: dict[str, torch.Tensor], layout: str):
    """``(logits (N, V), targets (N,), rows (N,))`` at the target tokens of a collated batch;
    logits and targets on the model's device, rows where ``batch`` is. The positions are found
    where the labels are: a batch from the host (as training passes it) costs the device no
    sync; the inputs go to the model's device here."""
    labels = batch["labels"]  # (B, T)
    at, targets = target_positions(labels, layout)  # (N,), (N,)
    device = model_device(model)
    inputs = to_device({k: v for k, v in batch.items() if k != "labels"}, device)
    if is_packed(batch):  # examples packed into rows: block-diagonal causal attention
        inputs = model_inputs(inputs, unwrap_model(model), causal=True)
    with logits_at(model, to_device({"at": at}, device)["at"], labels.shape[1]):
        logits = model(**inputs, use_cache=False).logits  # (N, V)
    return logits, to_device({"t": targets}, device)["t"], at // labels.shape[1]


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor], layout: str) -> torch.Tensor:
    """Mean cross-entropy over the target tokens of the batch (as HF's ``labels`` loss)."""
    logits, targets, _ = target_logits(model, batch, layout)
    return F.cross_entropy(logits.float(), targets)


def client_lm_losses(model: nn.Module, batch: dict[str, torch.Tensor], layout: str,
                     rows: list[tuple[int, int]]) -> list[torch.Tensor]:
    """:func:`lm_loss` of each client's rows ``(start, stop)`` of a stacked batch, from one
    forward pass: the mean cross-entropy over that client's target tokens."""
    logits, targets, at = target_logits(model, batch, layout)  # (N, V), (N,), (N,) row-major
    per_token = F.cross_entropy(logits.float(), targets, reduction="none")  # (N,)
    bounds = torch.searchsorted(at, torch.tensor([r for lohi in rows for r in lohi], device=at.device))
    bounds = bounds.tolist()  # where the labels are (the host, in training)
    return [per_token[bounds[2 * i]:bounds[2 * i + 1]].mean() for i in range(len(rows))]


def sequence_logprobs(model: nn.Module, batch: dict[str, torch.Tensor], layout: str):
    """``(sum of target-token log-probabilities (B,), target tokens (B,))`` per example."""
    logits, targets, rows = target_logits(model, batch, layout)
    token_lp = torch.log_softmax(logits.float(), -1).gather(1, targets[:, None])[:, 0]  # (N,)
    n = batch["labels"].shape[0]
    rows = rows.to(token_lp.device)
    sums = torch.zeros(n, device=token_lp.device).index_add_(0, rows, token_lp)
    counts = torch.zeros(n, device=token_lp.device).index_add_(0, rows, torch.ones_like(token_lp))
    return sums.cpu(), counts.cpu()


@torch.no_grad()
def generate(model: nn.Module, split: PairSplit, indices: list[int], tokenizer,
             max_new_tokens: int) -> list[str]:
    """Greedy (deterministic) continuations of the prompts at ``indices``, decoded without
    special tokens; an empty generation stays an empty string. ``model.generate`` (a peft
    wrapper's, which adds an adapter's virtual tokens or prefix), else the HF model's."""
    hf = unwrap_model(model)
    batch = to_device(split.prompt_batch(indices), model_device(hf))
    gen = model.generate if callable(getattr(model, "generate", None)) else hf.generate
    out = gen(**batch, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
              pad_token_id=split.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    if split.layout == "causal":
        out = out[:, batch["input_ids"].shape[1]:]  # (B, new)
    return [t.strip() for t in tokenizer.batch_decode(out, skip_special_tokens=True)]
