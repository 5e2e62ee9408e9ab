"""Tokenized conversations and their batches: each example is one rendered conversation whose
labels are its token ids on the assistant's tokens and -100 elsewhere (system and user turns,
the template's headers, padding), so the loss is taken on every assistant turn and nowhere else.

Batches are the causal layout of :mod:`fedslice.data.pairs` (right-padded; packed rows with
``federation.pack``); the prompt of each example (the conversation before its last assistant
turn, ready for the answer) is batched alone, left-padded, to generate from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from fedslice.data.batching import Indices, as_index_list
from fedslice.data.packing import IGNORE, pack_labeled


@dataclass
class ChatSplit:
    """Conversations as token ids.

    Attributes:
        ids: one int64 1-D tensor per conversation (already truncated).
        targets: per conversation, its token ids where the assistant speaks, :data:`IGNORE`
            elsewhere (same shape as ``ids``).
        prompts: per conversation, the tokens before its last assistant turn (what the model
            answers at evaluation).
        references: per conversation, the text of its last assistant turn.
        clients: each conversation's value of ``data.client_column`` (its natural client,
            :func:`fedslice.data.partition.natural_partitions`), or None.
    """

    ids: list[torch.Tensor]
    targets: list[torch.Tensor]
    prompts: list[torch.Tensor]
    references: list[str]
    pad_token_id: int
    clients: list | None = None
    layout: str = "causal"

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def labels(self) -> torch.Tensor:
        """A class id per example for the partitioners: none here (0)."""
        return torch.zeros(len(self), dtype=torch.int64)

    @property
    def groups(self) -> torch.Tensor:
        """Every conversation is its own reference group."""
        return torch.arange(len(self))

    @property
    def lengths(self) -> torch.Tensor:
        return torch.tensor([len(x) for x in self.ids], dtype=torch.int64)

    @property
    def head_lengths(self) -> torch.Tensor:
        """Assistant tokens per conversation: where the loss reads logits (the budget planner's
        batches follow them)."""
        return torch.tensor([int((t != IGNORE).sum()) for t in self.targets], dtype=torch.int64)

    def subset(self, indices: Indices) -> ChatSplit:
        idx = as_index_list(indices, len(self))
        clients = None if self.clients is None else [self.clients[i] for i in idx]
        return ChatSplit([self.ids[i] for i in idx], [self.targets[i] for i in idx],
                         [self.prompts[i] for i in idx], [self.references[i] for i in idx],
                         self.pad_token_id, clients)

    def collate(self, indices: Indices) -> dict[str, torch.Tensor]:
        """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` ``(B, T)``."""
        idx = _nonempty(indices, len(self))
        ids = [self.ids[i] for i in idx]
        lens = torch.tensor([len(x) for x in ids], dtype=torch.int64)
        width = int(lens.max())
        return {"input_ids": pad_sequence(ids, batch_first=True, padding_value=self.pad_token_id),
                "attention_mask": (torch.arange(width)[None, :] < lens[:, None]).to(torch.int64),
                "labels": pad_sequence([self.targets[i] for i in idx], batch_first=True,
                                       padding_value=IGNORE)}

    def collate_packed(self, indices: Indices) -> dict[str, torch.Tensor]:
        """The conversations at ``indices`` packed into rows (:mod:`fedslice.data.packing`)."""
        idx = _nonempty(indices, len(self))
        return pack_labeled([self.ids[i] for i in idx], [self.targets[i] for i in idx],
                            self.pad_token_id)

    def prompt_batch(self, indices: Indices) -> dict[str, torch.Tensor]:
        """The prompts at ``indices``, left-padded (new tokens follow every prompt directly)."""
        prompts = [self.prompts[i] for i in as_index_list(indices, len(self))]
        ids = pad_sequence(prompts, batch_first=True, padding_value=self.pad_token_id,
                           padding_side="left")  # (B, T)
        mask = pad_sequence([torch.ones_like(p) for p in prompts], batch_first=True,
                            padding_value=0, padding_side="left")
        return {"input_ids": ids, "attention_mask": mask}


def _nonempty(indices: Indices, size: int) -> list[int]:
    idx = as_index_list(indices, size)
    if not idx:
        raise ValueError("cannot collate an empty batch")
    return idx
