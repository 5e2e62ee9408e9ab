"""Tasks on a generative model (decoder or encoder-decoder): prompt -> target pairs."""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn as nn

from fedslice.data.pairs import PairSplit
from fedslice.data.batching import iter_batches
from fedslice.errors import ConfigError
import fedslice.tasks.lm as lm
from fedslice.tasks.base import Task, length_order
from fedslice.tasks.chat_template import install_template
from fedslice.tasks.text import Truncation, apply_chat

log = logging.getLogger(__name__)


class TextToText(Task):
    """Shared by text-to-text classification and generation: the layout follows the model
    (``causal`` for decoders, ``seq2seq`` for encoder-decoders); the loss is taken on target
    tokens only, with logits computed only there."""

    def __init__(self, cfg, arch, head):
        super().__init__(cfg, arch, head)
        self.layout = "causal" if head == "causal_lm" else "seq2seq"
        self.tokenizer = None

    def bind(self, loaded) -> None:
        self.tokenizer = loaded.tokenizer
        self.pad_id = loaded.tokenizer.pad_token_id
        self.start_id = getattr(loaded.model.config, "decoder_start_token_id", None)
        if self.layout == "seq2seq" and self.start_id is None:
            raise ConfigError(f"model {self.cfg.model.name!r} has no decoder_start_token_id")
        if self.cfg.task.chat_template_file is not None:
            install_template(loaded.tokenizer, self.cfg.task.chat_template_file, self.cfg.model.name)

    def prompt_ids(self, prompts: list[str], trunc: Truncation) -> list[torch.Tensor]:
        """Prompt token ids; decoders keep a prompt's end (the cue before the target) when it is
        cut, encoders its start."""
        if self.cfg.task.chat_template:
            prompts = [apply_chat(self.tokenizer, p) for p in prompts]
        # a chat template already holds the model's special tokens
        return trunc.ids(self.tokenizer, prompts, self.cfg.data.max_length, "prompts",
                         special=not self.cfg.task.chat_template,
                         side="left" if self.layout == "causal" else "right")

    def target_ids(self, targets: list[str], trunc: Truncation, *, eos: bool) -> list[torch.Tensor]:
        """Target ids, ending with the end-of-sequence token when ``eos`` (so generation learns to
        stop); an encoder-decoder's tokenizer adds its own special tokens."""
        limit = self.cfg.task.max_target_length
        seq2seq = self.layout == "seq2seq"
        ids = trunc.ids(self.tokenizer, targets, limit - int(eos), "targets", special=seq2seq)
        end = self.tokenizer.eos_token_id
        if eos and end is not None:  # T5/BART tokenizers end their targets with it already
            ids = [t if len(t) and t[-1] == end else torch.cat([t, torch.tensor([end])]) for t in ids]
        return ids

    def pair_split(self, prompts, targets, labels, groups, references, clients=None) -> PairSplit:
        return PairSplit(prompts, targets, torch.as_tensor(labels, dtype=torch.int64),
                         torch.as_tensor(groups, dtype=torch.int64), references, self.pad_id,
                         self.layout, self.start_id, clients)

    def loss(self, model: nn.Module, batch):
        return lm.lm_loss(model, batch, self.layout)

    def client_losses(self, model: nn.Module, batch, rows):
        return lm.client_lm_losses(model, batch, self.layout, rows)

    @torch.no_grad()
    def target_nll(self, model: nn.Module, split: PairSplit, batch_size: int) -> float:
        """Mean negative log-likelihood per target token over the split (the training loss)."""
        nll = tokens = 0.0
        for batch in iter_batches(split, length_order(split), batch_size, shuffle=False,
                                  generator=None):
            sums, counts = lm.sequence_logprobs(model, batch, self.layout)
            nll -= float(sums.sum())
            tokens += float(counts.sum())
        return nll / max(tokens, 1.0)


def groups_of(prompts: list[str]) -> list[int]:
    """One id per distinct prompt, in order of first appearance."""
    ids: dict[str, int] = {}
    return [ids.setdefault(p, len(ids)) for p in prompts]


@contextmanager
def eval_mode(model: nn.Module):
    """The model in eval mode (no dropout) within the block, restored after."""
    was = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was)


def first_rows(groups: torch.Tensor) -> np.ndarray:
    """Index of the first row of each group id (sorted by group id)."""
    g = groups.numpy()
    _, first = np.unique(g, return_index=True)
    return first


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 50 else math.inf
