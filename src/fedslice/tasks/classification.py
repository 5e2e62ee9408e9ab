"""``classification`` with a sequence-classification head (encoders, or decoders' ``score`` head)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from fedslice import progress
from fedslice.compute import model_device, to_device
from fedslice.data import TokenCache, iter_batches, num_batches, num_labels
from fedslice.data.sources import load_raw_splits
from fedslice.paths import cache_root
from fedslice.tasks.base import Task, length_order

_TOKENS = TokenCache(disk=None if (root := cache_root()) is None else root / "tokens")


class Classification(Task):
    kind = "classification"
    primary_metric = "accuracy"

    def load_raw(self):
        return load_raw_splits(self.cfg.data, self.cfg.seed)

    def num_labels(self, raw) -> int:
        return num_labels(raw)

    def encode(self, raw, loaded):
        self.label_names = raw["train"].label_names
        return {name: _TOKENS.get(split, name, loaded.tokenizer, self.cfg.data.max_length)
                for name, split in raw.items()}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split, batch_size: int, max_generations=None):
        return evaluate_classifier(model, split, batch_size)


@torch.no_grad()
def evaluate_classifier(model: nn.Module, data, batch_size: int) -> dict[str, float]:
    """Accuracy, mean cross-entropy and the accuracy on each class's examples (``None`` for a
    class without examples); batches of similar length (sorted) keep padding small."""
    if len(data) == 0:
        return {"accuracy": math.nan, "loss": math.nan}
    was_training = model.training
    model.eval()
    device = model_device(model)
    correct = 0
    loss_sum = 0.0
    hits = totals = None
    with progress.task("evaluation", num_batches(len(data), batch_size)) as advance:
        for batch in iter_batches(data, length_order(data), batch_size, shuffle=False,
                                  generator=None):
            advance()
            out = model(**to_device(batch, device))
            right = out.logits.argmax(-1).cpu() == batch["labels"]
            correct += int(right.sum())
            k = out.logits.shape[-1]
            if hits is None:
                hits, totals = torch.zeros(k, dtype=torch.int64), torch.zeros(k, dtype=torch.int64)
            hits += torch.bincount(batch["labels"][right], minlength=k)[:k]
            totals += torch.bincount(batch["labels"], minlength=k)[:k]
            loss_sum += float(out.loss) * len(batch["labels"])
    model.train(was_training)
    per_class = [h / t if t else None for h, t in zip(hits.tolist(), totals.tolist())]
    return {"accuracy": correct / len(data), "loss": loss_sum / len(data),
            "per_class_accuracy": per_class}
