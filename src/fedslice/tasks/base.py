"""What a task is: the model head it needs, how its data is encoded and batched, its training
loss and its evaluation. Methods, the engine and the Flower adapter see only this interface."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from fedslice.compute import model_device, to_device
from fedslice.config import ExperimentConfig
from fedslice.data.partition import sample_rows
from fedslice.models.arch import ArchSpec, Head


class Task:
    kind = "base"
    #: the metric plotted, compared and aimed at (``evaluation.target_accuracy``)
    primary_metric = "accuracy"
    #: class names by id, when the data names its classes (set by ``encode``)
    label_names: list[str] | None = None
    #: the data columns the text (or the default prompt) is read from, once the data is loaded
    text_columns: list[str] | None = None
    #: its training batches may be packed (``federation.pack``) where the architecture allows
    packable = True
    #: its loss compares the model with its frozen base (adapters off): full fine-tuning cannot
    needs_frozen_base = False

    def __init__(self, cfg: ExperimentConfig, arch: ArchSpec, head: Head):
        self.cfg, self.arch, self.head = cfg, arch, head

    # -- data --------------------------------------------------------------------------------
    def load_raw(self, carve_missing: bool = True) -> dict[str, Any]:
        """The raw train/dev/test splits this task reads (``carve_missing=False``: only the splits the
        data has, none carved off train)."""
        raise NotImplementedError

    def num_labels(self, raw: dict[str, Any]) -> int | None:
        """Classes of a sequence-classification head (None: no such head)."""
        return None

    def encode(self, raw: dict[str, Any], loaded) -> dict[str, Any]:
        """Tokenized splits (with ``subset``, ``collate``, ``lengths``, ``labels``)."""
        raise NotImplementedError

    def holdout(self, loaded):
        """The encoded examples the server keeps apart from the clients (a distillation corpus)."""
        from fedslice.errors import ConfigError
        raise ConfigError(f"method.distill.corpus = 'server_holdout' is for image tasks; a {self.kind} "
                          "task distils on a text corpus (a file, a folder or a hub dataset)")

    def profile_batch(self, config, batch_size: int, seq_len: int, seed: int) -> dict[str, torch.Tensor]:
        """A synthetic training batch of this task's shape (what a planner measures costs on)."""
        from fedslice.slicing.planner import profile_batch
        return profile_batch(config.vocab_size, batch_size, seq_len, seed, self.head)

    def planning_batch(self, config, batch_size: int, seq_len: int, seed: int,
                       target_length: int | None = None, prompt_length: int | None = None
                       ) -> dict[str, torch.Tensor]:
        """:meth:`profile_batch` as a real padded training batch is: its last position padding
        (attention then takes its masked path, as on rows of other lengths, and checkpointing
        keeps the mask), a causal LM's last ``target_length`` real tokens its target (the
        longest target of the data: where the head runs and the loss reads logits), an
        encoder-decoder's rows the longest prompt (``prompt_length``) into the encoder and the
        longest target into the decoder."""
        if self.head == "seq2seq_lm" and target_length and prompt_length:
            batch = self.profile_batch(config, batch_size, prompt_length, seed)
            dec = self.profile_batch(config, batch_size, 2 * target_length, seed + 1)["decoder_input_ids"]
            batch.update(decoder_input_ids=dec, labels=dec.clone())  # (B, target_length)
            return batch
        batch = self.profile_batch(config, batch_size, seq_len, seed)
        if "attention_mask" not in batch or "decoder_input_ids" in batch or seq_len < 2:
            return batch
        batch["attention_mask"][:, -1] = 0
        labels = batch["labels"]
        if labels.dim() == 2:
            keep = min(seq_len - 2, max(1, target_length or seq_len // 2))
            labels = batch["input_ids"].clone()
            labels[:, : seq_len - 1 - keep] = -100
            labels[:, -1] = -100
            batch["labels"] = labels
        return batch

    def packed_profile_batch(self, config, batch_size: int, seq_len: int, seed: int) -> dict[str, torch.Tensor]:
        """:meth:`profile_batch`'s examples packed into rows, as a packed training batch is
        (classification, or a causal LM's prompt and target halves: the heads that pack)."""
        from fedslice.data.packing import pack_causal, pack_classification

        batch = self.profile_batch(config, batch_size, seq_len, seed)
        ids = batch["input_ids"]  # (B, T)
        if self.head == "causal_lm":
            half = seq_len // 2
            return pack_causal(list(ids[:, :half]), list(ids[:, half:]), 0)
        lens = torch.full((len(ids),), seq_len, dtype=torch.int64)
        return pack_classification(ids.flatten(), None, lens, batch["labels"], 0)

    def packed_grid_batch(self, config, rows: int, length: int, examples: int, seed: int,
                          target_share: float = 0.5) -> dict[str, torch.Tensor]:
        """A packed batch of exactly ``rows`` rows of ``length`` tokens holding ``examples``
        examples (:func:`fedslice.data.packing.grid_layout`; a causal LM's examples each a
        prompt and, ``target_share`` of it, a target): a packed batch's shape, on which the
        budget planner measures the peak memory of the batches it simulates."""
        from fedslice.data.packing import grid_layout, pack_causal, pack_classification

        lens, capacity, place = grid_layout(rows, length, examples)
        flat = self.profile_batch(config, 1, rows * length, seed)["input_ids"][0]  # (R * C,)
        parts = list(torch.split(flat, lens))
        if self.head == "causal_lm":
            cut = [len(p) - min(len(p) - 1, max(1, round(target_share * len(p)))) for p in parts]
            return pack_causal([p[:c] for p, c in zip(parts, cut)], [p[c:] for p, c in zip(parts, cut)], 0,
                               layout=(capacity, place))
        labels = torch.zeros(len(lens), dtype=torch.long)
        return pack_classification(flat, None, torch.tensor(lens), labels, 0, layout=(capacity, place))

    def limit(self, split, n: int | None, seed: int):
        """A seeded subset of ``n`` examples (quick runs)."""
        return split if n is None or n >= len(split) else split.subset(sample_rows(len(split), n, seed))

    # -- training ----------------------------------------------------------------------------
    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The training loss of a batch, on the host or on the model's device (moved here:
        training passes host batches, so a task can read them without a device sync)."""
        return model(**to_device(batch, model_device(model))).loss

    def client_losses(self, model: nn.Module, batch: dict[str, torch.Tensor],
                      rows: list[tuple[int, int]]) -> list[torch.Tensor]:
        """The training loss of each client in a batch that stacks several clients' batches
        (``rows``: each client's ``(start, stop)``): each equals :meth:`loss` on that client's
        rows alone (the batched pass of :mod:`fedslice.fl.batched`). Here: cross-entropy of a
        classification head's logits, averaged per client."""
        labels = batch["labels"]
        if labels.dim() != 1 or labels.is_floating_point():
            raise NotImplementedError(f"{type(self).__name__}: no per-client loss for labels of "
                                      f"shape {tuple(labels.shape)}")
        batch = to_device(batch, model_device(model))
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits  # (B, C)
        labels = batch["labels"]
        return [F.cross_entropy(logits[lo:hi].float(), labels[lo:hi]) for lo, hi in rows]

    # -- inference ---------------------------------------------------------------------------
    def input_columns(self) -> list[str]:
        """The columns of a data row that :meth:`predict` reads."""
        raise NotImplementedError

    def predict(self, model: nn.Module, loaded, rows: list[dict[str, Any]], batch_size: int,
                source: str) -> list[dict[str, Any]]:
        """One prediction per row, in order: ``{"prediction": label id or text}``, plus
        ``probabilities`` (one per class) for classification. ``loaded``: the model's
        :class:`~fedslice.models.loading.LoadedModel` (tokenizer, config)."""
        raise NotImplementedError

    # -- evaluation --------------------------------------------------------------------------
    def evaluate(self, model: nn.Module, split, batch_size: int,
                 max_generations: int | None = None) -> dict[str, float]:
        raise NotImplementedError


def batch_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens a batch makes the model process (encoder + decoder for seq2seq; both responses of a
    preference pair), padding included; an image batch: its ``attention_mask``, one per patch
    and prefix token of each image."""
    first = batch["input_ids"] if "input_ids" in batch else batch["attention_mask"]
    return int(first.numel() + sum(batch[k].numel() for k in ("decoder_input_ids", "rejected_input_ids")
                                   if k in batch))


def batch_rows(batch: dict[str, torch.Tensor]) -> int:
    """Examples in a batch (with or without labels)."""
    first = batch["input_ids"] if "input_ids" in batch else batch.get("pixel_values", batch["attention_mask"])
    return int(first.shape[0])


def batch_real_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor | int:
    """Non-padding tokens of a batch (encoder + decoder), as a tensor on the batch's device (no
    host sync); a batch without attention masks (images) counts every token."""
    if "attention_mask" not in batch:
        return batch_tokens(batch)
    real = batch["attention_mask"].sum()
    if "decoder_attention_mask" in batch:
        real = real + batch["decoder_attention_mask"].sum()
    elif "decoder_input_ids" in batch:
        real = real + batch["decoder_input_ids"].numel()
    if "rejected_attention_mask" in batch:
        real = real + batch["rejected_attention_mask"].sum()
    return real


def batch_examples(batch: dict[str, torch.Tensor]) -> int:
    """Examples in a batch (a packed batch: ``example_starts``, one per example)."""
    if "example_starts" in batch:
        return int(batch["example_starts"].shape[0])
    return int(batch["labels"].shape[0])


def batch_head_positions(batch: dict[str, torch.Tensor]) -> int:
    """Where the output head runs: once per example (classification), or at each target token
    (language-model tasks: their labels are per token, -100 elsewhere)."""
    labels = batch["labels"]
    if labels.dim() == 1:
        return int(labels.shape[0])
    return int((labels != -100).sum()) + (int((batch["rejected_labels"] != -100).sum())
                                          if "rejected_labels" in batch else 0)


def length_order(split) -> torch.Tensor:
    """Example order by length (stable), so evaluation batches carry little padding."""
    return torch.argsort(split.lengths, stable=True)


def seeded_choice(n: int, k: int | None, seed: int) -> np.ndarray:
    """``k`` of ``range(n)`` (all when k is None), seeded and sorted."""
    return np.arange(n) if k is None or k >= n else np.sort(sample_rows(n, k, seed))
