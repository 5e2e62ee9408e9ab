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
from fedslice.models.arch import _unwrap


@contextmanager
def logits_at(model: nn.Module, mask: torch.Tensor) -> Iterator[None]:
    """Within the block, the LM head of ``model`` maps only the hidden states where ``mask``
    ``(B, T)`` is true: its output is ``(N, vocab)``, N = ``mask.sum()``, in row-major order."""
    head = _unwrap(model).get_output_embeddings()

    def select(module, args):
        (hidden,) = args  # (B, T, d)
        return (hidden[mask],)  # (N, d)

    handle = head.register_forward_pre_hook(select)
    try:
        yield
    finally:
        handle.remove()


def target_logits(model: nn.Module, batch: dict[str, torch.Tensor], layout: str):
    """``(logits (N, V), targets (N,), rows (N,))`` at the target tokens of a collated batch."""
    batch = to_device(batch, model_device(model))
    labels = batch["labels"]  # (B, T)
    if layout == "causal":  # the hidden state at t predicts token t + 1
        nxt = labels[:, 1:]
        mask = torch.zeros_like(labels, dtype=torch.bool)
        mask[:, :-1] = nxt != IGNORE
        targets = nxt[nxt != IGNORE]
    else:
        mask = labels != IGNORE
        targets = labels[mask]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with logits_at(model, mask):
        logits = model(**inputs, use_cache=False).logits  # (N, V)
    return logits, targets, mask.nonzero()[:, 0]


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
    return [per_token[int(bounds[2 * i]):int(bounds[2 * i + 1])].mean() for i in range(len(rows))]


def sequence_logprobs(model: nn.Module, batch: dict[str, torch.Tensor], layout: str):
    """``(sum of target-token log-probabilities (B,), target tokens (B,))`` per example."""
    logits, targets, rows = target_logits(model, batch, layout)
    token_lp = torch.log_softmax(logits.float(), -1).gather(1, targets[:, None])[:, 0]  # (N,)
    n = batch["labels"].shape[0]
    sums = torch.zeros(n, device=token_lp.device).index_add_(0, rows, token_lp)
    counts = torch.zeros(n, device=token_lp.device).index_add_(0, rows, torch.ones_like(token_lp))
    return sums.cpu(), counts.cpu()


@torch.no_grad()
def generate(model: nn.Module, split: PairSplit, indices: list[int], tokenizer,
             max_new_tokens: int) -> list[str]:
    """Greedy (deterministic) continuations of the prompts at ``indices``, decoded without
    special tokens; an empty generation stays an empty string."""
    hf = _unwrap(model)
    batch = to_device(split.prompt_batch(indices), model_device(hf))
    out = hf.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                      pad_token_id=split.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    if split.layout == "causal":
        out = out[:, batch["input_ids"].shape[1]:]  # (B, new)
    return [t.strip() for t in tokenizer.batch_decode(out, skip_special_tokens=True)]
