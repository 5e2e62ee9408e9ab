"""Tokenized prompt -> target pairs and their batches, for language-model tasks.

Two layouts:

* ``causal`` (decoders): one sequence ``prompt + target``, right-padded; ``labels`` holds the
  target tokens at their positions and -100 on the prompt and on padding, as HF expects.
* ``seq2seq`` (encoder-decoders): the encoder reads the prompt; the decoder reads the target
  shifted right behind the decoder start token; ``labels`` is the target (-100 on padding).

Prompts are also batched alone, left-padded for decoders, to generate from (:meth:`PairSplit.prompt_batch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch.nn.utils.rnn import pad_sequence

from fedslice.data.batching import Indices, as_index_list
from fedslice.data.packing import pack_causal

IGNORE = -100
Layout = Literal["causal", "seq2seq"]


@dataclass
class PairSplit:
    """Prompt/target token ids per example.

    Attributes:
        prompts, targets: one int64 1-D tensor per example (already truncated).
        labels: int64 ``(N,)``: the class id (text-to-text classification) or 0 (generation); the
            partitioners read it.
        groups: int64 ``(N,)``: examples with the same prompt share a group (its references).
        references: the untruncated target text of each example (generation metrics).
        clients: each example's value of ``data.client_column`` (its natural client), or None.
    """

    prompts: list[torch.Tensor]
    targets: list[torch.Tensor]
    labels: torch.Tensor
    groups: torch.Tensor
    references: list[str]
    pad_token_id: int
    layout: Layout
    decoder_start_token_id: int | None = None
    clients: list | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def lengths(self) -> torch.Tensor:
        """Tokens per example (prompt + target), for length-grouped batches."""
        return torch.tensor([len(p) + len(t) for p, t in zip(self.prompts, self.targets)],
                            dtype=torch.int64)

    @property
    def head_lengths(self) -> torch.Tensor:
        """Target tokens per example: where the output head runs and a training loss reads
        logits (the budget planner's batches follow them)."""
        return torch.tensor([len(t) for t in self.targets], dtype=torch.int64)

    def subset(self, indices: Indices) -> PairSplit:
        idx = as_index_list(indices, len(self))
        sel = torch.as_tensor(idx, dtype=torch.int64)
        return PairSplit([self.prompts[i] for i in idx], [self.targets[i] for i in idx],
                         self.labels[sel], self.groups[sel], [self.references[i] for i in idx],
                         self.pad_token_id, self.layout, self.decoder_start_token_id,
                         None if self.clients is None else [self.clients[i] for i in idx])

    def with_targets(self, indices: Indices, targets: list[torch.Tensor]) -> PairSplit:
        """The prompts at ``indices`` paired with other targets (e.g. candidate label words)."""
        idx = as_index_list(indices, len(self))
        n = len(idx)
        return PairSplit([self.prompts[i] for i in idx], targets, torch.zeros(n, dtype=torch.int64),
                         torch.arange(n), [""] * n, self.pad_token_id, self.layout,
                         self.decoder_start_token_id)

    def collate(self, indices: Indices) -> dict[str, torch.Tensor]:
        idx = as_index_list(indices, len(self))
        if not idx:
            raise ValueError("cannot collate an empty batch")
        prompts = [self.prompts[i] for i in idx]
        targets = [self.targets[i] for i in idx]
        if self.layout == "causal":
            return _collate_causal(prompts, targets, self.pad_token_id)
        return _collate_seq2seq(prompts, targets, self.pad_token_id, self.decoder_start_token_id)

    def collate_packed(self, indices: Indices) -> dict[str, torch.Tensor]:
        """The examples at ``indices`` packed into rows (causal layout only:
        :mod:`fedslice.data.packing`)."""
        if self.layout != "causal":
            raise ValueError("only causal-LM batches pack (an encoder-decoder's are padded)")
        idx = as_index_list(indices, len(self))
        if not idx:
            raise ValueError("cannot collate an empty batch")
        return pack_causal([self.prompts[i] for i in idx], [self.targets[i] for i in idx],
                           self.pad_token_id)

    def prompt_batch(self, indices: Indices) -> dict[str, torch.Tensor]:
        """The prompts at ``indices`` to generate from: left-padded for decoders (new tokens follow
        every prompt directly), right-padded for encoders."""
        prompts = [self.prompts[i] for i in as_index_list(indices, len(self))]
        side = "left" if self.layout == "causal" else "right"
        ids = pad_sequence(prompts, batch_first=True, padding_value=self.pad_token_id,
                           padding_side=side)  # (B, T)
        mask = pad_sequence([torch.ones_like(p) for p in prompts], batch_first=True,
                            padding_value=0, padding_side=side)
        return {"input_ids": ids, "attention_mask": mask}


def _lengths_mask(seqs: list[torch.Tensor]) -> torch.Tensor:
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    width = int(lengths.max())
    return (torch.arange(width)[None, :] < lengths[:, None]).to(torch.int64)  # (B, T)


def _collate_causal(prompts, targets, pad: int) -> dict[str, torch.Tensor]:
    seqs = [torch.cat([p, t]) for p, t in zip(prompts, targets)]
    labels = [torch.cat([torch.full_like(p, IGNORE), t]) for p, t in zip(prompts, targets)]
    return {"input_ids": pad_sequence(seqs, batch_first=True, padding_value=pad),  # (B, T)
            "attention_mask": _lengths_mask(seqs),
            "labels": pad_sequence(labels, batch_first=True, padding_value=IGNORE)}


def _collate_seq2seq(prompts, targets, pad: int, start: int | None) -> dict[str, torch.Tensor]:
    if start is None:
        raise ValueError("seq2seq batches need the model's decoder_start_token_id")
    labels = pad_sequence(targets, batch_first=True, padding_value=IGNORE)  # (B, S)
    decoder_in = torch.cat([torch.full_like(labels[:, :1], start), labels[:, :-1]], dim=1)
    decoder_in = decoder_in.masked_fill(decoder_in == IGNORE, pad)
    return {"input_ids": pad_sequence(prompts, batch_first=True, padding_value=pad),  # (B, T)
            "attention_mask": _lengths_mask(prompts),
            "decoder_input_ids": decoder_in, "decoder_attention_mask": _lengths_mask(targets),
            "labels": labels}
